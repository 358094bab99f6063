"""Qwen3 (``Qwen3ForCausalLM``): a Llama with per-head RMSNorm on queries and keys before RoPE
(megatron ``qk_layernorm``) and an explicit ``head_dim`` (128 for the 0.6B model, whose
hidden_size / heads is 64)."""

from lightning_fasync.trainers.megatron.convert._common import Family

FAMILY = Family("qwen3", qk_norm=True)
