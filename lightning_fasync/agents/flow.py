"""ToolAgentFlow: a multi-turn, tool-using agent flow (the spec's AgentFlow with tools).

One trajectory is a conversation: policy turn, tool observation, policy turn, ... Every policy
turn is one SGLang ``/generate`` request on token ids: the prompt plus everything so far (earlier
turns and observations, token for token), so the engine's per-token log-probs and weight
versions stay aligned with what the trainer will score, and nothing is re-tokenized. The
OpenAI chat endpoint would re-render and re-tokenize the conversation on every turn (a BPE
tokenizer may split the policy's own text differently the second time) and has no per-token
weight versions, so the masks and versions could not be token-exact.

The response lists hold, turn after turn:

- the policy's tokens (``loss_mask`` 1, the engine's log-prob and weight version);
- each turn's tool observation (``loss_mask`` 0, rollout log-prob 0.0, and the weight version of
  the policy token that called the tools, so versions never decrease along the response and
  ``mask_offpolicy_in_partial_rollout``, which keeps the newest version, is not moved by them).
  The observation is the chat template's rendering of the ``tool`` messages plus the generation
  prompt of the next assistant turn: the text a chat template adds after an assistant turn,
  tokenized (:func:`observation_ids`). The policy's own stop token ends its turn.

A turn ends at a stop token; tool calls in it (``<tool_call>`` blocks, see :mod:`.tools`) are
executed and their observation appended; a turn without one is the final answer (``completed``).
The episode is ``truncated`` when its response (observations included) reaches
``rollout.max_response_length`` or after ``agentflow.max_turns`` policy turns with a call still
unanswered. The reward is the SingleTurnFlow contract, on the final answer: ``reward_fn(sample,
view)`` where ``view`` is a copy of the trajectory whose response is the last policy turn only
(a tool's output can never be scored as the policy's answer).

Partial rollout. An aborted turn leaves the trajectory ``cancelled``; its tokens, versions and
mask are kept and the flow's place is in ``metadata`` (flat keys, plain data, checkpointed with
the recycled sample): ``agent_turn_start`` (where the current policy turn begins in the
response), ``agent_phase`` (``generate``: the turn is still being written; ``tools``: it ended
with calls not yet answered) and ``agent_turns`` (policy turns finished). The resumed flow
continues from exactly there: a half-written turn is continued on prompt + response, a turn
whose tools had not run has them run, token-identical in both cases.

Concurrency. Each turn's request holds one of ``agentflow.router.max_connections`` slots while it
is at the engine (released while tools run), so the bound is per request across every episode of
this flow, whatever the engine client.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, Optional, Sequence

from lightning_fasync.agents.sandbox import Sandbox, SandboxLimits
from lightning_fasync.agents.tools import TOOLS, ToolBox, ToolResult, has_tool_call, parse_tool_calls
from lightning_fasync.pipeline.engine_client import EngineClient, SamplingParams
from lightning_fasync.pipeline.flow import AgentFlow, RewardFn, continuation, mark_failed, resume_request, score
from lightning_fasync.types import PromptSample, Trajectory, TrajectoryStatus

__all__ = ["ToolAgentFlow", "observation_ids"]

GENERATE, TOOLS_PENDING = "generate", "tools"

# A stand-in conversation the observation is rendered after: a chat template renders a ``tool``
# message differently after an assistant turn than at the start, and that is where it comes.
_BEFORE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "."}]


def observation_ids(tokenizer: Any, contents: Sequence[str]) -> list[int]:
    """The tokens that follow a policy turn whose tool calls answered ``contents``.

    The chat template's rendering of one ``tool`` message per answer plus the next assistant
    turn's generation prompt, i.e. ``render(before + tools, add_generation_prompt=True)`` minus
    ``render(before)``, tokenized without special tokens.

    Raises:
        ValueError: the template does not render the tool messages after the conversation (it
            rewrites earlier turns), so there is no suffix to take.
    """
    messages = [{"role": "tool", "content": c} for c in contents]
    before = tokenizer.apply_chat_template(_BEFORE, tokenize=False)
    after = tokenizer.apply_chat_template(_BEFORE + messages, tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("The chat template does not append tool messages after the conversation; ToolAgentFlow "
                         "needs a template whose rendering of a longer conversation extends the shorter one's.")
    return list(tokenizer.encode(after[len(before):], add_special_tokens=False))


class ToolAgentFlow(AgentFlow):
    """Multi-turn episodes with tool calls (module docstring).

    Arguments:
        client: the engine client (the router when there are several replicas).
        sampling: sampling parameters; ``max_new_tokens`` is set per turn to the remaining budget.
        max_response_length: ``rollout.max_response_length``, observations included.
        tokenizer: the policy's tokenizer with its chat template (decodes turns, renders observations).
        reward_fn: ``(sample, trajectory) -> float`` (may be async), called on the final answer.
        max_turns: ``agentflow.max_turns``: policy turns per episode.
        tools: ``agentflow.tools``: enabled tools.
        sandbox: ``agentflow.sandbox``: limits of the ``python`` tool's runs.
        max_connections: ``agentflow.router.max_connections``: engine requests in flight at once.
        rid_prefix: request ids are ``{rid_prefix}{seq}-{index}-{turn}``.
    """

    def __init__(
        self,
        client: EngineClient,
        sampling: SamplingParams,
        max_response_length: int,
        tokenizer: Any,
        reward_fn: Optional[RewardFn] = None,
        max_turns: int = 4,
        tools: Sequence[str] = TOOLS,
        sandbox: Optional[SandboxLimits] = None,
        max_connections: Optional[int] = None,
        rid_prefix: str = "fa-",
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"`agentflow.max_turns` is {max_turns}; it must be >= 1.")
        if max_connections is not None and max_connections < 1:
            raise ValueError(f"`agentflow.router.max_connections` is {max_connections}; it must be positive.")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("ToolAgentFlow needs a tokenizer with a chat template (it renders the tool observations).")
        self.client = client
        self.sampling = sampling
        self.max_response_length = max_response_length
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.max_turns = max_turns
        self.sandbox = Sandbox(sandbox) if "python" in tools else None
        self.toolbox = ToolBox(tools, self.sandbox)
        self.max_connections = max_connections
        self.rid_prefix = rid_prefix
        # One semaphore per event loop (a semaphore belongs to the loop it first waits on).
        self._slots: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("calls", "errors", "malformed", "violations", "limits", "turns", "episodes"), 0)

    # ------------------------------------------------------------------ episode

    async def run(self, sample: PromptSample, index: int, seq: int) -> Trajectory:
        traj = continuation(sample, index, seq)
        if traj.status.finished:
            return traj  # finished before a step boundary recycled its group (scored then)
        if sample.metadata.get("sampling"):  # its budget is per turn: one prompt's own would not hold
            mark_failed(traj, ValueError(f"Prompt {sample.prompt_id}: metadata `sampling` (a prompt's own response "
                                         "budget) is for the single-turn flow; the tool agent flow does not take it."))
            return traj
        try:
            await self._episode(traj, seq)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # engine errors (and a broken sandbox) fail this trajectory only
            mark_failed(traj, exc)
            return traj
        if traj.status.finished:
            self._count(turns=traj.metadata.get("agent_turns", 0), episodes=1)
            if self.reward_fn is not None:
                await self._score(sample, traj)
        return traj

    async def _episode(self, traj: Trajectory, seq: int) -> None:
        meta = traj.metadata
        meta.setdefault("agent_turn_start", 0)
        meta.setdefault("agent_phase", GENERATE)
        meta.setdefault("agent_turns", 0)
        while True:
            if meta["agent_phase"] == TOOLS_PENDING:
                if not await self._answer_tools(traj):
                    return
                continue
            rid = f"{self.rid_prefix}{seq}-{traj.sample_index}-{meta['agent_turns']}"
            request = resume_request(traj, self.sampling, self.max_response_length, rid)
            if request is None:
                self._end(traj, TrajectoryStatus.TRUNCATED, "length")
                return
            async with self._slot():
                result = await self.client.generate(request)
            traj.extend(result.output_ids, result.output_log_probs, result.weight_versions)
            if result.finish_reason == "abort":
                traj.status = TrajectoryStatus.CANCELLED  # resumed later from this very turn
                return
            if result.finish_reason not in ("stop", "length"):
                raise ValueError(f"unknown finish_reason {result.finish_reason!r}")
            meta["agent_turns"] += 1
            if result.finish_reason == "length" or len(traj.response_ids) >= self.max_response_length:
                self._end(traj, TrajectoryStatus.TRUNCATED, "length")
                return
            if not has_tool_call(self._turn_text(traj)):
                self._end(traj, TrajectoryStatus.COMPLETED, "answer")
                return
            if meta["agent_turns"] >= self.max_turns:
                self._end(traj, TrajectoryStatus.TRUNCATED, "max_turns")
                return
            meta["agent_phase"] = TOOLS_PENDING  # recorded before the tools run: a resume runs them

    async def _answer_tools(self, traj: Trajectory) -> bool:
        """Run the current turn's calls and append their observation; False when the budget ended."""
        meta = traj.metadata
        calls = parse_tool_calls(self._turn_text(traj))
        results: list[ToolResult] = list(await asyncio.gather(*(self.toolbox.call(c) for c in calls)))
        self._count(
            calls=len(calls),
            errors=sum(r.outcome != "ok" for r in results),
            malformed=sum(c.error is not None for c in calls),
            violations=sum(r.outcome == "violation" for r in results),
            limits=sum(r.outcome == "limit" for r in results),
        )
        obs = observation_ids(self.tokenizer, [r.content for r in results])
        room = self.max_response_length - len(traj.response_ids)
        obs = obs[:room]
        version = traj.weight_versions[-1]  # the turn that called the tools
        traj.response_ids.extend(obs)
        traj.rollout_log_probs.extend([0.0] * len(obs))
        traj.loss_mask.extend([0] * len(obs))
        traj.weight_versions.extend([version] * len(obs))
        # New lists, never in-place edits: Trajectory.copy shares metadata values with the original.
        meta["agent_tool_results"] = [*meta.get("agent_tool_results", []), [r.content for r in results]]
        meta["agent_turn_start"] = len(traj.response_ids)
        meta["agent_phase"] = GENERATE
        if len(traj.response_ids) >= self.max_response_length:
            self._end(traj, TrajectoryStatus.TRUNCATED, "length")
            return False
        return True

    def _turn_text(self, traj: Trajectory) -> str:
        return self.tokenizer.decode(traj.response_ids[traj.metadata["agent_turn_start"]:], skip_special_tokens=True)

    @staticmethod
    def _end(traj: Trajectory, status: TrajectoryStatus, why: str) -> None:
        traj.status = status
        traj.metadata["agent_stop"] = why

    def _slot(self) -> Any:
        if self.max_connections is None:
            return _NoSlot()
        loop = asyncio.get_running_loop()
        with self._lock:
            slot = self._slots.get(loop)
            if slot is None:
                slot = self._slots[loop] = asyncio.Semaphore(self.max_connections)
        return slot

    # ------------------------------------------------------------------ reward

    def answer_view(self, traj: Trajectory) -> Trajectory:
        """A copy of ``traj`` whose response is its last policy turn (what the reward scores)."""
        start = traj.metadata.get("agent_turn_start", 0)
        view = traj.copy()
        view.response_ids = traj.response_ids[start:]
        view.rollout_log_probs = traj.rollout_log_probs[start:]
        view.loss_mask = traj.loss_mask[start:]
        view.weight_versions = traj.weight_versions[start:]
        return view

    async def _score(self, sample: PromptSample, traj: Trajectory) -> None:
        await score(self.reward_fn, sample, traj, self.answer_view(traj))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ metrics, shutdown

    def _count(self, **increments: int) -> None:
        with self._lock:
            for key, n in increments.items():
                self._counts[key] += n

    def metrics(self) -> dict[str, float]:
        """Counts since the previous call, for the step's metrics (a controller metric source).

        ``agent/tool_calls``, ``agent/tool_errors`` (answers that are errors, of any kind),
        ``agent/tool_malformed`` (calls that did not parse), ``agent/sandbox_violations`` and
        ``agent/sandbox_limits`` (sandbox runs stopped by a rule or a limit), and
        ``agent/turns_mean`` (policy turns per episode finished since then; absent when none).
        """
        with self._lock:
            counts = dict(self._counts)
            for key in self._counts:
                self._counts[key] = 0
        out = {
            "agent/tool_calls": float(counts["calls"]),
            "agent/tool_errors": float(counts["errors"]),
            "agent/tool_malformed": float(counts["malformed"]),
            "agent/sandbox_violations": float(counts["violations"]),
            "agent/sandbox_limits": float(counts["limits"]),
        }
        if counts["episodes"]:
            out["agent/turns_mean"] = counts["turns"] / counts["episodes"]
        return out

    def close(self) -> None:
        """Kill running sandboxes. Idempotent."""
        if self.sandbox is not None:
            self.sandbox.close()


class _NoSlot:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None
