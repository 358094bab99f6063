"""Llama (``LlamaForCausalLM``): RMSNorm, GQA, SwiGLU, RoPE (default or llama3 scaling), no
biases."""

from lightning_fasync.trainers.megatron.convert._common import Family

FAMILY = Family("llama")
