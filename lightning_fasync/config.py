"""Typed configuration with the spec's names and defaults (spec section 1), and its validation.

Every group is a dataclass whose fields carry a docstring; jsonargparse reads them for ``--help``.
``validate()`` refuses every combination the spec forbids, before any thread, process or engine
starts, with one sentence naming the key, the value given and the rule.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Optional, Union


class ConfigError(ValueError):
    """A configuration the spec forbids. The message is one sentence: key, value, rule."""


class ConfigWarning(UserWarning):
    """A configuration the spec allows but recommends against."""


# --------------------------------------------------------------------------------------------
# Groups
# --------------------------------------------------------------------------------------------


@dataclass
class FullyAsyncConfig:
    """``fully_async.*``: the fully-async switch and scheduling (spec sections 1 and 3)."""

    enable: bool = False
    """Enable the fully-async pipeline: a background rollout producer, collector and PipelineBuffer."""
    sliding_window: str = "no-window"
    """Dispatch/collection strategy: no-window, window-gated, windowed-fifo, or a registered name."""
    stale_steps: float = 0.0
    """Extra pipeline capacity in training steps; capacity = int(B * (1 + stale_steps)). Must be >= 0."""
    plugins: list[str] = field(default_factory=list)
    """Python modules imported before validation, e.g. to register a custom sliding window."""
    fetch_timeout: float = 1800.0
    """Seconds the trainer waits for one mini-batch from the PipelineBuffer before it fails."""
    pause_timeout: float = 600.0
    """Seconds pause() waits for in-flight requests to be cancelled (partial) or to finish."""
    event_log: bool = True
    """Write the JSONL event log (dispatch, complete, collect, consume, pause, resume, sync)."""


@dataclass
class DataSourceConfig:
    """``data_source.*``: one prompt source."""

    name: str = "default"
    """Name of the source (used in logs)."""
    num_prompts_per_step: int = 64
    """B: prompt groups consumed per training step; the sliding window's base batch size."""
    num_trajectories_per_prompt: int = 8
    """N: trajectories generated per prompt (one group)."""
    shuffle: bool = True
    """Shuffle prompts at each epoch (seeded by ``seed``)."""
    seed: int = 1234
    """Seed for the per-epoch shuffle."""
    task: str = "repeat"
    """Task that makes the prompts and scores the responses (``lightning_fasync.data.tasks``)."""
    task_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task (e.g. its length distribution)."""
    num_prompts: int = 4096
    """Prompts per epoch drawn from the task."""


@dataclass
class TrainerConfig:
    """``trainer.*``: the RL trainer's batch shape and resources (spec section 1)."""

    mini_batch_size: int = 64
    """M: trajectories per training call; each call fetches M // N complete groups."""
    num_nodes: int = 1
    """Nodes in the resident training pool."""
    num_gpus_per_node: int = 8
    """Training GPUs per node (on CPU: trainer processes per node)."""
    save_freq: int = 0
    """Save a checkpoint every this many rollout steps; 0 saves none periodically."""
    use_rollout_log_probs: bool = False
    """Use the engine's log-probs as the old policy instead of recomputing them on the trainer."""


@dataclass
class SGLangReplicaConfig:
    """One kind of rollout replica (``rollout.sglang_replicas.<kind>.*``)."""

    num_nodes: int = 1
    """Nodes hosting replicas of this kind."""
    num_gpus_per_replica: int = 4
    """GPUs per replica (tensor/expert parallel size). On CPU: cores per replica."""


@dataclass
class SamplerConfig:
    """``rollout.sampler.*``: synchronous dynamic sampling."""

    num_oversample: int = 0
    """Extra groups dispatched by synchronous dynamic sampling. Must be 0 in fully-async mode."""


@dataclass
class SGLangArgs:
    """``rollout.sglang_args.*``: arguments passed to every engine server."""

    max_running_requests: Optional[int] = None
    """Engine concurrency limit (SGLang ``--max-running-requests``); None keeps the engine default."""


@dataclass
class RolloutConfig:
    """``rollout.*``: the rollout pool and step-boundary behaviour (spec section 1)."""

    num_gpus_per_node: int = 8
    """GPUs per node in the resident rollout pool."""
    sglang_replicas: dict[str, SGLangReplicaConfig] = field(
        default_factory=lambda: {"regular": SGLangReplicaConfig()}
    )
    """Replica kinds; total rollout GPUs = sum over kinds of num_nodes * rollout.num_gpus_per_node."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """Synchronous dynamic sampling."""
    partial: bool = False
    """At a step boundary, abort in-flight requests and recycle complete groups (true) or wait (false)."""
    mask_offpolicy_in_partial_rollout: bool = False
    """On restore, loss-mask response tokens generated by older weight versions. Needs partial."""
    sglang_args: SGLangArgs = field(default_factory=SGLangArgs)
    """Engine server arguments."""
    max_response_length: int = 1024
    """Maximum number of response tokens per trajectory."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    filter: Optional[str] = None
    """``module:function`` called on each complete group by the collector; False drops it."""
    max_consecutive_failed_groups: int = 16
    """Fail the run after this many consecutive groups with a failed trajectory (engine down)."""


@dataclass
class RouterConfig:
    """``agentflow.router.*``."""

    max_connections: int = 512
    """Concurrent requests the agent flow keeps open to the router (or single engine)."""


@dataclass
class AgentFlowConfig:
    """``agentflow.*``: how prompts become engine requests."""

    router: RouterConfig = field(default_factory=RouterConfig)
    """Router connection limits."""


@dataclass
class M2POConfig:
    """``algorithm.m2po.*`` (Second-Moment Trust Policy Optimization)."""

    enable: bool = False
    """Mask the tokens with the largest second moment of old_log_probs - rollout_log_probs."""
    tau: float = 0.04
    """Keep tokens until the mean second moment over kept tokens is <= tau."""


@dataclass
class OPSMConfig:
    """``algorithm.opsm.*`` (Off-Policy Sequence Masking, DeepSeek-V3.2)."""

    enable: bool = False
    """Mask a sequence whose advantage is negative and whose mean behaviour/current KL exceeds delta."""
    delta: float = 1e-4
    """KL threshold per sequence (mean over its response tokens)."""


@dataclass
class ISCorrectionConfig:
    """``algorithm.is_correction.*``: importance sampling between rollout and trainer old policy."""

    enable: bool = False
    """Reweight by pi_old / pi_rollout (truncated IS, Yao et al.)."""
    level: str = "token"
    """token or sequence: where the ratio is computed."""
    mode: str = "truncate"
    """truncate: min(ratio, c); mask: drop tokens/sequences outside [c_low, c_high]."""
    c: float = 2.0
    """Truncation cap for mode truncate."""
    c_low: float = 0.5
    """Lower bound for mode mask."""
    c_high: float = 2.0
    """Upper bound for mode mask."""


@dataclass
class AlgorithmConfig:
    """``algorithm.*``: advantages, policy loss and off-policy protection (spec sections 1, 5.1)."""

    advantage_norm_std: bool = True
    """GRPO: divide group-relative advantages by the group's reward std."""
    clip_low: float = 0.2
    """PPO lower clip: ratio >= 1 - clip_low."""
    clip_high: float = 0.28
    """PPO upper clip (clip-higher): ratio <= 1 + clip_high."""
    dual_clip: Optional[float] = 3.0
    """Dual-clip bound c for negative advantages (None disables)."""
    loss_agg_mode: str = "token-mean"
    """token-mean, seq-mean-token-sum, seq-mean-token-mean."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    kl_coef: float = 0.0
    """KL-to-reference penalty coefficient."""
    is_correction: ISCorrectionConfig = field(default_factory=ISCorrectionConfig)
    """Importance-sampling correction."""
    m2po: M2POConfig = field(default_factory=M2POConfig)
    """M2PO token masking."""
    opsm: OPSMConfig = field(default_factory=OPSMConfig)
    """OPSM sequence masking."""


@dataclass
class FasyncConfig:
    """The whole plugin configuration; key names follow the spec's section 1 table."""

    fully_async: FullyAsyncConfig = field(default_factory=FullyAsyncConfig)
    """Fully-async switch and scheduling."""
    colocate: bool = True
    """Rollout and trainer share one resource pool. Must be false for fully-async."""
    run_mode: str = "default"
    """Entry mode: default, train-only or rollout-only. Fully-async supports only default."""
    data_source: DataSourceConfig = field(default_factory=DataSourceConfig)
    """The data source (B and N)."""
    data_sources: Optional[list[DataSourceConfig]] = None
    """The data sources actually used; None means [data_source]."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """RL trainer batch shape and resources."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout pool and step-boundary behaviour."""
    agentflow: AgentFlowConfig = field(default_factory=AgentFlowConfig)
    """Agent flow and router limits."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, loss and off-policy corrections."""

    # ---- derived quantities -----------------------------------------------------------------

    @property
    def sources(self) -> list[DataSourceConfig]:
        return list(self.data_sources) if self.data_sources is not None else [self.data_source]

    @property
    def B(self) -> int:  # noqa: N802 - the spec's symbol
        return self.sources[0].num_prompts_per_step

    @property
    def N(self) -> int:  # noqa: N802
        return self.sources[0].num_trajectories_per_prompt

    @property
    def M(self) -> int:  # noqa: N802
        return self.trainer.mini_batch_size

    @property
    def capacity(self) -> int:
        """C = int(B * (1 + stale_steps)) (spec section 1)."""
        return pipeline_capacity(self.B, self.fully_async.stale_steps)

    @property
    def groups_per_minibatch(self) -> int:
        """M // N groups per training call (spec section 2)."""
        return self.M // self.N

    @property
    def minibatches_per_step(self) -> int:
        """(B * N) // M training calls per outer step (spec section 2)."""
        return (self.B * self.N) // self.M

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pipeline_capacity(num_prompts_per_step: int, stale_steps: float) -> int:
    """C = int(B * (1 + stale_steps)): the spec's capacity, floored exactly as ``int(...)`` does."""
    return int(num_prompts_per_step * (1 + stale_steps))


# --------------------------------------------------------------------------------------------
# Construction from plain dicts (YAML)
# --------------------------------------------------------------------------------------------


def _build(cls: type, data: Any, prefix: str) -> Any:
    if isinstance(data, cls):
        return data
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ConfigError(f"`{prefix or 'config'}` must be a mapping, got {data!r}.")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(
            f"`{key}` is not a configuration key; the keys under `{prefix or 'the top level'}` "
            f"are: {', '.join(sorted(known))}."
        )
    kwargs = {}
    hints = _type_hints(cls)
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _convert(hints[name], value, key)
    return cls(**kwargs)


def _type_hints(cls: type) -> dict[str, Any]:
    import typing

    return typing.get_type_hints(cls)


def _convert(tp: Any, value: Any, key: str) -> Any:
    import typing

    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        return _convert(non_none[0], value, key)
    if is_dataclass(tp):
        return _build(tp, value, key)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"`{key}` must be a list, got {value!r}.")
        return [_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"`{key}` must be a mapping, got {value!r}.")
        return {k: _convert(args[1], v, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"`{key}` must be true or false, got {value!r}.")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"`{key}` must be an integer, got {value!r}.")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"`{key}` must be a number, got {value!r}.")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"`{key}` must be a string, got {value!r}.")
        return value
    return value


def config_from_dict(data: Optional[dict[str, Any]]) -> FasyncConfig:
    """Build a :class:`FasyncConfig` from a nested dict (e.g. parsed YAML); unknown keys are refused."""
    return _build(FasyncConfig, data or {}, "")


def set_by_path(cfg: FasyncConfig, dotted: str, value: Any) -> None:
    """Set ``a.b.c`` on a config, converting ``value`` to the field's type (for CLI overrides)."""
    parts = dotted.split(".")
    obj = cfg
    for i, part in enumerate(parts[:-1]):
        if isinstance(obj, dict):
            obj = obj[part]
        elif not hasattr(obj, part):
            raise ConfigError(f"`{'.'.join(parts[: i + 1])}` is not a configuration key.")
        else:
            obj = getattr(obj, part)
    last = parts[-1]
    if isinstance(obj, dict):
        obj[last] = value
        return
    hints = _type_hints(type(obj))
    if last not in hints:
        raise ConfigError(f"`{dotted}` is not a configuration key.")
    setattr(obj, last, _convert(hints[last], value, dotted))


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def import_plugins(cfg: FasyncConfig) -> None:
    """Import ``fully_async.plugins`` so custom strategies register before validation."""
    for module in cfg.fully_async.plugins:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(
                f"`fully_async.plugins` lists {module!r}, which cannot be imported ({exc}); "
                "each entry must be an importable Python module."
            ) from exc


def validate(cfg: FasyncConfig) -> FasyncConfig:
    """Refuse every combination the spec forbids; warn on what it recommends against.

    Raises:
        ConfigError: one sentence naming the key, the value given and the rule.
    """
    from lightning_fasync.pipeline.window import available_strategies

    import_plugins(cfg)
    fa = cfg.fully_async
    sources = cfg.sources
    if not sources:
        raise ConfigError("`data_sources` is empty; at least one data source is required.")

    for i, src in enumerate(sources):
        key = "data_source" if cfg.data_sources is None else f"data_sources[{i}]"
        if src.num_prompts_per_step <= 0:
            raise ConfigError(
                f"`{key}.num_prompts_per_step` is {src.num_prompts_per_step}; it must be a positive integer."
            )
        if src.num_trajectories_per_prompt <= 0:
            raise ConfigError(
                f"`{key}.num_trajectories_per_prompt` is {src.num_trajectories_per_prompt}; "
                "it must be a positive integer."
            )
    if cfg.M <= 0:
        raise ConfigError(f"`trainer.mini_batch_size` is {cfg.M}; it must be a positive integer.")
    if cfg.fully_async.stale_steps < 0:
        raise ConfigError(
            f"`fully_async.stale_steps` is {fa.stale_steps}; it must be >= 0 (capacity is int(B * (1 + stale_steps)))."
        )
    if fa.sliding_window not in available_strategies():
        raise ConfigError(
            f"`fully_async.sliding_window` is {fa.sliding_window!r}, which is not a registered strategy; "
            f"choose one of {', '.join(available_strategies())} or register yours (see docs/custom_window.md)."
        )
    if cfg.run_mode not in ("default", "train-only", "rollout-only"):
        raise ConfigError(
            f"`run_mode` is {cfg.run_mode!r}; it must be one of default, train-only, rollout-only."
        )
    if cfg.trainer.save_freq < 0:
        raise ConfigError(f"`trainer.save_freq` is {cfg.trainer.save_freq}; it must be >= 0 (0 disables periodic saves).")
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
    if cfg.rollout.mask_offpolicy_in_partial_rollout and not cfg.rollout.partial:
        raise ConfigError(
            "`rollout.mask_offpolicy_in_partial_rollout` is true while `rollout.partial` is false; "
            "it can only be enabled together with partial rollout."
        )
    if cfg.algorithm.m2po.enable and cfg.trainer.use_rollout_log_probs:
        raise ConfigError(
            "`algorithm.m2po.enable` is true while `trainer.use_rollout_log_probs` is true; "
            "M2PO compares old and rollout log-probs and cannot be used with rollout log-probs as the old policy."
        )
    if cfg.rollout.sampler.num_oversample < 0:
        raise ConfigError(
            f"`rollout.sampler.num_oversample` is {cfg.rollout.sampler.num_oversample}; it must be >= 0."
        )
    if cfg.agentflow.router.max_connections <= 0:
        raise ConfigError(
            f"`agentflow.router.max_connections` is {cfg.agentflow.router.max_connections}; it must be positive."
        )
    mrr = cfg.rollout.sglang_args.max_running_requests
    if mrr is not None and mrr <= 0:
        raise ConfigError(f"`rollout.sglang_args.max_running_requests` is {mrr}; it must be positive or null.")
    if cfg.rollout.max_response_length <= 0:
        raise ConfigError(
            f"`rollout.max_response_length` is {cfg.rollout.max_response_length}; it must be positive."
        )
    isc = cfg.algorithm.is_correction
    if isc.level not in ("token", "sequence"):
        raise ConfigError(f"`algorithm.is_correction.level` is {isc.level!r}; it must be token or sequence.")
    if isc.mode not in ("truncate", "mask"):
        raise ConfigError(f"`algorithm.is_correction.mode` is {isc.mode!r}; it must be truncate or mask.")
    if cfg.algorithm.loss_agg_mode not in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        raise ConfigError(
            f"`algorithm.loss_agg_mode` is {cfg.algorithm.loss_agg_mode!r}; it must be token-mean, "
            "seq-mean-token-sum or seq-mean-token-mean."
        )

    if fa.enable:
        if cfg.colocate:
            raise ConfigError(
                "`colocate` is true while `fully_async.enable` is true; fully-async mode needs separate "
                "trainer and rollout resources, so set colocate: false."
            )
        if cfg.run_mode != "default":
            raise ConfigError(
                f"`run_mode` is {cfg.run_mode!r} while `fully_async.enable` is true; fully-async supports only default."
            )
        if len(sources) != 1:
            raise ConfigError(
                f"`data_sources` lists {len(sources)} sources while `fully_async.enable` is true; "
                "fully-async supports exactly one data source."
            )
        if cfg.rollout.sampler.num_oversample != 0:
            raise ConfigError(
                f"`rollout.sampler.num_oversample` is {cfg.rollout.sampler.num_oversample} while "
                "`fully_async.enable` is true; it must be 0, extra in-flight capacity comes from fully_async.stale_steps."
            )
    if M % N != 0:
        warnings.warn(
            f"`trainer.mini_batch_size` is {M}, not a multiple of N = {N}; the spec recommends M % N == 0 "
            f"(each call trains M // N = {M // N} groups, i.e. {(M // N) * N} trajectories).",
            ConfigWarning,
            stacklevel=2,
        )
    return cfg
