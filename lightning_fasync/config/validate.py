"""``validate()``: refuse every combination the spec forbids, before any thread, process or engine
starts, with one sentence naming the key, the value given and the rule. A name that selects a
registered entry (window, engine backend, weight-sync path) is checked against its registry
(:mod:`lightning_fasync.registry`), and the entry's own ``check_config`` runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from typing import Sequence

from lightning_fasync.config.schema import DataSourceConfig, FasyncConfig, SGLangArgs, VLLMArgs
from lightning_fasync.errors import ConfigError, ConfigWarning
from lightning_fasync.registry import ENGINE_BACKENDS, WEIGHT_PATHS, WINDOWS, weight_sync_choices

__all__ = [
    "validate_backend",
    "import_plugins",
    "colocate_offload_enabled",
    "check_offload",
    "validate",
]


def validate_backend(cfg: FasyncConfig) -> None:
    """Refuse a ``rollout.backend`` configuration that cannot run (part of :func:`validate`; what
    depends on this host, the model, CUDA and SGLang, is checked when the run starts, by
    the backend's ``prepare``).

    Raises:
        ConfigError: one sentence naming the key, the value given and the rule.
    """
    ro, sa = cfg.rollout, cfg.rollout.sglang_args
    ENGINE_BACKENDS.get(ro.backend)  # a name not registered is refused, naming the key and the names there are
    if ro.backend != "external":
        for key in ("engine_urls", "router_url"):
            if getattr(ro, key):
                raise ConfigError(
                    f"`rollout.{key}` is {getattr(ro, key)!r} while `rollout.backend` is {ro.backend}; it names servers "
                    "someone else runs, read only with rollout.backend: external."
                )
    if ro.backend != "sglang":
        defaults = SGLangArgs()
        for key in ("mem_fraction_static", "skip_server_warmup", "weight_version", "port", "extra"):
            if getattr(sa, key) != getattr(defaults, key):
                raise ConfigError(
                    f"`rollout.sglang_args.{key}` is {getattr(sa, key)!r} while `rollout.backend` is {ro.backend}; it "
                    "is an argument of the SGLang servers the plugin launches, used only with rollout.backend: sglang."
                )
    if ro.backend != "vllm":
        defaults_v = VLLMArgs()
        for key in (f.name for f in dataclasses.fields(VLLMArgs)):
            if getattr(ro.vllm_args, key) != getattr(defaults_v, key):
                raise ConfigError(
                    f"`rollout.vllm_args.{key}` is {getattr(ro.vllm_args, key)!r} while `rollout.backend` is {ro.backend}; "
                    "it is an argument of the vLLM servers the plugin launches, used only with rollout.backend: vllm."
                )
    backend = ENGINE_BACKENDS.get(ro.backend)
    if backend.check_config is not None:
        backend.check_config(cfg)


def import_plugins(modules: Sequence[str]) -> None:
    """Import the modules of ``fully_async.plugins``, so that what they register (a window, a weight
    path, a trainer backend) is there before the config is checked or the command line read.

    Raises:
        ConfigError: a module that cannot be imported.
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(
                f"`fully_async.plugins` lists {module!r}, which cannot be imported ({exc}); "
                "each entry must be an importable Python module."
            ) from exc


def colocate_offload_enabled(cfg: FasyncConfig, device_type: str) -> bool:
    """Whether the colocate step offloads (``colocate_offload``) for a trainer on ``device_type``
    (``cuda``, ``cpu``, ...): never outside colocate mode; ``auto`` exactly on CUDA."""
    if cfg.fully_async.enable or not cfg.colocate:
        return False
    if cfg.colocate_offload == "auto":
        return device_type == "cuda"
    return cfg.colocate_offload is True


def check_offload(cfg: FasyncConfig, offload: bool) -> None:
    """Refuse what colocate offload (``offload``: resolved for the trainer's device, where the caller
    knows it) cannot do: a frozen tail (colocate with ``weight_update_mode: inflight``), as offloading
    hands the engines' KV cache to the trainer, which the requests frozen through training still
    hold; and ``rollout.check_weights``, whose probe is a request that needs that cache right after
    the sync, before the engines take it back."""
    if not offload:
        return
    value = "true" if cfg.colocate_offload is True else f"{cfg.colocate_offload}, on for a CUDA trainer,"
    if not cfg.fully_async.enable and cfg.boundary_mode == "inflight":
        raise ConfigError(
            f"`colocate_offload` is {value} while `rollout.weight_update_mode` is inflight; offloading hands the "
            "engines' KV cache to the trainer, which the requests frozen through training still hold: set "
            "colocate_offload: false, or weight_update_mode: abort."
        )
    if cfg.rollout.check_weights:
        raise ConfigError(
            f"`colocate_offload` is {value} while `rollout.check_weights` is true; the check's probe is a request, "
            "and the offloaded engines take their KV cache back only after the sync: set one of them false."
        )


def validate(cfg: FasyncConfig) -> FasyncConfig:
    """Refuse every combination the spec forbids; warn on what it recommends against.

    Each group's own rules are its ``check()`` (beside its fields in
    :mod:`~lightning_fasync.config.schema`); here are the rules across groups and the names the
    registries hold.

    Raises:
        ConfigError: one sentence naming the key, the value given and the rule.
    """
    import_plugins(cfg.fully_async.plugins)
    fa = cfg.fully_async
    sources = cfg.sources
    if not sources:
        raise ConfigError("`data_sources` is empty; at least one data source is required.")
    for i, src in enumerate(sources):
        src.check("data_source" if cfg.data_sources is None else f"data_sources[{i}]")
    cfg.trainer.check()
    fa.check()
    WINDOWS.get(fa.sliding_window)  # a name not registered is refused, naming the key and the names there are
    if cfg.run_mode != "default":
        raise ConfigError(
            f"`run_mode` is {cfg.run_mode!r}; lightning-fasync runs only the default mode "
            "(train-only and rollout-only are not supported)."
        )
    if len(sources) != 1:
        raise ConfigError(
            f"`data_sources` lists {len(sources)} sources; lightning-fasync reads exactly one data source "
            "(B, N, prompts and reward all come from it)."
        )
    if cfg.data_sources is not None and cfg.data_source not in (DataSourceConfig(), sources[0]):
        differs = next(f.name for f in dataclasses.fields(DataSourceConfig)
                       if getattr(cfg.data_source, f.name) != getattr(sources[0], f.name))
        raise ConfigError(
            f"`data_source.{differs}` is {getattr(cfg.data_source, differs)!r} but `data_sources[0].{differs}` is "
            f"{getattr(sources[0], differs)!r}; `data_sources` replaces `data_source`, so give the source in one of them."
        )
    cfg.rollout.check()
    B, N, M = cfg.B, cfg.N, cfg.M
    if (B * N) % M != 0:
        raise ConfigError(
            f"`trainer.mini_batch_size` is {M}, which does not divide B x N = {B} x {N} = {B * N}; "
            "B x N must be divisible by M."
        )
    if M < N:
        raise ConfigError(
            f"`trainer.mini_batch_size` is {M}, smaller than N = {N} trajectories per prompt; "
            "each training call fetches M // N >= 1 complete groups."
        )
    cfg.algorithm.check()
    if cfg.algorithm.m2po.enable and cfg.trainer.use_rollout_log_probs:
        raise ConfigError(
            "`algorithm.m2po.enable` is true while `trainer.use_rollout_log_probs` is true; "
            "M2PO compares old and rollout log-probs and cannot be used with rollout log-probs as the old policy."
        )
    if cfg.algorithm.prox_logp_method != "recompute" and cfg.trainer.use_rollout_log_probs:
        raise ConfigError(
            f"`algorithm.prox_logp_method` is {cfg.algorithm.prox_logp_method} while `trainer.use_rollout_log_probs` is "
            "true; the old policy is then the engine's log-probs, so there is nothing to interpolate: use recompute."
        )
    cfg.agentflow.check()
    validate_backend(cfg)
    if cfg.rollout.weight_sync not in weight_sync_choices():
        raise ConfigError(
            f"`rollout.weight_sync` is {cfg.rollout.weight_sync!r}; it must be one of {', '.join(weight_sync_choices())}."
        )
    if cfg.rollout.weight_sync != "auto":
        path = WEIGHT_PATHS.get(cfg.rollout.weight_sync)
        if path.check_config is not None:
            path.check_config(cfg)
    if fa.enable:
        if cfg.colocate:
            raise ConfigError(
                "`colocate` is true while `fully_async.enable` is true; fully-async mode needs separate "
                "trainer and rollout resources, so set colocate: false."
            )
        if cfg.rollout.sampler.num_oversample != 0:
            raise ConfigError(
                f"`rollout.sampler.num_oversample` is {cfg.rollout.sampler.num_oversample} while "
                "`fully_async.enable` is true; it must be 0, extra in-flight capacity comes from fully_async.stale_steps."
            )
    if cfg.rollout.inflight_kv != "keep" and cfg.boundary_mode != "inflight":
        raise ConfigError(
            f"`rollout.inflight_kv` is {cfg.rollout.inflight_kv} while `fully_async.enable` is false and "
            "`rollout.weight_update_mode` is auto; colocate reads auto as abort, and inflight_kv applies to in-flight "
            "updates only: leave it at keep, or set weight_update_mode: inflight."
        )
    offload = cfg.colocate_offload
    if offload not in (True, False, "auto"):
        raise ConfigError(f"`colocate_offload` is {offload!r}; it must be true, false or auto.")
    check_offload(cfg, offload is True)
    if offload is True and (fa.enable or not cfg.colocate):
        on = "`fully_async.enable` is true" if fa.enable else "`colocate` is false"
        raise ConfigError(
            f"`colocate_offload` is true while {on}; offloading only applies when rollout and training take turns on "
            "shared devices (colocate: true, fully_async.enable: false)."
        )
    if M % N != 0:
        warnings.warn(
            f"`trainer.mini_batch_size` is {M}, not a multiple of N = {N}; the spec recommends M % N == 0 "
            f"(each call trains M // N = {M // N} groups, i.e. {(M // N) * N} trajectories).",
            ConfigWarning,
            stacklevel=2,
        )
    cfg.eval.check()
    return cfg
