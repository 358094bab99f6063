"""The ``vllm`` weight-sync path: vLLM's own RL API (docs/weight_sync.md, docs/backends.md "vLLM").

Every push is the sequence a vLLM trainer makes on GPUs, over the ``fasync-gloo`` transfer engine
this package registers with vLLM (:mod:`lightning_fasync.weights.vllm_plugin`):

1. ``POST /pause?mode=abort`` on every server (the controller has already stopped dispatch and
   settled its in-flight requests: with ``rollout.partial`` the aborted ones come back with the
   tokens they have, and resume from them after the update);
2. ``POST /start_weight_update``;
3. per bucket, ``POST /update_weights`` (``update_info``: names, dtypes, shapes, the bucket's sha256)
   to every server while trainer rank 0 broadcasts the flattened bucket over the group that
   ``POST /init_weight_transfer_engine`` formed (once, and again when the serving set changes);
4. ``POST /finish_weight_update`` with the new ``weight_version`` (vLLM labels every token it
   samples afterwards with it: the per-token versions of ``/inference/v1/generate``);
5. ``POST /reset_prefix_cache`` (no KV of the old weights is reused), then ``POST /resume``;
6. with ``rollout.vllm_args.check_weights``, every server's log-probs of a fixed 16-token probe
   (``/v1/completions`` with ``prompt_logprobs``, a request, so after the resume) against the same
   log-probs computed here from the pushed tensors (:func:`reference_logprobs`).

A failed step leaves the servers paused and raises :class:`~lightning_fasync.weights.sync.WeightSyncError`
naming the server and the step, as the other paths do.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Mapping, Optional, Sequence

import torch

from lightning_fasync.pipeline.engine_client import SKIPPED, EngineError
from lightning_fasync.registry import WeightPath
from lightning_fasync.weights import wire as weight_wire
from lightning_fasync.weights.group import DistributedWeightSync
from lightning_fasync.weights.probe import probe_reference, tolerance_for
from lightning_fasync.weights.sync import Bucket, WeightSyncError, _label

VLLM_PAUSE_MODES = {"abort": "mode=abort", "in_place": "mode=keep&clear_cache=false",
                    "retract": "mode=keep&clear_cache=true"}
"""The weight syncs' pause modes as vLLM 0.32's ``/pause`` query. Its ``keep`` freezes the running
requests; with ``clear_cache`` (its default) the engine then resets its prefix cache with
``reset_running_requests``, which preempts them: their KV is recomputed on resume (SGLang's
``retract``). Only ``clear_cache=false`` keeps it (``in_place``)."""

async def served_logprobs(client: Any, url: str, ids: Sequence[int], timeout_s: float,
                          model_name: Optional[str] = None) -> list[float]:
    """The same log-probs as one vLLM server computes them (``/v1/completions`` with
    ``prompt_logprobs``), under the served model, or the loaded LoRA adapter ``model_name``."""
    name = model_name
    if name is None:
        model = await client._request("GET", url + "/v1/models", timeout=timeout_s)
        name = model["data"][0]["id"]
    answer = await client._request("POST", url + "/v1/completions", {
        "model": name, "prompt": list(ids), "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}, timeout=timeout_s)
    entries = answer["choices"][0]["prompt_logprobs"][1:]
    return [float(entry[str(token)]["logprob"]) for entry, token in zip(entries, ids[1:])]


class VLLMWeightSync(DistributedWeightSync):
    """``vllm``: vLLM's RL API over the ``fasync-gloo`` transfer engine (module docstring).

    Arguments (beyond :class:`~lightning_fasync.weights.group.DistributedWeightSync`'s):
        model: the policy (a preset or a Hugging Face directory), for the check.
        check_weights: after each push, compare every server's log-probs of a fixed probe with the
            pushed weights' own (:func:`reference_logprobs`); needs ``model``.
        dtype: the servers' weight dtype (``rollout.vllm_args.dtype``), for the check's tolerance.
    """

    kind = "vllm"
    pause_modes = tuple(VLLM_PAUSE_MODES)

    def __init__(self, *args: Any, model: Optional[str] = None, check_weights: bool = True, dtype: Any = "float32",
                 **kwargs: Any) -> None:
        kwargs["flatten"] = True  # one uint8 broadcast per bucket, checked by its digest
        super().__init__(*args, **kwargs)
        self.model = model
        self.check_weights = check_weights and model is not None
        self.dtype = weight_wire.parse_dtype(dtype) if isinstance(dtype, str) else dtype
        self._pushed: Optional[Mapping[str, torch.Tensor]] = None

    # ------------------------------------------------------------------ vLLM's calls

    def _init_request(self, host: str, port: int, rank_offset: int, world_size: int, name: str,
                      backend: str) -> tuple[str, dict[str, Any]]:
        return "/init_weight_transfer_engine", {"init_info": {
            "master_address": host, "master_port": port, "rank_offset": rank_offset, "world_size": world_size,
            "group_name": name, "timeout_s": self.timeout_s}}

    def _bucket_request(self, filled: Bucket, version: Optional[int]) -> tuple[str, dict[str, Any]]:
        meta = filled.metadata
        return "/update_weights", {"update_info": {
            "names": [m.name for m in meta], "dtype_names": [weight_wire.dtype_name(m.dtype) for m in meta],
            "shapes": [list(m.shape) for m in meta], "sha256": weight_wire.bucket_sha256(filled.flat)}}

    def _destroy_request(self, name: str) -> tuple[str, dict[str, Any]]:
        return "/shutdown_weight_transfer_engine", {}

    @staticmethod
    def _answer_ok(result: Any) -> bool:
        # vLLM answers 200 with {"message": ...}; a failure is an HTTP error, raised by the client.
        return isinstance(result, dict) and "error" not in result

    size_query = ("/get_world_size?include_dp=false", "world_size")  # vLLM's workers per server (TP x PP)

    # ------------------------------------------------------------------ the sequence

    async def push(self, named_tensors: Any, version: Optional[int], step: Optional[int] = None) -> Any:
        self._pushed = named_tensors if isinstance(named_tensors, Mapping) else None
        try:
            return await super().push(named_tensors, version, step)
        finally:
            self._pushed = None

    async def _deliver(self, staged: Any, version: Optional[int], where: str) -> None:
        await self.connect()
        mode = VLLM_PAUSE_MODES.get(self.pause_mode) if self.pause_mode is not None else None
        if mode is not None:
            await self._all(f"/pause?{mode}", None, where, "pause")
        started = False
        try:
            if self.members:
                await self._all("/start_weight_update", {}, where, "start_weight_update")
                started = True
            await self._send(staged, version, where)
            if started:
                started = False
                await self._all("/finish_weight_update", {"weight_version": _label(version)}, where, "finish_weight_update")
        finally:
            if started:  # a failed push: end the session so the next one can start; stay paused
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._all("/finish_weight_update", {}, where, "finish_weight_update"), 10)
        # Frozen requests (in_place: vLLM's keep) hold their blocks, so the cache cannot be reset;
        # servers this plugin starts then run without prefix caching (VLLMPool.prefix_caching).
        if self.members and self.pause_mode != "in_place":
            await self._all("/reset_prefix_cache", None, where, "reset_prefix_cache")
        if mode is not None:
            await self._all("/resume", None, where, "resume")
        if self.check_weights and self.members:  # the probe is a request: a paused server holds it
            await self.check_served(where)

    async def _all(self, path: str, body: Optional[dict[str, Any]], where: str, what: str) -> list[Any]:
        """One admin call to every serving server, bounded by the push's timeout; SKIPPED ones left out."""
        try:
            results = await asyncio.gather(*(self.client._on_worker(u, self.rpc._request(
                "POST", u + path, body, timeout=self.timeout_s, timeout_key=self.timeout_key)) for u in self.client.worker_urls))
        except EngineError as exc:
            raise WeightSyncError(f"The weight sync of {where} failed at {what}: {exc}") from exc
        return [r for r in results if r is not SKIPPED]

    def pushed_tensors(self) -> Optional[Mapping[str, torch.Tensor]]:
        """The tensors of the push under way: its kept copy, else the mapping given (None for a
        stream that is not kept: its tensors are gone once sent)."""
        kept = getattr(self, "_kept", None)
        if kept:
            return {n: t for b in kept for n, t in b.named_tensors()}
        return self._pushed

    async def check_served(self, where: str) -> None:
        """Every serving server's log-probs of the probe against the pushed weights' own (the
        servers repack some parameters, so their ``/weight_checker`` digests are not the trainer's).

        Raises:
            WeightSyncError: a server computes other log-probs (naming it, the largest difference and the tolerance).
        """
        named = self.pushed_tensors()
        probe = None if named is None or self.model is None else await probe_reference(self.model, named)
        if probe is None:
            return
        ids, reference = probe
        tolerance = tolerance_for(self.dtype)

        async def served_by(url: str) -> tuple[list[float], float]:
            return await served_logprobs(self.rpc, url, ids, self.timeout_s), tolerance

        await self.hold_probe(
            list(self.members), served_by, reference, where, "`rollout.vllm_args.check_weights`",
            lambda url, worst, tol: f"the server {url} does not hold the trainer's weights: its log-probs of a "
                                    f"{len(ids)}-token probe differ from the pushed weights' by up to {worst:.3g} "
                                    f"(tolerance {tol:g}, served as {self.dtype})")


def check_vllm_path(cfg: Any) -> None:
    """``rollout.weight_sync: vllm`` needs vLLM servers (``rollout.backend: vllm``, or external ones
    speaking vLLM's API)."""
    from lightning_fasync.errors import ConfigError

    if cfg.rollout.backend not in ("vllm", "external"):
        raise ConfigError(
            f"`rollout.weight_sync` is vllm while `rollout.backend` is {cfg.rollout.backend}; the vllm path speaks "
            "vLLM's RL API, set rollout.backend: vllm (or external, for vLLM servers someone else runs)."
        )
    check_vllm_pause(cfg)


def check_vllm_pause(cfg: Any) -> None:
    """Warn that external vLLM servers need ``--no-enable-prefix-caching`` for in-flight updates that
    keep the KV cache (frozen requests hold their blocks, so the prefix cache cannot be reset)."""
    if cfg.rollout.boundary_mode == "inflight" and cfg.rollout.inflight_kv == "keep" and cfg.rollout.backend == "external":
        import warnings

        from lightning_fasync.errors import ConfigWarning

        warnings.warn("`rollout.weight_update_mode` is inflight with external vLLM servers: start them with "
                      "--no-enable-prefix-caching, or a new request may reuse a prefix the old weights computed.",
                      ConfigWarning, stacklevel=2)


VLLM = WeightPath(
    name="vllm", make=VLLMWeightSync, client_method="update_weights_from_vllm", check_config=check_vllm_path,
    options=lambda cfg, model: {"model": model, "check_weights": cfg.rollout.vllm_args.check_weights,
                                "dtype": cfg.rollout.vllm_args.dtype},
)
"""``rollout.weight_sync: vllm`` (``auto`` with ``rollout.backend: vllm``): vLLM's RL API."""
