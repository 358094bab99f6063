"""Agent flows: how one prompt sample becomes one trajectory through an engine client.

The producer calls ``flow.run_group(sample, seq, n)`` once per dispatched group. The built-in
:class:`SingleTurnFlow` sends the group's N requests in one batched engine call and scores the
responses; it also resumes recycled partial trajectories (prompt + tokens so far,
``max_new_tokens`` reduced by what the trajectory already has, per-token versions continuing).
A flow of your own is named in ``agentflow.flow`` (docs/extending.md).
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
from typing import Any, Awaitable, Callable, Optional, Union

from lightning_fasync.pipeline.engine_client import EngineClient, EngineError, EngineFault, GenerateRequest, GenerateResult, SamplingParams
from lightning_fasync.types import PromptSample, Trajectory, TrajectoryStatus

RewardFn = Callable[[PromptSample, Trajectory], Union[float, Awaitable[float]]]


class AgentFlow(abc.ABC):
    """Turns a prompt sample into terminal trajectories.

    The producer calls :meth:`run_group` once per dispatched group. Its default runs
    :meth:`run` for the N samples concurrently; a flow that can do better (one batched engine
    call per group) overrides it.
    """

    @abc.abstractmethod
    async def run(self, sample: PromptSample, index: int, seq: int) -> Trajectory:
        """Return a trajectory with a terminal status; never raise for engine errors (mark failed)."""

    async def run_group(self, sample: PromptSample, seq: int, n: int) -> list[Trajectory]:
        """The N trajectories of one group; an exception in one marks only that one failed."""
        results = await asyncio.gather(*(self.run(sample, i, seq) for i in range(n)), return_exceptions=True)
        out = []
        for i, res in enumerate(results):
            if isinstance(res, BaseException):
                if isinstance(res, asyncio.CancelledError):
                    raise res
                traj = continuation(sample, i, seq)
                mark_failed(traj, res)
                res = traj
            out.append(res)
        return out


def mark_failed(traj: Trajectory, exc: BaseException) -> None:
    """Mark ``traj`` failed by ``exc``; an :class:`EngineFault` (timeout, lost replica) is flagged
    in ``metadata["engine_fault"]``, so the group is regenerated without spending the prompt's
    failure budget."""
    traj.status = TrajectoryStatus.FAILED
    traj.error = f"{type(exc).__name__}: {exc}"
    # The engine client's errors, and what an HTTP client raises when the server is not there.
    engine = isinstance(exc, (EngineError, OSError, asyncio.TimeoutError))
    traj.metadata["failed_in"] = "engine" if engine else "agent flow"
    if isinstance(exc, EngineFault):
        traj.metadata["engine_fault"] = True


def continuation(sample: PromptSample, index: int, seq: int) -> Trajectory:
    """The trajectory to continue: the recycled one (copied) or a fresh, empty one.

    A recycled trajectory that failed is started again from nothing.
    """
    if sample.resume is not None and index < len(sample.resume):
        prev = sample.resume[index]
        if prev.status is not TrajectoryStatus.FAILED:
            traj = prev.copy()
            traj.seq = seq
            traj.error = None
            return traj
    return Trajectory.fresh(sample.prompt_id, index, list(sample.input_ids), seq)


def request_seed(base: int, traj: Trajectory) -> int:
    """The sampling seed of the request that continues ``traj`` (``rollout.sampling_seed``): a hash of
    ``base``, the prompt id, the trajectory's index and its length so far, in [0, 2**31) (every
    engine's seed field takes it). Independent of batching and arrival order by construction."""
    key = f"{base}:{traj.prompt_id.epoch}:{traj.prompt_id.index}:{traj.sample_index}:{len(traj.response_ids)}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") & 0x7FFFFFFF


def _copy_params(sampling: SamplingParams) -> SamplingParams:
    """A shallow copy through ``__dict__``: ``copy.copy`` is ~10x slower and this runs once per request."""
    params = object.__new__(SamplingParams)
    params.__dict__.update(sampling.__dict__)
    return params


PROMPT_SAMPLING_KEYS = ("max_new_tokens", "ignore_eos")
"""What a prompt's ``metadata["sampling"]`` may set for its own requests (:func:`prompt_sampling`)."""


def prompt_sampling(sample: PromptSample, sampling: SamplingParams, max_response_length: int) -> tuple[SamplingParams, int]:
    """The sampling parameters and response budget of ``sample``'s requests: the rollout's, with what
    its ``metadata["sampling"]`` sets. ``max_new_tokens`` is that prompt's response budget, capped at
    ``rollout.max_response_length``; ``ignore_eos`` makes every response use all of it (a task whose
    response lengths the policy cannot move, ``RepeatTask(stop="length")``).

    Raises:
        ValueError: a key other than :data:`PROMPT_SAMPLING_KEYS`, or a value of the wrong kind.
    """
    own = sample.metadata.get("sampling")
    if not own:
        return sampling, max_response_length
    if not isinstance(own, dict):
        raise ValueError(f"Prompt {sample.prompt_id}: metadata `sampling` is {type(own).__name__}; it must be a mapping.")
    unknown = sorted(set(own) - set(PROMPT_SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"Prompt {sample.prompt_id}: metadata `sampling` sets {', '.join(unknown)}; "
                         f"a prompt may set only {', '.join(PROMPT_SAMPLING_KEYS)}.")
    budget = max_response_length
    params = _copy_params(sampling)
    if "max_new_tokens" in own:
        n = own["max_new_tokens"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"Prompt {sample.prompt_id}: metadata `sampling.max_new_tokens` is {n!r}; it must be an integer >= 1.")
        budget = min(n, max_response_length)
    if "ignore_eos" in own:
        if not isinstance(own["ignore_eos"], bool):
            raise ValueError(f"Prompt {sample.prompt_id}: metadata `sampling.ignore_eos` is {own['ignore_eos']!r}; it must be true or false.")
        params.ignore_eos = own["ignore_eos"]
    return params, budget


def resume_request(traj: Trajectory, sampling: SamplingParams, max_response_length: int, rid: str) -> Optional[GenerateRequest]:
    """The ``/generate`` request that continues ``traj``, or None when it has no budget left.

    The prompt is the original prompt plus the response so far; ``max_new_tokens`` is what remains
    of ``max_response_length``.
    """
    remaining = max_response_length - len(traj.response_ids)
    if remaining <= 0:
        return None
    params = _copy_params(sampling)
    params.max_new_tokens = remaining
    if sampling.sampling_seed is not None:
        params.sampling_seed = request_seed(sampling.sampling_seed, traj)
    return GenerateRequest(rid=rid, input_ids=list(traj.prompt_ids) + list(traj.response_ids), sampling_params=params)


def apply_result(traj: Trajectory, result: GenerateResult, max_response_length: int) -> None:
    """Append an engine result to ``traj`` and set its status from SGLang's finish reason."""
    traj.extend(result.output_ids, result.output_log_probs, result.weight_versions)
    reason = result.finish_reason
    if reason == "abort":
        traj.status = TrajectoryStatus.CANCELLED
    elif reason == "length" or len(traj.response_ids) >= max_response_length:
        traj.status = TrajectoryStatus.TRUNCATED
    elif reason == "stop":
        traj.status = TrajectoryStatus.COMPLETED
    else:
        traj.status = TrajectoryStatus.FAILED
        traj.error = f"unknown finish_reason {reason!r}"


class SingleTurnFlow(AgentFlow):
    """One batched engine call per group, then a reward per finished trajectory.

    Arguments:
        client: the engine client (one server, or a router in front of several).
        sampling: sampling parameters; ``max_new_tokens`` is set per request.
        max_response_length: ``rollout.max_response_length``.
        reward_fn: ``(sample, trajectory) -> float`` (may be async); called for finished
            trajectories only. An exception marks the trajectory failed.
        rid_prefix: request ids are ``{rid_prefix}{seq}-{index}``, so an abort by prefix can target
            one run.
    """

    def __init__(
        self,
        client: EngineClient,
        sampling: SamplingParams,
        max_response_length: int,
        reward_fn: Optional[RewardFn] = None,
        rid_prefix: str = "fa-",
    ) -> None:
        self.client = client
        self.sampling = sampling
        self.max_response_length = max_response_length
        self.reward_fn = reward_fn
        self.rid_prefix = rid_prefix

    async def run(self, sample: PromptSample, index: int, seq: int) -> Trajectory:
        return (await self._run(sample, seq, [index]))[0]

    async def run_group(self, sample: PromptSample, seq: int, n: int) -> list[Trajectory]:
        return await self._run(sample, seq, range(n))

    async def _run(self, sample: PromptSample, seq: int, indices) -> list[Trajectory]:
        trajs = [continuation(sample, i, seq) for i in indices]
        try:
            sampling, budget = prompt_sampling(sample, self.sampling, self.max_response_length)
        except ValueError as exc:
            for traj in trajs:
                mark_failed(traj, exc)
            return trajs
        pending: list[tuple[Trajectory, GenerateRequest]] = []
        for traj in trajs:
            if traj.status.finished:
                continue  # finished before a step boundary recycled its group
            request = resume_request(traj, sampling, budget, f"{self.rid_prefix}{seq}-{traj.sample_index}")
            if request is None:
                traj.status = TrajectoryStatus.TRUNCATED
            else:
                pending.append((traj, request))
        if pending:
            # One batched call per group: the group leaves TrajQueue only when its slowest member
            # is done anyway; EngineClient.generate_batch fans out (or batches) the requests.
            results = await self.client.generate_batch([req for _, req in pending])
            for (traj, _), result in zip(pending, results):
                if isinstance(result, BaseException):  # engine errors become failed trajectories
                    mark_failed(traj, result)
                else:
                    apply_result(traj, result, budget)
        if self.reward_fn is not None:
            for traj in trajs:
                if traj.status.finished and traj.reward is None:
                    await self._score(sample, traj)
        return trajs

    async def _score(self, sample: PromptSample, traj: Trajectory) -> None:
        await score(self.reward_fn, sample, traj)  # type: ignore[arg-type]


async def score(reward_fn: RewardFn, sample: PromptSample, traj: Trajectory, view: Optional[Trajectory] = None) -> None:
    """Set ``traj.reward`` to ``reward_fn(sample, view or traj)`` (which may be async); a reward
    function that raises marks ``traj`` failed instead."""
    try:
        reward: Any = reward_fn(sample, traj if view is None else view)
        if hasattr(reward, "__await__"):
            reward = await reward
        traj.reward = float(reward)
    except Exception as exc:
        traj.status = TrajectoryStatus.FAILED
        traj.metadata["failed_in"] = "reward"
        # A RewardRunner's error names the reward, the exception and the reward's own frame already.
        traj.error = str(exc) if type(exc).__name__ == "RewardError" else f"reward function raised {type(exc).__name__}: {exc}"
