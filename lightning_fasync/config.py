"""Typed configuration with the spec's names and defaults (docs/contract.md §1), and its validation.

Every group is a dataclass whose fields carry a docstring; jsonargparse reads them for ``--help``.
``validate()`` refuses every combination the spec forbids, before any thread, process or engine
starts, with one sentence naming the key, the value given and the rule.
"""

from __future__ import annotations

import importlib
import warnings
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Literal, Mapping, Optional, Sequence, Union

from lightning_fasync.agents.sandbox import SandboxLimits
from lightning_fasync.pipeline.window import available_strategies, pipeline_capacity


class ConfigError(ValueError):
    """A configuration the spec forbids. The message is one sentence: key, value, rule."""


class ConfigWarning(UserWarning):
    """A configuration the spec allows but recommends against."""


# --------------------------------------------------------------------------------------------
# Groups
# --------------------------------------------------------------------------------------------


@dataclass
class FullyAsyncConfig:
    """``fully_async.*``: the fully-async switch and scheduling (docs/contract.md §1 and §3)."""

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
    """Shuffle the task's prompts at each epoch (seeded by ``seed``); a ``datasource`` orders its own."""
    seed: int = 1234
    """Seed of the task's prompts and their per-epoch shuffle; a ``datasource`` takes its own in ``datasource_args``."""
    task: str = "repeat"
    """Task that makes the prompts and scores the responses: a registered name (``repeat``) or
    ``package.module:Class`` (see docs/extending.md)."""
    task_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task (e.g. its length distribution)."""
    num_prompts: int = 4096
    """Prompts per epoch drawn from the task (a ``datasource`` decides its own)."""
    datasource: Optional[str] = None
    """``package.module:Class`` of a DataSource to use instead of the task's prompts (see docs/extending.md)."""
    datasource_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of ``datasource``."""
    reward: Optional[str] = None
    """``package.module:function`` ``(sample, trajectory) -> float`` (or async) to use instead of the
    task's reward; ``lightning_fasync.data.rewards:math_reward`` is the math-verify one."""
    reward_timeout: float = 30.0
    """Seconds one reward call may take; past it the trajectory fails under the group policy
    (counted in ``rollout/reward_failed``)."""
    reward_processes: int = 0
    """Run synchronous rewards in a pool of this many processes (CPU-heavy verifiers; a reward that
    hangs is killed); 0: in threads, off the producer's event loop."""
    path: Optional[str] = None
    """Prompts from local files instead of ``task``: a parquet, jsonl or json file, or a directory
    of them, read with Hugging Face ``datasets`` (no hub access)."""
    format: Optional[str] = None
    """``parquet``, ``json`` (also jsonl); None: from the file extension."""
    prompt_key: str = "prompt"
    """Dotted path of the prompt in each record: a string, or a chat message list."""
    answer_key: Optional[str] = None
    """Dotted path of the ground truth in each record (e.g. ``reward_model.ground_truth``), handed
    to the reward as ``sample.metadata["answer"]``."""
    system_prompt: Optional[str] = None
    """A system message put before each prompt."""
    max_prompt_length: Optional[int] = None
    """Drop prompts longer than this many tokens after the chat template (the count is printed)."""


@dataclass
class TrainerConfig:
    """``trainer.*``: the RL trainer's batch shape and resources (docs/contract.md §1)."""

    mini_batch_size: int = 64
    """M: trajectories per training call; each call fetches M // N complete groups."""
    num_nodes: int = 1
    """Nodes in the resident training pool."""
    num_gpus_per_node: int = 8
    """Training GPUs per node (on CPU: trainer processes per node)."""
    save_freq: int = 0
    """Save a checkpoint every this many rollout steps; 0 saves none periodically."""
    save_keep_last: Optional[int] = 3
    """Periodic checkpoints kept: older ones are removed after each successful save; null keeps all."""
    save_hf: bool = False
    """With each checkpoint, also write the policy as a Hugging Face directory beside it
    (``step-NNNNNN.hf``: config, safetensors, tokenizer), gathered shard by shard from a sharded
    trainer; removed with its checkpoint. ``lightning-fasync export`` does the same afterwards."""
    preempt_grace_s: float = 30.0
    """After SIGTERM or SIGINT: seconds to finish the step and save a checkpoint before the run exits
    (status 128 + signal); a step that cannot finish in time is abandoned (the last checkpoint stands)."""
    rollout_steps: Optional[int] = None
    """Outer (rollout) steps to train; sets Lightning's max_steps to rollout_steps x (B x N) // M."""
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
    context_length: Optional[int] = None
    """Prompt + response tokens per request (SGLang ``--context-length``); None: the datasource's
    longest prompt + ``rollout.max_response_length`` + 1."""
    mem_fraction_static: Optional[float] = None
    """``rollout.backend: sglang`` only: fraction of GPU memory for weights and KV cache (SGLang
    ``--mem-fraction-static``); None keeps SGLang's default."""
    skip_server_warmup: bool = True
    """``rollout.backend: sglang`` only: pass ``--skip-server-warmup`` (the trainer's first weight sync
    comes before any generation anyway)."""
    weight_version: Optional[str] = None
    """``rollout.backend: sglang`` only: label of the weights a server loads at start (SGLang
    ``--weight-version``): ``default`` or an integer; None keeps SGLang's ``default`` (read as version 0).
    The trainer's first sync relabels them."""
    port: Optional[int] = None
    """``rollout.backend: sglang`` only: port of the first server on 127.0.0.1 (server i listens on
    port + i); None: free ports."""
    extra: Union[dict[str, Any], list[str]] = field(default_factory=dict)
    """``rollout.backend: sglang`` only: more ``sglang.launch_server`` arguments, passed through
    verbatim: a list of command-line tokens (``["--ep-size", "4"]``), or a dict where ``ep_size: 4``
    becomes ``--ep-size 4``, ``true`` a bare flag, ``false``/null nothing and a list one value after another."""


@dataclass
class EngineRestartConfig:
    """``rollout.engine_restart.*``: what happens when an engine replica dies, hangs or its router dies."""

    max_attempts: int = 3
    """Restart attempts per lost replica (and for a dead router); 0: a lost replica stays out."""
    backoff_s: float = 2.0
    """Delay before the second attempt; doubles after each failed one."""
    timeout_s: float = 300.0
    """Longest time without any serving replica (one replica: its restart); past it the run stops."""
    hang_timeout_s: float = 60.0
    """A replica whose ``/health`` has not answered for this long is killed and restarted; 0 disables."""
    poll_interval_s: float = 0.5
    """Seconds between two looks at the engine and router processes."""


@dataclass
class RolloutConfig:
    """``rollout.*``: the rollout pool and step-boundary behaviour (docs/contract.md §1)."""

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
    stop_token_ids: Optional[list[int]] = None
    """Token ids that end a response; None: the task's EOS when ``data_source.task`` makes the
    prompts, else the policy's own (its tokenizer's EOS and end-of-turn token, its
    ``generation_config.json``'s ``eos_token_id``)."""
    filter: Optional[str] = None
    """``module:function`` called on each complete group by the collector; False drops it."""
    max_consecutive_failed_groups: int = 16
    """Fail the run after this many consecutive groups with a failed trajectory (engine down)."""
    request_timeout: float = 600.0
    """Seconds one generate call may take, step-boundary pauses included; past it the request fails
    (a hung engine) and its trajectory follows the group policy like any engine error."""
    weight_sync: str = "auto"
    """How the trainer's weights reach the engines at each step boundary (docs/weight_sync.md):
    ``distributed`` (a weight-update group from trainer rank 0 to every engine, bucketed broadcasts;
    NCCL on GPUs, gloo on CPU), ``tensor`` (same host: SGLang's serialised tensors in shared memory or
    CUDA IPC), ``disk`` (a Hugging Face safetensors directory) or ``auto``: ``tensor`` for the embedded
    backend, ``distributed`` for the others. ``FullyAsyncStrategy(weight_sync=...)`` overrides it."""
    weight_sync_bucket_mb: int = 512
    """The most MiB of weights per bucket (one broadcast, one serialised payload or one safetensors
    shard); a larger tensor goes alone. Bigger buckets mean fewer round trips and more memory held."""
    engine_restart: EngineRestartConfig = field(default_factory=EngineRestartConfig)
    """Engine and router fault handling (embedded engines)."""
    backend: str = "embedded"
    """Who runs the rollout engines (docs/backends.md): ``embedded`` (this package's engine, started per
    replica), ``sglang`` (one ``python -m sglang.launch_server`` per replica of ``rollout.sglang_replicas``
    on its GPUs, sglang-router in front of several) or ``external`` (servers someone else runs, at
    ``rollout.engine_urls``)."""
    engine_urls: list[str] = field(default_factory=list)
    """``rollout.backend: external`` only: every server's URL (``http://host:port``); weight updates,
    pauses and aborts go to each."""
    router_url: Optional[str] = None
    """``rollout.backend: external`` only: the sglang-router in front of ``engine_urls``, where
    generation requests go; None: the first engine URL."""
    engine_startup_timeout: float = 180.0
    """Seconds each engine server (or external URL) has to answer ``/health`` at start; past it the run
    stops with the server's log tail."""


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
    flow: str = "lightning_fasync.pipeline.flow:SingleTurnFlow"
    """``package.module:Class`` of the agent flow; built with ``client``, ``sampling``,
    ``max_response_length``, ``reward_fn`` and ``flow_args`` (see docs/extending.md)."""
    flow_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of ``flow``."""
    max_turns: int = 4
    """Multi-turn flows (``lightning_fasync.agents.flow:ToolAgentFlow``): policy turns per episode, each one
    engine request; an episode still calling tools after this many is truncated."""
    tools: list[str] = field(default_factory=lambda: ["calculator", "python"])
    """Tool-using flows: the tools offered, ``calculator`` (arithmetic, in-process) and ``python`` (code run
    in the sandbox); docs/agents.md."""
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)
    """Tool-using flows: limits of each sandboxed run of the ``python`` tool (docs/agents.md)."""


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


REFERENCE_DTYPES = ("float32", "bfloat16", "float16")
WEIGHT_SYNC_CHOICES = ("auto", "distributed", "tensor", "disk")
"""The values of ``rollout.weight_sync`` (``rollout/weight_sync.py`` implements the last three)."""
PROX_LOGP_METHODS = ("recompute", "loglinear", "metrics")
"""The values of ``algorithm.prox_logp_method``."""


@dataclass
class ReferenceConfig:
    """``algorithm.reference.*``: the frozen reference (or teacher) model of the KL term.

    It scores every training call's tokens (``timing/teacher``); the loss adds
    ``algorithm.kl_coef * k3 KL(pi_theta || pi_ref)``, reported as ``train/ref_kl``. It is never
    trained, checkpointed or sent to the rollout engines.

    ``validate()`` refuses a non-zero ``kl_coef`` without a reference (the loss could not be
    computed). A reference with ``kl_coef: 0`` is only a warning, not an error: it is still run,
    so ``train/ref_kl`` monitors how far the policy drifts from it, at the cost of one forward pass
    per training call, which is what the warning says.
    """

    model: Optional[str] = None
    """The reference: ``policy`` (a frozen copy of the policy's initial weights: a KL penalty), a
    preset name (``tiny``) or a local Hugging Face directory (e.g. a teacher for on-policy
    distillation); it must use the policy's tokenizer. None: no reference (``kl_coef`` must be 0)."""
    dtype: Optional[str] = None
    """Parameter dtype of the reference: float32, bfloat16 or float16; None: the policy's."""


@dataclass
class AlgorithmConfig:
    """``algorithm.*``: advantages, policy loss and off-policy protection (docs/contract.md §1, §5.1)."""

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
    """KL-to-reference penalty coefficient (k3 of KL(pi_theta || pi_ref)); non-zero needs
    ``algorithm.reference.model``."""
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    """The frozen reference / teacher model of the KL term."""
    is_correction: ISCorrectionConfig = field(default_factory=ISCorrectionConfig)
    """Importance-sampling correction."""
    m2po: M2POConfig = field(default_factory=M2POConfig)
    """M2PO token masking."""
    opsm: OPSMConfig = field(default_factory=OPSMConfig)
    """OPSM sequence masking."""
    prox_logp_method: str = "recompute"
    """How the old (proximal) policy's log-probs are had (AReaL's ``actor.prox_logp_method``):
    ``recompute``: a forward pass under the step-start weights (the first training call of a step
    reuses its own forward, whose weights are those); ``loglinear``: no forward pass, log-linear
    interpolation between the engine's log-probs and the current policy's by weight version, exact
    for on-policy tokens and at a step's first call; ``metrics``: recompute, and log the
    interpolation's error (``train/prox_approx_abs_err``)."""


@dataclass
class EvalSamplingConfig:
    """``eval.sampling.*``: how eval responses are generated."""

    greedy: bool = True
    """Greedy decoding (SGLang's temperature 0); false samples with ``temperature``, ``top_p`` and ``top_k``."""
    temperature: float = 1.0
    """Sampling temperature when ``greedy`` is false."""
    top_p: float = 1.0
    """Nucleus sampling threshold when ``greedy`` is false."""
    top_k: int = -1
    """Top-k sampling when ``greedy`` is false; -1 disables it."""
    n: int = 1
    """Samples per prompt; greedy decoding needs 1 (its samples would be identical)."""
    max_response_length: Optional[int] = None
    """Maximum number of response tokens of an eval sample; None: ``rollout.max_response_length``."""


@dataclass
class EvalConfig:
    """``eval.*``: evaluation of the current weights on the rollout engines at step boundaries,
    outside the training pipeline's accounting (docs/tasks.md, "Evaluation during training")."""

    every_n_steps: int = 0
    """Evaluate after every this many rollout steps (after steps n-1, 2n-1, ... counted from 0, as
    ``trainer.save_freq`` saves), once the new weights are synced; 0: never."""
    at_start: bool = False
    """Also evaluate the starting weights before the first step (logged at step = first step - 1)."""
    at_end: bool = False
    """Also evaluate after the run's last step (``trainer.rollout_steps`` / ``max_steps``, or the Fabric
    loop's ``rollout_steps``)."""
    data_source: list[DataSourceConfig] = field(default_factory=list)
    """The eval sets: data sources as ``data_source`` (task, files or a datasource; ``num_prompts``,
    ``seed``, ``reward``), at most ``num_prompts`` prompts of each one's first epoch; metrics go
    under ``val/<name>/``."""
    sampling: EvalSamplingConfig = field(default_factory=EvalSamplingConfig)
    """How eval responses are generated."""
    accuracy_threshold: float = 1.0
    """A sample counts as correct in ``val/<name>/accuracy`` when its reward is >= this."""
    timeout: float = 600.0
    """Seconds one evaluation (every eval set) may take; past it the run fails."""


EVAL_SOURCE_NAME = r"^[A-Za-z0-9_.-]+$"
"""What an eval set's name may be: one segment of its metric names (``val/<name>/accuracy``)."""


@dataclass
class FasyncConfig:
    """The whole plugin configuration; key names follow the spec's section 1 table."""

    fully_async: FullyAsyncConfig = field(default_factory=FullyAsyncConfig)
    """Fully-async switch and scheduling."""
    colocate: bool = True
    """Rollout and trainer share one resource pool. Must be false for fully-async."""
    colocate_offload: Union[bool, Literal["auto"]] = "auto"
    """Colocate mode only: around each training phase the engines release their weights and KV cache
    (SGLang's /release_memory_occupation, servers started with --enable-memory-saver) and the trainer
    moves model and optimizer state onto its device and back, each stage timed (timing/offload_rollout,
    timing/onload_train, timing/offload_train, timing/onload_rollout_weights, timing/onload_rollout_kv;
    docs/colocate.md). auto: on when the trainer's device is CUDA; true also on CPU, where the trainer
    has nothing to move."""
    run_mode: str = "default"
    """Entry mode. Only default is supported (the spec's train-only and rollout-only are refused)."""
    data_source: DataSourceConfig = field(default_factory=DataSourceConfig)
    """The data source (B and N)."""
    data_sources: Optional[list[DataSourceConfig]] = None
    """The data sources actually used; None means [data_source]. Exactly one is supported."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """RL trainer batch shape and resources."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout pool and step-boundary behaviour."""
    agentflow: AgentFlowConfig = field(default_factory=AgentFlowConfig)
    """Agent flow and router limits."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, loss and off-policy corrections."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation at step boundaries."""

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
        """C = int(B * (1 + stale_steps)) (docs/contract.md §1)."""
        return pipeline_capacity(self.B, self.fully_async.stale_steps)

    @property
    def groups_per_minibatch(self) -> int:
        """M // N groups per training call (docs/contract.md §2)."""
        return self.M // self.N

    @property
    def minibatches_per_step(self) -> int:
        """(B * N) // M training calls per outer step (docs/contract.md §2)."""
        return (self.B * self.N) // self.M

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# The one parser: every command (fit, simulate, serve's engine flags aside) and every dict config
# goes through jsonargparse built from the dataclasses above, whose field docstrings are the docs.
# --------------------------------------------------------------------------------------------

GROUPS: dict[str, type] = {
    "fully_async": FullyAsyncConfig,
    "data_source": DataSourceConfig,
    "trainer": TrainerConfig,
    "rollout": RolloutConfig,
    "agentflow": AgentFlowConfig,
    "algorithm": AlgorithmConfig,
    "eval": EvalConfig,
}
"""The plugin's config groups (docs/contract.md §1), by top-level key."""

SCALARS = ("colocate", "colocate_offload", "run_mode", "data_sources")
"""The plugin's top-level keys that are not groups."""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a config dataclass (what ``--help`` shows)."""
    from docstring_parser import parse_from_object

    return {p.arg_name: p.description or "" for p in parse_from_object(cls).params}


def add_config_arguments(parser: Any, skip_trainer: Sequence[str] = ()) -> None:
    """Add the plugin's keys to a jsonargparse ``parser`` under the spec's names.

    Arguments:
        parser: a ``jsonargparse.ArgumentParser`` (LightningCLI's, or :func:`config_parser`'s).
        skip_trainer: ``trainer.*`` keys the parser already has (LightningCLI's ``trainer`` group
            holds Lightning's Trainer arguments; the RL keys are added into it one by one).
    """
    import typing

    docs = field_docs(FasyncConfig)
    for key, cls in GROUPS.items():
        if key == "trainer" and skip_trainer:
            hints, tdocs = typing.get_type_hints(TrainerConfig), field_docs(TrainerConfig)
            for f in fields(TrainerConfig):
                if f.name not in skip_trainer:
                    parser.add_argument(f"--trainer.{f.name}", type=hints[f.name], default=f.default, help=tdocs[f.name])
            continue
        parser.add_class_arguments(cls, key, help=docs[key])
        if key == "rollout":
            # jsonargparse cannot write dataclass instances nested in a dict back to YAML; a plain
            # dict default keeps a saved config.yaml reusable.
            parser.set_defaults({"rollout.sglang_replicas": {k: asdict(v) for k, v in RolloutConfig().sglang_replicas.items()}})
    parser.add_argument("--colocate", type=bool, default=True, help=docs["colocate"])
    parser.add_argument("--colocate_offload", type=Union[bool, Literal["auto"]], default="auto",
                        help=docs["colocate_offload"])
    parser.add_argument("--run_mode", type=str, default="default", help=docs["run_mode"])
    parser.add_argument("--data_sources", type=Optional[list[DataSourceConfig]], default=None, help=docs["data_sources"])


def config_parser(**sections: type) -> Any:
    """A parser of the plugin's keys plus extra dataclass ``sections`` (e.g. ``simulate=SimConfig``)."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    parser = ArgumentParser(exit_on_error=False, default_env=False)
    parser.add_argument("--config", action=ActionConfigFile, help="A YAML file of these keys.")
    add_config_arguments(parser)
    for key, cls in sections.items():
        parser.add_class_arguments(cls, key)
    return parser


def config_from_namespace(ns: Any, **sections: type) -> tuple["FasyncConfig", dict[str, Any]]:
    """The :class:`FasyncConfig` (and the extra ``sections``) of a parsed jsonargparse namespace."""
    values = _plain(ns)
    groups = {k: _dataclass(cls, values.get(k) or {}) for k, cls in GROUPS.items()}
    sources = values.get("data_sources")
    cfg = FasyncConfig(
        **groups,
        colocate=values.get("colocate", True),
        colocate_offload=values.get("colocate_offload", "auto"),
        run_mode=values.get("run_mode", "default"),
        data_sources=None if sources is None else [_dataclass(DataSourceConfig, s) for s in sources],
    )
    return cfg, {k: _dataclass(cls, values.get(k) or {}) for k, cls in sections.items()}


def load_config(data: Optional[Mapping[str, Any]] = None, **sections: type) -> Any:
    """The public builder: a validated-for-type :class:`FasyncConfig` from a nested dict (parsed
    YAML, a user's dict); unknown keys and mistyped values are refused naming the key.

    With ``sections`` (e.g. ``simulate=SimConfig``) returns ``(cfg, {name: section})``.
    """
    parser = config_parser(**sections)
    try:
        ns = parser.parse_object(dict(data or {}))
    except Exception as exc:  # jsonargparse's ArgumentError
        raise ConfigError(_config_error_sentence(exc)) from None
    cfg, extra = config_from_namespace(ns, **sections)
    return (cfg, extra) if sections else cfg


def load_config_file(path: str, overrides: Sequence[str] = (), **sections: type) -> tuple["FasyncConfig", dict[str, Any]]:
    """Read a YAML config and command-line style ``overrides`` (``--fully_async.stale_steps=2``)."""
    import os

    if not os.path.exists(path):
        raise ConfigError(f"`--config` is {path!r}, which does not exist.")
    parser = config_parser(**sections)
    try:
        ns = parser.parse_args(["--config", path, *overrides])
    except Exception as exc:
        raise ConfigError(_config_error_sentence(exc)) from None
    return config_from_namespace(ns, **sections)


def with_overrides(cfg: "FasyncConfig", overrides: Mapping[str, Any]) -> "FasyncConfig":
    """A copy of ``cfg`` with dotted-key ``overrides`` (``{"fully_async.stale_steps": 2.0}``) applied."""
    data = cfg.to_dict()
    for dotted, value in overrides.items():
        node = data
        parts = dotted.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                raise ConfigError(f"`{dotted}` is not a configuration key.")
            node = node[part]
        node[parts[-1]] = value
    return load_config(data)


def _dataclass(cls: type, value: Any) -> Any:
    if isinstance(value, cls):
        return value
    kwargs = {}
    hints = _type_hints(cls)
    for f in fields(cls):
        if f.name in value:
            kwargs[f.name] = _typed(hints[f.name], value[f.name])
    return cls(**kwargs)


def _typed(tp: Any, value: Any) -> Any:
    import typing

    if is_dataclass(tp) and isinstance(value, Mapping):
        return _dataclass(tp, value)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union and value is not None:
        return _typed(next(a for a in args if a is not type(None)), value)
    if origin is dict and isinstance(value, Mapping):
        return {k: _typed(args[1], v) for k, v in value.items()}
    if origin is list and isinstance(value, (list, tuple)):
        return [_typed(args[0], v) for v in value]
    return value


def _type_hints(cls: type) -> dict[str, Any]:
    import typing

    return typing.get_type_hints(cls)


def _plain(obj: Any) -> Any:
    """jsonargparse namespaces and tuples → plain dicts and lists; dataclasses stay."""
    if hasattr(obj, "as_dict"):
        obj = obj.as_dict()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items() if not k.startswith("__") and k != "config"}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _config_error_sentence(exc: BaseException) -> str:
    """jsonargparse's message as the project's one sentence naming the key."""
    import re

    text = " ".join(str(exc).split())
    m = re.search(r"Group '([\w.]+)' does not accept (?:nested key|option) '([\w.]+)'", text)
    if m:
        group, key = m.groups()
        cls = GROUPS.get(group.split(".")[0])
        known = f"; the keys under `{group}` are: {', '.join(f.name for f in fields(cls))}" if cls and "." not in group else ""
        return f"`{group}.{key}` is not a configuration key{known}."
    m = re.search(r'[Kk]ey "([\w.\[\]]+)": Does not validate against any of the Union subtypes Subtypes: \[(.*?)\] '
                  r'Errors:.*Given value: (.*)$', text)
    if m:
        key, kinds, got = m.groups()
        # "<class 'bool'>, typing.Literal['auto']" -> "true or false, 'auto'"
        kinds = re.sub(r"typing\.Literal\[(.*?)\]", r"\1", kinds.replace("<class 'bool'>", "true or false"))
        return f"`{key}` is {got.strip()!r}; it must be one of: {kinds}."
    m = re.search(r"^Option '([\w.]+)' is not accepted", text)
    if m:
        top = sorted([*GROUPS, *SCALARS])
        return f"`{m.group(1)}` is not a configuration key; the top-level keys are: {', '.join(top)}."
    m = re.search(r'[Kk]ey "([\w.\[\]]+)": Expected a <class \'(\w+)\'>\. Got value: (.*)$', text)
    if m:
        key, kind, got = m.groups()
        kinds = {"float": "a number", "int": "an integer", "bool": "true or false", "str": "a string"}
        return f"`{key}` must be {kinds.get(kind, kind)}, got {got.strip()!r}."
    m = re.search(r"[Kk]ey \"([\w.\[\]]+)\": (.*)$", text)
    if m:
        return f"`{m.group(1)}`: {m.group(2)}"
    return text


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def validate_backend(cfg: FasyncConfig) -> None:
    """Refuse a ``rollout.backend`` configuration that cannot run (part of :func:`validate`; what
    depends on this host, the model, CUDA and SGLang, is checked when the run starts, by
    ``rollout.backends.check_sglang_backend``).

    Raises:
        ConfigError: one sentence naming the key, the value given and the rule.
    """
    from lightning_fasync.rollout.backends import BACKENDS, check_extra

    ro, sa = cfg.rollout, cfg.rollout.sglang_args
    if ro.backend not in BACKENDS:
        raise ConfigError(f"`rollout.backend` is {ro.backend!r}; it must be one of {', '.join(BACKENDS)}.")
    if not ro.engine_startup_timeout > 0:
        raise ConfigError(f"`rollout.engine_startup_timeout` is {ro.engine_startup_timeout}; it must be > 0 seconds.")
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
    if ro.backend == "external":
        if not ro.engine_urls:
            raise ConfigError("`rollout.engine_urls` is empty while `rollout.backend` is external; list every server's URL.")
        for key, url in [*((f"engine_urls[{i}]", u) for i, u in enumerate(ro.engine_urls)), ("router_url", ro.router_url)]:
            if url is not None and not (isinstance(url, str) and url.startswith(("http://", "https://"))):
                raise ConfigError(f"`rollout.{key}` is {url!r}; it must be an http:// or https:// URL.")
    if ro.backend == "sglang":
        if not ro.sglang_replicas:
            raise ConfigError("`rollout.sglang_replicas` is empty while `rollout.backend` is sglang; name at least one replica kind.")
        if ro.num_gpus_per_node <= 0:
            raise ConfigError(f"`rollout.num_gpus_per_node` is {ro.num_gpus_per_node}; it must be a positive integer.")
        for kind, rep in ro.sglang_replicas.items():
            key = f"rollout.sglang_replicas.{kind}"
            if rep.num_nodes != 1:
                raise ConfigError(
                    f"`{key}.num_nodes` is {rep.num_nodes} while `rollout.backend` is sglang; the plugin launches servers "
                    "on this host only (1), launch them on other nodes yourself and use rollout.backend: external."
                )
            if rep.num_gpus_per_replica <= 0 or ro.num_gpus_per_node % rep.num_gpus_per_replica:
                raise ConfigError(
                    f"`{key}.num_gpus_per_replica` is {rep.num_gpus_per_replica}; it must be a positive divisor of "
                    f"`rollout.num_gpus_per_node` ({ro.num_gpus_per_node})."
                )
        if sa.mem_fraction_static is not None and not 0 < sa.mem_fraction_static < 1:
            raise ConfigError(
                f"`rollout.sglang_args.mem_fraction_static` is {sa.mem_fraction_static}; it must be in (0, 1) or null."
            )
        if sa.weight_version is not None and sa.weight_version != "default" and not str(sa.weight_version).isdigit():
            raise ConfigError(
                f"`rollout.sglang_args.weight_version` is {sa.weight_version!r}; it must be default, a non-negative "
                "integer or null (the pipeline reads weight versions as integers)."
            )
        replicas = sum(ro.num_gpus_per_node // r.num_gpus_per_replica for r in ro.sglang_replicas.values())
        if sa.port is not None and not 1 <= sa.port <= 65536 - replicas:
            raise ConfigError(
                f"`rollout.sglang_args.port` is {sa.port}; it must be a TCP port (server i listens on port + i, "
                f"{replicas} servers) or null (free ports)."
            )
        check_extra(sa.extra)


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


def colocate_offload_enabled(cfg: FasyncConfig, device_type: str) -> bool:
    """Whether the colocate step offloads (``colocate_offload``) for a trainer on ``device_type``
    (``cuda``, ``cpu``, ...): never outside colocate mode; ``auto`` exactly on CUDA."""
    if cfg.fully_async.enable or not cfg.colocate:
        return False
    if cfg.colocate_offload == "auto":
        return device_type == "cuda"
    return cfg.colocate_offload is True


def validate(cfg: FasyncConfig) -> FasyncConfig:
    """Refuse every combination the spec forbids; warn on what it recommends against.

    Raises:
        ConfigError: one sentence naming the key, the value given and the rule.
    """
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
        if src.path and src.datasource:
            raise ConfigError(f"`{key}.path` and `{key}.datasource` are both set; prompts come from one of them.")
        if src.format not in (None, "parquet", "json", "jsonl"):
            raise ConfigError(f"`{key}.format` is {src.format!r}; it must be parquet, json, jsonl or null (from the extension).")
        if not src.reward_timeout > 0:
            raise ConfigError(f"`{key}.reward_timeout` is {src.reward_timeout}; it must be > 0 seconds.")
        if src.reward_processes < 0:
            raise ConfigError(f"`{key}.reward_processes` is {src.reward_processes}; it must be >= 0 (0: threads).")
        if src.max_prompt_length is not None and src.max_prompt_length <= 0:
            raise ConfigError(f"`{key}.max_prompt_length` is {src.max_prompt_length}; it must be a positive integer or null.")
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
    if cfg.trainer.save_freq < 0:
        raise ConfigError(f"`trainer.save_freq` is {cfg.trainer.save_freq}; it must be >= 0 (0 disables periodic saves).")
    if cfg.trainer.save_keep_last is not None and cfg.trainer.save_keep_last < 1:
        raise ConfigError(
            f"`trainer.save_keep_last` is {cfg.trainer.save_keep_last}; it must be >= 1 (null keeps every checkpoint)."
        )
    if not cfg.rollout.request_timeout > 0:
        raise ConfigError(f"`rollout.request_timeout` is {cfg.rollout.request_timeout}; it must be > 0 seconds.")
    er = cfg.rollout.engine_restart
    if er.max_attempts < 0:
        raise ConfigError(f"`rollout.engine_restart.max_attempts` is {er.max_attempts}; it must be >= 0 (0: no restarts).")
    for key in ("backoff_s", "hang_timeout_s"):
        if getattr(er, key) < 0:
            raise ConfigError(f"`rollout.engine_restart.{key}` is {getattr(er, key)}; it must be >= 0 seconds.")
    for key in ("timeout_s", "poll_interval_s"):
        if not getattr(er, key) > 0:
            raise ConfigError(f"`rollout.engine_restart.{key}` is {getattr(er, key)}; it must be > 0 seconds.")
    if not cfg.trainer.preempt_grace_s > 0:
        raise ConfigError(f"`trainer.preempt_grace_s` is {cfg.trainer.preempt_grace_s}; it must be > 0 seconds.")
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
    if cfg.algorithm.prox_logp_method not in PROX_LOGP_METHODS:
        raise ConfigError(
            f"`algorithm.prox_logp_method` is {cfg.algorithm.prox_logp_method!r}; it must be one of "
            f"{', '.join(PROX_LOGP_METHODS)}."
        )
    if cfg.algorithm.prox_logp_method != "recompute" and cfg.trainer.use_rollout_log_probs:
        raise ConfigError(
            f"`algorithm.prox_logp_method` is {cfg.algorithm.prox_logp_method} while `trainer.use_rollout_log_probs` is "
            "true; the old policy is then the engine's log-probs, so there is nothing to interpolate: use recompute."
        )
    if cfg.rollout.sampler.num_oversample < 0:
        raise ConfigError(
            f"`rollout.sampler.num_oversample` is {cfg.rollout.sampler.num_oversample}; it must be >= 0."
        )
    if cfg.agentflow.router.max_connections <= 0:
        raise ConfigError(
            f"`agentflow.router.max_connections` is {cfg.agentflow.router.max_connections}; it must be positive."
        )
    validate_agentflow(cfg)
    mrr = cfg.rollout.sglang_args.max_running_requests
    if mrr is not None and mrr <= 0:
        raise ConfigError(f"`rollout.sglang_args.max_running_requests` is {mrr}; it must be positive or null.")
    validate_backend(cfg)
    if cfg.rollout.weight_sync not in WEIGHT_SYNC_CHOICES:
        raise ConfigError(
            f"`rollout.weight_sync` is {cfg.rollout.weight_sync!r}; it must be one of {', '.join(WEIGHT_SYNC_CHOICES)}."
        )
    if cfg.rollout.weight_sync_bucket_mb <= 0:
        raise ConfigError(
            f"`rollout.weight_sync_bucket_mb` is {cfg.rollout.weight_sync_bucket_mb}; it must be a positive number of MiB."
        )
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
    ref = cfg.algorithm.reference
    if cfg.algorithm.kl_coef != 0 and not ref.model:
        raise ConfigError(
            f"`algorithm.kl_coef` is {cfg.algorithm.kl_coef} while `algorithm.reference.model` is not set; "
            "the KL penalty needs a reference model (e.g. `policy`, a frozen copy of the initial policy)."
        )
    if ref.dtype is not None and ref.dtype not in REFERENCE_DTYPES:
        raise ConfigError(
            f"`algorithm.reference.dtype` is {ref.dtype!r}; it must be null or one of {', '.join(REFERENCE_DTYPES)}."
        )
    if ref.model and cfg.algorithm.kl_coef == 0:
        warnings.warn(
            f"`algorithm.reference.model` is {ref.model!r} while `algorithm.kl_coef` is 0; the reference runs on every "
            "training call (`timing/teacher`) only to report `train/ref_kl`, nothing in the loss uses it.",
            ConfigWarning,
            stacklevel=2,
        )

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
    offload = cfg.colocate_offload
    if offload not in (True, False, "auto"):
        raise ConfigError(f"`colocate_offload` is {offload!r}; it must be true, false or auto.")
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
    validate_eval(cfg)
    return cfg


def validate_agentflow(cfg: FasyncConfig) -> None:
    """Refuse an ``agentflow.*`` tool or turn setting that cannot run (part of :func:`validate`).

    Raises:
        ConfigError: one sentence naming the key, the value given and the rule.
    """
    from lightning_fasync.agents.tools import TOOLS

    af = cfg.agentflow
    if af.max_turns < 1:
        raise ConfigError(f"`agentflow.max_turns` is {af.max_turns}; it must be >= 1 (policy turns per episode).")
    for i, name in enumerate(af.tools):
        if name not in TOOLS:
            raise ConfigError(f"`agentflow.tools[{i}]` is {name!r}; it must be one of {', '.join(TOOLS)}.")
    if len(set(af.tools)) != len(af.tools):
        raise ConfigError(f"`agentflow.tools` is {af.tools!r}; each tool may be listed once.")
    for key, value in asdict(af.sandbox).items():
        if not value > 0:
            raise ConfigError(f"`agentflow.sandbox.{key}` is {value}; it must be > 0.")


def validate_eval(cfg: FasyncConfig) -> None:
    """Refuse an ``eval.*`` configuration that cannot run (part of :func:`validate`).

    Raises:
        ConfigError: one sentence naming the key, the value given and the rule.
    """
    import math
    import re

    ev = cfg.eval
    if ev.every_n_steps < 0:
        raise ConfigError(f"`eval.every_n_steps` is {ev.every_n_steps}; it must be >= 0 (0 disables evaluation).")
    enabled = ev.every_n_steps > 0 or ev.at_start or ev.at_end
    if enabled and not ev.data_source:
        on = f"`eval.every_n_steps` is {ev.every_n_steps}" if ev.every_n_steps > 0 else (
            "`eval.at_start` is true" if ev.at_start else "`eval.at_end` is true")
        raise ConfigError(f"{on} while `eval.data_source` is empty; list at least one eval set to evaluate on.")
    names: set[str] = set()
    for i, src in enumerate(ev.data_source):
        key = f"eval.data_source[{i}]"
        if not isinstance(src.name, str) or not re.match(EVAL_SOURCE_NAME, src.name):
            raise ConfigError(
                f"`{key}.name` is {src.name!r}; it must be letters, digits, '_', '.' or '-' (it is a segment of "
                "the metric names val/<name>/...)."
            )
        if src.name in names:
            raise ConfigError(f"`{key}.name` is {src.name!r}, which another eval set already has; eval set names must be unique.")
        names.add(src.name)
        if src.num_prompts <= 0:
            raise ConfigError(f"`{key}.num_prompts` is {src.num_prompts}; it must be a positive integer (the eval set's size).")
        if src.path and src.datasource:
            raise ConfigError(f"`{key}.path` and `{key}.datasource` are both set; prompts come from one of them.")
        if src.format not in (None, "parquet", "json", "jsonl"):
            raise ConfigError(f"`{key}.format` is {src.format!r}; it must be parquet, json, jsonl or null (from the extension).")
        if (src.path or src.datasource) and not src.reward:
            raise ConfigError(
                f"`{key}.{'path' if src.path else 'datasource'}` is set but `{key}.reward` is not; name the reward, e.g. "
                "lightning_fasync.data.rewards:math_reward (math-verify)."
            )
        if not src.reward_timeout > 0:
            raise ConfigError(f"`{key}.reward_timeout` is {src.reward_timeout}; it must be > 0 seconds.")
        if src.reward_processes < 0:
            raise ConfigError(f"`{key}.reward_processes` is {src.reward_processes}; it must be >= 0 (0: threads).")
        if src.max_prompt_length is not None and src.max_prompt_length <= 0:
            raise ConfigError(f"`{key}.max_prompt_length` is {src.max_prompt_length}; it must be a positive integer or null.")
    sp = ev.sampling
    if sp.n <= 0:
        raise ConfigError(f"`eval.sampling.n` is {sp.n}; it must be a positive integer.")
    if sp.greedy and sp.n > 1:
        raise ConfigError(
            f"`eval.sampling.n` is {sp.n} while `eval.sampling.greedy` is true; greedy decoding gives {sp.n} identical "
            "samples, so n must be 1 (or set greedy: false to sample)."
        )
    if not (math.isfinite(sp.temperature) and sp.temperature >= 0):
        raise ConfigError(f"`eval.sampling.temperature` is {sp.temperature}; it must be a finite number >= 0.")
    if not 0 < sp.top_p <= 1:
        raise ConfigError(f"`eval.sampling.top_p` is {sp.top_p}; it must be in (0, 1].")
    if sp.top_k == 0 or sp.top_k < -1:
        raise ConfigError(f"`eval.sampling.top_k` is {sp.top_k}; it must be a positive integer or -1 (disabled).")
    if sp.max_response_length is not None and sp.max_response_length <= 0:
        raise ConfigError(
            f"`eval.sampling.max_response_length` is {sp.max_response_length}; it must be a positive integer or null "
            "(rollout.max_response_length)."
        )
    if not ev.timeout > 0:
        raise ConfigError(f"`eval.timeout` is {ev.timeout}; it must be > 0 seconds.")
    if not math.isfinite(ev.accuracy_threshold):
        raise ConfigError(f"`eval.accuracy_threshold` is {ev.accuracy_threshold}; it must be a finite number.")
