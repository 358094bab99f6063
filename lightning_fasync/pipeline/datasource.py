"""Datasources: where prompts come from, and where recycled groups go back to.

A datasource serves recycled prompts (partial groups put back at a step boundary, prompts whose
generation must be redone) before new ones (docs/contract.md §2, step 2; docs/contract.md, "Nothing lost").
"""

from __future__ import annotations

import abc
import random
from collections import deque
from typing import Any, Optional, Sequence

from lightning_fasync.errors import PipelineError
from lightning_fasync.types import PromptId, PromptSample


class DataSource(abc.ABC):
    """The producer's prompt supply."""

    @abc.abstractmethod
    def next_sample(self) -> Optional[PromptSample]:
        """The next prompt: a recycled one if any, else a new one; None when exhausted."""

    @abc.abstractmethod
    def recycle(self, samples: Sequence[PromptSample]) -> None:
        """Put prompts back; they are served before new ones, oldest prompt id first."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Position, RNG and recycle queue."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    @property
    def num_recycled(self) -> int:
        return 0

    @property
    def max_prompt_length(self) -> Optional[int]:
        """The longest prompt in tokens, when the datasource knows it (sizes the engines' context;
        None: set ``rollout.sglang_args.context_length``)."""
        return None


def _sample_key(sample: PromptSample) -> tuple[int, int]:
    return (sample.prompt_id.epoch, sample.prompt_id.index)


class ListDataSource(DataSource):
    """Prompts from an in-memory list, epoch after epoch, each epoch in its own seeded order.

    The prompt id is (epoch, position in that epoch's order), so consumption priority follows the
    order prompts were first served. The order of epoch ``e`` is a permutation drawn from
    ``random.Random(seed + e)``: the position and the seed are the whole RNG state.

    Arguments:
        prompts: ``(input_ids, metadata)`` pairs; metadata is handed to the reward function.
        shuffle: permute each epoch.
        seed: base seed of the per-epoch permutation.
        num_epochs: stop after this many epochs (None: never).
    """

    def __init__(
        self,
        prompts: Sequence[tuple[list[int], dict[str, Any]]],
        shuffle: bool = True,
        seed: int = 0,
        num_epochs: Optional[int] = None,
    ) -> None:
        if len(prompts) == 0:
            raise ValueError("ListDataSource needs at least one prompt.")
        self._prompts = list(prompts)
        self.shuffle = shuffle
        self.seed = seed
        self.num_epochs = num_epochs
        self._epoch = 0
        self._position = 0
        self._order = self._make_order(0)
        self._recycled: deque[PromptSample] = deque()

    def _make_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._prompts)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def max_prompt_length(self) -> int:
        return max(len(ids) for ids, _ in self._prompts)

    @property
    def num_recycled(self) -> int:
        return len(self._recycled)

    def next_sample(self) -> Optional[PromptSample]:
        if self._recycled:
            return self._recycled.popleft()
        if self._position >= len(self._order):
            if self.num_epochs is not None and self._epoch + 1 >= self.num_epochs:
                return None
            self._epoch += 1
            self._position = 0
            self._order = self._make_order(self._epoch)
        index = self._position
        self._position += 1
        input_ids, metadata = self._prompts[self._order[index]]
        meta = dict(metadata)
        meta.setdefault("dataset_index", self._order[index])
        return PromptSample(prompt_id=PromptId(self._epoch, index), input_ids=list(input_ids), metadata=meta)

    def recycle(self, samples: Sequence[PromptSample]) -> None:
        if not samples:
            return
        merged = sorted([*self._recycled, *samples], key=_sample_key)
        self._recycled = deque(merged)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "recycled": [s.to_dict() for s in self._recycled],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The saved position is meaningful only in the saved order: a different seed or shuffle
        # would replay some prompts and skip others, so it is refused, not silently overwritten.
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle)):
            if state[key] != mine:

                raise PipelineError(
                    f"The datasource was saved with {key}={state[key]!r} and is now built with {key}={mine!r} "
                    f"(`data_source.{key}`); resuming would break exactly-once prompt order: use the saved value."
                )
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._order = self._make_order(self._epoch)
        self._recycled = deque(PromptSample.from_dict(d) for d in state["recycled"])
