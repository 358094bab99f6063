"""A lean forward pass for Llama-family causal LMs (Llama, Qwen2, Qwen3, Mistral) over a paged KV cache.

The runner reads the Hugging Face model's own parameters (fused copies of q|k|v and gate|up are
rebuilt after every weight update), and its numerics match the HF forward (the log-prob equality
test checks this). What it replaces is the bookkeeping around attention. The KV cache is a pool of
fixed-size blocks (pages of ``page_size`` tokens) shared by all requests, as in SGLang: its size
comes from a memory budget (``--mem-fraction-static``, ``--max-total-tokens``; see
:func:`plan_kv_pool`), each running request holds a *slot* (a row of the block table, the list of
its blocks) and blocks are handed to it as it grows and returned when it leaves, so memory follows
live tokens instead of ``slots x context``. A decode step is one batched forward over exactly the
running requests, with no padding to a common prompt length and no cache re-allocation. On a small
model a decode step is dominated by per-op overhead, so the step is written to issue few ops:

* per-step tensors (slots, tokens, positions and the new tokens' cache rows in one conversion, the
  block-gather index, the attention mask, RoPE rows) are built once and shared by every layer;
* the blocks of the batch are read with one ``index_select`` per layer for K and for V, whole
  pages at a time (``[kv_heads * blocks, page_size * head_dim]`` rows), landing as the padded
  ``[batch * kv_heads, span, head_dim]`` the attention reads;
* weights are fused (q|k|v, gate|up) and pre-transposed once; in float32 each decoder layer's
  RMSNorm weights are folded into the matrix after them, and (no per-head q/k norm) the attention
  scale into W_q; in other dtypes q/k/v and gate/up are views of the fused matrices;
* RoPE is one complex multiply (q/k features stored pair-interleaved, see ``__init__``), else
  ``roll`` + ``addcmul`` with the sign folded into the sin table;
* attention is ``baddbmm`` (mask broadcast over the query heads of a kv group) + ``softmax`` +
  ``bmm`` over the gathered blocks, without repeating kv heads; residual adds ride in
  ``addmm``;
* prefill runs the last layer's attention, output projection and MLP on each prompt's last
  position only (the others only feed the KV cache, already written).
"""

from __future__ import annotations

import heapq
import re
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
PREFILL_MAX_TOKENS = 8192  # padded tokens per batched prefill forward
# A prefill forward's fixed cost in padded tokens: on the tiny presets one costs ~0.6 ms plus ~9 us
# per padded token (one CPU thread), so a forward is worth ~64 tokens of padding (prefill_chunks).
PREFILL_FORWARD_TOKENS = 64
# Tokens per KV block. SGLang defaults to 1 (its kernels read token by token); the embedded engine
# gathers whole blocks with one index_select per layer, which copies rows of page_size x head_dim
# at memory speed, at the cost of at most page_size - 1 masked positions per request, and hands a
# request a block every page_size decode steps instead of every step: page 1 makes the tiny
# preset's decode ~15 % slower (docs/engine.md). Without --page-size the pool takes the largest of
# these with which it holds one request of context_length tokens, so every pool that holds one
# request at page 1 (--max-total-tokens >= --context-length) starts.
DEFAULT_PAGE_SIZE = 16
PAGE_SIZE_FALLBACKS = (8, 4, 2, 1)
# --mem-fraction-static when not given. CPU: weights + KV pool may take 40 % of the memory available
# at start, leaving the rest to the trainer and the activations on the same machine. CUDA: SGLang's
# rule without CUDA graphs, (total - reserved) / total, reserving ~3.6 GiB (10 GiB on > 60 GiB devices).
CPU_MEM_FRACTION_STATIC = 0.4
_CUDA_RESERVED_BYTES, _CUDA_RESERVED_LARGE_BYTES = int(3.6 * 2**30), 10 * 2**30
_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a decoder layer's parameter


class UnsupportedModelError(ValueError):
    """The embedded engine has no lean forward for this architecture."""


def _linear_residual(x: torch.Tensor, a: torch.Tensor, linear: Any) -> torch.Tensor:
    """``x + linear(a)`` as one addmm when the layer has no bias."""
    if linear.bias is not None:
        return x + F.linear(a, linear.weight, linear.bias)
    shape = x.shape
    return torch.addmm(x.reshape(-1, shape[-1]), a.reshape(-1, a.shape[-1]), linear.weight.t()).view(shape)


class KVCacheTooLargeError(ValueError):
    """The KV pool and the weights do not fit the memory budget, or the pool cannot hold one request."""


class _PoolBelowOneRequest(KVCacheTooLargeError):
    """The pool holds fewer tokens than one request of ``context_length`` (in whole pages)."""


def _available_bytes(device: torch.device) -> Optional[int]:
    """Free memory on ``device``: CUDA's free bytes, or the host's MemAvailable (capped by a cgroup
    v2 memory limit, as in a container); None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
        if limit != "max" and available is not None:
            available = min(available, max(int(limit) - current, 0))
    except (OSError, ValueError):
        pass
    return available


def default_mem_fraction_static(device: torch.device) -> float:
    """``--mem-fraction-static`` when not given (see ``CPU_MEM_FRACTION_STATIC``)."""
    if device.type != "cuda":
        return CPU_MEM_FRACTION_STATIC
    total = torch.cuda.mem_get_info(device)[1]
    reserved = _CUDA_RESERVED_LARGE_BYTES if total > 60 * 2**30 else _CUDA_RESERVED_BYTES
    return max(round((total - reserved) / total, 3), 0.1)


@dataclass(frozen=True)
class KVPoolPlan:
    """The KV pool's size, and the budget it was sized from (bytes; None where unknown)."""

    page_size: int
    num_blocks: int  # whole requests of context_length: a multiple of ceil(context_length / page_size)
    bytes_per_token: int  # K and V of one token over all layers
    weight_bytes: int
    available_bytes: Optional[int]  # the device's memory available to weights + pool at start
    budget_bytes: Optional[int]  # mem_fraction_static x available_bytes
    mem_fraction_static: float

    @property
    def max_total_tokens(self) -> int:
        return self.num_blocks * self.page_size

    @property
    def pool_bytes(self) -> int:
        return self.max_total_tokens * self.bytes_per_token


def plan_kv_pool(
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    weight_bytes: int,
    available_bytes: Optional[int],
    max_slots: int,
    context_length: int,
    device_type: str = "cpu",
    page_size: Optional[int] = None,
    max_total_tokens: Optional[int] = None,
    mem_fraction_static: float = CPU_MEM_FRACTION_STATIC,
) -> KVPoolPlan:
    """Size the KV pool from a memory budget, as SGLang does.

    The budget is ``mem_fraction_static`` of the memory available to weights + pool (the device's
    free memory, on CPU MemAvailable, measured with the weights loaded, plus the weights): the
    weights take their share and the pool the rest, but never more tokens than ``max_slots``
    requests of ``context_length`` tokens hold (without a prefix cache no request could use them).
    ``max_total_tokens`` (SGLang's ``--max-total-tokens``) sets the pool's size in tokens instead;
    it must fit the budget with the weights (SGLang would shrink it to the budget with a warning;
    here a CPU server would be killed by the kernel instead, so the mismatch is refused). The size
    is rounded down to whole requests of ``context_length`` tokens (in pages): the pool is laid out
    as such regions, so that a batch of requests holding their own region's blocks reads the pool
    as a view (see ``ModelRunner._init_pool``).

    Args:
        available_bytes: None when unknown: no budget, the pool is ``max_total_tokens`` or the
            ``max_slots x context_length`` cap.
        page_size: None: ``DEFAULT_PAGE_SIZE``, or the largest of ``PAGE_SIZE_FALLBACKS`` with which
            the pool holds one request (only a page size given is refused for that).

    Raises:
        KVCacheTooLargeError: the weights alone exceed the budget, ``max_total_tokens`` does not fit
            it, or the pool cannot hold one request of ``context_length`` tokens; the message
            names the flags and the numbers.
        ValueError: a non-positive size or a fraction outside (0, 1].
    """
    if page_size is None:
        sizes = (DEFAULT_PAGE_SIZE, *PAGE_SIZE_FALLBACKS)
        kwargs = dict(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, weight_bytes=weight_bytes,
                      available_bytes=available_bytes, max_slots=max_slots, context_length=context_length,
                      device_type=device_type, max_total_tokens=max_total_tokens,
                      mem_fraction_static=mem_fraction_static)
        for size in sizes:
            try:
                return plan_kv_pool(page_size=size, **kwargs)
            except _PoolBelowOneRequest:
                if size == sizes[-1]:
                    raise
    if page_size < 1:
        raise ValueError(f"--page-size is {page_size}; it must be at least 1.")
    if max_total_tokens is not None and max_total_tokens < 1:
        raise ValueError(f"--max-total-tokens is {max_total_tokens}; it must be at least 1.")
    if not 0 < mem_fraction_static <= 1:
        raise ValueError(f"--mem-fraction-static is {mem_fraction_static}; it must be in (0, 1].")
    per_token = 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    dtype_name = str(dtype).replace("torch.", "")
    gib = 2**30
    budget = None if available_bytes is None else int(mem_fraction_static * available_bytes)
    budget_words = (f"the memory budget of {(budget or 0) / gib:.2f} GiB (--mem-fraction-static {mem_fraction_static} "
                    f"x {(available_bytes or 0) / gib:.2f} GiB of {device_type} memory available to weights and cache)")
    per_token_words = (f"{per_token} bytes per token: {layers} layers x 2 (K, V) x {kv_heads} kv heads x {head_dim} "
                       f"x {dtype_name}")
    one_request = -(-context_length // page_size) * page_size
    if max_total_tokens is not None:
        tokens = max_total_tokens // page_size * page_size
        if budget is not None and weight_bytes + tokens * per_token > budget:
            raise KVCacheTooLargeError(
                f"A KV pool of --max-total-tokens {max_total_tokens} takes {tokens * per_token / gib:.2f} GiB "
                f"({per_token_words}), which with the weights' {weight_bytes / gib:.2f} GiB exceeds {budget_words}; "
                "lower --max-total-tokens or raise --mem-fraction-static."
            )
        source = f"--max-total-tokens {max_total_tokens}"
    else:
        cap = max_slots * one_request
        tokens = cap
        source = f"--max-running-requests {max_slots} x --context-length {context_length}"
        if budget is not None:
            room = budget - weight_bytes
            if room <= 0:
                raise KVCacheTooLargeError(
                    f"The weights take {weight_bytes / gib:.2f} GiB, which leaves nothing of {budget_words} for "
                    "the KV cache; raise --mem-fraction-static or free memory."
                )
            if room // per_token < cap:
                tokens = room // per_token // page_size * page_size
                source = (f"the {room / gib:.2f} GiB that the weights' {weight_bytes / gib:.2f} GiB leave of "
                          f"{budget_words}, at {per_token_words}")
    if tokens < one_request:
        raise _PoolBelowOneRequest(
            f"The KV pool holds {tokens} tokens ({source}), fewer than the {one_request} tokens one request of "
            f"--context-length {context_length} takes in pages of --page-size {page_size}; raise "
            "--mem-fraction-static or --max-total-tokens, or lower --context-length."
        )
    return KVPoolPlan(page_size=page_size, num_blocks=tokens // one_request * (one_request // page_size),
                      bytes_per_token=per_token,
                      weight_bytes=weight_bytes, available_bytes=available_bytes, budget_bytes=budget,
                      mem_fraction_static=mem_fraction_static)


def prefill_chunks(lengths: list[int], *, forward_tokens: int = PREFILL_FORWARD_TOKENS,
                   max_tokens: int = PREFILL_MAX_TOKENS) -> list[list[int]]:
    """Split a prefill batch into forwards: indices into ``lengths``, each forward's shortest first.

    A forward costs about ``forward_tokens`` plus one per padded token (its rows times its longest
    prompt), and holds at most ``max_tokens`` padded tokens (a longer prompt runs alone). Sorted by
    length, the split with the least cost is a shortest-path over the cut points, O(n^2) for n
    prompts (an admission burst: a few groups).
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: least cost of the j shortest prompts
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        width = lengths[order[j - 1]]  # the longest of the forward ending at j
        for i in range(j - 1, -1, -1):
            rows = j - i
            if rows > 1 and rows * width > max_tokens:
                break
            cost = best[i] + forward_tokens + rows * width
            if cost < best[j]:
                best[j], cut[j] = cost, i
    chunks: list[list[int]] = []
    j = n
    while j > 0:
        chunks.append(order[cut[j] : j])
        j = cut[j]
    return chunks[::-1]


class ModelRunner:
    """Runs batched prefill and batched decode for one model over a paged KV cache.

    The pool holds ``num_blocks`` blocks of ``page_size`` tokens. A request's *slot* is its row of
    the block table; the caller (the engine's scheduler) hands blocks to a slot with
    :meth:`allocate` before the forward that writes them, and takes them back with :meth:`free`.
    Blocks are zeroed when handed out, so a masked position never reads another request's leftovers
    (NaN or inf, if a model ever wrote one) instead of zeros.

    Args:
        model: A Hugging Face ``*ForCausalLM`` of a supported architecture.
        max_slots: Rows of the block table (the engine's ``max_running_requests``).
        context_length: Tokens per request at most (prompt + response).
        page_size: Tokens per block (SGLang's ``--page-size``); default ``DEFAULT_PAGE_SIZE``, or
            a smaller one where the pool would hold less than one request (:func:`plan_kv_pool`).
        max_total_tokens: The pool's size in tokens (SGLang's ``--max-total-tokens``); default: from
            the memory budget (see :func:`plan_kv_pool`).
        mem_fraction_static: Share of the memory available at start that weights + pool may take
            (SGLang's ``--mem-fraction-static``); default :func:`default_mem_fraction_static`.

    Raises:
        UnsupportedModelError: The architecture is not in ``SUPPORTED_MODEL_TYPES`` or uses
            sliding-window attention.
        KVCacheTooLargeError: The configuration does not fit the memory budget or cannot hold one
            request of ``context_length`` tokens.
    """

    def __init__(self, model: Any, max_slots: int, context_length: int, *, page_size: Optional[int] = None,
                 max_total_tokens: Optional[int] = None, mem_fraction_static: Optional[float] = None) -> None:
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
        # Decode always through the gathered pages (never the slot-cache view, whose span is not whole
        # pages): a request's numbers then depend on its tokens alone, not on its slot (Engine's
        # deterministic mode).
        self.paged_only = False
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._arange = torch.arange(context_length, device=self.device)
        self._fold = self.dtype == torch.float32
        self._eps_t = torch.tensor(self.eps, dtype=self.dtype, device=self.device)
        self._inv_hidden = 1.0 / config.hidden_size
        self._neg_inf = torch.tensor(float("-inf"), dtype=self.dtype, device=self.device)
        self._zero = torch.tensor(0.0, dtype=self.dtype, device=self.device)
        self._build_rope_tables(inner.rotary_emb)
        self._rope = torch.stack([self._cos, self._sin_signed], dim=1)  # [context, 2, d]: one gather per step
        self._qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        half = self.head_dim // 2
        # RoPE as one complex multiply: with each head's q/k features stored pair-interleaved
        # ((x_j, x_{j+d/2}) adjacent, by permuting the rows of W_q/W_k once), HF's
        # ``x * cos + rotate_half(x) * sin`` is ``x_c * (cos + i sin)``. q.k dot products are
        # unchanged (both sides permuted alike), and the attention scale is folded into W_q.
        # Needs float32, duplicated cos/sin halves (every HF rope type) and no per-head q/k norm.
        self._complex_rope = (
            self.dtype == torch.float32
            and not self._qk_norm
            and self.head_dim % 2 == 0
            and torch.equal(self._cos[:, :half], self._cos[:, half:])
            and torch.equal(self._sin_signed[:, :half], -self._sin_signed[:, half:])
        )
        if self._complex_rope:
            self._cis = torch.complex(self._cos[:, :half], self._sin_signed[:, half:])  # [context, d/2]
            pairs = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
            heads = self.num_heads + self.num_kv_heads
            self._qk_perm = (torch.arange(heads).unsqueeze(1) * self.head_dim + pairs).reshape(-1).to(self.device)
        self._attn_scale = 1.0 if self._complex_rope else self.scale
        self._weight_bytes: dict[int, tuple[Any, int]] = {}  # released parameter storages -> their bytes
        self.refresh_weights()
        # The pool is sized after the fused weight copies exist: they are part of the weights' share.
        if mem_fraction_static is None:
            mem_fraction_static = default_mem_fraction_static(self.device)
        weights = self.memory_bytes(kv=False)["weights"]
        free = _available_bytes(self.device)
        self.plan = plan_kv_pool(
            layers=len(self.layers), kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype,
            weight_bytes=weights, available_bytes=None if free is None else free + weights, max_slots=max_slots,
            context_length=context_length, device_type=self.device.type, page_size=page_size,
            max_total_tokens=max_total_tokens, mem_fraction_static=mem_fraction_static)
        start = time.perf_counter()
        self._init_pool()
        self.kv_pool_init_s = time.perf_counter() - start  # /server_info's startup_time.kv_cache_allocation

    def _init_pool(self) -> None:
        """Allocate the block pool, the block table and the views the forward passes use.

        The pool is laid out as ``regions`` slot-sized regions ``[kv_heads, blocks_per_request *
        page, d]`` (``[regions, kv_heads, blocks_per_request, page, d]`` per layer): block ``B`` is
        page ``B % M`` of region ``B // M`` (``M = blocks_per_request``), and its page for kv head
        ``h`` is row ``(B // M * kv_heads + h) * M + B % M`` of the pool viewed as pages. Slot
        ``s < regions`` has region ``s`` as its *home*: its blocks come from there while they are
        free, and a batch of slots ``0..B-1`` that all hold only home blocks is read as a view of the
        pool, as a slot cache would be, with no gather (the common case when the pool is not short).
        Otherwise blocks come from anywhere (highest free first, away from the low slots' homes)
        and decode gathers the batch's pages.
        """
        self.page_size = p = self.plan.page_size
        kvh, d = self.num_kv_heads, self.head_dim
        self.num_blocks = self.plan.num_blocks
        self.max_blocks_per_request = m = -(-self.context_length // p)
        self.regions = self.num_blocks // m
        # One tensor for K and V of every layer: handed-out blocks are zeroed with one op.
        self.kv_pool = torch.zeros((2, len(self.layers), self.regions, kvh, m, p, d), dtype=self.dtype,
                                   device=self.device)
        self.k_cache = list(self.kv_pool[0].unbind(0))  # per layer [regions, kv_heads, blocks, page, d]
        self.v_cache = list(self.kv_pool[1].unbind(0))
        # Token rows for index_copy_ ([regions * kv_heads * blocks * page, d]), pages for the gather
        # ([regions * kv_heads * blocks, page * d]), and regions as slots ([regions * kv_heads, m * page, d]).
        self._k_flat = [c.view(-1, d) for c in self.k_cache]
        self._v_flat = [c.view(-1, d) for c in self.v_cache]
        self._k_pages = [c.view(-1, p * d) for c in self.k_cache]
        self._v_pages = [c.view(-1, p * d) for c in self.v_cache]
        self._k_regions = [c.view(-1, m * p, d) for c in self.k_cache]
        self._v_regions = [c.view(-1, m * p, d) for c in self.v_cache]
        self._pool_pages = self.kv_pool.view(2 * len(self.layers), -1, p * d)
        # Per slot and block column: the page row of kv head 0 (head h: + h * M). Columns past a
        # request's blocks repeat its first block: a finite, masked stand-in for the gather.
        self.block_table = torch.zeros((self.max_slots, m), dtype=torch.long, device=self.device)
        self._slot_blocks: list[list[int]] = [[] for _ in range(self.max_slots)]  # block ids
        self._slot_rows: list[list[int]] = [[] for _ in range(self.max_slots)]  # their head-0 page rows
        self._stray = [False] * self.max_slots  # holds a block outside its home region
        self._strays = 0
        self._free = set(range(self.num_blocks))
        self._free_heap = [-b for b in range(self.num_blocks)]  # max-heap, lazily pruned against _free
        heapq.heapify(self._free_heap)
        self._head_pages = (torch.arange(kvh, device=self.device) * m).view(1, kvh, 1)
        self._head_rows = (torch.arange(kvh, device=self.device) * (m * p)).view(1, kvh)
        self._span_arange = torch.arange(m * p, device=self.device)

    # ---------------------------------------------------------------- block accounting

    @property
    def free_blocks(self) -> int:
        """Blocks not held by any request."""
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def max_total_tokens(self) -> int:
        """The pool's capacity in tokens (SGLang's ``max_total_num_tokens``)."""
        return self.num_blocks * self.page_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks that ``tokens`` cached tokens take."""
        return -(-tokens // self.page_size)

    def slot_blocks(self, slot: int) -> list[int]:
        """The blocks ``slot`` holds, in position order (a copy)."""
        return list(self._slot_blocks[slot])

    def _page_row(self, block: int) -> int:
        m = self.max_blocks_per_request
        return block // m * self.num_kv_heads * m + block % m

    def _take(self, slot: int, column: int) -> int:
        """A free block for ``slot``'s block ``column``: its home block if free, else the highest."""
        if slot < self.regions:
            home = slot * self.max_blocks_per_request + column
            if home in self._free:
                self._free.discard(home)
                return home
        while True:
            block = -heapq.heappop(self._free_heap)
            if block in self._free:
                self._free.discard(block)
                if not self._stray[slot]:
                    self._stray[slot] = True
                    self._strays += 1
                return block

    def allocate(self, slots: list[int], tokens: list[int]) -> None:
        """Grow each slot's blocks to hold ``tokens[i]`` cached tokens: blocks are taken from the free
        ones (see ``_init_pool``), zeroed and entered in the block table, all slots in one batch.

        Raises:
            RuntimeError: fewer free blocks than needed (the scheduler checks before calling).
        """
        grants: list[tuple[int, int]] = []  # (slot, blocks to add)
        total = 0
        for slot, n in zip(slots, tokens):
            need = -(-n // self.page_size) - len(self._slot_blocks[slot])
            if need > 0:
                grants.append((slot, need))
                total += need
        if not total:
            return
        if total > len(self._free):
            raise RuntimeError(f"The KV pool has {len(self._free)} free blocks; {total} were asked for.")
        rows, cols, pages = [], [], []
        for slot, need in grants:
            held, held_rows = self._slot_blocks[slot], self._slot_rows[slot]
            first = not held
            for _ in range(need):
                block = self._take(slot, len(held))
                row = self._page_row(block)
                rows.append(slot)
                cols.append(len(held))
                pages.append(row)
                held.append(block)
                held_rows.append(row)
            if first:  # a new request: its first block stands in for the columns it does not hold
                self.block_table[slot].fill_(held_rows[0])
        rows_t, cols_t, pages_t = torch.tensor([rows, cols, pages], dtype=torch.long, device=self.device)
        self.block_table.index_put_((rows_t, cols_t), pages_t)
        heads = pages_t if self.num_kv_heads == 1 else (pages_t.unsqueeze(1) + self._head_pages.view(1, -1)).view(-1)
        self._pool_pages.index_fill_(1, heads, 0)

    def free(self, slot: int) -> None:
        """Return ``slot``'s blocks to the pool."""
        held = self._slot_blocks[slot]
        if not held:
            return
        for block in held:
            self._free.add(block)
            heapq.heappush(self._free_heap, -block)
        if len(self._free_heap) > 2 * len(self._free) + 64:  # home takes leave stale entries behind
            self._free_heap = [-b for b in self._free]
            heapq.heapify(self._free_heap)
        self._slot_blocks[slot], self._slot_rows[slot] = [], []
        if self._stray[slot]:
            self._stray[slot] = False
            self._strays -= 1

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
    def refresh_weights(self, names: Optional[Iterable[str]] = None) -> None:
        """Rebuild the fused q|k|v and gate|up matrices from the HF parameters, in place.

        One matmul instead of three (two) per layer is a sizeable share of a small model's decode
        step. In float32 each layer's RMSNorm weights are also folded into the matrix that consumes
        the norm's output (``(w * n) @ W.T == n @ (W * w).T``), which saves one op per norm; in
        other dtypes the HF norm module runs as is, and the q/k/v and gate/up parameters are views
        of the fused matrices, so an update writes them once and the rebuild copies nothing. The
        engine calls this after every weight update, so the fused copies never go stale.

        Args:
            names: The parameters a weight update changed: only the layers they belong to (and the
                lm_head views, for any other name) are rebuilt, so an update sent in many buckets
                rebuilds each layer once. None: everything, into new memory.
        """
        layers: Iterable[int] = range(len(self.layers))
        lm = True
        if names is not None and len(getattr(self, "_fused", ())) == len(self.layers):
            touched: set[int] = set()
            lm = False
            for name in names:
                match = _LAYER_NAME.search(name)
                if match is None:
                    lm = True  # embeddings (maybe tied to lm_head), the final norm, lm_head
                else:
                    touched.add(int(match.group(1)))
            layers = sorted(i for i in touched if i < len(self.layers))
        else:
            self._fused: list[tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]] = [None] * len(self.layers)  # type: ignore[list-item]
            self._decode_w: list[tuple] = [None] * len(self.layers)  # type: ignore[list-item]
        for i in layers:
            self._fused[i] = self._fuse_layer(self.layers[i], self._fused[i])
            w, bias, gate_up = self._fused[i]
            attn, mlp = self.layers[i].self_attn, self.layers[i].mlp
            # Transposed views for addmm/mm, taken once (the o_proj/down views alias the parameters,
            # so in-place weight updates reach them).
            self._decode_w[i] = (w.t(), bias, attn.o_proj.weight.t(), attn.o_proj.bias, gate_up.t(),
                                 mlp.down_proj.weight.t(), mlp.down_proj.bias)
        if lm:
            # The final norm's weight is not folded into lm_head: with a large vocabulary the folded
            # copy would cost the head's size in memory, and a pass over it at every weight update,
            # to save one small op per step.
            self._lm_weight = self.lm_head.weight
            self._lm_t = self._lm_weight.t()

    def _fuse_layer(self, layer: Any, into: Optional[tuple] = None) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """Layer ``layer``'s fused q|k|v (with its bias) and gate|up matrices, written into ``into``
        (the layer's previous ones) where their shapes still fit: each piece is then read and written
        once (concatenation, norm fold and scale in one op), and a weight update allocates nothing."""
        attn, mlp = layer.self_attn, layer.mlp
        pieces = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        has_bias = not any(b is None for b in biases)
        rows = sum(p.shape[0] for p in pieces)
        old_w, old_bias, old_gate_up = into if into is not None else (None, None, None)
        w = old_w if _reusable(old_w, pieces[0], rows) else torch.empty(
            rows, pieces[0].shape[1], dtype=pieces[0].dtype, device=pieces[0].device)
        bias = None
        if has_bias:
            bias = old_bias if _reusable(old_bias, biases[0], rows) else torch.empty(
                rows, dtype=biases[0].dtype, device=biases[0].device)
        ups = [mlp.gate_proj.weight, mlp.up_proj.weight]
        gate_up = old_gate_up if _reusable(old_gate_up, ups[0], 2 * ups[0].shape[0]) else torch.empty(
            2 * ups[0].shape[0], ups[0].shape[1], dtype=ups[0].dtype, device=ups[0].device)
        norm_in = layer.input_layernorm.weight if self._fold else None
        norm_post = layer.post_attention_layernorm.weight if self._fold else None
        if self._complex_rope:
            # Rows of q|k permuted pair-interleaved (see __init__), q's also scaled; v as is.
            nq, nqk = self.num_heads * self.head_dim, self._qk_perm.numel()
            qk = torch.cat(pieces[:2])
            torch.index_select(qk, 0, self._qk_perm, out=w[:nqk])
            _scaled_into(pieces[2], norm_in, w[nqk:])
            if norm_in is not None:
                w[:nqk].mul_(norm_in)
            w[:nq] *= self.scale
            if bias is not None:
                torch.index_select(torch.cat(biases[:2]), 0, self._qk_perm, out=bias[:nqk])
                bias[nqk:].copy_(biases[2])
                bias[:nq] *= self.scale
        else:
            start = 0
            for piece in pieces:
                _scaled_into(piece, norm_in, w[start : start + piece.shape[0]])
                start += piece.shape[0]
            if bias is not None:
                torch.cat(biases, out=bias)
        _scaled_into(ups[0], norm_post, gate_up[: ups[0].shape[0]])
        _scaled_into(ups[1], norm_post, gate_up[ups[0].shape[0] :])
        if not self._fold and not self._complex_rope:
            # Nothing is folded: q, k, v (gate, up) become views of the fused matrices, so a weight
            # update writes them once and the rebuild above copies nothing (a view onto itself).
            _rebind([attn.q_proj, attn.k_proj, attn.v_proj], w)
            _rebind([mlp.gate_proj, mlp.up_proj], gate_up)
        return w, bias, gate_up

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The model's last RMSNorm, with its weight (not folded into lm_head; see refresh_weights)."""
        return torch.mul(self._norm(self.norm, x), self.norm.weight) if self._fold else self.norm(x)

    def _norm(self, module: Any, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of ``x``; in float32 without the weight, which is folded into the next matrix.

        HF's formula, ``x * rsqrt(mean(x^2) + eps)``, in four ops: ``vector_norm`` then
        ``addcmul`` gives ``eps + |x|^2 / n``.
        """
        if not self._fold:
            return module(x)
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return x * torch.addcmul(self._eps_t, norm, norm, value=self._inv_hidden).rsqrt_()

    def _qkv(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Project, (Qwen3) head-norm and rotate ``h`` ``[N, hidden]``.

        Returns q ``[N, H, d]``, k and v ``[N, kvh, d]``.
        """
        n = h.shape[0]
        w, bias, _ = self._fused[i]
        qkv = F.linear(h, w, bias).view(n, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        nqk = self.num_heads + self.num_kv_heads
        qk, v = qkv[:, :nqk], qkv[:, nqk:]
        attn = self.layers[i].self_attn
        if hasattr(attn, "q_norm"):  # Qwen3 normalises each head before RoPE.
            qk = torch.cat([attn.q_norm(qk[:, : self.num_heads]), attn.k_norm(qk[:, self.num_heads :])], dim=1)
        if self._complex_rope:  # cos is the complex rotation here, sin unused
            qk = torch.view_as_real(torch.view_as_complex(qk.view(n, nqk, -1, 2)) * cos).view(n, nqk, -1)
        else:
            qk = torch.addcmul(qk * cos, qk.roll(self.head_dim // 2, dims=-1), sin)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v

    def _mlp_residual(self, i: int, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, hidden]`` plus attention output projection, then plus the MLP of the result."""
        layer = self.layers[i]
        o_proj, down = layer.self_attn.o_proj, layer.mlp.down_proj
        # Functional calls and residual adds folded into addmm: on a tiny model a decode step is
        # mostly per-op overhead, so every op saved counts.
        x = _linear_residual(x, attn_out, o_proj)
        gate_up = torch.mm(self._norm(layer.post_attention_layernorm, x), self._fused[i][2].t())
        gate, up = gate_up.chunk(2, dim=-1)
        if self._silu:
            act = F.silu(gate, inplace=True).mul_(up)  # in place: gate is a view of a temporary
        else:
            act = layer.mlp.act_fn(gate) * up
        return _linear_residual(x, act, down)

    @torch.inference_mode()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Run prompts into their slots' blocks (positions ``0..len-1``), batched.

        Prompts are right-padded: a valid query never attends a padded key (those sit after it), so
        the plain causal mask is exact for every real token; only real tokens are written to the pool.
        A forward pads its rows to its longest prompt, so the prompts run sorted by length, in the
        forwards :func:`prefill_chunks` picks (a resumed or retracted request's prompt carries its
        tokens so far: tens to hundreds of tokens beside prompts of tens).

        Args:
            slots: Each request's slot, holding blocks for its prompt (:meth:`allocate`).
            prompts: Each request's prompt, ``1 <= len <= context_length``.

        Returns:
            Logits of each prompt's last position, ``[batch, vocab]`` (float32), in ``prompts``' order.
        """
        chunks = prefill_chunks([len(p) for p in prompts])
        logits = torch.cat([self._prefill_chunk([slots[i] for i in c], [prompts[i] for i in c]) for c in chunks])
        order = [i for c in chunks for i in c]
        if order == sorted(order):
            return logits
        return logits.index_select(0, torch.tensor(order, device=logits.device).argsort())  # back to prompts' order

    def _prefill_chunk(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        b, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], dtype=torch.long, device=self.device)
        n, d, page = b * width, self.head_dim, self.page_size
        # Pool row of every real token (kv head 0: page row * page + offset), and its row in the
        # padded batch.
        locs: list[int] = []
        for slot, p in zip(slots, prompts):
            rows = self._slot_rows[slot]
            locs.extend(rows[t // page] * page + t % page for t in range(len(p)))
        loc_t = torch.tensor(locs, dtype=torch.long, device=self.device)
        if self.num_kv_heads > 1:
            loc_t = (loc_t.unsqueeze(1) + self._head_rows).view(-1)
        real = None
        if len(locs) < n:
            real = torch.tensor([r * width + t for r, p in enumerate(prompts) for t in range(len(p))],
                                dtype=torch.long, device=self.device)
        if self._complex_rope:
            cos, sin = self._cis[:width].repeat(b, 1).view(n, 1, -1), None
        else:
            cos = self._cos[:width].repeat(b, 1).view(n, 1, d)
            sin = self._sin_signed[:width].repeat(b, 1).view(n, 1, d)
        last_pos = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        last = torch.arange(0, n, width, device=self.device) + last_pos  # rows of the flattened batch
        x = F.embedding(ids.view(-1), self.embed.weight)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, self._norm(layer.input_layernorm, x), cos, sin)
            k_real, v_real = (k, v) if real is None else (k.index_select(0, real), v.index_select(0, real))
            self._k_flat[i].index_copy_(0, loc_t, k_real.reshape(-1, d))
            self._v_flat[i].index_copy_(0, loc_t, v_real.reshape(-1, d))
            q = q.view(b, width, self.num_heads, d).transpose(1, 2)
            k = k.view(b, width, self.num_kv_heads, d).transpose(1, 2)
            v = v.view(b, width, self.num_kv_heads, d).transpose(1, 2)
            if i < len(self.layers) - 1:
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self._attn_scale, enable_gqa=True)
                attn = attn.transpose(1, 2).reshape(n, -1)
            else:
                # Only the last position of each prompt feeds the logits: the last layer's
                # attention, output projection and MLP (most of its cost) run on those rows alone.
                x = x.index_select(0, last)
                q_last = q.gather(2, last_pos.view(b, 1, 1, 1).expand(b, self.num_heads, 1, d))
                mask = (self._arange[:width] <= last_pos.unsqueeze(1)).view(b, 1, 1, width)
                attn = F.scaled_dot_product_attention(q_last, k, v, attn_mask=mask, scale=self._attn_scale,
                                                      enable_gqa=True)
                attn = attn.reshape(b, -1)
            x = self._mlp_residual(i, x, attn)
        return F.linear(self._final_norm(x), self._lm_weight, self.lm_head.bias).float()

    @torch.inference_mode()
    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step for a batch of running requests.

        Written for few Python-level torch calls: on a small model a decode step is mostly per-op
        overhead, so per-step tensors (positions, the new tokens' pool rows, the block-gather index,
        mask, RoPE rows) are built once and shared by all layers, weights are pre-transposed views,
        and residual adds ride in addmm.

        Args:
            slots: Each request's slot, sorted; it holds a block for ``positions[i]`` (:meth:`allocate`).
            tokens: Each request's last sampled token (not yet in the cache).
            positions: Each token's position (= tokens already cached for that request).

        Returns:
            Next-token logits ``[batch, vocab]`` (float32).
        """
        b, kvh, d, nh, page = len(slots), self.num_kv_heads, self.head_dim, self.num_heads, self.page_size
        nqk = nh + kvh
        held = self._slot_rows
        locs = [held[s][p // page] * page + p % page for s, p in zip(slots, positions)]
        slot_t, ids, pos_t, loc_t = torch.tensor([slots, tokens, positions, locs], dtype=torch.long,
                                                 device=self.device)
        span = max(positions) + 1
        # Slots 0..B-1 all holding only blocks of their home regions (the common case when the pool
        # is not short) read the pool as a slot cache, a view; any other batch gathers its pages.
        contiguous = slots[0] == 0 and slots[-1] == b - 1 and slots == list(range(b))
        pages = None
        if not (contiguous and self._strays == 0) or self.paged_only:
            blocks = (span - 1) // page + 1
            span = blocks * page  # whole pages
            table = self.block_table[:b, :blocks] if contiguous else self.block_table.index_select(0, slot_t)[:, :blocks]
            # Page rows to gather, request-major then kv head then block: the gathered pages are the
            # [b * kv_heads, span, d] the attention reads, with no transpose. Columns past a
            # request's blocks repeat its first block (masked).
            pages = table.reshape(-1) if kvh == 1 else (table.unsqueeze(1) + self._head_pages).view(-1)
        # Additive mask over the gathered span, one row per request (and kv head): own positions only.
        # baddbmm broadcasts it over the query heads of the group.
        bias = torch.where(self._span_arange[:span] > pos_t.unsqueeze(1), self._neg_inf, self._zero).unsqueeze(1)
        if kvh > 1:
            bias = bias.expand(b, kvh, span).reshape(b * kvh, 1, span)
        if self._complex_rope:
            cis = self._cis.index_select(0, pos_t).unsqueeze(1)  # [b, 1, d/2] complex
        else:
            cos_sin = self._rope.index_select(0, pos_t)  # [b, 2, d]
            cos, sin = cos_sin[:, :1], cos_sin[:, 1:]
        # Row of (kv head, block, offset) in the pool viewed as token rows [..., d]: one index_copy_
        # per cache and layer, cheaper than a multi-index index_put.
        rows = loc_t if kvh == 1 else (loc_t.unsqueeze(1) + self._head_rows).view(-1)
        qwen3 = self._qk_norm
        x = F.embedding(ids, self.embed.weight)
        for i, (qkv_t, qkv_b, o_t, o_b, gu_t, down_t, down_b) in enumerate(self._decode_w):
            layer = self.layers[i]
            h = self._norm(layer.input_layernorm, x)
            qkv = (torch.addmm(qkv_b, h, qkv_t) if qkv_b is not None else torch.mm(h, qkv_t)).view(b, -1, d)
            qk = qkv[:, :nqk]
            if qwen3:  # Qwen3 normalises each head before RoPE.
                attn_mod = layer.self_attn
                qk = torch.cat([attn_mod.q_norm(qk[:, :nh]), attn_mod.k_norm(qk[:, nh:])], dim=1)
            if self._complex_rope:
                qk = torch.view_as_real(torch.view_as_complex(qk.view(b, nqk, -1, 2)) * cis).view(b, nqk, d)
            else:
                qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)
            self._k_flat[i].index_copy_(0, rows, qk[:, nh:].reshape(-1, d))
            self._v_flat[i].index_copy_(0, rows, qkv[:, nqk:].reshape(-1, d))
            if pages is None:
                keys, values = self._k_regions[i][: b * kvh, :span], self._v_regions[i][: b * kvh, :span]
            else:
                keys = self._k_pages[i].index_select(0, pages).view(b * kvh, span, d)
                values = self._v_pages[i].index_select(0, pages).view(b * kvh, span, d)
            # Query head h reads kv head h // group (HF's repeat_kv), so fold the group into rows.
            q = qk[:, :nh] if kvh == 1 else qk[:, :nh].reshape(b * kvh, self.group, d)
            scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=self._attn_scale)
            attn = torch.bmm(torch.softmax(scores, dim=-1), values).view(b, -1)
            x = torch.addmm(x, attn, o_t) if o_b is None else x + F.linear(attn, o_t.t(), o_b)
            gate, up = torch.mm(self._norm(layer.post_attention_layernorm, x), gu_t).chunk(2, dim=-1)
            act = F.silu(gate, inplace=True).mul_(up) if self._silu else layer.mlp.act_fn(gate) * up
            x = torch.addmm(x, act, down_t) if down_b is None else x + F.linear(act, down_t.t(), down_b)
        logits = torch.mm(self._final_norm(x), self._lm_t)
        if self.lm_head.bias is not None:
            logits = logits + self.lm_head.bias
        return logits.float()

    # ---------------------------------------------------------------- memory release (colocate)
    # SGLang's /release_memory_occupation keeps every tensor's address and shape and hands its
    # physical memory back (torch_memory_saver); resizing a tensor's storage to 0 bytes and back is
    # the same on CPU and CUDA: shapes, strides and views (the cache views below) stay valid.

    def release_kv_cache(self) -> int:
        """Free the KV pool's memory (its tensors keep their shapes; no request may hold blocks);
        returns the bytes freed."""
        if self.used_blocks:
            raise RuntimeError(f"The KV pool cannot be released while requests hold {self.used_blocks} blocks.")
        return _free_storages([self.kv_pool], self.device)

    def resume_kv_cache(self) -> None:
        """Reallocate the KV pool released by :meth:`release_kv_cache`, zeroed (it holds no request)."""
        t = self.kv_pool
        t.untyped_storage().resize_(t.numel() * t.element_size())
        t.zero_()

    def release_weights(self) -> int:
        """Free the parameters' memory and the fused copies built from them; the parameters keep
        their shapes, dtypes and names, so a weight update can load into them after
        :meth:`resume_weights`. Returns the bytes freed."""
        before = self.memory_bytes()["weights"]
        # The fused copies are rebuilt from the parameters on resume; drop them now.
        self._fused, self._decode_w, self._lm_weight, self._lm_t = [], [], None, None
        storages: dict[int, tuple[Any, int]] = {}
        with torch.no_grad():
            for p in self.model.parameters():
                s = p.untyped_storage()
                if not s.resizable():
                    # A storage once shared with numpy (a weight checksum) or a file mapping (weights
                    # loaded from safetensors) cannot be resized: give the parameter one of its own
                    # (allocated, not written), and the old one goes with its last reference.
                    p.data = torch.empty_like(p)
                    s = p.untyped_storage()
                if s.nbytes():
                    storages.setdefault(s.data_ptr(), (s, s.nbytes()))
            for s, _ in storages.values():
                s.resize_(0)
        self._weight_bytes = storages
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return before - self.memory_bytes()["weights"]

    def resume_weights(self) -> None:
        """Reallocate the parameters released by :meth:`release_weights`, zeroed, as SGLang's resume
        gives memory back without its old contents: they serve garbage until a weight update."""
        with torch.no_grad():
            for storage, nbytes in self._weight_bytes.values():
                storage.resize_(nbytes)
            for p in self.model.parameters():
                p.zero_()
        self._weight_bytes = {}
        self.refresh_weights()

    def memory_bytes(self, kv: bool = True) -> dict[str, int]:
        """Bytes held now by the weights (parameters and their fused copies) and by the KV pool
        (``kv=False``: the weights only, before the pool exists)."""
        held = {"weights": _distinct_bytes([*self.model.parameters(), *self._derived_weights()])}
        if kv:
            held["kv_cache"] = _distinct_bytes([self.kv_pool])
        return held

    def _derived_weights(self) -> list[torch.Tensor]:
        out = [t for fused in self._fused if fused is not None for t in fused if t is not None]
        if self._lm_weight is not None:
            out.append(self._lm_weight)
        return out


def _distinct_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied weights counted once)."""
    sizes = {s.data_ptr(): s.nbytes() for s in (t.untyped_storage() for t in tensors) if s.nbytes()}
    return sum(sizes.values())


def _free_storages(tensors: list[torch.Tensor], device: torch.device) -> int:
    """Resize each distinct storage behind ``tensors`` to 0 bytes; return the bytes freed. On CUDA
    the caching allocator then returns the blocks to the device, where other processes get them."""
    freed = _distinct_bytes(tensors)
    for t in tensors:
        t.untyped_storage().resize_(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return freed


def _reusable(old: Optional[torch.Tensor], like: torch.Tensor, rows: Optional[int] = None) -> bool:
    """``old`` can take a rebuilt fused matrix of ``like``'s dtype and device (and ``rows`` rows):
    it exists, has storage (not released) and the expected shape."""
    if old is None or old.dtype != like.dtype or old.device != like.device or not old.untyped_storage().nbytes():
        return False
    shape = like.shape if rows is None else (rows, *like.shape[1:])
    return tuple(old.shape) == tuple(shape)


def _scaled_into(src: torch.Tensor, scale: Optional[torch.Tensor], out: torch.Tensor) -> None:
    """``out = src * scale`` (a norm weight broadcast over rows), or a copy without ``scale``
    (none when ``src`` already is ``out``)."""
    if scale is not None:
        torch.mul(src, scale, out=out)
    elif not (src.data_ptr() == out.data_ptr() and src.shape == out.shape and src.stride() == out.stride()):
        out.copy_(src)


def _rebind(modules: list[Any], fused: torch.Tensor) -> None:
    """Make each module's weight a view of its rows of ``fused`` (which holds their values)."""
    start = 0
    for module in modules:
        rows = module.weight.shape[0]
        module.weight.data = fused[start : start + rows]
        start += rows
