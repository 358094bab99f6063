"""Qwen2 (``Qwen2ForCausalLM``): a Llama with biases on the q/k/v projections (not on o_proj);
sliding-window attention is refused."""

from lightning_fasync.trainers.megatron.convert._common import Family

FAMILY = Family("qwen2", qkv_bias=True)
