"""``rollout.weight_sync: adapter``: only the LoRA adapter goes to the engines (docs/lora.md).

With ``model.lora.sync: adapter`` the module's ``engine_state_dict()`` is an
:class:`~lightning_fasync.lora.AdapterWeights` (the adapter's A and B tensors in peft's saved
naming, and its ``adapter_config.json``). A push writes it in peft's saved format
(``adapter_config.json`` + ``adapter_model.safetensors``, the directory SGLang, vLLM and
``peft.PeftModel.from_pretrained`` load) into each engine's LoRA directory (``lora_dir`` of its
``/server_info``: the embedded engine loads adapters from there only; elsewhere the run's weights
directory), then, per engine, with SGLang 0.5.23's API: ``/unload_lora_adapter`` of the previous
adapter (one that was not loaded, as after a restart, is no error), ``/load_lora_adapter`` under the
same name, ``/update_weight_version`` with the step's version. Pause, flush and continue are every
path's (:class:`~lightning_fasync.weights.sync.WeightSync`); there is no begin/end bracket (SGLang's
adapter loads are self-contained). The directories are removed once every engine has loaded them.

For a replica that restarts (a supervised pool), the push is kept as :class:`AdapterKept`: a copy of
the adapter directory and references to the trainer's frozen base weights, whose ``named_tensors()``
are what the replica holds once it has loaded the adapter onto its base (the engine's own merge,
:func:`~lightning_fasync.lora.merged_weights`), for the pool's checksum check.

The embedded engine merges the loaded adapter into the weights it serves to every request
(``lightning_fasync/engine/lora.py``). vLLM (``rollout.backend: vllm``) applies an adapter only to
requests that name it: its servers run with ``--enable-lora`` and the runtime LoRA endpoints, a
push is vLLM 0.32's ``/v1/load_lora_adapter`` under a name per version
(:meth:`~lightning_fasync.fleet.vllm.VLLMClient.swap_lora_adapter`), after which every rollout
request names it as its ``model`` and the previous one is unloaded (``commit_lora_adapter``).
SGLang (``rollout.backend: sglang``) is started with ``--enable-lora`` and every ``/generate`` names
the adapter (``lora_path``). Servers someone else runs are refused (:func:`check_adapter_config`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from lightning_fasync.config import ConfigError
from lightning_fasync.lora import AdapterWeights, merged_weights, read_adapter_dir, write_adapter_dir
from lightning_fasync.registry import WeightPath
from lightning_fasync.pipeline.engine_client import SKIPPED, EngineError
from lightning_fasync.weights.sync import KeptWeights, WeightSync, WeightSyncError

__all__ = ["ADAPTER", "DEFAULT_LORA_NAME", "AdapterKept", "AdapterWeightSync", "check_adapter_config"]

DEFAULT_LORA_NAME = "policy"
"""The name the trainer's adapter is loaded under on every engine."""


@dataclass
class AdapterKept(KeptWeights):
    """The last adapter push, kept for a replica that restarts: ``path`` is a copy of its adapter
    directory, ``base`` the frozen base weights (the trainer's own tensors, not copies: a LoRA run
    never changes them)."""

    base: Optional[Mapping[str, torch.Tensor]] = None

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """What a replica started from the base model holds after loading the adapter (Hugging Face names)."""
        if self.base is None or self.path is None:
            raise RuntimeError("This kept adapter has no base weights or no directory (released?).")
        config, tensors = read_adapter_dir(self.path)
        return merged_weights(self.base, config, tensors)


class AdapterWeightSync(WeightSync):
    """``adapter``: the LoRA adapter in peft's saved format, loaded with ``/load_lora_adapter`` (module docstring).

    Arguments:
        lora_name: the name the adapter is loaded under.
    """

    kind = "adapter"
    bracketed = False  # SGLang's adapter loads are self-contained (no begin/end bracket)

    def __init__(self, *args: Any, lora_name: str = DEFAULT_LORA_NAME, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lora_name = lora_name

    async def _stage(self, named_tensors: Any, version: int) -> Any:
        if not isinstance(named_tensors, AdapterWeights):
            raise ValueError(
                "rollout.weight_sync: adapter sends a LoRA adapter, but the trainer gave full weights; build the module "
                "with model.lora.sync: adapter (its engine_state_dict() is then an AdapterWeights)."
            )
        limit = getattr(self.client, "max_lora_rank", None)
        rank = named_tensors.config.get("r")
        if limit is not None and isinstance(rank, int) and rank > limit:
            raise WeightSyncError(
                f"The trainer's adapter has rank {rank} (model.lora.r) and the servers accept at most {limit}: "
                f"set `{self.client.max_lora_rank_key}` to at least {rank}."
            )
        return named_tensors

    async def _send(self, staged: Any, version: Optional[int], where: str) -> None:
        if isinstance(staged, str):  # a kept push, delivered to a restarted replica
            config, tensors = await asyncio.get_running_loop().run_in_executor(None, read_adapter_dir, staged)
            staged = AdapterWeights(tensors, config)
        urls = list(self.client.worker_urls)
        roots = await self._roots(urls)
        written: dict[str, str] = {}
        loop = asyncio.get_running_loop()
        try:
            for root in sorted(set(roots.values())):
                os.makedirs(root, exist_ok=True)
                directory = tempfile.mkdtemp(prefix=f"adapter-v{version}-", dir=root)
                written[root] = directory
                await loop.run_in_executor(None, write_adapter_dir, dict(staged), staged.config, directory)
            swapped = await asyncio.gather(*(self._swap(url, written[roots[url]], version, where) for url in urls))
            try:
                await self.rpc.commit_lora_adapter(self.lora_name, version,
                                                   [u for u, r in zip(urls, swapped) if r is not SKIPPED],
                                                   self.timeout_s, self.timeout_key)
            except EngineError as exc:
                raise WeightSyncError(f"The weight sync of {where} failed: {exc}") from exc
        finally:
            for directory in written.values():  # every engine has read it (or failed)
                shutil.rmtree(directory, ignore_errors=True)

    def served_tensors(self, named_tensors: Any) -> Mapping[str, torch.Tensor]:
        """The base with the pushed adapter merged (what an engine serves once it loaded it)."""
        if named_tensors.base is None:
            raise WeightSyncError("`rollout.check_weights` needs the adapter's base weights (AdapterWeights.base), "
                                  "which this trainer did not give; set it false.")
        return merged_weights(named_tensors.base, named_tensors.config, named_tensors)

    def probe_lora_name(self) -> Optional[str]:
        return self.lora_name

    def _keep(self, staged: Any, version: int) -> Optional[KeptWeights]:
        if not self.keep:
            return None
        root = self.work_dir or tempfile.gettempdir()
        os.makedirs(root, exist_ok=True)
        directory = write_adapter_dir(dict(staged), staged.config, tempfile.mkdtemp(prefix=f"kept-adapter-v{version}-",
                                                                                     dir=root))
        return AdapterKept("adapter", version, path=directory, base=staged.base)

    async def _roots(self, urls: list[str]) -> dict[str, str]:
        """Each engine's directory to write the adapter into: its ``lora_dir`` (``/server_info``), else
        the run's weights directory (``work_dir``) or the system's temp dir."""
        fallback = os.path.join(self.work_dir or tempfile.gettempdir(), "adapters")

        async def one(url: str) -> tuple[str, str]:
            try:
                info = await self.client._request("GET", url + "/server_info", missing_ok=True)
            except Exception:  # noqa: BLE001 - an engine that does not say: the fallback
                info = None
            root = info.get("lora_dir") if isinstance(info, dict) else None
            return url, root if isinstance(root, str) and root else fallback

        return dict(await asyncio.gather(*(one(u) for u in urls)))

    async def _swap(self, url: str, directory: str, version: Optional[int], where: str) -> Any:
        """Load ``directory`` under the adapter's name on ``url`` and set the version, with the
        engine's own API (the client's ``swap_lora_adapter``: SGLang's unload and load, vLLM's
        load under the version's name)."""

        async def swap() -> None:
            try:
                await self.rpc.swap_lora_adapter(url, self.lora_name, directory, version, self.timeout_s,
                                                 self.timeout_key)
            except EngineError as exc:
                raise WeightSyncError(f"The weight sync of {where} failed: {exc}") from exc

        return await self.client._on_worker(url, swap())


def check_adapter_config(cfg: Any) -> None:
    """Refuse what the adapter path cannot run (part of ``config.validate``)."""
    ro = cfg.rollout
    backend = getattr(ro, "backend", "embedded")
    if backend not in ("embedded", "vllm", "sglang"):
        raise ConfigError(
            f"`rollout.weight_sync` is adapter while `rollout.backend` is {backend}; the plugin starts the embedded, "
            "sglang and vllm servers to serve every rollout request with the loaded adapter, servers someone else "
            "runs it cannot: use model.lora.sync: merged there."
        )
    if backend != "embedded" and getattr(ro, "boundary_mode", None) == "inflight":
        raise ConfigError(
            f"`rollout.weight_update_mode` is inflight while `rollout.weight_sync` is adapter on {backend}; a frozen "
            "request stays on the adapter it started with, which the push replaces: use weight_update_mode abort or wait."
        )
    if getattr(cfg, "colocate_offload", False) is True:
        raise ConfigError(
            "`colocate_offload` is true while `rollout.weight_sync` is adapter; engines that released their weights "
            "hold no base to load an adapter onto: use model.lora.sync: merged with colocate_offload."
        )


ADAPTER = WeightPath(name="adapter", make=AdapterWeightSync, client_method="update_lora_adapter",
                     check_config=check_adapter_config)
"""``rollout.weight_sync: adapter``: the LoRA adapter alone, loaded with ``/load_lora_adapter``."""
