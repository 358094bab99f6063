"""A lean forward pass for Llama-family causal LMs (Llama, Qwen2, Qwen3, Mistral) over a slot KV cache.

The runner reads the Hugging Face model's own parameters (fused copies of q|k|v and gate|up are
rebuilt after every weight update), and its numerics match the HF forward (the log-prob equality
test checks this). What it replaces is the bookkeeping around attention: each running request owns
one *slot* of a preallocated cache ``[slots, kv_heads, context, head_dim]`` per layer, so a decode
step is one batched forward over exactly the running requests, with no padding to a common prompt
length and no cache re-allocation. On a small model a decode step is dominated by per-op overhead,
so the step is written to issue few ops: RoPE tables computed once, q and k rotated together,
attention as ``baddbmm`` + ``bmm`` without repeating kv heads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
PREFILL_MAX_TOKENS = 8192  # padded tokens per batched prefill forward


class UnsupportedModelError(ValueError):
    """The embedded engine has no lean forward for this architecture."""


def _linear_residual(x: torch.Tensor, a: torch.Tensor, linear: Any) -> torch.Tensor:
    """``x + linear(a)`` as one addmm when the layer has no bias."""
    if linear.bias is not None:
        return x + F.linear(a, linear.weight, linear.bias)
    shape = x.shape
    return torch.addmm(x.reshape(-1, shape[-1]), a.reshape(-1, a.shape[-1]), linear.weight.t()).view(shape)


class ModelRunner:
    """Runs batched prefill and batched decode for one model over a slot KV cache.

    Args:
        model: A Hugging Face ``*ForCausalLM`` of a supported architecture.
        max_slots: Number of cache slots (the engine's ``max_running_requests``).
        context_length: Tokens per slot (prompt + response).

    Raises:
        UnsupportedModelError: The architecture is not in ``SUPPORTED_MODEL_TYPES`` or uses
            sliding-window attention.
    """

    def __init__(self, model: Any, max_slots: int, context_length: int) -> None:
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"The embedded engine supports {', '.join(SUPPORTED_MODEL_TYPES)} models, not "
                f"{model_type!r}; serve this model with a real SGLang server instead."
            )
        if getattr(config, "use_sliding_window", False) or (
            model_type == "mistral" and getattr(config, "sliding_window", None)
        ):
            raise UnsupportedModelError("Sliding-window attention is not supported by the embedded engine.")
        self.model = model
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.group = self.num_heads // self.num_kv_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self._silu = getattr(config, "hidden_act", None) == "silu"
        self.max_slots = max_slots
        self.context_length = context_length
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        shape = (max_slots, self.num_kv_heads, context_length, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self._arange = torch.arange(context_length, device=self.device)
        self._build_rope_tables(inner.rotary_emb)
        self.refresh_weights()

    @torch.no_grad()
    def _build_rope_tables(self, rotary: Any) -> None:
        # The HF rotary module itself computes the tables (any rope_type it supports), once.
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        cos, sin = rotary(probe, self._arange.unsqueeze(0))
        half = self.head_dim // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(device=self.device, dtype=cos.dtype)
        # rotate_half(x) == x.roll(half, -1) * sign, so folding the sign into sin saves two ops.
        self._cos, self._sin_signed = cos[0].to(self.dtype), (sin[0] * sign).to(self.dtype)

    @torch.no_grad()
    def refresh_weights(self) -> None:
        """Rebuild the fused q|k|v and gate|up matrices from the HF parameters.

        One matmul instead of three (two) per layer is a sizeable share of a small model's decode
        step. The engine calls this after every weight update, so the fused copies never go stale.
        """
        self._fused: list[tuple[torch.Tensor, Any, torch.Tensor]] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
            biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
            bias = None if any(b is None for b in biases) else torch.cat(biases)
            self._fused.append((w, bias, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])))

    def _norm(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        # HF's RMSNorm formula, minus its dtype round trips (F.rms_norm is not fused on CPU and
        # issues more ops than this).
        if x.dtype != torch.float32:
            return module(x)
        return module.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _qkv(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Project, (Qwen3) head-norm and rotate; returns q ``[B, L, H, d]``, k, v ``[B, L, kvh, d]``."""
        b, length, _ = h.shape
        w, bias, _ = self._fused[i]
        qkv = F.linear(h, w, bias).view(b, length, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        nqk = self.num_heads + self.num_kv_heads
        qk, v = qkv[:, :, :nqk], qkv[:, :, nqk:]
        attn = self.layers[i].self_attn
        if hasattr(attn, "q_norm"):  # Qwen3 normalises each head before RoPE.
            qk = torch.cat([attn.q_norm(qk[:, :, : self.num_heads]), attn.k_norm(qk[:, :, self.num_heads :])], dim=2)
        qk = qk * cos + qk.roll(self.head_dim // 2, dims=-1) * sin
        return qk[:, :, : self.num_heads], qk[:, :, self.num_heads :], v

    def _mlp_residual(self, i: int, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        layer = self.layers[i]
        o_proj, down = layer.self_attn.o_proj, layer.mlp.down_proj
        # Functional calls and residual adds folded into addmm: on a tiny model a decode step is
        # mostly per-op overhead, so every op saved counts.
        x = _linear_residual(x, attn_out, o_proj)
        gate, up = F.linear(self._norm(layer.post_attention_layernorm, x), self._fused[i][2]).chunk(2, dim=-1)
        act = F.silu(gate) if self._silu else layer.mlp.act_fn(gate)
        return _linear_residual(x, act * up, down)

    @torch.inference_mode()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Run prompts into their slots' caches (positions ``0..len-1``), batched.

        Prompts are right-padded: a valid query never attends a padded key (those sit after it), so
        the plain causal mask is exact for every real token; padded positions are overwritten later.

        Args:
            slots: Each request's cache slot.
            prompts: Each request's prompt, ``1 <= len <= context_length``.

        Returns:
            Logits of each prompt's last position, ``[batch, vocab]`` (float32).
        """
        chunks: list[list[int]] = [[]]
        width = 0
        for idx, p in enumerate(prompts):
            grown = max(width, len(p))
            if chunks[-1] and grown * (len(chunks[-1]) + 1) > PREFILL_MAX_TOKENS:
                chunks.append([])
                grown = len(p)
            chunks[-1].append(idx)
            width = grown
        return torch.cat([self._prefill_chunk([slots[i] for i in c], [prompts[i] for i in c]) for c in chunks])

    def _prefill_chunk(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        b, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros((b, width), dtype=torch.long, device=self.device)
        for row, p in enumerate(prompts):
            ids[row, : len(p)] = torch.tensor(p, dtype=torch.long)
        slot_t = torch.tensor(slots, dtype=torch.long, device=self.device)
        cos, sin = self._cos[:width].view(1, width, 1, -1), self._sin_signed[:width].view(1, width, 1, -1)
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, self._norm(layer.input_layernorm, x), cos, sin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            self.k_cache[i][slot_t, :, :width] = k
            self.v_cache[i][slot_t, :, :width] = v
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            x = self._mlp_residual(i, x, attn.transpose(1, 2).reshape(b, width, -1))
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        h = x[torch.arange(b, device=self.device), last]
        return self.lm_head(self._norm(self.norm, h)).float()

    @torch.inference_mode()
    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step for a batch of running requests.

        Args:
            slots: Each request's cache slot.
            tokens: Each request's last sampled token (not yet in the cache).
            positions: Each token's position (= tokens already cached for that request).

        Returns:
            Next-token logits ``[batch, vocab]`` (float32).
        """
        b = len(slots)
        slot_t = torch.tensor(slots, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(1)
        span = max(positions) + 1
        # Contiguous slots 0..B-1 (the common case) read the cache as a view instead of a gather.
        contiguous = slots == list(range(b))
        # Additive mask, one row per (request, kv head, query head in the group): own positions only.
        bias = torch.zeros((b, span), dtype=self.dtype, device=self.device)
        bias.masked_fill_(self._arange[:span].unsqueeze(0) > pos_t.unsqueeze(1), float("-inf"))
        bias = bias.view(b, 1, 1, span).expand(b, self.num_kv_heads, self.group, span).reshape(-1, self.group, span)
        cos, sin = self._cos[pos_t].view(b, 1, 1, -1), self._sin_signed[pos_t].view(b, 1, 1, -1)
        # Row of (slot, kv head, position) in the cache viewed as [slots * kv_heads * context, d]:
        # one index_copy_ per cache and layer, cheaper than a two-index index_put.
        heads = torch.arange(self.num_kv_heads, device=self.device)
        rows = ((slot_t.unsqueeze(1) * self.num_kv_heads + heads) * self.context_length + pos_t.unsqueeze(1)).view(-1)
        x = F.embedding(ids, self.embed.weight)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, self._norm(layer.input_layernorm, x), cos, sin)
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc.view(-1, self.head_dim).index_copy_(0, rows, k.reshape(-1, self.head_dim))
            vc.view(-1, self.head_dim).index_copy_(0, rows, v.reshape(-1, self.head_dim))
            if contiguous:
                keys, values = kc[:b, :, :span], vc[:b, :, :span]
            else:
                keys, values = kc[slot_t, :, :span], vc[slot_t, :, :span]
            keys = keys.reshape(b * self.num_kv_heads, span, self.head_dim)
            values = values.reshape(b * self.num_kv_heads, span, self.head_dim)
            # Query head h reads kv head h // group (HF's repeat_kv), so fold the group into rows.
            qg = q.reshape(b * self.num_kv_heads, self.group, self.head_dim)
            scores = torch.baddbmm(bias, qg, keys.transpose(1, 2), alpha=self.scale)
            attn = torch.bmm(torch.softmax(scores, dim=-1), values).view(b, 1, -1)
            x = self._mlp_residual(i, x, attn)
        return F.linear(self._norm(self.norm, x[:, 0]), self.lm_head.weight, self.lm_head.bias).float()
