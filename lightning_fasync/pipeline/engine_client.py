"""The engine-client interface the agent flows and the producer talk to (docs/contract.md §2:
"dispatches to AgentFlow ... AgentFlow then interfaces with the inference engine"), and the
request and result types of one ``/generate`` call. The flows themselves live in ``flow.py``.

The HTTP client for SGLang-compatible servers lives in ``lightning_fasync.fleet.client``; this module
only fixes the contract so the pipeline stays free of HTTP and model imports.
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass
class SamplingParams:
    """SGLang ``sampling_params`` fields the pipeline uses."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        d = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "ignore_eos": self.ignore_eos,
        }
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if self.sampling_seed is not None:
            d["sampling_seed"] = self.sampling_seed
        return d


@dataclass
class GenerateRequest:
    """One ``/generate`` call: token ids in, request id ``rid`` for abort."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams


@dataclass
class GenerateResult:
    """What an engine returned for one request, in SGLang's terms.

    ``finish_reason`` is SGLang's ``meta_info.finish_reason.type``: ``stop``, ``length`` or
    ``abort``. ``weight_versions`` holds one version per output token (SGLang reports spans; the
    client expands them).
    """

    rid: str
    output_ids: list[int]
    output_log_probs: list[float]
    weight_versions: list[int]
    finish_reason: str
    prompt_tokens: int = 0
    meta_info: dict[str, Any] = field(default_factory=dict)


SKIPPED = object()
"""What an admin call to an engine returns when the engine left the serving set meanwhile (its
supervisor took it out): neither a success nor a failure of the update."""


class EngineError(RuntimeError):
    """An engine call failed after the client's retries; ``status`` is the HTTP status, if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class EngineFault(EngineError):
    """The engine did not serve the request, through no fault of the request: it timed out
    (``rollout.request_timeout``), or the replica or router went away. The pipeline regenerates
    such a group without spending the prompt's failure budget (see ``PipelineState``)."""


class EngineClient(abc.ABC):
    """What the producer needs from a rollout engine (or a router in front of several).

    Implementations: ``lightning_fasync.fleet.client.SGLangClient`` (HTTP, SGLang native API,
    also the embedded engine), the instant in-process engine of the control-plane benchmark, and
    the simulator's virtual-time engine.
    """

    @abc.abstractmethod
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Generate; an aborted request returns the tokens it has with ``finish_reason='abort'``."""

    @abc.abstractmethod
    async def abort(self, rid: str) -> None:
        """Abort one request (SGLang ``/abort_request`` with ``rid``)."""

    @abc.abstractmethod
    async def abort_all(self) -> None:
        """Abort every running request on every worker (``/abort_request`` with ``abort_all``)."""

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[Union[GenerateResult, BaseException]]:
        """Generate several requests (one group); an engine error is returned in its slot, not raised.

        The default runs :meth:`generate` concurrently; a client for a server that takes batched
        ``/generate`` input (SGLang does) can send one call instead.
        """
        return list(await asyncio.gather(*(self.generate(r) for r in requests), return_exceptions=True))

    async def pause(self, mode: str = "abort") -> None:
        """Stop the engines generating (SGLang ``/pause_generation``): ``abort``, ``in_place`` (the
        requests wait where they are, their KV cache kept) or ``retract``. A client whose engines
        cannot pause leaves this out, and the modes that need it (colocate in-flight) refuse to run."""
        raise EngineError(f"{type(self).__name__} cannot pause its engines (pause mode {mode!r}).")

    async def resume(self) -> None:
        """Let paused engines generate again (SGLang ``/continue_generation``)."""
        raise EngineError(f"{type(self).__name__} cannot resume its engines.")

    async def close(self) -> None:
        """Release connections. Idempotent."""
