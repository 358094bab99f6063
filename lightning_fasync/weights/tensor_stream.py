"""TensorStream: full, Hugging Face-named tensors that arrive one at a time, in a known order.

A sharded trainer (FSDP2, tensor parallel) holds no full tensor anywhere: each one is gathered by a
collective every rank takes part in, in the same order. A :class:`TensorStream` is that sequence:
its :attr:`~TensorStream.specs` (name, global shape, dtype; known without gathering) say what
comes, so a weight sync can lay out its buckets before the first byte arrives, and iterating it
gathers one tensor at a time. Rank 0 hands the stream to the weight sync, which copies each tensor
into its bucket as it arrives; every other rank :meth:`~TensorStream.drain` s its own stream, which
runs the same collectives and drops the results. Rank 0 drains what its push did not consume (a
failed push), so the ranks' collectives always match.

Peak extra memory on the receiving side: one bucket plus the tensor being gathered, which a gather
may hold twice for a moment (gloo's all-gather keeps the pieces and the whole).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import torch

__all__ = ["TensorSpec", "TensorStream"]


@dataclass(frozen=True)
class TensorSpec:
    """What one tensor of a stream will be: its name, global shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.dtype.itemsize


class TensorStream:
    """Tensors named and shaped by ``specs``, produced in that order by ``produce(i)`` (which may
    run a collective); iterated at most once.

    Arguments:
        specs: what comes, in order (names unique; a tied tensor appears once, under its first name).
        produce: ``i -> tensor`` for ``specs[i]``; called exactly once per index, in order.
    """

    def __init__(self, specs: Sequence[TensorSpec], produce: Callable[[int], torch.Tensor]) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("A TensorStream's names must be unique.")
        self.specs: list[TensorSpec] = list(specs)
        self._produce = produce
        self._next = 0

    def __len__(self) -> int:
        return len(self.specs)

    @property
    def consumed(self) -> int:
        """How many tensors have been produced so far."""
        return self._next

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._next:
            raise RuntimeError("A TensorStream is iterated once: it was already (partly) consumed.")
        while self._next < len(self.specs):
            yield self.take()

    def take(self) -> tuple[str, torch.Tensor]:
        """The next ``(name, tensor)``, checked against its spec."""
        i = self._next
        if i >= len(self.specs):
            raise StopIteration
        spec = self.specs[i]
        self._next += 1
        tensor = self._produce(i)
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise RuntimeError(
                f"The stream produced {spec.name} as {tuple(tensor.shape)} {tensor.dtype}; its spec says "
                f"{spec.shape} {spec.dtype}."
            )
        return spec.name, tensor

    def drain(self) -> None:
        """Produce and drop what is left (the other ranks' collectives need this rank's part)."""
        while self._next < len(self.specs):
            self.take()

    @classmethod
    def from_mapping(cls, named: Mapping[str, torch.Tensor]) -> "TensorStream":
        """A stream over tensors already in memory (a test, or a trainer that is not sharded)."""
        items = list(named.items())
        specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in items]
        return cls(specs, lambda i: items[i][1])
