"""The embedded rollout engine: a continuous-batching scheduler around a ``ModelRunner``.

One engine thread owns the model and the KV cache. Between two decode steps it runs control
operations (abort, pause, weight update), admits waiting requests into free cache slots (prefill),
then decodes one token for every running request at once. Requests therefore join and leave the
running batch at step granularity; an abort frees its slot before the next step. Every generated
token records the weight version of the weights that produced it.

Callers on other threads (the HTTP server's event loop) talk to the engine through ``submit`` (a
request with an ``on_finish`` callback) and the blocking control methods, which wait for the engine
thread with a timeout.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from lightning_fasync.rollout.model_runner import ModelRunner
from lightning_fasync.rollout.sampling import sample

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = 64
DEFAULT_MAX_CONTEXT = 4096
CONTROL_TIMEOUT_S = 120.0
# An idle engine that receives a request waits until arrivals pause for ADMIT_QUIET_S (at most
# ADMIT_MAX_WAIT_S) before its prefill, so a burst (a producer submitting a group, 64 HTTP requests
# arriving within milliseconds) is prefilled as one batch instead of a lone request first and the
# rest a few steps later while the server is still parsing them. A busy engine never waits.
ADMIT_QUIET_S = 0.001
ADMIT_MAX_WAIT_S = 0.01


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down or crashed); no request can be served."""


@dataclass
class EngineRequest:
    """One generation request and, once finished, its output.

    ``output_versions`` holds the weight version of each output token. ``finish_reason`` is the
    SGLang ``meta_info.finish_reason`` dict (``type`` is ``stop``, ``length`` or ``abort``).
    ``on_finish`` is called on the engine thread exactly once, when the request finishes or fails.
    """

    rid: str
    input_ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: Optional[int] = None
    on_finish: Optional[Callable[["EngineRequest"], None]] = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[str] = field(default_factory=list)
    finish_reason: Optional[dict[str, Any]] = None
    error: Optional[BaseException] = None
    slot: Optional[int] = None
    created_at: float = field(default_factory=time.monotonic)
    finished_at: Optional[float] = None
    _generator: Optional[torch.Generator] = None
    _stop_ids: frozenset = frozenset()  # set at admission: stop tokens, plus EOS unless ignore_eos
    _max_output: int = 0  # set at admission: min(max_new_tokens, context_length - prompt length)

    def version_spans(self) -> list[list[Any]]:
        """Runs of equal versions over the output tokens: ``[[start, end, version], ...]``, end exclusive."""
        versions = self.output_versions
        if versions and versions.count(versions[0]) == len(versions):  # one version: a C-speed check
            return [[0, len(versions), versions[0]]]
        spans: list[list[Any]] = []
        for i, version in enumerate(versions):
            if spans and spans[-1][2] == version:
                spans[-1][1] = i + 1
            else:
                spans.append([i, i + 1, version])
        return spans


class Engine:
    """Continuous-batching generation over one causal LM.

    Args:
        model: A Hugging Face causal LM of a supported architecture (see ``ModelRunner``).
        max_running_requests: Requests decoded together at most; the rest wait.
        context_length: Prompt + response tokens per request; defaults to the model's
            ``max_position_embeddings`` capped at 4096.
        weight_version: Version label of the initial weights.
        eos_token_ids: Tokens that end a request unless ``ignore_eos``; defaults to the model's.
        seed: Seed of the generator used by unseeded requests.
    """

    def __init__(
        self,
        model: Any,
        *,
        max_running_requests: Optional[int] = None,
        context_length: Optional[int] = None,
        weight_version: str = "0",
        eos_token_ids: Optional[list[int]] = None,
        seed: int = 0,
    ) -> None:
        self.max_running_requests = max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        self.context_length = context_length or min(
            getattr(model.config, "max_position_embeddings", DEFAULT_MAX_CONTEXT), DEFAULT_MAX_CONTEXT
        )
        self.runner = ModelRunner(model, self.max_running_requests, self.context_length)
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.weight_version = str(weight_version)
        self.eos_token_ids = set(eos_token_ids if eos_token_ids is not None else _model_eos_ids(model))
        self._generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        self._cond = threading.Condition()
        self._waiting: list[EngineRequest] = []  # guarded by _cond
        self._ops: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []  # guarded by _cond
        self._running: list[EngineRequest] = []  # engine thread only, sorted by slot
        # Per-request sampling parameters of the running batch, rebuilt only when it changes.
        self._batch_params: Optional[tuple[list, list, list, list, list]] = None
        self._free_slots = list(range(self.max_running_requests))
        self._paused = False
        self._stopping = False
        self.fatal_error: Optional[BaseException] = None
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="fasync-engine", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- public, any thread

    @property
    def alive(self) -> bool:
        """True while the engine thread serves requests."""
        return self._thread.is_alive() and self.fatal_error is None and not self._stopping

    @property
    def paused(self) -> bool:
        return self._paused

    def validate(self, req: EngineRequest) -> None:
        """Raise ``ValueError`` naming what is wrong with a request (the server's 400 message)."""
        if not req.input_ids:
            raise ValueError("The prompt is empty; give at least one input token.")
        if len(req.input_ids) >= self.context_length:
            raise ValueError(
                f"The prompt has {len(req.input_ids)} tokens; the context length is {self.context_length}, "
                "so at most {} prompt tokens are accepted.".format(self.context_length - 1)
            )
        bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}).")
        if req.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {req.max_new_tokens}.")
        if req.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {req.temperature}.")
        if not 0 < req.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {req.top_p}.")
        if req.top_k == 0 or req.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {req.top_k}.")

    def submit(self, req: EngineRequest) -> None:
        """Queue a request; ``req.on_finish`` fires on completion. Raises ``ValueError`` if invalid."""
        self.validate(req)
        with self._cond:
            if not self.alive:
                raise EngineDeadError(self._dead_message())
            self._waiting.append(req)
            self._cond.notify_all()

    def generate(self, input_ids: list[int], timeout: float = 600.0, rid: Optional[str] = None, **sampling: Any) -> EngineRequest:
        """Blocking convenience for tests and benchmarks: submit and wait for the result."""
        done = threading.Event()
        req = EngineRequest(rid=rid or f"local-{time.monotonic_ns()}", input_ids=list(input_ids), on_finish=lambda r: done.set(), **sampling)
        self.submit(req)
        if not done.wait(timeout):
            raise TimeoutError(f"Request {req.rid} did not finish within {timeout} s.")
        if req.error is not None:
            raise req.error
        return req

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Abort requests whose rid starts with ``rid`` (SGLang semantics), or all of them.

        Aborted requests finish with what they generated so far and ``finish_reason.type == 'abort'``.

        Returns:
            The number of requests aborted.
        """
        if not abort_all and not rid:
            raise ValueError("Give a request id (rid) or abort_all=true.")
        return self._call(lambda: self._abort_matching(lambda r: abort_all or r.rid.startswith(rid), "Abort requested."))

    def pause(self, mode: str = "abort") -> int:
        """Stop generating. ``abort`` aborts every request; ``in_place`` keeps them (and their KV).

        ``retract`` is accepted and behaves as ``in_place``. New requests queue until ``resume``.

        Returns:
            The number of requests aborted (0 for ``in_place``).
        """
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"Unknown pause mode {mode!r}; use 'abort', 'in_place' or 'retract'.")

        def op() -> int:
            self._paused = True
            if mode == "abort":
                return self._abort_matching(lambda r: True, "Aborted by pause_generation.")
            return 0

        return self._call(op)

    def resume(self) -> None:
        """Continue after ``pause`` (SGLang ``/continue_generation``)."""

        def op() -> None:
            self._paused = False

        self._call(op)

    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor], weight_version: Optional[str] = None
    ) -> int:
        """Copy tensors into the model between two decode steps; running requests continue.

        All names and shapes are checked before anything is copied, so a bad update changes nothing.

        Returns:
            The number of tensors copied.
        """
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        unknown = [n for n in named_tensors if n not in params]
        if unknown:
            raise ValueError(f"Unknown parameter name(s) in weight update: {unknown[:5]}.")
        for name, tensor in named_tensors.items():
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"Shape mismatch for {name}: update has {tuple(tensor.shape)}, model has {tuple(params[name].shape)}."
                )

        def op() -> int:
            with torch.no_grad():
                for name, tensor in named_tensors.items():
                    params[name].copy_(tensor)
            self.runner.refresh_weights()
            if weight_version is not None:
                self.weight_version = str(weight_version)
            return len(named_tensors)

        return self._call(op)

    def set_weight_version(self, version: str) -> None:
        """Relabel the current weights (SGLang ``/update_weight_version``)."""

        def op() -> None:
            self.weight_version = str(version)

        self._call(op)

    def loads(self) -> dict[str, Any]:
        """Load figures for ``/v1/loads`` and ``/get_load``."""
        with self._cond:
            waiting = len(self._waiting)
        running = list(self._running)
        return {
            "num_running_reqs": len(running),
            "num_waiting_reqs": waiting,
            "num_total_tokens": sum(len(r.input_ids) + len(r.output_ids) for r in running),
            "max_running_requests": self.max_running_requests,
            "paused": self._paused,
            "num_decode_steps": self.steps,
            "weight_version": self.weight_version,
        }

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine thread, failing unfinished requests. Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"The engine thread did not stop within {timeout} s.")

    # ---------------------------------------------------------------- engine thread

    def _call(self, fn: Callable[[], Any], timeout: float = CONTROL_TIMEOUT_S) -> Any:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if not self.alive:
                raise EngineDeadError(self._dead_message())
            self._ops.append((fn, fut))
            self._cond.notify_all()
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"The engine thread did not run a control operation within {timeout} s "
                "(a decode step is stuck or the engine died)."
            ) from None

    def _dead_message(self) -> str:
        if self.fatal_error is not None:
            return f"The engine crashed: {self.fatal_error!r}"
        return "The engine is stopped."

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._ops or (not self._paused and (self._waiting or self._running))):
                        self._cond.wait(timeout=1.0)
                    if self._stopping:
                        break
                    ops, self._ops = self._ops, []
                for fn, fut in ops:
                    try:
                        fut.set_result(fn())
                    except Exception as exc:  # handed to the caller, who re-raises it
                        fut.set_exception(exc)
                if self._paused:
                    continue
                if not self._running:
                    self._await_burst()
                self._admit()
                if self._running:
                    self._decode_step()
        except BaseException as exc:
            logger.exception("The engine thread crashed; failing every request.")
            self.fatal_error = exc
        finally:
            self._fail_everything()

    def _await_burst(self) -> None:
        deadline = time.monotonic() + ADMIT_MAX_WAIT_S
        with self._cond:
            seen = len(self._waiting)
            while 0 < seen < len(self._free_slots) and not (self._stopping or self._ops or self._paused):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(min(ADMIT_QUIET_S, remaining))  # a submit wakes it at once
                if len(self._waiting) == seen:
                    break  # quiet: the burst is in
                seen = len(self._waiting)

    def _admit(self) -> None:
        with self._cond:
            n = min(len(self._free_slots), len(self._waiting))
            new, self._waiting = self._waiting[:n], self._waiting[n:]
        if not new:
            return
        for req in new:
            req.slot = self._free_slots.pop(0)
            if req.sampling_seed is not None:
                req._generator = torch.Generator(device=self.runner.device).manual_seed(int(req.sampling_seed))
            stops = set(req.stop_token_ids)
            if not req.ignore_eos:
                stops |= self.eos_token_ids
            req._stop_ids = frozenset(stops)
            # Past this the next token would have no cache position left.
            req._max_output = min(req.max_new_tokens, self.context_length - len(req.input_ids))
        logits = self.runner.prefill([r.slot for r in new], [r.input_ids for r in new])
        self._running.extend(new)
        self._running.sort(key=lambda r: r.slot)
        self._batch_params = None
        self._append_tokens(new, logits, self._sampling_params(new))

    def _sampling_params(self, batch: list[EngineRequest]) -> tuple[list, list, list, list, list]:
        return (
            [r.slot for r in batch],
            [r.temperature for r in batch],
            [r.top_p for r in batch],
            [r.top_k for r in batch],
            [r._generator for r in batch],
        )

    def _decode_step(self) -> None:
        batch = self._running  # sorted by slot
        if self._batch_params is None:
            self._batch_params = self._sampling_params(batch)
        params = self._batch_params
        logits = self.runner.decode(
            params[0],
            [r.output_ids[-1] for r in batch],
            [len(r.input_ids) + len(r.output_ids) - 1 for r in batch],
        )
        self.steps += 1
        self._append_tokens(list(batch), logits, params)

    def _append_tokens(self, batch: list[EngineRequest], logits: torch.Tensor, params: tuple) -> None:
        tokens, logprobs = sample(logits, params[1], params[2], params[3], params[4], self._generator)
        version = self.weight_version
        for req, token, logprob in zip(batch, tokens, logprobs):
            out = req.output_ids
            out.append(token)
            req.output_logprobs.append(logprob)
            req.output_versions.append(version)
            if token in req._stop_ids:
                self._finish(req, {"type": "stop", "matched": token})
            elif len(out) >= req._max_output:
                self._finish(req, {"type": "length", "length": len(out)})

    def _abort_matching(self, match: Callable[[EngineRequest], bool], message: str) -> int:
        with self._cond:
            queued = [r for r in self._waiting if match(r)]
            self._waiting = [r for r in self._waiting if not match(r)]
        running = [r for r in self._running if match(r)]
        for req in queued + running:
            self._finish(req, {"type": "abort", "message": message, "status_code": 200})
        return len(queued) + len(running)

    def _finish(self, req: EngineRequest, reason: dict[str, Any], error: Optional[BaseException] = None) -> None:
        # By identity: the dataclass __eq__ would compare every field of every request before it.
        for i, running in enumerate(self._running):
            if running is req:
                del self._running[i]  # keeps the rest sorted by slot
                self._batch_params = None
                break
        if req.slot is not None:
            self._free_slots.append(req.slot)
            self._free_slots.sort()  # lowest slots first keeps the batch contiguous (cache views)
            req.slot = None
        req.finish_reason, req.error, req.finished_at = reason, error, time.monotonic()
        if req.on_finish is not None:
            try:
                req.on_finish(req)
            except Exception:
                # A caller's callback must not take the engine down for everyone; log it loudly.
                logger.exception("on_finish callback of request %s raised.", req.rid)

    def _fail_everything(self) -> None:
        error = EngineDeadError(self._dead_message())
        with self._cond:
            pending, self._waiting = self._waiting, []
            ops, self._ops = self._ops, []
        for _, fut in ops:
            fut.set_exception(error)
        for req in pending + list(self._running):
            self._finish(req, {"type": "abort", "message": str(error), "status_code": 503}, error)


def _model_eos_ids(model: Any) -> list[int]:
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
    return []
