"""The embedded rollout engine: a continuous-batching scheduler around a ``ModelRunner``.

One engine thread owns the model and the KV cache. Between two decode steps it runs control
operations (abort, pause, weight update), admits waiting requests (prefill) while a slot is free
and the paged KV pool has blocks for their prompts, then decodes one token for every running
request at once, first handing a block to each request that crosses a page boundary; when the pool
has too few, it retracts running requests back to the queue (SGLang's retract-decode), to be
prefilled again later with their tokens so far. Requests therefore join and leave the running batch
at step granularity; an abort frees its slot and blocks before the next step. Every generated token
records the weight version of the weights that produced it.

Callers on other threads (the HTTP server's event loop) talk to the engine through ``submit`` (a
request with an ``on_finish`` callback) and the blocking control methods, which wait for the engine
thread with a timeout.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Mapping, Optional

import torch

from lightning_fasync.engine.model_runner import ModelRunner
from lightning_fasync.engine.sampling import reported_logprobs, sample

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
# SGLang's memory tags (``srt/constants.py``, ``GPU_MEMORY_ALL_TYPES``), in its order: what
# /release_memory_occupation and /resume_memory_occupation take; no tags means all of them.
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


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
    min_p: float = 0.0
    min_new_tokens: int = 0
    # SGLang's penalties over the output tokens so far, and OpenAI/SGLang's additive logit bias.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None
    # Input-token log-probs from this prompt position on (-1: none), as SGLang's logprob_start_len.
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[list[int]] = None
    on_finish: Optional[Callable[["EngineRequest"], None]] = None
    # Called on the engine thread after each output token (streaming), and a text-level stop check
    # (stop strings) returning the matched string or None; both optional.
    on_token: Optional[Callable[["EngineRequest"], None]] = None
    stop_check: Optional[Callable[["EngineRequest"], Optional[str]]] = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[str] = field(default_factory=list)
    # Filled only when asked: per output token [(logprob, token_id), ...] of the top tokens / of
    # ``token_ids_logprob``; per input position the same, and the input tokens' own log-probs.
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_token_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_logprobs: Optional[list[Optional[float]]] = None
    input_top_logprobs: Optional[list[Optional[list[tuple[float, int]]]]] = None
    input_token_ids_logprobs: Optional[list[Optional[list[tuple[float, int]]]]] = None
    retractions: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV an aborted request left behind (keep_aborted_kv)
    finish_reason: Optional[dict[str, Any]] = None
    error: Optional[BaseException] = None
    slot: Optional[int] = None
    created_at: float = field(default_factory=time.monotonic)
    finished_at: Optional[float] = None
    _generator: Optional[torch.Generator] = None
    _stop_ids: frozenset = frozenset()  # set at admission: stop tokens, plus EOS unless ignore_eos
    _max_output: int = 0  # set at admission: min(max_new_tokens, context_length - prompt length)

    def version_spans(self, current_version: Optional[str] = None, upto: Optional[int] = None) -> list[dict[str, Any]]:
        """Runs of equal versions over the output tokens (the first ``upto``), in SGLang 0.5.23's shape.

        ``[{"version", "start", "end"}, ...]`` with ``end`` exclusive. With no output token, one empty
        span of ``current_version`` (SGLang reports the version in force).
        """
        versions = self.output_versions if upto is None else self.output_versions[:upto]
        if not versions:
            return [{"version": current_version, "start": 0, "end": 0}]
        if versions.count(versions[0]) == len(versions):  # one version: a C-speed check
            return [{"version": versions[0], "start": 0, "end": len(versions)}]
        spans: list[dict[str, Any]] = []
        for i, version in enumerate(versions):
            if spans and spans[-1]["version"] == version:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": version, "start": i, "end": i + 1})
        return spans

    @property
    def adjusts_logits(self) -> bool:
        """True when penalties or a logit bias change this request's logits before sampling."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0 or self.logit_bias)

    @property
    def needs_extras(self) -> bool:
        """True when a decode step must do more for this request than sample one token."""
        return bool(self.top_logprobs_num or self.token_ids_logprob or self.on_token or self.stop_check
                    or self.min_new_tokens or self.adjusts_logits)


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
        allow_auto_truncate: Cap ``max_new_tokens`` at what the context leaves instead of refusing
            a request whose prompt plus ``max_new_tokens`` exceeds the context (SGLang's
            ``--allow-auto-truncate``).
        return_original_logprob: Report log-probs of the raw logits at temperature 1 instead of
            SGLang's default (temperature-scaled; see ``lightning_fasync/engine/sampling.py``), as SGLang does under
            ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``.
        enable_memory_saver: Free the released memory in ``release_memory_occupation`` (SGLang's
            ``--enable-memory-saver``); without it the calls are accepted and free nothing, as in SGLang.
        page_size: Tokens per KV block (SGLang's ``--page-size``); see ``ModelRunner``.
        max_total_tokens: The KV pool's size in tokens (SGLang's ``--max-total-tokens``); default:
            from the memory budget.
        mem_fraction_static: Share of the memory available at start that weights + KV pool may take
            (SGLang's ``--mem-fraction-static``).
        keep_aborted_kv: Keep an aborted request's KV cache (its slot and blocks: the prompt and
            every output token but the last) instead of freeing it. A later request whose prompt is
            those tokens plus one more (a partial rollout resumed: prompt + tokens so far) takes the
            cache over and goes on decoding from it, with no prefill; its ``cached_tokens`` says how
            many tokens it did not prefill, as SGLang's prefix cache does. Kept caches give way,
            oldest first, to requests that need the memory, and go with ``/flush_cache``, a weight
            update with ``flush_cache`` and a release of the KV cache; an update without
            ``flush_cache`` leaves them, computed under the earlier weights (as a frozen request's
            cache across an in-flight update).
    """

    def __init__(
        self,
        model: Any,
        *,
        max_running_requests: Optional[int] = None,
        context_length: Optional[int] = None,
        weight_version: str = "default",
        eos_token_ids: Optional[list[int]] = None,
        seed: int = 0,
        allow_auto_truncate: bool = False,
        return_original_logprob: bool = False,
        enable_memory_saver: bool = False,
        page_size: Optional[int] = None,
        max_total_tokens: Optional[int] = None,
        mem_fraction_static: Optional[float] = None,
        deterministic: bool = False,
        keep_aborted_kv: bool = False,
    ) -> None:
        self.max_running_requests = max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        self.context_length = context_length or min(
            getattr(model.config, "max_position_embeddings", DEFAULT_MAX_CONTEXT), DEFAULT_MAX_CONTEXT
        )
        self.runner = ModelRunner(model, self.max_running_requests, self.context_length, page_size=page_size,
                                  max_total_tokens=max_total_tokens, mem_fraction_static=mem_fraction_static)
        self.model = model
        # SGLang's --enable-deterministic-inference: a request's log-probs and tokens do not depend on
        # the requests batched with it. Here by running each request's prefill, decode and sampling
        # on its own, through one attention path (the paged one) whatever its slot.
        self.deterministic = deterministic
        self.runner.paged_only = deterministic
        self.vocab_size = model.config.vocab_size
        self.weight_version = str(weight_version)
        self.eos_token_ids = set(eos_token_ids if eos_token_ids is not None else _model_eos_ids(model))
        self.allow_auto_truncate = allow_auto_truncate
        self.return_original_logprob = return_original_logprob
        self._generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        self._cond = threading.Condition()
        self._waiting: list[EngineRequest] = []  # guarded by _cond
        self._ops: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []  # guarded by _cond
        self._running: list[EngineRequest] = []  # engine thread only, sorted by slot
        # Per-request sampling parameters of the running batch, rebuilt only when it changes.
        self._batch_params: Optional[tuple[list, list, list, list, list]] = None
        self._free_slots = list(range(self.max_running_requests))
        self._paused = False
        self._pause_mode: Optional[str] = None
        self._stopping = False
        self.fatal_error: Optional[BaseException] = None
        self.steps = 0
        self.generated_tokens = 0  # output tokens sampled since start (engine thread writes)
        self.decode_retractions = 0  # requests sent back to the queue because the KV pool was full
        self.prefill_tokens = 0  # tokens run through prefill, re-prefills of retracted requests included
        # Admissions that ran a prefill, the requests they prefilled and the seconds they took: what a
        # prefill batch costs besides its requests' own (lightning-fasync plan measures it).
        self.prefill_batches = 0
        self.prefill_requests = 0
        self.prefill_busy_s = 0.0
        self.aborted_requests = 0
        self.retracted_requests = 0  # by a retract pause or a full KV pool: each is prefilled again
        self.enable_memory_saver = enable_memory_saver
        self.released_tags: set[str] = set()  # engine thread writes; see release_memory_occupation
        # An aborted request's slot and KV blocks, kept (oldest first) under the tokens they hold,
        # until a request whose prompt continues them adopts them, the memory is needed, or the
        # cache is flushed (engine thread only; see keep_aborted_kv in the class docstring).
        self.keep_aborted_kv = keep_aborted_kv
        self._kept: "OrderedDict[tuple[int, ...], int]" = OrderedDict()
        self.kept_kv_hits = 0  # resumed requests that went on from a kept cache instead of a prefill
        self.kept_kv_tokens = 0  # the prompt tokens those hits did not prefill
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

    @property
    def memory_released(self) -> bool:
        """True while released memory is actually freed: requests then wait in the queue."""
        return self.enable_memory_saver and bool(self.released_tags)

    def validate(self, req: EngineRequest) -> None:
        """Raise ``ValueError`` naming what is wrong with a request (the server's 400 message)."""
        if not req.input_ids:
            raise ValueError("The prompt is empty; give at least one input token.")
        n_in = len(req.input_ids)
        # SGLang's checks and messages (tokenizer_manager._validate_one_request).
        if n_in >= self.context_length:
            raise ValueError(
                f"The input ({n_in} tokens) is longer than the model's context length ({self.context_length} tokens)."
            )
        bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}).")
        if req.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {req.max_new_tokens}.")
        if req.max_new_tokens + n_in > self.context_length and not self.allow_auto_truncate:
            raise ValueError(
                "Requested token count exceeds the model's maximum context length of "
                f"{self.context_length} tokens. You requested a total of {req.max_new_tokens + n_in} tokens: "
                f"{n_in} tokens from the input messages and {req.max_new_tokens} tokens for the completion. "
                "Please reduce the number of tokens in the input messages or the completion to fit within the limit."
            )
        if not (req.temperature >= 0 and req.temperature < float("inf")):
            raise ValueError(f"temperature must be a non-negative finite number, got {req.temperature}.")
        if not 0 < req.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {req.top_p}.")
        if req.top_k == 0 or req.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {req.top_k}.")
        if not 0 <= req.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {req.min_p}.")
        for name, lo, hi in (("frequency_penalty", -2.0, 2.0), ("presence_penalty", -2.0, 2.0)):
            if not lo <= getattr(req, name) <= hi:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(req, name)}.")
        if not 0.0 < req.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {req.repetition_penalty}.")
        bad = [t for t in (req.logit_bias or {}) if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias must has keys in [0, {self.vocab_size - 1}], got {bad[0]}.")
        if not 0 <= req.min_new_tokens <= req.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({req.max_new_tokens})], got {req.min_new_tokens}.")
        if req.logprob_start_len > n_in:
            raise ValueError(
                f"logprob_start_len={req.logprob_start_len} is higher than the number of input tokens {n_in}. "
                "Please use a smaller logprob_start_len."
            )
        if req.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {req.top_logprobs_num}.")
        bad = [t for t in (req.token_ids_logprob or []) if not 0 <= t < self.vocab_size]
        if bad:  # SGLang's message (tokenizer_manager._validate_token_ids_logprob)
            raise ValueError(f"token_ids_logprob contains out-of-vocabulary token id {bad[0]}; "
                             f"valid range is [0, {self.vocab_size}).")

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

    def abort(self, rid: str = "", abort_all: bool = False, abort_message: Optional[str] = None) -> int:
        """Abort requests whose rid starts with ``rid`` (SGLang semantics), or all of them.

        Aborted requests finish with what they generated so far and ``finish_reason.type == 'abort'``.

        Returns:
            The number of requests aborted.
        """
        if not abort_all and not rid:
            raise ValueError("Give a request id (rid) or abort_all=true.")
        # SGLang: an abort_message makes the aborted requests answer 503 with that message.
        status = 503 if abort_message else None
        return self._call(lambda: self._abort_matching(lambda r: abort_all or r.rid.startswith(rid),
                                                       abort_message or "Aborted", status))

    def cancel(self, reqs: list[EngineRequest], message: str = "Aborted") -> int:
        """Abort exactly these requests (a client that went away); finished ones are left alone."""
        targets = {id(r) for r in reqs}
        return self._call(lambda: self._abort_matching(lambda r: id(r) in targets, message))

    def pause(self, mode: str = "abort") -> int:
        """Stop generating (SGLang ``/pause_generation``). New requests queue until ``resume``.

        ``abort`` aborts every request (they return what they generated); ``in_place`` keeps the
        running requests and their KV cache as they are; ``retract`` sends the running requests back
        to the front of the queue, freeing their cache: on ``resume`` they are prefilled again
        (prompt plus the tokens so far) under the weights then in force, and go on generating.

        Returns:
            The number of requests aborted (``abort``) or retracted (``retract``); 0 for ``in_place``.
        """
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"Unknown pause mode {mode!r}; use 'abort', 'in_place' or 'retract'.")

        def op() -> int:
            self._paused, self._pause_mode = True, mode
            if mode == "abort":
                return self._abort_matching(lambda r: True, "Aborted")
            if mode == "retract":
                return self._retract_running()
            return 0

        return self._call(op)

    def flush_cache(self) -> tuple[bool, str]:
        """SGLang ``/flush_cache``: refused while a request holds cache, as in SGLang; otherwise
        drops the caches aborted requests left (``keep_aborted_kv``), the engine's only cache
        across requests."""

        def op() -> tuple[bool, str]:
            with self._cond:
                queued = 0 if self._paused else len(self._waiting)
            if self._running or queued:
                return False, (
                    f"Cache not flushed: {len(self._running)} running and {queued} waiting request(s). "
                    "(When there are running or waiting requests, the operation will not be performed.)\n"
                )
            self._drop_kept()
            return True, "Cache flushed.\n"

        return self._call(op)

    def drop_kept_kv(self) -> None:
        """Drop the caches aborted requests left (``keep_aborted_kv``), running requests aside: what
        a weight update with ``flush_cache`` does to them."""
        self._call(self._drop_kept)

    @property
    def kept_kv(self) -> int:
        """How many aborted requests' caches are kept now."""
        return len(self._kept)

    def resume(self) -> None:
        """Continue after ``pause`` (SGLang ``/continue_generation``)."""

        def op() -> None:
            self._paused, self._pause_mode = False, None

        self._call(op)

    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor], weight_version: Optional[str] = None
    ) -> int:
        """Copy tensors into the model between two decode steps; running requests continue.

        All names and shapes are checked before anything is copied, so a bad update changes nothing.

        Returns:
            The number of tensors copied.
        """
        # Tied parameters (lm_head.weight = embed_tokens.weight) answer to both names, as in a state dict.
        params = dict(self.model.named_parameters(remove_duplicate=False))
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
            if self.enable_memory_saver and "weights" in self.released_tags:
                raise ValueError("The weights are released (/release_memory_occupation); resume them with "
                                 "/resume_memory_occupation {\"tags\": [\"weights\"]} before updating them.")
            with torch.no_grad():
                for name, tensor in named_tensors.items():
                    params[name].copy_(tensor)
            self.runner.refresh_weights(named_tensors.keys())  # the layers these belong to
            if weight_version is not None:
                self.weight_version = str(weight_version)
            return len(named_tensors)

        return self._call(op)

    def set_weight_version(self, version: str) -> None:
        """Relabel the current weights (SGLang ``/update_weight_version``)."""

        def op() -> None:
            self.weight_version = str(version)

        self._call(op)

    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> int:
        """SGLang's ``/release_memory_occupation``: free the memory of ``tags`` until
        :meth:`resume_memory_occupation` (None or empty: every tag in ``MEMORY_TAGS``).

        As in SGLang the engine must be idle (requests queued while paused are allowed; they wait).
        ``kv_cache`` frees the KV cache, ``weights`` the parameters and their fused copies (shapes,
        names and buffers stay), ``cuda_graph`` nothing (the engine captures no CUDA graphs). Without
        ``enable_memory_saver`` nothing is freed, as SGLang without ``--enable-memory-saver``.
        While anything is freed, requests wait in the queue and weight updates are refused.

        Returns:
            The bytes freed.

        Raises:
            ValueError: an unknown tag, a tag already released, or requests still running.
        """
        tags = _memory_tags(tags)

        def op() -> int:
            again = [t for t in tags if t in self.released_tags]
            if again:
                raise ValueError(f"`tags` holds {again[0]!r}, which is released already; resume it first.")
            with self._cond:
                waiting = 0 if self._paused else len(self._waiting)
            if self._running or waiting:
                raise ValueError(
                    f"release_memory_occupation needs an idle engine (as SGLang): {len(self._running)} running and "
                    f"{waiting} waiting request(s); abort them or pause generation first."
                )
            freed = 0
            if "kv_cache" in tags:
                self._drop_kept()  # they would point into memory about to go
            if self.enable_memory_saver:
                if "kv_cache" in tags:
                    freed += self.runner.release_kv_cache()
                if "weights" in tags:
                    freed += self.runner.release_weights()
            self.released_tags.update(tags)
            return freed

        freed = self._call(op)
        if self.enable_memory_saver:
            logger.info("Released memory %s: %.1f MiB freed.", ",".join(tags), freed / 2**20)
        else:
            logger.info("Released memory %s: nothing freed (the server runs without --enable-memory-saver).",
                        ",".join(tags))
        return freed

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """SGLang's ``/resume_memory_occupation``: reallocate what ``tags`` released (None or empty:
        every tag). Resumed weights are zeros, as SGLang's resumed memory does not keep its old
        contents: load weights (a weight update) before generating. The KV cache comes back empty.

        Raises:
            ValueError: an unknown tag, or one that is not released.
        """
        tags = _memory_tags(tags)

        def op() -> None:
            resident = [t for t in tags if t not in self.released_tags]
            if resident:
                raise ValueError(f"`tags` holds {resident[0]!r}, which is not released; release it first.")
            if self.enable_memory_saver:
                if "weights" in tags:
                    self.runner.resume_weights()
                if "kv_cache" in tags:
                    self.runner.resume_kv_cache()
            self.released_tags.difference_update(tags)
            with self._cond:
                self._cond.notify_all()  # queued requests may run now

        self._call(op)
        logger.info("Resumed memory %s.", ",".join(tags))

    def memory_usage(self) -> dict[str, Any]:
        """What the weights and the KV cache hold now, in SGLang's ``memory_usage`` units (GB) and
        keys (``token_capacity``: the pool's size in tokens; ``startup_available``: the memory the
        budget was taken from), plus the bytes, the pool's blocks (total, in use, free), the budget
        and the released tags."""
        runner = self.runner
        held, plan = runner.memory_bytes(), runner.plan
        return {"weight": round(held["weights"] / 2**30, 3), "kvcache": round(held["kv_cache"] / 2**30, 3),
                "token_capacity": runner.max_total_tokens,
                "startup_available": round((plan.available_bytes or 0) / 2**30, 3),
                "weight_bytes": held["weights"], "kvcache_bytes": held["kv_cache"],
                "kv_pool": {"page_size": runner.page_size, "bytes_per_token": plan.bytes_per_token,
                            "pool_bytes": plan.pool_bytes, "total_blocks": runner.num_blocks,
                            "used_blocks": runner.used_blocks, "free_blocks": runner.free_blocks,
                            "used_tokens": runner.used_blocks * runner.page_size,
                            "mem_fraction_static": plan.mem_fraction_static, "budget_bytes": plan.budget_bytes,
                            "decode_retractions": self.decode_retractions},
                "prefill_tokens": self.prefill_tokens, "aborted_requests": self.aborted_requests,
                "retracted_requests": self.retracted_requests,
                "kept_kv": len(self._kept), "kept_kv_hits": self.kept_kv_hits, "kept_kv_tokens": self.kept_kv_tokens,
                "released_tags": [t for t in MEMORY_TAGS if t in self.released_tags],
                "enable_memory_saver": self.enable_memory_saver}

    def loads(self) -> dict[str, Any]:
        """Load figures for ``/v1/loads`` and ``/get_load``."""
        with self._cond:
            waiting = len(self._waiting)
        running = list(self._running)
        return {
            "num_running_reqs": len(running),
            "num_waiting_reqs": waiting,
            "num_total_tokens": sum(len(r.input_ids) + len(r.output_ids) for r in running),
            "kv_used_tokens": self.runner.used_blocks * self.runner.page_size,  # held by blocks, pages whole
            "max_total_num_tokens": self.runner.max_total_tokens,
            "max_running_requests": self.max_running_requests,
            "paused": self._paused,
            "pause_mode": self._pause_mode,
            "num_decode_steps": self.steps,
            # Admissions that ran a prefill, the requests in them, and the seconds they took in all.
            "num_prefill_batches": self.prefill_batches,
            "num_prefill_requests": self.prefill_requests,
            "prefill_busy_s": round(self.prefill_busy_s, 6),
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
            started = not fut.cancel()  # one not yet started never runs: its caller was told it failed
            raise TimeoutError(
                f"The engine thread did not run a control operation within {timeout} s "
                "(a decode step is stuck or the engine died); "
                + ("it had started and runs to its end." if started else "it will not run.")
            ) from None

    def _dead_message(self) -> str:
        if self.fatal_error is not None:
            return f"The engine crashed: {self.fatal_error!r}"
        return "The engine is stopped."

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._ops or (not self._paused and not self.memory_released
                                                               and (self._waiting or self._running))):
                        self._cond.wait(timeout=1.0)
                    if self._stopping:
                        break
                    ops, self._ops = self._ops, []
                for fn, fut in ops:
                    if not fut.set_running_or_notify_cancel():
                        continue  # its caller timed out waiting and was told it will not run
                    try:
                        fut.set_result(fn())
                    except Exception as exc:  # handed to the caller, who re-raises it
                        fut.set_exception(exc)
                if self._paused or self.memory_released:  # no cache or weights to run on: requests wait
                    continue
                if not self._running:
                    self._await_burst()
                t0, batches = time.perf_counter(), self.prefill_batches
                self._admit()
                if self.prefill_batches != batches:
                    self.prefill_busy_s += time.perf_counter() - t0
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
        free = self.runner.free_blocks
        adopt: dict[int, tuple[int, ...]] = {}  # id(request) -> the kept cache it goes on from
        with self._cond:
            n, slots = 0, len(self._free_slots)
            for req in self._waiting:
                key = self._kept_key(req)
                if key is not None and key not in adopt.values():
                    adopt[id(req)] = key  # its slot and blocks are there already
                    n += 1
                    continue
                take, need = self._admission_blocks(req)
                # Kept caches give way, oldest first, to a request that needs their memory.
                while (slots == 0 or need > free) and len(self._kept) > len(adopt):
                    free += self._evict_kept(set(adopt.values()))
                    slots += 1
                if slots == 0 or need > free:
                    break  # first come, first served: the rest wait behind it
                free -= take
                slots -= 1
                n += 1
            new, self._waiting = self._waiting[:n], self._waiting[n:]
        if not new:
            return
        admitted, adopted = [], []
        for req in new:
            if req.logprob_start_len >= 0 and req.input_token_logprobs is None:
                self._input_logprobs(req)
            if req.retractions == 0:  # a retracted request keeps its generator, stops and cap
                if req.sampling_seed is not None:
                    req._generator = torch.Generator(device=self.runner.device).manual_seed(int(req.sampling_seed))
                stops = set(req.stop_token_ids)
                if not req.ignore_eos:
                    stops |= self.eos_token_ids
                req._stop_ids = frozenset(stops)
                # Past this the next token would have no cache position left.
                req._max_output = min(req.max_new_tokens, self.context_length - len(req.input_ids))
            if req._max_output <= len(req.output_ids):  # max_new_tokens 0: a prefill-only request
                self._finish(req, {"type": "length", "length": len(req.output_ids)})
                continue
            key = adopt.get(id(req))
            if key is not None:  # its next decode step feeds its last prompt token
                req.slot = self._kept.pop(key)
                req.cached_tokens = len(key)
                self.kept_kv_hits += 1
                self.kept_kv_tokens += len(key)
                adopted.append(req)
                continue
            req.slot = self._free_slots.pop(0)
            admitted.append(req)
        if adopted:
            self._running.extend(adopted)
            self._running.sort(key=lambda r: r.slot)
            self._batch_params = None
        if not admitted:
            return
        # A retracted request is prefilled again with its tokens so far (SGLang's retract).
        prompts = [r.input_ids + r.output_ids if r.output_ids else r.input_ids for r in admitted]
        slots = [r.slot for r in admitted]
        self.runner.allocate(slots, [len(p) for p in prompts])
        self.prefill_tokens += sum(len(p) for p in prompts)
        self.prefill_batches += 1
        self.prefill_requests += len(admitted)
        self._running.extend(admitted)
        self._running.sort(key=lambda r: r.slot)
        self._batch_params = None
        if self.deterministic:
            for req, prompt in zip(admitted, prompts):
                self._append_tokens([req], self.runner.prefill([req.slot], [prompt]), self._sampling_params([req]))
            return
        logits = self.runner.prefill(slots, prompts)
        self._append_tokens(admitted, logits, self._sampling_params(admitted))

    def _admission_blocks(self, req: EngineRequest) -> tuple[int, int]:
        """KV blocks a waiting request takes at admission (its prompt and any tokens so far), and the
        free blocks it needs to be admitted: one more, for its first decode steps, but never more
        than its longest possible sequence takes, so a request the pool can hold alone is always
        admitted into an idle engine. (0, 0) for one that finishes at admission without a prefill."""
        n_in, n_out = len(req.input_ids), len(req.output_ids)
        max_output = req._max_output if req.retractions else min(req.max_new_tokens, self.context_length - n_in)
        if max_output <= n_out:
            return 0, 0
        take = self.runner.blocks_for(n_in + n_out)
        # The last output token is never written to the cache.
        return take, min(take + 1, self.runner.blocks_for(n_in + max_output - 1))

    def _send_back(self, reqs: list[EngineRequest]) -> None:
        """Return running requests to the front of the queue, in the given order, freeing their
        slots and blocks; admitted again, they are prefilled with their tokens so far."""
        gone = {id(r) for r in reqs}
        self._running = [r for r in self._running if id(r) not in gone]  # stays sorted by slot
        for req in reqs:
            self.runner.free(req.slot)
            self._free_slots.append(req.slot)
            req.slot = None
            req.retractions += 1
        self.retracted_requests += len(reqs)
        self._free_slots.sort()
        self._batch_params = None
        with self._cond:
            self._waiting = list(reqs) + self._waiting

    def _retract_running(self) -> int:
        retracted = list(self._running)
        self._send_back(retracted)
        return len(retracted)

    def _retract_decode(self, growing: list[EngineRequest]) -> None:
        """SGLang's retract-decode (``retraction_policy`` ``length``): while the pool has fewer free
        blocks than the requests in ``growing`` need for this step, send back the running request
        with the fewest output tokens (then the longest prompt): the least work to redo. At least
        one request keeps running; one that alone cannot grow is aborted, as SGLang does."""
        runner = self.runner
        needs = {id(r) for r in growing}
        short = len(growing) - runner.free_blocks
        keep = sorted(self._running, key=lambda r: (len(r.output_ids), -len(r.input_ids)), reverse=True)
        retracted = []
        while short > 0 and len(keep) > 1:
            req = keep.pop()
            short -= len(runner.slot_blocks(req.slot)) + (id(req) in needs)
            retracted.append(req)
        if retracted:
            retracted.sort(key=lambda r: r.created_at)  # back in arrival order
            self._send_back(retracted)
            self.decode_retractions += len(retracted)
            logger.info("KV pool full: retracted %d request(s) to the queue (%d running, %d of %d blocks free).",
                        len(retracted), len(self._running), runner.free_blocks, runner.num_blocks)
        if short > 0:
            last = keep[0]
            self._finish(last, {"type": "abort", "status_code": 500, "err_type": None, "message":
                                "Out of memory even after retracting all other requests in the decode batch: "
                                f"the KV pool has {runner.num_blocks} blocks of {runner.page_size} tokens."})

    @torch.inference_mode()
    def _input_logprobs(self, req: EngineRequest) -> None:
        """Log-probs of the prompt tokens from ``logprob_start_len`` on (one plain forward pass).

        The first prompt token has no log-prob (None), as in SGLang.
        """
        if req.logprob_start_len >= len(req.input_ids):
            req.input_token_logprobs, req.input_top_logprobs, req.input_token_ids_logprobs = [], [], []
            return
        ids = torch.tensor([req.input_ids], dtype=torch.long, device=self.runner.device)
        logits = self.model(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits[:-1], dim=-1)  # row i predicts token i + 1
        start = req.logprob_start_len
        token_lp = [None] + lp.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1).tolist()
        req.input_token_logprobs = token_lp[start:]
        if req.top_logprobs_num:
            top = lp.topk(min(req.top_logprobs_num, lp.shape[-1]), dim=-1)
            rows = [list(zip(v, i)) for v, i in zip(top.values.tolist(), top.indices.tolist())]
            req.input_top_logprobs = ([None] + rows)[start:]
        if req.token_ids_logprob:
            picked = lp[:, req.token_ids_logprob].tolist()
            rows = [list(zip(v, req.token_ids_logprob)) for v in picked]
            req.input_token_ids_logprobs = ([None] + rows)[start:]

    def _sampling_params(self, batch: list[EngineRequest]) -> tuple:
        min_ps = [r.min_p for r in batch]
        return (
            [r.slot for r in batch],
            [r.temperature for r in batch],
            [r.top_p for r in batch],
            [r.top_k for r in batch],
            [r._generator for r in batch],
            min_ps if max(min_ps) > 0 else None,
            [r for r in batch if r.needs_extras],
        )

    def _decode_step(self) -> None:
        page = self.runner.page_size
        positions = [len(r.input_ids) + len(r.output_ids) - 1 for r in self._running]
        # A request whose new token starts a page needs a block for it first.
        growing = [r for r, p in zip(self._running, positions) if p % page == 0]
        if growing:
            while len(growing) > self.runner.free_blocks and self._evict_kept():
                pass  # kept caches give way to running requests before any is retracted
            if len(growing) > self.runner.free_blocks:
                self._retract_decode(growing)
                if not self._running:
                    return
                positions = [len(r.input_ids) + len(r.output_ids) - 1 for r in self._running]
                growing = [r for r, p in zip(self._running, positions) if p % page == 0]
            self.runner.allocate([r.slot for r in growing],
                                 [len(r.input_ids) + len(r.output_ids) for r in growing])
        batch = self._running  # sorted by slot
        if self.deterministic:
            for req, position in zip(list(batch), positions):
                logits = self.runner.decode([req.slot], [_last_token(req)], [position])
                self._append_tokens([req], logits, self._sampling_params([req]))
            self.steps += 1
            return
        if self._batch_params is None:
            self._batch_params = self._sampling_params(batch)
        params = self._batch_params
        logits = self.runner.decode(params[0], [_last_token(r) for r in batch], positions)
        self.steps += 1
        self._append_tokens(list(batch), logits, params)

    def _append_tokens(self, batch: list[EngineRequest], logits: torch.Tensor, params: tuple) -> None:
        extras = params[6]
        if extras and any(r.adjusts_logits for r in extras):
            logits = self._adjust_logits(batch, logits)
        banned = None
        if extras and any(r.min_new_tokens for r in extras):
            banned = [sorted(r._stop_ids) if len(r.output_ids) < r.min_new_tokens else None for r in batch]
        tokens, logprobs = sample(logits, params[1], params[2], params[3], params[4], self._generator,
                                  min_ps=params[5], banned=banned, original=self.return_original_logprob)
        if extras:
            self._token_extras(batch, logits, extras, banned)
        version = self.weight_version
        self.generated_tokens += len(batch)
        for req, token, logprob in zip(batch, tokens, logprobs):
            out = req.output_ids
            out.append(token)
            req.output_logprobs.append(logprob)
            req.output_versions.append(version)
            if token in req._stop_ids:
                self._finish(req, {"type": "stop", "matched": token})
            elif len(out) >= req._max_output:
                self._finish(req, {"type": "length", "length": len(out)})
            elif req.stop_check is not None and len(out) >= req.min_new_tokens:
                matched = req.stop_check(req)
                if matched is not None:
                    self._finish(req, {"type": "stop", "matched": matched})
            if req.on_token is not None and req.finish_reason is None:
                req.on_token(req)

    @staticmethod
    def _adjust_logits(batch: list[EngineRequest], logits: torch.Tensor) -> torch.Tensor:
        """Penalties over each request's output tokens so far, then its logit bias (SGLang's penalizers:
        frequency and presence subtract ``penalty x count`` and ``penalty x [count > 0]``; repetition
        divides positive and multiplies negative logits of the tokens seen). Sampling and the reported
        log-probs both see the adjusted logits, as in SGLang."""
        logits = logits.clone()
        for i, req in enumerate(batch):
            if not req.adjusts_logits:
                continue
            row = logits[i]
            if req.output_ids and (req.frequency_penalty or req.presence_penalty or req.repetition_penalty != 1.0):
                ids = torch.tensor(req.output_ids, device=row.device)
                counts = torch.bincount(ids, minlength=row.shape[0]).to(row.dtype)
                seen = counts > 0
                if req.repetition_penalty != 1.0:
                    rp = req.repetition_penalty
                    row.copy_(torch.where(seen, torch.where(row < 0, row * rp, row / rp), row))
                row.sub_(req.frequency_penalty * counts + req.presence_penalty * seen.to(row.dtype))
            if req.logit_bias:
                keys = torch.tensor(list(req.logit_bias), device=row.device)
                row.index_add_(0, keys, torch.tensor(list(req.logit_bias.values()), dtype=row.dtype, device=row.device))
        return logits

    def _token_extras(self, batch: list[EngineRequest], logits: torch.Tensor, extras: list[EngineRequest],
                      banned: Optional[list]) -> None:
        """Top-k and chosen-id log-probs (of the distribution ``sample`` reports) for the rows that asked."""
        want = {id(r) for r in extras if r.top_logprobs_num or r.token_ids_logprob}
        if not want:
            return
        rows = [i for i, r in enumerate(batch) if id(r) in want]
        lp = reported_logprobs(logits[rows].float(), [batch[i].temperature for i in rows],
                               [banned[i] for i in rows] if banned is not None else None, self.return_original_logprob)
        for j, i in enumerate(rows):
            req = batch[i]
            if req.top_logprobs_num:
                top = lp[j].topk(min(req.top_logprobs_num, lp.shape[-1]))
                req.output_top_logprobs.append(list(zip(top.values.tolist(), top.indices.tolist())))
            if req.token_ids_logprob:
                req.output_token_ids_logprobs.append(list(zip(lp[j, req.token_ids_logprob].tolist(), req.token_ids_logprob)))

    def _abort_matching(self, match: Callable[[EngineRequest], bool], message: str, status_code: Optional[int] = None) -> int:
        with self._cond:
            queued = [r for r in self._waiting if match(r)]
            self._waiting = [r for r in self._waiting if not match(r)]
        running = [r for r in self._running if match(r)]
        for req in queued + running:
            self._finish(req, {"type": "abort", "message": message, "status_code": status_code, "err_type": None})
        self.aborted_requests += len(queued) + len(running)
        return len(queued) + len(running)

    def _finish(self, req: EngineRequest, reason: dict[str, Any], error: Optional[BaseException] = None) -> None:
        # By identity: the dataclass __eq__ would compare every field of every request before it.
        for i, running in enumerate(self._running):
            if running is req:
                del self._running[i]  # keeps the rest sorted by slot
                self._batch_params = None
                break
        if req.slot is not None:
            if (self.keep_aborted_kv and error is None and reason.get("type") == "abort"
                    and reason.get("status_code") is None and len(req.input_ids) + len(req.output_ids) > 1):
                # The cache holds the prompt and every output token but the last (never fed back).
                tokens = tuple((req.input_ids + req.output_ids)[:-1])
                if tokens in self._kept:
                    self._free_slot(self._kept.pop(tokens))
                self._kept[tokens] = req.slot
            else:
                self._free_slot(req.slot)
            req.slot = None
        req.finish_reason, req.error, req.finished_at = reason, error, time.monotonic()
        if req.on_finish is not None:
            try:
                req.on_finish(req)
            except Exception:
                # A caller's callback must not take the engine down for everyone; log it loudly.
                logger.exception("on_finish callback of request %s raised.", req.rid)

    def _free_slot(self, slot: int) -> None:
        self.runner.free(slot)
        self._free_slots.append(slot)
        self._free_slots.sort()  # lowest slots first keeps the batch contiguous (the pool read as a view)

    def _evict_kept(self, spare: Container[tuple[int, ...]] = ()) -> int:
        """Free the oldest kept cache not in ``spare``; returns the blocks it held (0: none left)."""
        for tokens in self._kept:
            if tokens not in spare:
                slot = self._kept.pop(tokens)
                blocks = len(self.runner.slot_blocks(slot))
                self._free_slot(slot)
                return blocks
        return 0

    def _drop_kept(self) -> None:
        while self._kept:
            self._free_slot(self._kept.popitem(last=False)[1])

    def _kept_key(self, req: EngineRequest) -> Optional[tuple[int, ...]]:
        """The kept cache a waiting request can go on from: its prompt less the last token, for a
        request with no tokens of its own yet (a retracted one is prefilled as before)."""
        if not self._kept or req.output_ids or req.retractions or len(req.input_ids) < 2:
            return None
        key = tuple(req.input_ids[:-1])
        return key if key in self._kept else None

    def _fail_everything(self) -> None:
        error = EngineDeadError(self._dead_message())
        with self._cond:
            pending, self._waiting = self._waiting, []
            ops, self._ops = self._ops, []
        for _, fut in ops:
            if not fut.cancelled():
                fut.set_exception(error)
        for req in pending + list(self._running):
            self._finish(req, {"type": "abort", "message": str(error), "status_code": 503}, error)


def _last_token(req: EngineRequest) -> int:
    """The token a decode step feeds: the last output token, or the last prompt token of a request
    that went on from a kept cache (it had no prefill to sample its first token from)."""
    return req.output_ids[-1] if req.output_ids else req.input_ids[-1]


def _memory_tags(tags: Optional[list[str]]) -> list[str]:
    """The tags of a memory call, checked; None or empty means all (SGLang)."""
    if not tags:
        return list(MEMORY_TAGS)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"`tags` holds {unknown[0]!r}; SGLang's memory tags are {', '.join(MEMORY_TAGS)}.")
    return list(dict.fromkeys(tags))


def _model_eos_ids(model: Any) -> list[int]:
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
    return []
