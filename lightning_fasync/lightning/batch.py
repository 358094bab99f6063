"""Training batches: what the dataloader yields, groups → padded tensors, and the packed forwards.

Lightning's fit loop prefetches one batch ahead, which would pull a mini-batch out of the
PipelineBuffer before the step boundary that should precede it. So the dataloader yields an empty
:class:`RolloutBatch` ticket, and :class:`~lightning_fasync.lightning.callback.FullyAsyncCallback`
fills it in ``on_train_batch_start`` (main thread, exactly when the spec's trainer fetches).

The loss always works on the padded ``[B, L-1]`` layout of :class:`PolicyBatch`; only the model's
forwards change with ``trainer.pack_sequences`` and ``trainer.max_tokens_per_micro_batch``
(docs/packing.md): :func:`plan_forwards` cuts the call into :class:`MicroBatch` forwards, each
packing its sequences without padding (positions restarting at 0 per sequence, so the model's own
attention keeps each sequence to itself) or padding them to its own longest, and maps each scored
position back to the padded layout.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import IterableDataset

from lightning_fasync.errors import ConfigError
from lightning_fasync.runtime.packing import first_fit_decreasing, packed_cost, padded_cost, split_to
from lightning_fasync.types import TrajectoryGroup


@dataclass
class RolloutBatch:
    """One training call's data: M // N complete groups (filled at ``on_train_batch_start``)."""

    groups: Optional[list[TrajectoryGroup]] = None
    rollout_step: int = -1
    data: Any = None  # the module's prepared tensors (``prepare_rollout_batch``), when it has one
    call_index: int = 0
    """Training calls (optimizer updates) already done in this rollout step."""
    calls_per_step: int = 1
    """(B × N) // M: training calls per rollout step, i.e. per weight version."""



class RolloutTickets(IterableDataset):
    """An endless stream of empty :class:`RolloutBatch` tickets (the run ends at ``max_steps``)."""

    def __iter__(self) -> Iterator[RolloutBatch]:
        while True:
            yield RolloutBatch()


def rollout_dataloader() -> torch.utils.data.DataLoader:
    """The dataloader a fully-async LightningModule returns from ``train_dataloader``."""
    return torch.utils.data.DataLoader(RolloutTickets(), batch_size=None, num_workers=0)


@dataclass
class PolicyBatch:
    """Right-padded tensors for a causal LM over prompt + response.

    ``response_mask``, ``rollout_log_probs`` and ``weight_versions`` are aligned with the
    response positions inside ``input_ids`` shifted by one (position t predicts token t + 1), so
    they index the logits directly: ``logits[:, :-1]`` gathered at ``input_ids[:, 1:]``.
    """

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L-1] float
    rollout_log_probs: torch.Tensor  # [B, L-1]
    weight_versions: torch.Tensor  # [B, L-1], -1 outside responses
    rewards: torch.Tensor  # [G, N]
    forwards: Optional["ForwardPlan"] = None
    """How the model's forwards run over these rows (:func:`plan_forwards`); None: one forward of
    the padded ``input_ids``."""


def collate_groups(groups: list[TrajectoryGroup], pad_id: int) -> PolicyBatch:
    """Pad prompt + response of every trajectory; rewards as [groups, N] (NaN when missing)."""
    trajs = [t for g in groups for t in g.trajectories]
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
    L = max(max(lengths, default=1), 2)
    B = len(trajs)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L - 1), dtype=torch.float32)
    rollout_lp = torch.zeros((B, L - 1), dtype=torch.float32)
    versions = torch.full((B, L - 1), -1, dtype=torch.long)
    for i, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, :p] = torch.tensor(t.prompt_ids, dtype=torch.long)
        if r:
            input_ids[i, p : p + r] = torch.tensor(list(t.response_ids), dtype=torch.long)
            # Response token j sits at position p + j and is predicted from position p + j - 1.
            mask[i, p - 1 : p - 1 + r] = torch.tensor(list(t.loss_mask), dtype=torch.float32)
            rollout_lp[i, p - 1 : p - 1 + r] = torch.tensor(list(t.rollout_log_probs), dtype=torch.float32)
            versions[i, p - 1 : p - 1 + r] = torch.tensor(list(t.weight_versions), dtype=torch.long)
        attention[i, : p + r] = 1
    rewards = torch.tensor(
        [[float("nan") if t.reward is None else float(t.reward) for t in g.trajectories] for g in groups],
        dtype=torch.float32,
    )
    return PolicyBatch(input_ids, attention, mask, rollout_lp, versions, rewards)


# ------------------------------------------------------------------------------ packed forwards

PACKED_ATTENTION: dict[str, str] = {
    "sdpa": "rows",
    "eager": "rows",
    "flex_attention": "rows",
    "flash_attention_2": "flat",
    "flash_attention_3": "flat",
}
"""How a packed micro-batch is laid out for each Hugging Face ``attn_implementation`` (the policy
config's ``_attn_implementation``), where the library keeps packed sequences apart itself when it is
given ``position_ids`` that restart at 0 per sequence and no ``attention_mask``:

* ``rows``: ``sdpa``, ``eager``, ``flex_attention`` build a block-diagonal causal mask from the
  positions (transformers' ``masking_utils.find_packed_sequence_indices``, transformers >= 4.53).
  Its cost is quadratic in a row's length, so the sequences are packed first-fit decreasing into
  rows no longer than the micro-batch's longest sequence (never a longer row than padding has).
* ``flat``: FlashAttention 2 / 3 take the varlen kernel (``cu_seqlens`` from the positions), which
  transformers does for a batch of one row only: the micro-batch is one row.

An implementation not listed is not packed (``trainer.pack_sequences: null``) or refused (``true``);
add an entry for your own (e.g. a Hub kernel) if transformers keeps its packed sequences apart."""


@dataclass
class MicroBatch:
    """One forward of a training call over some of its sequences.

    ``input_ids`` are ``[R, T]``: packed (``position_ids`` given, restarting at 0 for each sequence
    and for each row's padded tail; ``attention_mask`` None, so the model finds the sequences from
    the positions) or padded (``attention_mask`` given, ``position_ids`` None). ``source`` are the
    flat indices into ``R * T`` of the positions whose next token is scored, ``target`` where each
    score lands in the flat ``[len(rows), W]`` padded layout (``W = L - 1``).
    """

    rows: torch.Tensor  # [n] the sequences: rows of the call's PolicyBatch
    input_ids: torch.Tensor  # [R, T]
    position_ids: Optional[torch.Tensor]  # [R, T] (packed) or None
    attention_mask: Optional[torch.Tensor]  # [R, T] (padded) or None
    source: torch.Tensor  # [S]
    target: torch.Tensor  # [S]
    tokens: int = 0
    """Real tokens (prompt + response) of its sequences."""

    def to(self, device: torch.device) -> "MicroBatch":
        return replace(self, **{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()})


@dataclass
class ForwardPlan:
    """A training call's forwards: its sequences cut into micro-batches (each packed or padded)."""

    micro_batches: list[MicroBatch]
    width: int
    """``L - 1``: the padded layout's positions per sequence."""
    packed: bool
    max_tokens: Optional[int] = None
    """The token budget it was cut with (``trainer.max_tokens_per_micro_batch``)."""
    lengths: list[int] = field(default_factory=list)
    """Prompt + response tokens of each sequence."""
    layout: str = "rows"

    def to(self, device: torch.device) -> "ForwardPlan":
        return replace(self, micro_batches=[mb.to(device) for mb in self.micro_batches])


def sequence_lengths(data: PolicyBatch) -> list[int]:
    """Prompt + response tokens of each row (right padding: the attention mask's count)."""
    return [int(n) for n in data.attention_mask.sum(dim=-1).tolist()]


def _segments(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For consecutive segments of ``lengths``: every token's segment and its position inside it
    (vectorised: no per-token Python)."""
    n = torch.tensor(lengths, dtype=torch.long, device=device)
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=device), n)
    first = torch.cumsum(n, 0) - n
    within = torch.arange(int(n.sum()), device=device) - first[seg]
    return seg, within


def _scored(lengths: list[int], place: list[int], W: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``source`` / ``target`` of :class:`MicroBatch` for sequences of ``lengths`` placed at flat
    offsets ``place`` of a flattened forward: positions ``0 .. len - 2`` of each (the last one's next
    token is the following sequence's, or padding), landing at ``i * W + t``."""
    scored = [max(0, n - 1) for n in lengths]
    seg, within = _segments(scored, device)
    source = torch.tensor(place, dtype=torch.long, device=device)[seg] + within
    target = seg * W + within
    return source, target


def _packed_micro_batch(data: PolicyBatch, rows: list[int], lengths: list[int], pad_id: int,
                        flat: bool) -> MicroBatch:
    """``rows`` (longest first) packed without padding: one row (``flat``), or first-fit decreasing
    into rows no longer than the longest of them."""
    device = data.input_ids.device
    L = data.input_ids.shape[1]
    W = L - 1
    own = [lengths[r] for r in rows]
    if not rows:  # an empty micro-batch (split_to): one 2-token row of padding, nothing scored
        ids = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return MicroBatch(torch.zeros(0, dtype=torch.long, device=device), ids, torch.arange(2, device=device)[None],
                          None, empty, empty, 0)
    capacity = None if flat else max(own)
    packs = first_fit_decreasing(own, capacity)
    loads = [sum(own[i] for i in pack) for pack in packs]
    T = max(max(loads), 2)
    # Where each sequence of the micro-batch goes: (row, offset) → a flat offset into R * T.
    place = [0] * len(rows)
    for r, pack in enumerate(packs):
        offset = 0
        for i in pack:
            place[i] = r * T + offset
            offset += own[i]
    seg, within = _segments(own, device)
    flat_ids = data.input_ids.reshape(-1)
    src = torch.tensor(rows, dtype=torch.long, device=device)[seg] * L + within
    dst = torch.tensor(place, dtype=torch.long, device=device)[seg] + within
    input_ids = torch.full((len(packs) * T,), pad_id, dtype=torch.long, device=device)
    input_ids[dst] = flat_ids[src]
    # Each row's padded tail is a segment of its own (positions from 0), the packed ones are overwritten.
    tails = torch.arange(T, device=device)[None] - torch.tensor(loads, device=device)[:, None]
    position_ids = tails.reshape(-1).clone()
    position_ids[dst] = within
    source, target = _scored(own, place, W, device)
    return MicroBatch(torch.tensor(rows, dtype=torch.long, device=device), input_ids.view(len(packs), T),
                      position_ids.view(len(packs), T), None, source, target, sum(own))


def _padded_micro_batch(data: PolicyBatch, rows: list[int], lengths: list[int], pad_id: int) -> MicroBatch:
    """``rows`` right-padded to the longest of them (the plain layout, on a subset of the call)."""
    device = data.input_ids.device
    W = data.input_ids.shape[1] - 1
    own = [lengths[r] for r in rows]
    T = max(max(own, default=2), 2)
    index = torch.tensor(rows, dtype=torch.long, device=device)
    if rows:
        input_ids, attention = data.input_ids[index, :T], data.attention_mask[index, :T]
    else:
        input_ids = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
        attention = torch.ones_like(input_ids)
    source, target = _scored(own, [i * T for i in range(len(rows))], W, device)
    return MicroBatch(index, input_ids, None, attention, source, target, sum(own))


def plan_forwards(data: PolicyBatch, pad_id: int, *, pack: bool, max_tokens: Optional[int] = None,
                  layout: str = "rows", micro_batches: int = 1) -> ForwardPlan:
    """Cut a training call into micro-batch forwards.

    Arguments:
        data: the call's padded batch (on the device the forwards run on).
        pad_id: the token id that fills packed rows' tails.
        pack: pack each micro-batch's sequences without padding (else pad each to its longest).
        max_tokens: ``trainer.max_tokens_per_micro_batch``: each micro-batch holds at most this
            many tokens (real tokens when packed, rows x longest when padded), first-fit decreasing;
            a longer sequence has a micro-batch of its own. None: one micro-batch.
        layout: ``rows`` or ``flat`` (:data:`PACKED_ATTENTION`), for packed micro-batches.
        micro_batches: at least this many micro-batches (:func:`~lightning_fasync.runtime.packing.split_to`):
            what a data-parallel rank with fewer than the others runs.
    """
    lengths = sequence_lengths(data)
    cost = packed_cost if pack else padded_cost
    bins = first_fit_decreasing(lengths, max_tokens, cost)
    bins = split_to(bins, max(micro_batches, 1), lengths, cost)
    if pack:
        mbs = [_packed_micro_batch(data, b, lengths, pad_id, layout == "flat") for b in bins]
    else:
        mbs = [_padded_micro_batch(data, b, lengths, pad_id) for b in bins]
    return ForwardPlan(mbs, data.input_ids.shape[1] - 1, pack, max_tokens, lengths, layout)


_CHECKED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def check_packed_attention(model: torch.nn.Module) -> None:
    """Refuse a model whose attention lets packed sequences see each other, once per model (its
    first packed forward; every rank at the same call, so a sharded model's gathers match).

    Two one-row forwards pack the same 3-token sequence after two different 4-token ones: if the
    library keeps packed sequences apart (:data:`PACKED_ATTENTION`), its logits are the same in both. A model
    whose modeling code does not build its mask from the positions (custom or remote code, or a
    transformers older than 4.53) fails here instead of training on mixed sequences.

    Raises:
        ConfigError: the second sequence's logits depend on the first's tokens.
    """
    if model in _CHECKED:
        return
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or getattr(embeddings, "num_embeddings", 8)
    device = next(model.parameters()).device
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2]], device=device)
    logits = []
    # In eval mode (dropout would make the two forwards differ however the attention behaves), and
    # without consuming the run's random numbers.
    training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            for first in ([1, 2, 3, 4], [4, 3, 1, 2]):  # one row per forward: FlashAttention's varlen path needs that
                ids = torch.tensor([first + [2, 3, 1]], device=device) % vocab
                logits.append(model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, 4:].float())
    finally:
        model.train(training)
    gap = (logits[0] - logits[1]).abs().max().item()
    if not gap <= 1e-3 * (1.0 + logits[0].abs().max().item()):
        attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
        raise ConfigError(
            f"`trainer.pack_sequences`: the policy ({type(model).__name__}, attention {attn!r}) lets packed sequences "
            f"attend to each other (a packed sequence's logits moved by {gap:.3g} when the one before it changed); "
            "set `trainer.pack_sequences: false` for this model."
        )
    _CHECKED.add(model)


def forward_log_probs(model: torch.nn.Module, mb: MicroBatch, width: int, with_entropy: bool = False,
                      entropy_grad: bool = False, temperature: float = 1.0
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """One micro-batch's forward: its sequences' next-token log-probs ``[n, width]`` in the padded
    layout (0 after each sequence's last scored position), the entropy likewise (or None), and a
    zero that carries the forward's graph (an empty micro-batch's whole loss, so that its backward
    still runs every layer: FSDP2's gradient reduction is a collective).

    Packed micro-batches go in with ``position_ids`` and without ``attention_mask``, so transformers
    builds the per-sequence causal mask itself (or takes FlashAttention's varlen path); the logits
    are scored only at the ``source`` positions."""
    if mb.position_ids is not None:
        check_packed_attention(model)
        logits = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits
    else:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    n = mb.rows.numel()
    picked = logits.reshape(-1, logits.shape[-1]).index_select(0, mb.source).float()
    if temperature != 1.0:
        picked = picked / temperature
    log_probs_all = torch.log_softmax(picked, dim=-1)
    targets = mb.input_ids.reshape(-1).index_select(0, mb.source + 1)
    scores = log_probs_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    log_probs = scores.new_zeros(n * width).index_put((mb.target,), scores).view(n, width)
    anchor = logits.float().sum() * 0.0 if n == 0 else scores.sum() * 0.0
    if not with_entropy:
        return log_probs, None, anchor
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent = -(log_probs_all.exp() * log_probs_all).sum(-1)
        entropy = ent.new_zeros(n * width).index_put((mb.target,), ent).view(n, width)
    return log_probs, entropy, anchor
