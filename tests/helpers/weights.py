"""A tensor stream that records what its consumer still holds, for tests/weights/ (the stream, the
weight sync)."""

from __future__ import annotations

import weakref

import torch

from lightning_fasync.weights.tensor_stream import TensorSpec, TensorStream


class Tracked:
    """A stream over ``state`` whose ``produce(i)`` makes a fresh copy (a gather's result) and
    records what the consumer still holds of the earlier ones: their count and bytes."""

    def __init__(self, state: dict[str, torch.Tensor], fail_at: int | None = None) -> None:
        self.items = list(state.items())
        self.fail_at = fail_at
        self.refs: list[weakref.ref] = []
        self.held: list[tuple[int, int]] = []  # (tensors, bytes) still alive when each was produced
        specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in self.items]
        self.stream = TensorStream(specs, self.produce)

    def produce(self, i: int) -> torch.Tensor:
        alive = [r() for r in self.refs]
        alive = [t for t in alive if t is not None]
        self.held.append((len(alive), sum(t.numel() * t.element_size() for t in alive)))
        del alive
        if i == self.fail_at:
            raise RuntimeError("the gather failed")
        tensor = self.items[i][1].clone()
        self.refs.append(weakref.ref(tensor))
        return tensor
