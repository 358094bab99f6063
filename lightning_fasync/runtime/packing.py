"""Token bin-packing for the trainer: pure Python on lengths, no tensors.

What both halves of sequence packing share (docs/packing.md): :func:`first_fit_decreasing` splits a
training call into token-budget micro-batches and packs each micro-batch's sequences into rows of
bounded length; :func:`split_to` gives every data-parallel rank the same number of micro-batches;
:func:`balanced_equal_count` hands each data-parallel rank groups of (about) the same token count.
Every function is deterministic in its inputs (ties go to the lower index), so every rank computes
the same answer from the same lengths.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

__all__ = ["balanced_equal_count", "first_fit_decreasing", "padded_cost", "packed_cost", "split_to"]

Cost = Callable[[Sequence[int]], int]
"""The cost of a bin from the lengths of its items (longest first)."""


def packed_cost(lengths: Sequence[int]) -> int:
    """A packed bin costs its tokens."""
    return sum(lengths)


def padded_cost(lengths: Sequence[int]) -> int:
    """A padded bin costs its rows times its longest (the first of ``lengths``, which come longest first)."""
    return len(lengths) * (lengths[0] if lengths else 0)


def first_fit_decreasing(lengths: Sequence[int], capacity: Optional[int], cost: Cost = packed_cost) -> list[list[int]]:
    """Indices of ``lengths`` in bins of at most ``capacity`` (by ``cost``), first-fit decreasing.

    Items are taken longest first (ties: lower index first) and each goes into the first bin it
    fits in, else into a new bin; an item that alone exceeds ``capacity`` gets a bin of its own
    (a sequence is never split). Within a bin the items stay longest first. ``capacity`` None: one
    bin holding everything (none for no items).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if capacity is None:
        return [order] if order else []
    bins: list[list[int]] = []
    sizes: list[list[int]] = []
    for i in order:
        for items, held in zip(bins, sizes):
            if cost(held + [lengths[i]]) <= capacity:
                items.append(i)
                held.append(lengths[i])
                break
        else:
            bins.append([i])
            sizes.append([lengths[i]])
    return bins


def split_to(bins: list[list[int]], count: int, lengths: Sequence[int], cost: Cost = packed_cost) -> list[list[int]]:
    """``bins`` made ``count`` bins (``count >= len(bins)``) without making any bin costlier: the
    costliest bin of two or more items is split in two (its items, longest first, each to the
    lighter half) until there are ``count``; when every bin holds one item, empty bins make up the
    rest. Data-parallel ranks under FSDP2 must run the same number of forwards (each gathers the
    parameters), so a rank with fewer micro-batches than another splits its own."""
    out = [list(b) for b in bins]
    while len(out) < count:
        splittable = [j for j, b in enumerate(out) if len(b) > 1]
        if not splittable:
            out.extend([] for _ in range(count - len(out)))
            break
        j = max(splittable, key=lambda k: (cost([lengths[i] for i in out[k]]), -k))
        halves: tuple[list[int], list[int]] = ([], [])
        for i in out[j]:
            light = min((0, 1), key=lambda h: (cost([lengths[k] for k in halves[h]] + [lengths[i]]), h))
            halves[light].append(i)
        out[j:j + 1] = [halves[0], halves[1]]
    return out


def balanced_equal_count(costs: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``costs`` in ``parts`` parts of equal size (``len(costs)`` must be a multiple of
    ``parts``) with balanced total cost: the costliest item first, each to the lightest part that
    still has room (ties: the lower part). Each part's indices are returned in increasing order.

    Raises:
        ValueError: ``len(costs)`` is not a multiple of ``parts``.
    """
    if parts < 1 or len(costs) % parts:
        raise ValueError(f"{len(costs)} items cannot be shared evenly by {parts} parts.")
    room = len(costs) // parts
    loads = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        part = min((p for p in range(parts) if len(out[p]) < room), key=lambda p: (loads[p], p))
        out[part].append(i)
        loads[part] += costs[i]
    return [sorted(p) for p in out]
