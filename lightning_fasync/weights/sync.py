"""Trainer → engine weight sync: one interface, three paths (docs/weight_sync.md).

- ``distributed`` (:mod:`~lightning_fasync.weights.group`): trainer global rank 0 forms a
  weight-update group with every engine TP rank (SGLang's ``/init_weights_update_group``; rank
  offsets ``1 + Σ tp``; gloo on CPU, NCCL on CUDA), then per bucket fires
  ``/update_weights_from_distributed`` to every engine and broadcasts one flattened bucket. Engines
  on other devices or hosts.
- ``tensor``: ``/update_weights_from_tensor`` with SGLang's serialised buckets (shared memory on
  CPU, CUDA IPC on GPU). Engines on this host.
- ``disk``: ``/update_weights_from_disk`` with a Hugging Face directory of safetensors shards.

Every push: pause generation (``/pause_generation``; the controller has already stopped dispatch
and settled its in-flight requests) → flush → begin the weight-update bracket where the servers
have it → the buckets, each carrying the weight version label → end the bracket → flush → continue.
A failed or partial update raises :class:`WeightSyncError` naming the engine and the step, and the
engines stay paused (no mix of versions is served). With a supervised pool, a replica that leaves
the serving set mid-push is skipped (the ``distributed`` path re-forms its group without it and
pushes again); it gets the pushed weights when it restarts: :class:`KeptWeights` holds them
(shared-memory buckets, or the directory) and :func:`push_kept` delivers them to that replica.
Weights leave in Hugging Face naming, bucket by bucket, in the order given: a mapping of tensors,
or a :class:`~lightning_fasync.weights.tensor_stream.TensorStream` (a sharded trainer's tensors,
gathered one at a time), whose buckets are planned from its specs and filled from it as they are
sent, so at most one bucket and one tensor of it are held at a time (:class:`_Streamed`).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, ClassVar, Iterator, Mapping, Optional, Sequence, Union

import torch

from lightning_fasync.config import ConfigError
from lightning_fasync.pipeline.engine_client import SKIPPED, EngineError
from lightning_fasync.registry import WEIGHT_PATHS, WeightPath, weight_sync_choices
from lightning_fasync.weights import wire as weight_wire
from lightning_fasync.weights.tensor_stream import TensorSpec, TensorStream
from lightning_fasync.weights.wire import FlattenedTensorMetadata

Weights = Union[Mapping[str, torch.Tensor], TensorStream]  # what a push takes

PAUSE_MODES = ("abort", "retract", "in_place")
DEFAULT_BUCKET_BYTES = 512 * 2**20


class WeightSyncError(EngineError):
    """A weight update failed, or reached only some engines; the message names the engine and step."""


def resolve_weight_sync(cfg: Any, choice: Optional[str] = None) -> str:
    """The weight-sync path of a run: ``choice`` (an override such as
    ``FullyAsyncStrategy(weight_sync=...)``), else ``rollout.weight_sync``; ``auto`` is ``tensor`` for
    engines on this host (the embedded backend), ``vllm`` for vLLM servers (``rollout.backend: vllm``)
    and ``distributed`` otherwise (``rollout.backend`` sglang or external, or replicas on other nodes:
    ``rollout.placement: ray``)."""
    kind = choice if choice is not None else getattr(cfg.rollout, "weight_sync", "auto")
    if kind == "auto":
        if getattr(cfg.rollout, "placement", "local") != "local":  # replicas on other nodes: over the network
            return "distributed"
        return {"embedded": "tensor", "vllm": "vllm"}.get(getattr(cfg.rollout, "backend", "embedded"), "distributed")
    if kind not in WEIGHT_PATHS:
        raise ConfigError(f"`rollout.weight_sync` is {kind!r}; it must be one of {', '.join(weight_sync_choices())}.")
    return kind


@dataclass
class Bucket:
    """One flattened bucket: ``flat`` (``uint8``) laid out by ``metadata`` (SGLang's layout)."""

    flat: torch.Tensor
    metadata: list[FlattenedTensorMetadata]

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return weight_wire.unflatten(self.flat, self.metadata)


@dataclass
class KeptWeights:
    """The weights of the last push, kept for a replica that restarts: shared-memory buckets
    (``tensor`` and ``distributed``) or the pushed directory (``disk``). :meth:`release` frees them."""

    kind: str  # "tensor" (buckets) or "disk" (path)
    version: int
    buckets: Optional[list[Bucket]] = None
    path: Optional[str] = None

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every kept tensor by name (what a replica must hold; see ``weight_checksum``)."""
        if self.kind == "disk":
            from safetensors.torch import load_file

            out: dict[str, torch.Tensor] = {}
            for name in sorted(os.listdir(self.path or "")):
                if name.endswith(".safetensors"):
                    out.update(load_file(os.path.join(self.path or "", name)))
            return out
        return {n: t for b in self.buckets or [] for n, t in b.named_tensors()}

    def release(self) -> None:
        """Free the shared memory, or remove the directory. Idempotent."""
        self.buckets = None
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


class WeightSync(abc.ABC):
    """Push the trainer's weights to every engine of ``client`` (module docstring).

    Arguments:
        client: the engines (admin calls go to every serving worker).
        bucket_bytes: the most bytes per bucket (``rollout.weight_sync_bucket_mb``); a larger
            tensor goes alone.
        timeout_s: the longest one push may take; every wait inside it ends by then.
        timeout_key: what a timeout error names as the setting to raise.
        pause_mode: ``/pause_generation`` mode around the push: ``abort`` (SGLang's default),
            ``retract`` (running requests re-prefill under the new weights; SGLang >= 0.5.23) or
            ``in_place`` (no flush: the old KV cache stays); None: no pause (the caller holds the
            engines idle).
        keep: return the pushed weights as :class:`KeptWeights` (a pool that restarts replicas).
        work_dir: where ``disk`` writes its directories (default: the system's temp dir).
        check_model: the policy the engines serve (a preset or a Hugging Face directory): after every
            push, each serving engine's log-probs of a fixed probe are held against the pushed
            weights' own, computed here (``rollout.check_weights``; :mod:`~lightning_fasync.weights.probe`).
            None: no check.
    """

    kind: ClassVar[str]
    pause_modes: ClassVar[tuple[str, ...]] = PAUSE_MODES
    """The ``pause_mode`` values this path's engines take."""

    def __init__(self, client: Any, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 600.0,
                 timeout_key: str = "admin_timeout", pause_mode: Optional[str] = "abort", keep: bool = False,
                 work_dir: Optional[str] = None, check_model: Optional[str] = None) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes is {bucket_bytes}; it must be positive.")
        self.client = client
        # Update calls are not repeated after a failure (a replayed bucket would be out of order).
        self.rpc = client.clone()
        self.rpc.retries = 0
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.timeout_key = timeout_key
        self.pause_mode = pause_mode
        self.set_pause_mode(pause_mode)
        self.keep = keep
        self.work_dir = work_dir
        self.check_model = check_model
        self.last_check_gap: Optional[float] = None
        """The largest log-prob difference of the last checked push over its engines (``check_model``)."""
        self.closed = False
        self._tp: dict[str, int] = {}  # engine URL -> its TP size (from /get_server_info)

    def set_pause_mode(self, mode: Optional[str]) -> None:
        """The ``/pause_generation`` mode of the next pushes (the class docstring's ``pause_mode``).

        Raises:
            ValueError: a mode this path's engines do not take.
        """
        if mode is not None and mode not in self.pause_modes:
            raise ValueError(f"pause_mode is {mode!r}; {self.kind} takes {', '.join(self.pause_modes)} or None.")
        self.pause_mode = mode

    async def connect(self) -> None:
        """Prepare the path (``distributed``: form the group). Idempotent; :meth:`push` calls it."""

    async def close(self) -> None:
        """Release what the path holds (``distributed``: the group). Idempotent."""
        self.closed = True
        await self.client.close()
        await self.rpc.close()

    async def push(self, named_tensors: Weights, version: Optional[int],
                   step: Optional[int] = None) -> Optional[KeptWeights]:
        """Every engine loads ``named_tensors`` (Hugging Face names) and labels them ``version``.

        Args:
            named_tensors: a mapping (a tied tensor listed twice is sent once), or a fresh
                :class:`TensorStream`, consumed here in order on the calling thread (its ``take``
                may run a collective). A failed push leaves what it did not take of a stream in
                it: the caller drains it, so every rank's collectives match.
            version: the weight version label (None: the engines keep theirs).
            step: the rollout step that ended (named in errors).

        Returns:
            The pushed weights with ``keep``, else None.

        Raises:
            WeightSyncError: an engine failed, did not answer in time, or the update reached only
                some engines; the message names the engine URL and the step. Also a stream whose
                ``take`` failed (the message names the tensor; the cause is chained).
            ValueError: no tensors, or a stream already (partly) consumed.
        """
        if self.closed:
            raise RuntimeError("This WeightSync is closed.")
        where = _where(version, step)
        if self.check_model is not None and isinstance(named_tensors, (TensorStream, _Streamed)):
            raise WeightSyncError(
                f"The weight sync of {where}: `rollout.check_weights` holds the engines' log-probs against the pushed "
                "tensors', and this trainer pushes a stream of gathered shards that is gone once sent; set it false "
                "with a sharded trainer.")
        named_tensors = self._streamed(named_tensors, where)
        self._discard(None)
        staged = await self._stage(named_tensors, version)
        try:
            await self._deliver(staged, version, where)
            if self.check_model is not None:
                await self.check_pushed(named_tensors, where)
        except BaseException:
            self._discard(staged)
            raise
        finally:
            await self.rpc.close()  # its connections belong to this event loop
        return self._keep(staged, version)

    # ------------------------------------------------------------------ the check (rollout.check_weights)

    def served_tensors(self, named_tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """What every engine serves after a push of ``named_tensors`` (Hugging Face names): the tensors
        themselves (the adapter path: the base with the adapter merged)."""
        return named_tensors

    async def check_pushed(self, named_tensors: Mapping[str, torch.Tensor], where: str) -> None:
        """Every serving engine's log-probs of the probe against those of ``served_tensors(named_tensors)``
        under ``check_model`` (:mod:`~lightning_fasync.weights.probe`), within the tolerance of their dtype.

        Raises:
            WeightSyncError: an engine computes other log-probs, gives none, or the pushed tensors do not
                cover the policy (each message names the engine or the key).
        """
        from lightning_fasync.weights.probe import probe_reference, sglang_served_logprobs, tolerance_for

        assert self.check_model is not None
        served_tensors = await asyncio.to_thread(self.served_tensors, named_tensors)
        probe = await probe_reference(self.check_model, served_tensors)
        if probe is None:
            raise WeightSyncError(
                f"The weight sync of {where}: `rollout.check_weights` cannot compute the probe's log-probs from the "
                f"pushed tensors, which do not cover the policy {self.check_model!r}; set it false.")
        ids, reference = probe
        pushed = next(t.dtype for n, t in served_tensors.items() if n.endswith("embed_tokens.weight"))

        async def served_by(url: str) -> tuple[list[float], float]:
            # The engine's own dtype (``/server_info``): one serving a lower precision is held to its tolerance.
            info = await self.rpc._request("GET", url + "/server_info", timeout=self.timeout_s, missing_ok=True)
            try:
                dtype = weight_wire.parse_dtype(info.get("dtype") if isinstance(info, dict) else None)
            except ValueError:  # not said, or "auto"
                dtype = None
            logprobs = await sglang_served_logprobs(self.rpc, url, ids, self.timeout_s, lora_name=self.probe_lora_name())
            return logprobs, max(tolerance_for(pushed), tolerance_for(dtype))

        gaps = await self.hold_probe(
            list(self.client.worker_urls), served_by, reference, where, "`rollout.check_weights`",
            lambda url, worst, tolerance: f"the engine {url} does not serve the pushed weights: its log-probs of a "
                                          f"{len(ids)}-token probe differ from theirs by up to {worst:.3g} (tolerance "
                                          f"{tolerance:g}, `rollout.check_weights`)")
        self.last_check_gap = max(gaps) if gaps else None

    async def hold_probe(self, urls: Sequence[str], served_by: Callable[[str], Awaitable[tuple[list[float], float]]],
                         reference: Sequence[float], where: str, key: str,
                         mismatch: Callable[[str, float, float], str]) -> list[float]:
        """Each of ``urls``' log-probs of the probe (``served_by(url)``: them and their tolerance) against
        ``reference``; one that leaves the serving set meanwhile is passed over. The one loop of both
        checks (``rollout.check_weights`` here, ``rollout.vllm_args.check_weights`` in vllm_sync).

        Returns:
            The largest difference of each server checked.

        Raises:
            WeightSyncError: a server gave no log-probs (naming ``key``), or ones further than its
                tolerance from ``reference`` (``mismatch(url, worst, tolerance)`` says how).
        """
        from lightning_fasync.weights.probe import worst_gap

        gaps = []
        for url in urls:
            try:
                answer = await self.client._on_worker(url, served_by(url))
            except (EngineError, KeyError, IndexError, TypeError, ValueError) as exc:
                raise WeightSyncError(f"The weight sync of {where}: {url} did not give the probe's log-probs ({key}): "
                                      f"{exc!r}") from exc
            if answer is SKIPPED:
                continue
            served, tolerance = answer
            worst = worst_gap(served, reference)
            gaps.append(worst)
            if not worst <= tolerance:
                raise WeightSyncError(f"The weight sync of {where}: {mismatch(url, worst, tolerance)}.")
        return gaps

    def probe_lora_name(self) -> Optional[str]:
        """The adapter the probe is served under (SGLang's ``lora_path``); None: the served model."""
        return None

    def _streamed(self, named_tensors: Any, where: str) -> Any:
        """A :class:`TensorStream` as its :class:`_Streamed` buckets; anything else as it is."""
        if isinstance(named_tensors, TensorStream):
            named_tensors = _Streamed(named_tensors, self.bucket_bytes)
        if isinstance(named_tensors, _Streamed):
            named_tensors.where = where
        return named_tensors

    # ------------------------------------------------------------------ the sequence, per path

    @abc.abstractmethod
    async def _stage(self, named_tensors: Any, version: int) -> Any:
        """Lay the tensors (a mapping, or a stream's :class:`_Streamed`) out for sending (buckets, a
        directory)."""

    @abc.abstractmethod
    async def _send(self, staged: Any, version: int, where: str) -> None:
        """Send what ``_stage`` made to every serving engine and check every answer."""

    def _keep(self, staged: Any, version: int) -> Optional[KeptWeights]:
        self._discard(staged)
        return None

    def _discard(self, staged: Any) -> None:
        """Release a staged push that is not kept."""

    bracketed = True  # tensor and distributed updates run inside SGLang 0.5.23's bracket
    keep_cache = False
    """No ``/flush_cache`` and updates with ``flush_cache: false`` whatever the pause mode
    (``rollout.resume_kv: keep``): the caches the aborted requests left stay for their resumption."""

    @property
    def flush_in_update(self) -> bool:
        """The updates' ``flush_cache``: not after an ``in_place`` pause (its requests keep the old KV),
        nor with :attr:`keep_cache`."""
        return self.pause_mode != "in_place" and not self.keep_cache

    async def _deliver(self, staged: Any, version: Optional[int], where: str) -> None:
        await self.connect()
        # /flush_cache around the update only when this push paused generation (it then succeeds
        # once the aborted or retracted requests are gone); the updates flush too.
        flush = self.pause_mode not in (None, "in_place") and not self.keep_cache
        if self.pause_mode is not None:
            await self._admin(self.client.pause(self.pause_mode), "pause_generation", where)
            if flush:
                await self._flush(where)
        bracket = False
        try:
            if self.bracketed:
                bracket = await self._admin(self.client.begin_weight_update(), "begin_weight_update", where)
            await self._send(staged, version, where)
            if bracket:
                bracket = False
                await self._admin(self.client.end_weight_update(), "end_weight_update", where)
        finally:
            if bracket:  # a failed push: close the bracket so the next one can open it; stay paused
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.client.end_weight_update(), 10)
        if flush:
            await self._flush(where)
        if self.pause_mode is not None:
            await self._admin(self.client.resume(), "continue_generation", where)

    async def _admin(self, call: Awaitable[Any], what: str, where: str) -> Any:
        try:
            return await call
        except EngineError as exc:
            raise WeightSyncError(f"The weight sync of {where} failed at {what}: {exc}") from exc

    async def _flush(self, where: str) -> None:
        """``/flush_cache`` until every engine accepts it (SGLang refuses while requests hold cache)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                await self.client.flush_cache()
                return
            except EngineError as exc:
                if exc.status != 400 or time.monotonic() > deadline:
                    raise WeightSyncError(
                        f"The weight sync of {where} could not flush the engines' cache within {self.timeout_s:g} s "
                        f"(`{self.timeout_key}`): {exc}") from exc
            await asyncio.sleep(0.1)

    async def _update(self, url: str, path: str, body: dict[str, Any], where: str) -> Any:
        """One update call to ``url``; ``SKIPPED`` when it leaves the serving set meanwhile."""

        async def call() -> Any:
            return await self.rpc._request("POST", url + path, body, timeout=self.timeout_s, timeout_key=self.timeout_key)

        try:
            result = await self.client._on_worker(url, call())
        except EngineError as exc:
            raise WeightSyncError(f"The weight sync of {where} failed on {url} ({path}): {exc}") from exc
        if result is not SKIPPED and not self._answer_ok(result):
            raise WeightSyncError(f"The weight sync of {where} failed on {url} ({path}): {str(result)[:500]}")
        return result

    @staticmethod
    def _answer_ok(result: Any) -> bool:
        """Whether an update call's answer says it succeeded (SGLang's ``{"success": true, ...}``)."""
        return isinstance(result, dict) and result.get("success") is True

    async def _update_all(self, path: str, body_for: Any, where: str) -> None:
        # With a supervisor, no serving engine is not an error here: the weights are kept, and a
        # replica that comes back gets them before it serves (the supervisor reports a lasting loss).
        await asyncio.gather(*(self._update(u, path, body_for(u), where) for u in self.client.worker_urls))

    size_query: ClassVar[tuple[str, str]] = ("/get_server_info", "tp_size")
    """Where an engine says how many ranks receive the weights: the GET path and its answer's key."""

    async def tp_sizes(self, urls: Sequence[str]) -> list[int]:
        """Each engine's ranks (SGLang's TP size; :attr:`size_query`), 1 where it does not say; asked once."""
        path, key = self.size_query

        async def one(url: str) -> None:
            try:
                info = await self.client._request("GET", url + path, missing_ok=True)
            except EngineError:
                info = None
            size = info.get(key) if isinstance(info, dict) else None
            self._tp[url] = int(size) if isinstance(size, int) and size > 0 else 1

        await asyncio.gather(*(one(u) for u in urls if u not in self._tp))
        return [self._tp[u] for u in urls]


# ---------------------------------------------------------------------------------- buckets


def unique_tensors(named_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``named_tensors`` without the second name of a tied tensor (``lm_head.weight`` when it is
    ``embed_tokens.weight``, as a state dict lists it): it is sent once, under its first name,
    which is how the engines' parameters name it (SGLang skips the tied name when it loads)."""
    if not named_tensors:
        raise ValueError("Nothing to push: no tensors.")
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for name, tensor in named_tensors.items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tensor.stride(), tensor.dtype)
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = tensor
    return out


class _Streamed:
    """The buckets of a :class:`TensorStream`: planned from its specs by the rule a mapping's are
    (:func:`weight_wire.plan_ranges`), then taken from it bucket by bucket, in order, each tensor on
    the calling thread (``take`` may run a collective every rank takes part in: never from another
    thread) and dropped as soon as it is copied into its bucket. What this holds: one bucket plus
    one tensor (the gather producing the tensor may need it twice for a moment). A stream cannot be replayed: each bucket is taken once.

    (A stream lists a tied tensor once already; :func:`unique_tensors` is for mappings.)
    """

    def __init__(self, stream: TensorStream, max_bytes: int) -> None:
        if stream.consumed:
            raise ValueError(f"The TensorStream was already consumed ({stream.consumed} of {len(stream)} tensors "
                             "taken); a push needs a fresh one.")
        if not len(stream):
            raise ValueError("Nothing to push: no tensors.")
        self.stream = stream
        sizes = [(s.nbytes, s.dtype.itemsize) for s in stream.specs]
        self.buckets: list[list[TensorSpec]] = [stream.specs[r.start : r.stop]
                                                for r in weight_wire.plan_ranges(sizes, max_bytes)]
        self.taken = 0  # buckets handed out so far
        self.where = "a weight update"  # named in errors (the push sets it)
        self._held: Optional[torch.Tensor] = None  # the next tensor, taken ahead by device()

    def __len__(self) -> int:
        return len(self.buckets)

    @property
    def nbytes(self) -> int:
        return self.stream.nbytes

    def device(self) -> torch.device:
        """Where the stream's tensors are: its next tensor is taken (and held) to tell."""
        if self._held is None:
            spec = self.stream.specs[self.stream.consumed]
            self._held = self._take(spec)
        return self._held.device

    def _take(self, spec: TensorSpec) -> torch.Tensor:
        k = self.stream.consumed
        try:
            name, tensor = self.stream.take()
        except Exception as exc:  # noqa: BLE001 - a gather, or the trainer's own code: named, chained
            raise WeightSyncError(f"The weight sync of {self.where} failed taking {spec.name} (tensor {k + 1} of "
                                  f"{len(self.stream)}) from the trainer's stream: {type(exc).__name__}: {exc}") from exc
        if name != spec.name:  # cannot happen with a TensorStream; a bucket's layout depends on it
            raise WeightSyncError(f"The trainer's stream gave {name} where its specs say {spec.name}.")
        return tensor

    def tensors(self, i: int) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
        """Bucket ``i``'s tensors, taken one at a time (``i`` must be the next bucket). Drop each
        before asking for the next: this generator holds none while it takes one."""
        if i != self.taken:
            raise RuntimeError(f"Bucket {i + 1} of a stream was asked for after bucket {self.taken}: a stream "
                               "is taken once, in order.")
        self.taken += 1
        for spec in self.buckets[i]:
            tensor, self._held = self._held, None
            if tensor is None:
                tensor = self._take(spec)
            yield spec, tensor
            del tensor

    def fill(self, i: int, buffer: Callable[[int, torch.device], torch.Tensor]) -> Bucket:
        """Bucket ``i`` flattened into ``buffer(nbytes, device of its first tensor)``, tensor by tensor."""
        specs = self.buckets[i]
        metadata = weight_wire.layout([s.name for s in specs], [s.dtype for s in specs], [s.shape for s in specs])
        flat: Optional[torch.Tensor] = None
        k = 0
        # A plain loop (zip and enumerate keep the previous item alive while they take the next).
        for _, tensor in self.tensors(i):
            if flat is None:
                flat = buffer(weight_wire.bucket_bytes(metadata), tensor.device)
            meta = metadata[k]
            flat[meta.start_idx : meta.end_idx].copy_(tensor.detach().reshape(-1).view(torch.uint8))
            del tensor  # before the next one is taken
            k += 1
        assert flat is not None
        return Bucket(flat, metadata)



class _BucketedSync(WeightSync):
    """What ``tensor`` and ``distributed`` share: flattened buckets, kept in shared memory."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Two reused shared-memory buffers when nothing is kept: one is filled while the other is sent.
        self._staging: list[Optional[torch.Tensor]] = [None, None]
        self._kept: list[Bucket] = []  # this push's buckets, in shared memory, when kept

    def _keep(self, staged: Any, version: int) -> Optional[KeptWeights]:
        kept, self._kept = self._kept, []
        return KeptWeights("tensor", version, buckets=kept) if self.keep else None

    def _discard(self, staged: Any) -> None:
        self._kept = []

    def _buffer(self, nbytes: int, device: torch.device, slot: int = 0) -> torch.Tensor:
        if device.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        if self.keep:  # each bucket is kept: memory of its own
            return weight_wire.new_shared_bytes(nbytes)
        staging = self._staging[slot]
        if staging is None or staging.numel() < nbytes:
            staging = self._staging[slot] = weight_wire.new_shared_bytes(nbytes)
        return staging[:nbytes]

    def _plan(self, named_tensors: Any) -> Any:
        """A mapping's buckets; a stream's :class:`_Streamed` as it is (its buckets are planned)."""
        if isinstance(named_tensors, _Streamed):
            return named_tensors
        return weight_wire.plan_buckets(unique_tensors(named_tensors), self.bucket_bytes)

    def _fill(self, bucket: list[tuple[str, torch.Tensor]], device: torch.device, slot: int = 0) -> Bucket:
        metadata = weight_wire.layout([n for n, _ in bucket], [t.dtype for _, t in bucket], [t.shape for _, t in bucket])
        flat = self._buffer(weight_wire.bucket_bytes(metadata), device, slot)
        return Bucket(flat, weight_wire.flatten_into(bucket, flat))

    def _filler(self, staged: Any, device: Optional[torch.device]) -> "_Filler":
        return _Filler(self, staged, device)

    def _kept_copy(self, bucket: Bucket) -> Bucket:
        if bucket.flat.device.type == "cpu" and self.keep:
            return bucket
        cpu = weight_wire.new_shared_bytes(bucket.flat.numel())
        cpu.copy_(bucket.flat)
        return Bucket(cpu, bucket.metadata)


class _Filler:
    """The buckets of a push, filled in order. On CPU the next bucket is filled on a thread while
    the current one is sent (two staging buffers alternate), so the trainer's copy overlaps the
    engines' load instead of adding to it; on an accelerator each bucket is filled when asked for
    (its copies are asynchronous already). A stream's buckets (:class:`_Streamed`) are filled when
    asked for, on the calling thread, into one staging buffer: its ``take`` may run a collective,
    and one bucket at a time is its memory bound. Use as ``async with``: leaving waits for a fill
    still running, so no thread writes into a buffer the next push reuses.

    Arguments:
        device: where the buckets are laid out; None (a stream only): where its tensors are.
    """

    def __init__(self, sync: _BucketedSync, staged: Any, device: Optional[torch.device]) -> None:
        self.sync, self.staged, self.device = sync, staged, device
        self.streamed = isinstance(staged, _Streamed)
        self.ahead: Optional[tuple[int, asyncio.Future]] = None

    def _fill(self, i: int) -> Bucket:
        if self.streamed:
            return self.staged.fill(i, lambda nbytes, device: self.sync._buffer(nbytes, self.device or device))
        bucket = self.staged[i]
        assert self.device is not None
        return bucket if isinstance(bucket, Bucket) else self.sync._fill(bucket, self.device, slot=i % 2)

    async def get(self, i: int) -> Bucket:
        """Bucket ``i`` filled; starts filling bucket ``i + 1`` (on CPU)."""
        if self.ahead is not None and self.ahead[0] == i:
            filled = await self.ahead[1]
        else:
            await self._settle()
            filled = self._fill(i)
        self.ahead = None
        if not self.streamed and self.device is not None and self.device.type == "cpu" and i + 1 < len(self.staged):
            self.ahead = (i + 1, asyncio.get_running_loop().run_in_executor(None, self._fill, i + 1))
        return filled

    async def _settle(self) -> None:
        if self.ahead is not None:
            future, self.ahead = self.ahead[1], None
            with contextlib.suppress(Exception):
                await asyncio.shield(future)

    async def __aenter__(self) -> "_Filler":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._settle()


class TensorWeightSync(_BucketedSync):
    """``tensor``: ``/update_weights_from_tensor``, one bucket at a time to every engine at once.

    CPU tensors go as handles to themselves (``(name, tensor)`` pairs, SGLang's default load
    format): the first push moves each tensor's storage into a named shared-memory file in place
    (the trainer's parameters then live there; same values, same tensors), and from then on the
    engines copy straight from them, with nothing copied on this side. That needs room in
    ``/dev/shm`` for the tensors; without it, and for CUDA tensors, buckets are flattened
    (``load_format="flattened_bucket"``) into staging memory. Each bucket's memory is kept until
    every engine has answered, then released (``torch.cuda.ipc_collect()`` on CUDA); with ``keep``
    a copy for replicas that restart is made while the engines load.

    Arguments:
        zero_copy: send CPU tensors as handles to themselves (above); False: always flatten.
    """

    kind = "tensor"

    def __init__(self, *args: Any, zero_copy: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.zero_copy = zero_copy

    async def _stage(self, named_tensors: Any, version: int) -> Any:
        return self._plan(named_tensors)  # filled one bucket at a time in _send

    async def _send(self, staged: Any, version: int, where: str) -> None:
        if isinstance(staged, _Streamed):  # flattened as taken, where the tensors are; never zero-copy
            await self._send_flattened(staged, None, version, where)
            return
        first = staged[0] if staged else None
        device = first.flat.device if isinstance(first, Bucket) else (first[0][1].device if first else torch.device("cpu"))
        if self.zero_copy and first is not None and not isinstance(first, Bucket) and _shareable(staged):
            await self._send_shared(staged, version, where)
            return
        await self._send_flattened(staged, device, version, where)

    async def _send_flattened(self, staged: Any, device: Optional[torch.device], version: int, where: str) -> None:
        kept: list[Bucket] = []
        async with self._filler(staged, device) as fills:
            for i in range(len(staged)):
                filled = await fills.get(i)
                await self.send_bucket(filled, version, where)
                if self.keep:
                    kept.append(self._kept_copy(filled))
                if filled.flat.is_cuda:
                    del filled
                    torch.cuda.ipc_collect()  # the engines have dropped their handles: free the memory
        self._kept = kept

    async def _send_shared(self, staged: Sequence[list[tuple[str, torch.Tensor]]], version: int, where: str) -> None:
        loop = asyncio.get_running_loop()
        # Into shared memory first, here (the serialiser would do it too): a storage must not move
        # while the thread below copies from it.
        for _, tensor in (pair for bucket in staged for pair in bucket):
            storage = tensor.untyped_storage()
            if not storage.is_shared():
                storage._share_filename_cpu_()
        kept: list[Bucket] = []
        for bucket in staged:
            # The copy kept for restarts is made on a thread while the engines copy the same tensors.
            keeping = loop.run_in_executor(None, self._fill, bucket, torch.device("cpu")) if self.keep else None
            try:
                await self.send_pairs(bucket, version, where)
            finally:
                if keeping is not None:
                    kept.append(await keeping)
        self._kept = kept

    async def send_pairs(self, bucket: Sequence[tuple[str, torch.Tensor]], version: int, where: str) -> None:
        """``(name, tensor)`` pairs to every serving engine at once, as handles to the tensors' own
        (shared) memory; returns when each has answered."""
        tp = dict(zip(self.client.worker_urls, await self.tp_sizes(self.client.worker_urls)))
        pairs = [(n, t.detach()) for n, t in bucket]

        def body(url: str) -> dict[str, Any]:
            payloads = [weight_wire.serialize(pairs) for _ in range(tp.get(url, 1))]
            return {"serialized_named_tensors": payloads, "flush_cache": self.flush_in_update,
                    "abort_all_requests": False, "weight_version": _label(version)}

        await self._update_all("/update_weights_from_tensor", body, where)

    async def send_bucket(self, bucket: Bucket, version: int, where: str) -> None:
        """One bucket to every serving engine at once; returns when each has answered."""
        tp = dict(zip(self.client.worker_urls, await self.tp_sizes(self.client.worker_urls)))

        def body(url: str) -> dict[str, Any]:
            # One payload per TP rank of this engine: each rank maps (and releases) its own.
            payloads = [weight_wire.serialize_bucket(bucket.flat, bucket.metadata) for _ in range(tp.get(url, 1))]
            return {"serialized_named_tensors": payloads, "load_format": "flattened_bucket",
                    "flush_cache": self.flush_in_update, "abort_all_requests": False, "weight_version": _label(version)}

        await self._update_all("/update_weights_from_tensor", body, where)


def _shareable(buckets: Sequence[list[tuple[str, torch.Tensor]]]) -> bool:
    """Every tensor is a contiguous CPU tensor whose storage is in shared memory already or fits in
    what ``/dev/shm`` has free (with a quarter to spare): then it can travel as a handle to itself."""
    storages: dict[int, torch.UntypedStorage] = {}
    for _, tensor in (pair for bucket in buckets for pair in bucket):
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return False
        storage = tensor.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
    need = sum(s.nbytes() for s in storages.values() if not s.is_shared())
    if not need:
        return True
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return False
    return need <= 0.75 * stat.f_bavail * stat.f_frsize


def _where(version: Optional[int], step: Optional[int]) -> str:
    """What an error of a push names: its step, else its weight version."""
    return f"step {step}" if step is not None else (f"weight version {version}" if version is not None
                                                    else "a weight update")


def _label(version: Optional[int]) -> Optional[str]:
    """The weight version label SGLang takes (a string); None leaves the engines' label as it is."""
    return None if version is None else str(version)


# ---------------------------------------------------------------------------------- disk


class DiskWeightSync(WeightSync):
    """``disk``: a Hugging Face directory (safetensors shards of at most ``bucket_bytes`` each and
    ``model.safetensors.index.json``) that every engine loads with ``/update_weights_from_disk``.
    The directory is removed after the push unless it is kept for restarts."""

    kind = "disk"
    bracketed = False  # SGLang's disk update is self-contained (no begin/end bracket)

    async def _stage(self, named_tensors: Any, version: int) -> Any:
        from safetensors.torch import save_file

        streamed = isinstance(named_tensors, _Streamed)
        if not streamed:
            named_tensors = unique_tensors(named_tensors)
        root = self.work_dir
        if root:
            os.makedirs(root, exist_ok=True)
        directory = tempfile.mkdtemp(prefix=f"v{version}-", dir=root)
        try:
            shards = named_tensors if streamed else weight_wire.plan_buckets(named_tensors, self.bucket_bytes)
            weight_map = {}
            for i in range(len(shards)):
                file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                tensors = {}
                if streamed:  # taken here, on the calling thread, one at a time (each moved off its device at once)
                    for spec, tensor in named_tensors.tensors(i):
                        tensors[spec.name] = tensor.detach().contiguous().cpu()
                        del tensor
                else:
                    tensors = {n: t.detach().contiguous().cpu() for n, t in shards[i]}
                # The write runs on a thread; the shard's tensors (at most one bucket) are dropped after it.
                await asyncio.get_running_loop().run_in_executor(None, save_file, tensors, os.path.join(directory, file),
                                                                 {"format": "pt"})
                weight_map.update(dict.fromkeys(tensors, file))
                del tensors
            total = named_tensors.nbytes if streamed else sum(t.numel() * t.element_size()
                                                              for t in named_tensors.values())
            with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return directory

    async def _send(self, staged: Any, version: int, where: str) -> None:
        body = {"model_path": staged, "flush_cache": self.flush_in_update, "abort_all_requests": False,
                "weight_version": _label(version)}
        await self._update_all("/update_weights_from_disk", lambda url: body, where)

    def _keep(self, staged: Any, version: int) -> Optional[KeptWeights]:
        if self.keep:
            return KeptWeights("disk", version, path=staged)
        self._discard(staged)
        return None

    def _discard(self, staged: Any) -> None:
        if staged is not None:
            shutil.rmtree(staged, ignore_errors=True)


# ---------------------------------------------------------------------------------- building


def make_weight_sync(kind: str, client: Any, **kwargs: Any) -> WeightSync:
    """The :class:`WeightSync` of the registered path ``kind`` over ``client`` (an ``SGLangClient``)."""
    return WEIGHT_PATHS.get(kind).make(client, **kwargs)


TENSOR = WeightPath(name="tensor", make=TensorWeightSync, client_method="update_weights_from_tensor")
"""``rollout.weight_sync: tensor``: buckets of tensors in the update request (engines on this host)."""
DISK = WeightPath(name="disk", make=DiskWeightSync, client_method="update_weights_from_disk")
"""``rollout.weight_sync: disk``: a Hugging Face directory the engines load."""


async def push_kept(kept: KeptWeights, client: Any, timeout_s: float = 120.0, path: Optional[str] = None) -> None:
    """Load ``kept`` into the engines of ``client`` (a restarted replica, not serving yet) with the
    same code as a push: its buckets over the ``tensor`` path (it runs on this host; ``path``
    ``distributed`` for one on another node), or its directory over its own path (``disk``;
    ``adapter``, a LoRA adapter's directory)."""
    sync = make_weight_sync(kept.kind if kept.path is not None else (path or "tensor"), client, timeout_s=timeout_s,
                            pause_mode=None)
    try:
        if kept.path is None and path == "distributed":  # a group with the one engine, the tensors broadcast
            await sync.push(dict(kept.named_tensors()), kept.version)
        else:
            staged = kept.path if kept.path is not None else kept.buckets
            await sync._deliver(staged, kept.version, f"weight version {kept.version}")
    finally:
        leave = getattr(sync, "leave", None)
        if leave is not None:  # no weight-update group (or its port) outlives the join
            await leave()
        await sync.rpc.close()  # the caller's client stays the caller's
