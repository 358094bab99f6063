"""The data model shared by every layer (docs/contract.md, "Data model").

Nothing here imports torch, Lightning or HTTP code: these are plain records that travel from the
rollout engines through the pipeline to the trainer.
"""

from __future__ import annotations

import copy as _copy
import enum
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True, order=True)
class PromptId:
    """A prompt's identity: its epoch and its index in that epoch's (shuffled) order.

    The ordering (epoch, then index) is the PipelineBuffer's consumption priority (docs/contract.md §2).
    """

    epoch: int
    index: int

    def __str__(self) -> str:
        return f"{self.epoch}:{self.index}"

    @classmethod
    def parse(cls, text: str) -> "PromptId":
        epoch, index = text.split(":")
        return cls(int(epoch), int(index))


class TrajectoryStatus(str, enum.Enum):
    """How a trajectory ended.

    - ``completed``: the engine stopped on a stop token (or the agent flow finished).
    - ``truncated``: it hit the maximum response length. Still valid training data.
    - ``failed``: the engine or the flow raised; the group policy drops the group (see collector).
    - ``cancelled``: aborted at a step boundary (``rollout.partial: true``); the tokens generated so
      far are kept and the trajectory is resumed after the weight update.
    """

    COMPLETED = "completed"
    TRUNCATED = "truncated"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        """True when the trajectory needs no more generation."""
        return self in (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED)


@dataclass(slots=True)
class Trajectory:
    """One response to one prompt, possibly produced across several weight versions.

    ``response_ids``, ``rollout_log_probs``, ``loss_mask`` and ``weight_versions`` are aligned:
    one entry per response token. ``start_version``/``end_version`` are the weight versions of the
    first and last generated token (None before any token exists).
    """

    prompt_id: PromptId
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    start_version: Optional[int] = None
    end_version: Optional[int] = None
    status: TrajectoryStatus = TrajectoryStatus.CANCELLED
    reward: Optional[float] = None
    seq: int = -1
    error: Optional[str] = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def fresh(cls, prompt_id: PromptId, sample_index: int, prompt_ids: list[int], seq: int) -> "Trajectory":
        """An empty trajectory, built without the dataclass ``__init__`` (this runs once per
        request on the producer's hot path)."""
        t = object.__new__(cls)
        t.prompt_id = prompt_id
        t.sample_index = sample_index
        t.prompt_ids = prompt_ids
        t.response_ids = []
        t.rollout_log_probs = []
        t.loss_mask = []
        t.weight_versions = []
        t.start_version = None
        t.end_version = None
        t.status = TrajectoryStatus.CANCELLED
        t.reward = None
        t.seq = seq
        t.error = None
        t.metadata = {}
        return t

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def version_span(self) -> int:
        """``end_version - start_version`` (0 when no token was generated)."""
        if self.start_version is None or self.end_version is None:
            return 0
        return self.end_version - self.start_version

    @property
    def is_partial(self) -> bool:
        """True when first and last generated tokens come from different weight versions."""
        return self.version_span != 0

    def extend(self, token_ids: list[int], log_probs: list[float], versions: list[int]) -> None:
        """Append newly generated tokens (one engine call's output) to the response."""
        if not (len(token_ids) == len(log_probs) == len(versions)):
            raise ValueError(
                f"Engine output is misaligned: {len(token_ids)} tokens, {len(log_probs)} log-probs, "
                f"{len(versions)} versions; each output token needs one of each."
            )
        if not token_ids:
            return
        self.response_ids.extend(token_ids)
        self.rollout_log_probs.extend(log_probs)
        self.loss_mask.extend([1] * len(token_ids))
        self.weight_versions.extend(versions)
        if self.start_version is None:
            self.start_version = versions[0]
        self.end_version = versions[-1]

    def copy(self) -> "Trajectory":
        """A copy whose token lists can be extended without touching this one (cheaper than
        ``copy.deepcopy``, which matters when many partial trajectories resume at once)."""
        dup = _copy.copy(self)
        dup.response_ids = _copy.copy(self.response_ids)
        dup.rollout_log_probs = _copy.copy(self.rollout_log_probs)
        dup.loss_mask = _copy.copy(self.loss_mask)
        dup.weight_versions = _copy.copy(self.weight_versions)
        dup.metadata = dict(self.metadata)
        return dup

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_id": str(self.prompt_id),
            "sample_index": self.sample_index,
            "prompt_ids": list(self.prompt_ids),
            "response_ids": list(self.response_ids),
            "rollout_log_probs": list(self.rollout_log_probs),
            "loss_mask": list(self.loss_mask),
            "weight_versions": list(self.weight_versions),
            "start_version": self.start_version,
            "end_version": self.end_version,
            "status": self.status.value,
            "reward": self.reward,
            "seq": self.seq,
            "error": self.error,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trajectory":
        d = dict(d)
        d["prompt_id"] = PromptId.parse(d["prompt_id"])
        d["status"] = TrajectoryStatus(d["status"])
        return cls(**d)


@dataclass
class PromptSample:
    """A prompt handed out by a datasource, to be expanded into N trajectories.

    ``resume`` holds the N trajectories of a recycled group (docs/contract.md §2, step 2): the agent flow
    continues each unfinished one from its tokens so far instead of starting again.
    """

    prompt_id: PromptId
    input_ids: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)
    resume: Optional[list[Trajectory]] = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_id": str(self.prompt_id),
            "input_ids": list(self.input_ids),
            "metadata": dict(self.metadata),
            "resume": None if self.resume is None else [t.to_dict() for t in self.resume],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PromptSample":
        resume = d.get("resume")
        return cls(
            prompt_id=PromptId.parse(d["prompt_id"]),
            input_ids=list(d["input_ids"]),
            metadata=dict(d.get("metadata") or {}),
            resume=None if resume is None else [Trajectory.from_dict(t) for t in resume],
        )


@dataclass
class TrajectoryGroup:
    """The N trajectories of one prompt, as the trainer consumes them."""

    sample: PromptSample
    seq: int
    trajectories: list[Trajectory]

    @property
    def prompt_id(self) -> PromptId:
        return self.sample.prompt_id

    @property
    def rewards(self) -> list[Optional[float]]:
        return [t.reward for t in self.trajectories]
