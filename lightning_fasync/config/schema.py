"""The typed configuration with the spec's names and defaults (docs/contract.md §1).

Every group is a dataclass whose fields carry a docstring; jsonargparse reads them for ``--help``.
This module imports nothing of the package but :mod:`lightning_fasync.errors`.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional, Union

from lightning_fasync.errors import ConfigError, ConfigWarning

__all__ = [
    "pipeline_capacity",
    "TOOLS",
    "SANDBOX_MODES",
    "SandboxLimits",
    "FullyAsyncConfig",
    "DataSourceConfig",
    "TrainerConfig",
    "SGLangReplicaConfig",
    "SamplerConfig",
    "SGLangArgs",
    "VLLMArgs",
    "EngineRestartConfig",
    "RolloutConfig",
    "RouterConfig",
    "AgentFlowConfig",
    "M2POConfig",
    "OPSMConfig",
    "ISCorrectionConfig",
    "REFERENCE_DTYPES",
    "MIXED_PRECISION",
    "PROX_LOGP_METHODS",
    "ReferenceConfig",
    "AlgorithmConfig",
    "LORA_SYNC_MODES",
    "LoRAConfig",
    "PLACEMENTS",
    "RayConfig",
    "EvalSamplingConfig",
    "EvalConfig",
    "EVAL_SOURCE_NAME",
    "FasyncConfig",
    "GROUPS",
    "SCALARS",
]


def pipeline_capacity(num_prompts_per_step: int, stale_steps: float) -> int:
    """C = int(B * (1 + stale_steps)): the spec's capacity, floored exactly as ``int(...)`` does."""
    return int(num_prompts_per_step * (1 + stale_steps))


TOOLS = ("calculator", "python")
"""The built-in tool names (``agentflow.tools``; :mod:`lightning_fasync.agents.tools` implements them)."""


SANDBOX_MODES = ("bwrap", "process")
"""``agentflow.sandbox.mode``: ``bwrap`` (isolation the kernel enforces, through bubblewrap) or
``process`` (the weaker in-process check alone); docs/agents.md has what each guarantees."""


@dataclass
class SandboxLimits:
    """``agentflow.sandbox.*``: isolation and limits of one sandboxed tool run (the ``python`` tool)."""

    mode: str = "bwrap"
    """``bwrap``: each run in bubblewrap's user, PID, mount, network and IPC namespaces as an unprivileged
    uid, the host read-only and mostly absent, only a size-limited tmpfs writable; refused at startup where
    bubblewrap or the namespaces are missing. ``process``: a plain subprocess watched by an audit hook,
    a tripwire, not a boundary (docs/agents.md)."""
    cpu_s: float = 5.0
    """CPU seconds per process of a run (RLIMIT_CPU); past it the run ends with "error: time limit exceeded"."""
    wall_s: float = 10.0
    """Wall-clock seconds per run, interpreter start included; past it every process of the run is killed
    ("error: time limit exceeded"). bubblewrap's setup of the sandbox, before the code may run, is
    bounded apart (30 s)."""
    memory_mb: int = 256
    """Address space per process of a run in MiB (RLIMIT_AS); past it "error: memory limit exceeded"."""
    file_mb: int = 16
    """Largest file a run may write, in MiB (RLIMIT_FSIZE); past it "error: file size limit exceeded"."""
    disk_mb: int = 64
    """Mode ``bwrap``: MiB a run may write in all (its working directory is a tmpfs of this size, in memory);
    past it "error: disk limit exceeded"."""
    max_processes: int = 16
    """Mode ``bwrap``: processes and threads a run may have at once, its interpreter included (RLIMIT_NPROC
    in the run's own user namespace)."""
    max_output: int = 1024
    """Bytes of stdout + stderr kept; a run that prints more is stopped ("error: output limit exceeded")."""
    max_concurrent: int = 4
    """Sandboxes running at once (across all episodes); further tool calls wait for a free one."""

    def check(self) -> None:
        """Refuse an ``agentflow.sandbox.*`` value out of range (whether this host can give the mode's
        isolation is :func:`lightning_fasync.agents.sandbox.check_config`'s to say)."""
        if self.mode not in SANDBOX_MODES:
            raise ConfigError(f"`agentflow.sandbox.mode` is {self.mode!r}; it must be one of {', '.join(SANDBOX_MODES)}.")
        for key, value in asdict(self).items():
            if key != "mode" and not value > 0:
                raise ConfigError(f"`agentflow.sandbox.{key}` is {value}; it must be > 0.")


# --------------------------------------------------------------------------------------------
# Groups
# --------------------------------------------------------------------------------------------


@dataclass
class FullyAsyncConfig:
    """``fully_async.*``: the fully-async switch and scheduling (docs/contract.md §1 and §3)."""

    enable: bool = False
    """Enable the fully-async pipeline: a background rollout producer, collector and PipelineBuffer."""
    sliding_window: str = "no-window"
    """Dispatch/collection strategy: no-window, window-gated, windowed-fifo, or a registered name.
    Fully-async only: colocate (``fully_async.enable: false``) runs no-window at capacity B +
    ``rollout.sampler.num_oversample`` whatever this and ``stale_steps`` say, so that one config serves
    both modes."""
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

    def check(self) -> None:
        """Refuse a ``fully_async.*`` value out of range (the window's name is the registry's to check)."""
        if self.stale_steps < 0:
            raise ConfigError(
                f"`fully_async.stale_steps` is {self.stale_steps}; it must be >= 0 (capacity is int(B * (1 + stale_steps)))."
            )


@dataclass
class DataSourceConfig:
    """``data_source.*``: one prompt source."""

    name: str = "default"
    """Name of the source: an eval set's metrics go under ``val/<name>/``; the training source's is
    recorded with the run's settings in its checkpoints."""
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
    reward_processes: Optional[int] = None
    """Run synchronous rewards in a pool of this many processes (CPU-heavy verifiers; a reward that
    hangs is killed); 0: in threads, off the producer's event loop; null: processes (min(4, cores))
    for a reward marked ``cpu_bound`` (``math_reward``), threads for any other."""
    path: Optional[str] = None
    """Prompts from local files instead of ``task``: a parquet, jsonl or json file, or a directory
    of them, read with Hugging Face ``datasets`` (no hub access)."""
    format: Optional[str] = None
    """``parquet``, ``json`` (also jsonl) for the files at ``path``; None: from the file extension."""
    prompt_key: str = "prompt"
    """Dotted path of the prompt in each record of the files at ``path``: a string, or a chat message list."""
    answer_key: Optional[str] = None
    """Dotted path of the ground truth in each record (e.g. ``reward_model.ground_truth``), handed
    to the reward as ``sample.metadata["answer"]``."""
    system_prompt: Optional[str] = None
    """A system message put before each prompt read from ``path``."""
    max_prompt_length: Optional[int] = None
    """Drop prompts read from ``path`` longer than this many tokens after the chat template (the count
    is printed)."""

    def check(self, key: str = "data_source", for_eval: bool = False) -> None:
        """Refuse what this source cannot be (``key`` names it: ``data_source``, ``eval.data_source[i]``).

        Raises:
            ConfigError: naming the key, the value and the rule.
        """
        if not for_eval:
            if self.num_prompts_per_step <= 0:
                raise ConfigError(f"`{key}.num_prompts_per_step` is {self.num_prompts_per_step}; it must be a positive integer.")
            if self.num_trajectories_per_prompt <= 0:
                raise ConfigError(
                    f"`{key}.num_trajectories_per_prompt` is {self.num_trajectories_per_prompt}; it must be a positive integer."
                )
        if self.path and self.datasource:
            raise ConfigError(f"`{key}.path` and `{key}.datasource` are both set; prompts come from one of them.")
        if self.format not in (None, "parquet", "json", "jsonl"):
            raise ConfigError(f"`{key}.format` is {self.format!r}; it must be parquet, json, jsonl or null (from the extension).")
        if not self.reward_timeout > 0:
            raise ConfigError(f"`{key}.reward_timeout` is {self.reward_timeout}; it must be > 0 seconds.")
        if self.reward_processes is not None and self.reward_processes < 0:
            raise ConfigError(
                f"`{key}.reward_processes` is {self.reward_processes}; it must be >= 0 (0: threads) or null (auto)."
            )
        if self.max_prompt_length is not None and self.max_prompt_length <= 0:
            raise ConfigError(f"`{key}.max_prompt_length` is {self.max_prompt_length}; it must be a positive integer or null.")
        default = DataSourceConfig()
        if not self.path:
            for name in FILE_ONLY_KEYS:
                if getattr(self, name) != getattr(default, name):
                    raise ConfigError(
                        f"`{key}.{name}` is {getattr(self, name)!r} but `{key}.path` is not set; it applies only to "
                        f"prompts read from files (a task or a datasource makes its own): set `{key}.path` or remove it."
                    )
        if for_eval:
            for name in ("num_prompts_per_step", "num_trajectories_per_prompt"):
                if getattr(self, name) != getattr(default, name):
                    raise ConfigError(
                        f"`{key}.{name}` is {getattr(self, name)}; an eval set has no steps or groups of its own: it "
                        "scores its first `num_prompts` prompts with `eval.sampling.n` responses each. Remove it."
                    )


FILE_ONLY_KEYS = ("format", "prompt_key", "answer_key", "system_prompt", "max_prompt_length")
"""``data_source`` keys that only prompts read from ``path`` use."""


@dataclass
class TrainerConfig:
    """``trainer.*``: the RL trainer's batch shape and resources (docs/contract.md §1)."""

    mini_batch_size: int = 64
    """M: trajectories per training call; each call fetches M // N complete groups."""
    num_nodes: int = 1
    """Nodes in the resident training pool: the CLI's ``trainer.num_nodes`` is Lightning's too; a
    Trainer or Fabric of one's own takes its own, and ``plan``/``simulate`` size the pool with this."""
    num_gpus_per_node: int = 8
    """Training GPUs per node: on GPUs the SGLang and vLLM servers take the GPUs after these (none
    when colocated), and ``plan``/``simulate`` size the pool with it; the trainer's own processes are
    Lightning's ``devices``."""
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
    pack_sequences: Optional[bool] = None
    """Run the trainer's forwards on the call's sequences packed without padding (docs/packing.md):
    concatenated into rows, positions restarting at 0 per sequence so the model's attention keeps
    each to itself, the log-probs mapped back to the padded layout the loss reads: the padded
    forward's loss, metrics and gradients, to float rounding. true: packed (refused for an attention implementation not known to keep
    packed sequences apart); false: padded; null: packed where the policy's attention allows it
    (the Hugging Face policy's sdpa, eager, flex and FlashAttention), padded under MegatronStrategy."""
    max_tokens_per_micro_batch: Optional[int] = None
    """Cut each training call into micro-batches of at most this many tokens (prompt + response,
    first-fit decreasing; a longer sequence is a micro-batch of its own), one forward and backward
    each: still one optimizer update per call, with the whole call's loss normalisation and
    metrics. Bounds the trainer's activation memory; null: the whole call in one forward."""

    def check(self) -> None:
        """Refuse a ``trainer.*`` value out of range."""
        if self.mini_batch_size <= 0:
            raise ConfigError(f"`trainer.mini_batch_size` is {self.mini_batch_size}; it must be a positive integer.")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ConfigError(
                f"`trainer.max_tokens_per_micro_batch` is {self.max_tokens_per_micro_batch}; it must be >= 1 tokens "
                "(null: the whole training call in one forward)."
            )
        if self.save_freq < 0:
            raise ConfigError(f"`trainer.save_freq` is {self.save_freq}; it must be >= 0 (0 disables periodic saves).")
        if self.save_keep_last is not None and self.save_keep_last < 1:
            raise ConfigError(
                f"`trainer.save_keep_last` is {self.save_keep_last}; it must be >= 1 (null keeps every checkpoint)."
            )
        if not self.preempt_grace_s > 0:
            raise ConfigError(f"`trainer.preempt_grace_s` is {self.preempt_grace_s}; it must be > 0 seconds.")


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
    max_lora_rank: int = 16
    """``rollout.backend: sglang`` with ``rollout.weight_sync: adapter`` only: the largest LoRA rank
    the servers accept (SGLang ``--max-lora-rank``); must be at least ``model.lora.r`` (a push of a
    larger adapter is refused naming this key)."""
    extra: Union[dict[str, Any], list[str]] = field(default_factory=dict)
    """``rollout.backend: sglang`` only: more ``sglang.launch_server`` arguments, passed through
    verbatim: a list of command-line tokens (``["--ep-size", "4"]``), or a dict where ``ep_size: 4``
    becomes ``--ep-size 4``, ``true`` a bare flag, ``false``/null nothing and a list one value after another."""


@dataclass
class VLLMArgs:
    """``rollout.vllm_args.*``: ``rollout.backend: vllm``, one vLLM OpenAI server per replica (docs/backends.md, "vLLM")."""

    python: Optional[str] = None
    """The Python interpreter that has vLLM and this package (``pip install --no-deps lightning-fasync``
    for the ``fasync-gloo`` transfer engine); None: ``$FASYNC_VLLM_PYTHON``, else this one."""
    dtype: str = "float32"
    """The weights' dtype on the servers (vLLM ``--dtype``); the trainer's pushed weights are cast to it."""
    max_num_seqs: Optional[int] = None
    """Requests a server runs at once (vLLM ``--max-num-seqs``); None keeps vLLM's default."""
    kv_cache_gib: float = 1.0
    """CPU servers only: GiB of KV cache per server (``VLLM_CPU_KVCACHE_SPACE``)."""
    gpu_memory_utilization: Optional[float] = None
    """GPU servers only: fraction of GPU memory for weights and KV cache (vLLM ``--gpu-memory-utilization``)."""
    tensor_parallel_size: int = 1
    """GPU servers only: GPUs per server (vLLM ``--tensor-parallel-size``)."""
    enforce_eager: bool = True
    """Pass ``--enforce-eager`` (no graph capture: a faster start; CPU servers gain nothing from graphs here)."""
    weight_transfer: str = "fasync-gloo"
    """vLLM's weight-transfer engine (``--weight-transfer-config``): ``fasync-gloo``, this package's gloo
    broadcast, which runs on CPU and GPU servers alike."""
    check_weights: bool = True
    """After every weight sync, compare each server's log-probs of a fixed 16-token probe with the
    pushed weights' own (one forward of the probe on the trainer's rank 0, each sync); false skips it."""
    port: Optional[int] = None
    """Port of the first server on 127.0.0.1 (server i listens on port + i); None: free ports."""
    max_lora_rank: int = 16
    """``rollout.weight_sync: adapter`` only: the largest LoRA rank the servers accept (vLLM
    ``--max-lora-rank``, its default 16); must be at least ``model.lora.r`` (a push of a larger
    adapter is refused naming this key)."""
    extra: Union[dict[str, Any], list[str]] = field(default_factory=dict)
    """More ``vllm.entrypoints.openai.api_server`` arguments, as ``rollout.sglang_args.extra`` takes them."""


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

    def check(self) -> None:
        """Refuse a ``rollout.engine_restart.*`` value out of range."""
        if self.max_attempts < 0:
            raise ConfigError(f"`rollout.engine_restart.max_attempts` is {self.max_attempts}; it must be >= 0 (0: no restarts).")
        for key in ("backoff_s", "hang_timeout_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"`rollout.engine_restart.{key}` is {getattr(self, key)}; it must be >= 0 seconds.")
        for key in ("timeout_s", "poll_interval_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"`rollout.engine_restart.{key}` is {getattr(self, key)}; it must be > 0 seconds.")


PLACEMENTS = ("local", "ray")
"""The values of ``rollout.placement`` (docs/multinode.md)."""


@dataclass
class RayConfig:
    """``rollout.ray.*``: engine replicas placed on a Ray cluster's nodes (``rollout.placement: ray``,
    docs/multinode.md). The replicas' servers then bind their node's address and require the API key
    in ``$FASYNC_ENGINE_API_KEY`` on every route."""

    address: str = "auto"
    """The cluster to join, as ``ray.init`` takes it: ``auto`` (the cluster this node joined with
    ``ray start``), the head's ``HOST:PORT``, or ``ray://HOST:10001``."""
    replica_resources: dict[str, float] = field(default_factory=dict)
    """Ray resources each replica needs besides its CPUs, e.g. ``{"rollout_node": 1}`` when the
    rollout nodes were started with ``ray start --resources='{"rollout_node": 8}'``: replicas then go
    there only, never to the trainer's node."""
    namespace: str = "lightning-fasync"
    """The Ray namespace of the replicas' actors."""
    timeout_s: float = 120.0
    """Seconds a call to a replica's actor (placing it, starting or stopping its server, its log) may
    take before it is an error."""

    def check(self) -> None:
        """Refuse a ``rollout.ray.*`` value out of range."""
        if not self.timeout_s > 0:
            raise ConfigError(f"`rollout.ray.timeout_s` is {self.timeout_s}; it must be > 0 seconds.")
        bad = {k: v for k, v in self.replica_resources.items() if not (isinstance(v, (int, float)) and v > 0)}
        if bad:
            raise ConfigError(f"`rollout.ray.replica_resources` is {self.replica_resources}; every amount must be > 0.")


WEIGHT_UPDATE_MODES = ("wait", "abort", "inflight", "auto")
"""``rollout.weight_update_mode``'s values (docs/weight_sync.md, "In-flight updates")."""


@dataclass
class RolloutConfig:
    """``rollout.*``: the rollout pool and step-boundary behaviour (docs/contract.md §1)."""

    num_gpus_per_node: int = 8
    """GPUs per node in the resident rollout pool: ``rollout.backend: sglang`` places its replicas on
    them (``sglang_replicas``), and ``plan``/``simulate`` size the pool with it; the embedded and vLLM
    engines run one replica per ``FullyAsyncStrategy(rollout_replicas=...)`` instead."""
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
    weight_update_mode: Optional[str] = None
    """How a step boundary treats the requests in flight (docs/weight_sync.md, "In-flight updates"):
    ``wait`` (they finish first; ``rollout.partial: false``), ``abort`` (they are aborted and resume
    from their tokens after the update; ``rollout.partial: true``) or ``inflight`` (the engines freeze
    them during the update and they go on decoding under the new weights: nothing aborted, nothing
    re-queued; needs ``rollout.partial: true``, as their trajectories span versions; in a colocate run
    the step's over-dispatched tail is frozen from the end of its rollout phase through training and
    the sync, docs/weight_sync.md "In colocate"). null: the
    spec's behaviour, ``abort`` with ``rollout.partial`` and ``wait`` without. ``auto`` (the long-tailed
    workload's config): ``inflight`` where it was run against the engine itself (fully-async with
    ``rollout.partial`` on the ``embedded`` and ``vllm`` backends, vLLM's adapter path excepted),
    else what null reads, so colocate and ``partial: false`` overrides need no other change. A boundary that saves a
    checkpoint or evaluates runs as ``abort`` in every mode, so the checkpoint holds the partial
    trajectories (and a resumed run continues them from their tokens) and evaluation meets no
    training request."""
    inflight_kv: str = "keep"
    """``rollout.weight_update_mode: inflight`` only: what a frozen request's KV cache becomes at the
    swap: ``keep`` (PipelineRL: the keys and values computed by the old weights stay, decoding goes on
    at once) or ``recompute`` (NeMo-RL: the engine drops them and prefills prompt + tokens so far again
    under the new weights; SGLang's ``retract`` pause mode)."""
    resume_kv: str = "recompute"
    """A request aborted at a boundary (``rollout.partial: true``, aborted rather than frozen) and
    resumed from its prompt and tokens so far: ``recompute`` (the spec's and SGLang's after an update
    that flushes its cache: prefilled again under the new weights) or ``keep`` (the embedded
    engine keeps the aborted request's KV cache through the weight update, which then does not
    flush it, and the resumed request goes on from it with no prefill: the keys and values of its
    earlier tokens stay the older weights', as a frozen request's with ``inflight_kv: keep``).
    ``embedded`` backend only; a replica that needs the memory, a restart or a colocate offload of
    the KV cache drops kept caches, and the request is then prefilled again."""
    sglang_args: SGLangArgs = field(default_factory=SGLangArgs)
    """Engine server arguments."""
    vllm_args: VLLMArgs = field(default_factory=VLLMArgs)
    """``rollout.backend: vllm`` only: the vLLM servers' arguments."""
    max_response_length: int = 1024
    """Maximum number of response tokens per trajectory."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    sampling_seed: Optional[int] = None
    """Seed every rollout request (SGLang's ``sampling_seed``, vLLM's ``seed``): each request's seed is
    derived from this one, its prompt id, its trajectory's index in the group and the tokens the
    trajectory already has, so what a trajectory samples does not depend on which requests the
    engine batched it with or in which order they arrived. null: the engines' own random state."""
    deterministic_inference: bool = False
    """Start the engines with SGLang's ``--enable-deterministic-inference`` (the embedded engine and
    ``sglang`` backends): a request's tokens and log-probs do not depend on the requests batched
    with it. With ``rollout.sampling_seed`` a trajectory is then a function of its prompt and the
    weights. Slower (the embedded engine runs each request on its own). Servers of ``external`` and
    ``vllm`` are not started with it (start your own with the flag); refused there."""
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
    check_weights: bool = False
    """After every weight sync, hold each engine's log-probs of a fixed 16-token probe (SGLang's
    ``/generate`` with ``return_logprob``; under the loaded adapter with ``weight_sync: adapter``)
    against the pushed weights' own, one forward of the probe on the trainer: a difference beyond
    the served dtype's tolerance (1e-3 in float32, 0.1 otherwise) fails the run naming the engine.
    It reaches the servers' prompt log-probs (on the embedded engine, a forward of its Hugging Face
    parameters; docs/weight_sync.md). The embedded, sglang and external backends; vLLM servers have
    ``rollout.vllm_args.check_weights``. Not with a sharded trainer (its weights leave as a stream
    of gathered shards) nor with colocate offload (the engines' KV cache comes back after the sync)."""
    engine_restart: EngineRestartConfig = field(default_factory=EngineRestartConfig)
    """Engine and router fault handling (the embedded engines and the vllm backend's servers)."""
    backend: str = "embedded"
    """Who runs the rollout engines (docs/backends.md): ``embedded`` (this package's engine, started per
    replica), ``sglang`` (one ``python -m sglang.launch_server`` per replica of ``rollout.sglang_replicas``
    on its GPUs, sglang-router in front of several), ``vllm`` (one vLLM OpenAI server per replica,
    ``rollout.vllm_args``) or ``external`` (servers someone else runs, at ``rollout.engine_urls``)."""
    engine_urls: list[str] = field(default_factory=list)
    """``rollout.backend: external`` only: every server's URL (``http://host:port``); weight updates,
    pauses and aborts go to each."""
    router_url: Optional[str] = None
    """``rollout.backend: external`` only: the sglang-router in front of ``engine_urls``, where
    generation requests go; None: the client sends each to the least busy of ``engine_urls``."""
    engine_startup_timeout: float = 180.0
    """Seconds each engine server (or external URL) has to answer ``/health`` at start; past it the run
    stops with the server's log tail."""
    placement: str = "local"
    """Where the engine replicas run: ``local`` (this host) or ``ray`` (other nodes of a Ray cluster,
    ``rollout.ray.*``; ``rollout.backend: embedded`` only; docs/multinode.md)."""
    ray: RayConfig = field(default_factory=RayConfig)
    """``rollout.placement: ray`` only: the cluster and where on it the replicas go."""
    engine_device: str = "cpu"
    """``rollout.backend: embedded`` only: the engine replicas' torch device, ``cpu`` or ``cuda`` /
    ``cuda:N``. On a GPU the replicas may share the trainer's device (two processes on one GPU, as the
    GPU check runs the main job, docs/gpu.md); the other backends' servers get the GPUs the resource
    plan gives them."""

    @property
    def boundary_mode(self) -> str:
        """The effective ``weight_update_mode`` of the rollout keys alone: null read from ``partial``
        (``abort`` or ``wait``), ``auto`` as ``inflight`` where the backend was tested with it.
        :attr:`FasyncConfig.boundary_mode` adds the colocate rule; the drivers read that one."""
        spec = "abort" if self.partial else "wait"
        if self.weight_update_mode == "auto":
            tested = self.backend == "embedded" or (self.backend == "vllm" and self.weight_sync != "adapter")
            return "inflight" if self.partial and tested else spec
        return self.weight_update_mode or spec

    def check(self) -> None:
        """Refuse a ``rollout.*`` value out of range, or two that contradict each other (the backend's
        and the weight-sync path's own rules are their registry entries' to check)."""
        if not self.request_timeout > 0:
            raise ConfigError(f"`rollout.request_timeout` is {self.request_timeout}; it must be > 0 seconds.")
        if not self.engine_startup_timeout > 0:
            raise ConfigError(f"`rollout.engine_startup_timeout` is {self.engine_startup_timeout}; it must be > 0 seconds.")
        self.engine_restart.check()
        mode = self.weight_update_mode
        if mode is not None and mode not in WEIGHT_UPDATE_MODES:
            raise ConfigError(f"`rollout.weight_update_mode` is {mode!r}; it must be wait, abort, inflight, auto or null.")
        if mode not in (None, "auto") and (mode == "wait") == self.partial:
            raise ConfigError(
                f"`rollout.weight_update_mode` is {mode} while `rollout.partial` is {str(self.partial).lower()}; "
                f"{'wait keeps every trajectory on one version, which is partial: false' if mode == 'wait' else mode + ' lets trajectories span weight versions, which needs partial: true'}."
            )
        if self.inflight_kv not in ("keep", "recompute"):
            raise ConfigError(f"`rollout.inflight_kv` is {self.inflight_kv!r}; it must be keep or recompute.")
        if self.inflight_kv != "keep" and self.boundary_mode != "inflight":
            raise ConfigError(
                f"`rollout.inflight_kv` is {self.inflight_kv} while `rollout.weight_update_mode` is {mode or 'null'}"
                f"{' (here ' + self.boundary_mode + ')' if mode == 'auto' else ''}; it applies to in-flight updates "
                "only: set weight_update_mode: inflight or leave it at keep."
            )
        if self.resume_kv not in ("recompute", "keep"):
            raise ConfigError(f"`rollout.resume_kv` is {self.resume_kv!r}; it must be recompute or keep.")
        if self.resume_kv == "keep" and not self.partial:
            raise ConfigError("`rollout.resume_kv` is keep while `rollout.partial` is false; nothing is aborted and "
                              "resumed then: set partial: true or leave resume_kv at recompute.")
        if self.resume_kv == "keep" and self.backend != "embedded":
            raise ConfigError(f"`rollout.resume_kv` is keep while `rollout.backend` is {self.backend}; keeping an aborted "
                              "request's cache is the embedded engine's (--keep-aborted-kv): use backend: embedded or "
                              "leave resume_kv at recompute.")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"`rollout.placement` is {self.placement!r}; it must be one of {', '.join(PLACEMENTS)}.")
        self.ray.check()
        if self.placement == "ray":
            if self.backend not in ("embedded", "sglang"):
                raise ConfigError(
                    f"`rollout.placement` is ray while `rollout.backend` is {self.backend}; Ray places the embedded "
                    "engine's and SGLang's servers: start vllm servers on other nodes yourself and list them under "
                    "rollout.backend: external."
                )
            if self.weight_sync in ("tensor", "adapter"):
                raise ConfigError(
                    f"`rollout.weight_sync` is {self.weight_sync} while `rollout.placement` is ray; {self.weight_sync} "
                    "passes weights through this host's memory or files, which replicas on other nodes cannot read: "
                    "use distributed (the auto choice here) or disk on a path every node shares."
                )
        if self.deterministic_inference and self.backend not in ("embedded", "sglang"):
            raise ConfigError(
                f"`rollout.deterministic_inference` is true while `rollout.backend` is {self.backend}; it starts the "
                "plugin's own embedded or sglang servers with --enable-deterministic-inference, so start your servers "
                "deterministic yourself and leave it false."
            )
        if self.sampling_seed is not None and not 0 <= self.sampling_seed < 2**63:
            raise ConfigError(f"`rollout.sampling_seed` is {self.sampling_seed}; it must be a non-negative integer or null.")
        if self.mask_offpolicy_in_partial_rollout and not self.partial:
            raise ConfigError(
                "`rollout.mask_offpolicy_in_partial_rollout` is true while `rollout.partial` is false; "
                "it can only be enabled together with partial rollout."
            )
        if self.sampler.num_oversample < 0:
            raise ConfigError(f"`rollout.sampler.num_oversample` is {self.sampler.num_oversample}; it must be >= 0.")
        mrr = self.sglang_args.max_running_requests
        if mrr is not None and mrr <= 0:
            raise ConfigError(f"`rollout.sglang_args.max_running_requests` is {mrr}; it must be positive or null.")
        if self.weight_sync_bucket_mb <= 0:
            raise ConfigError(
                f"`rollout.weight_sync_bucket_mb` is {self.weight_sync_bucket_mb}; it must be a positive number of MiB."
            )
        if self.check_weights and "vllm" in (self.backend, self.weight_sync):
            key = "rollout.backend" if self.backend == "vllm" else "rollout.weight_sync"
            raise ConfigError(
                f"`rollout.check_weights` is true while `{key}` is vllm; vLLM servers are checked by "
                "rollout.vllm_args.check_weights (on by default): leave rollout.check_weights false."
            )
        if self.max_response_length <= 0:
            raise ConfigError(f"`rollout.max_response_length` is {self.max_response_length}; it must be positive.")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.engine_device):
            raise ConfigError(f"`rollout.engine_device` is {self.engine_device!r}; it must be cpu, cuda or cuda:N.")
        if self.engine_device != "cpu" and self.backend != "embedded":
            raise ConfigError(
                f"`rollout.engine_device` is {self.engine_device!r} with `rollout.backend: {self.backend}`; it places the "
                "embedded engine only (the other backends' servers get the resource plan's GPUs): leave it at cpu."
            )


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

    def check(self) -> None:
        """Refuse an ``agentflow.*`` tool, turn, connection or sandbox setting that cannot run."""
        if self.router.max_connections <= 0:
            raise ConfigError(f"`agentflow.router.max_connections` is {self.router.max_connections}; it must be positive.")
        if self.max_turns < 1:
            raise ConfigError(f"`agentflow.max_turns` is {self.max_turns}; it must be >= 1 (policy turns per episode).")
        for i, name in enumerate(self.tools):
            if name not in TOOLS:
                raise ConfigError(f"`agentflow.tools[{i}]` is {name!r}; it must be one of {', '.join(TOOLS)}.")
        if len(set(self.tools)) != len(self.tools):
            raise ConfigError(f"`agentflow.tools` is {self.tools!r}; each tool may be listed once.")
        self.sandbox.check()


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
MIXED_PRECISION = ("bf16", "fp16")
"""The values of ``model.mixed_precision`` besides null (FSDP2's parameter dtype)."""
PROX_LOGP_METHODS = ("recompute", "loglinear", "metrics")
"""The values of ``algorithm.prox_logp_method``."""

LORA_SYNC_MODES = ("merged", "adapter")
"""The values of ``model.lora.sync`` (docs/lora.md)."""


@dataclass
class LoRAConfig:
    """``model.lora.*``: train LoRA adapters (peft's ``LoraConfig``) instead of every weight (docs/lora.md).

    The policy is wrapped with ``peft.get_peft_model``: its weights are frozen and only the
    adapters' A and B matrices train, sit in the optimizer, the old-actor snapshot and the
    checkpoints (the base is rebuilt from ``model.model``). null (``model.lora`` unset): full
    fine-tuning.
    """

    r: int = 8
    """The adapters' rank (peft's ``r``); > 0."""
    alpha: float = 16.0
    """peft's ``lora_alpha``: the update B·A is scaled by ``alpha / r``; > 0."""
    dropout: float = 0.0
    """peft's ``lora_dropout`` on the adapters' input during training; in [0, 1)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """The linear layers that get an adapter, by the last part of their name (peft's
    ``target_modules``); each must name a linear layer of the policy (refused otherwise, when the
    policy is built)."""
    sync: str = "merged"
    """What the engines get at each weight sync: ``merged`` (base + B·A·alpha/r, in Hugging Face
    names, over ``rollout.weight_sync`` as for full fine-tuning) or ``adapter`` (only the adapter, in
    peft's saved format, loaded with ``/load_lora_adapter``; needs ``rollout.weight_sync: adapter``)."""

    def check(self) -> None:
        """Refuse a value out of range, in one sentence naming the key."""
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise ConfigError(f"`model.lora.r` is {self.r!r}; the adapters' rank must be an integer > 0.")
        if not self.alpha > 0:
            raise ConfigError(f"`model.lora.alpha` is {self.alpha}; it must be > 0 (the update is scaled by alpha / r).")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"`model.lora.dropout` is {self.dropout}; it must be in [0, 1).")
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            raise ConfigError(f"`model.lora.target_modules` is {self.target_modules!r}; it must list at least one "
                              "module name (e.g. q_proj, v_proj).")
        if self.sync not in LORA_SYNC_MODES:
            raise ConfigError(f"`model.lora.sync` is {self.sync!r}; it must be one of {', '.join(LORA_SYNC_MODES)}.")


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

    def check(self) -> None:
        """Refuse an ``algorithm.*`` value out of range, or a KL term without its reference; warn on a
        reference nothing uses."""
        if self.prox_logp_method not in PROX_LOGP_METHODS:
            raise ConfigError(
                f"`algorithm.prox_logp_method` is {self.prox_logp_method!r}; it must be one of {', '.join(PROX_LOGP_METHODS)}."
            )
        isc = self.is_correction
        if isc.level not in ("token", "sequence"):
            raise ConfigError(f"`algorithm.is_correction.level` is {isc.level!r}; it must be token or sequence.")
        if isc.mode not in ("truncate", "mask"):
            raise ConfigError(f"`algorithm.is_correction.mode` is {isc.mode!r}; it must be truncate or mask.")
        if self.loss_agg_mode not in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
            raise ConfigError(
                f"`algorithm.loss_agg_mode` is {self.loss_agg_mode!r}; it must be token-mean, "
                "seq-mean-token-sum or seq-mean-token-mean."
            )
        ref = self.reference
        if self.kl_coef != 0 and not ref.model:
            raise ConfigError(
                f"`algorithm.kl_coef` is {self.kl_coef} while `algorithm.reference.model` is not set; "
                "the KL penalty needs a reference model (e.g. `policy`, a frozen copy of the initial policy)."
            )
        if ref.dtype is not None and ref.dtype not in REFERENCE_DTYPES:
            raise ConfigError(
                f"`algorithm.reference.dtype` is {ref.dtype!r}; it must be null or one of {', '.join(REFERENCE_DTYPES)}."
            )
        if ref.model and self.kl_coef == 0:
            warnings.warn(
                f"`algorithm.reference.model` is {ref.model!r} while `algorithm.kl_coef` is 0; the reference runs on every "
                "training call (`timing/teacher`) only to report `train/ref_kl`, nothing in the loss uses it.",
                ConfigWarning,
                stacklevel=3,
            )


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

    def check(self) -> None:
        """Refuse an ``eval.sampling.*`` value that cannot sample."""
        if self.n <= 0:
            raise ConfigError(f"`eval.sampling.n` is {self.n}; it must be a positive integer.")
        if self.greedy and self.n > 1:
            raise ConfigError(
                f"`eval.sampling.n` is {self.n} while `eval.sampling.greedy` is true; greedy decoding gives {self.n} identical "
                "samples, so n must be 1 (or set greedy: false to sample)."
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"`eval.sampling.temperature` is {self.temperature}; it must be a finite number >= 0.")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"`eval.sampling.top_p` is {self.top_p}; it must be in (0, 1].")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"`eval.sampling.top_k` is {self.top_k}; it must be a positive integer or -1 (disabled).")
        if self.max_response_length is not None and self.max_response_length <= 0:
            raise ConfigError(
                f"`eval.sampling.max_response_length` is {self.max_response_length}; it must be a positive integer or null "
                "(rollout.max_response_length)."
            )


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

    def check(self) -> None:
        """Refuse an ``eval.*`` configuration that cannot run: when it is on, its sets, their names and
        rewards, the sampling, the timeout."""
        if self.every_n_steps < 0:
            raise ConfigError(f"`eval.every_n_steps` is {self.every_n_steps}; it must be >= 0 (0 disables evaluation).")
        enabled = self.every_n_steps > 0 or self.at_start or self.at_end
        if enabled and not self.data_source:
            on = f"`eval.every_n_steps` is {self.every_n_steps}" if self.every_n_steps > 0 else (
                "`eval.at_start` is true" if self.at_start else "`eval.at_end` is true")
            raise ConfigError(f"{on} while `eval.data_source` is empty; list at least one eval set to evaluate on.")
        names: set[str] = set()
        for i, src in enumerate(self.data_source):
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
            src.check(key, for_eval=True)
            if (src.path or src.datasource) and not src.reward:
                raise ConfigError(
                    f"`{key}.{'path' if src.path else 'datasource'}` is set but `{key}.reward` is not; name the reward, e.g. "
                    "lightning_fasync.data.rewards:math_reward (math-verify)."
                )
        self.sampling.check()
        if not self.timeout > 0:
            raise ConfigError(f"`eval.timeout` is {self.timeout}; it must be > 0 seconds.")
        if not math.isfinite(self.accuracy_threshold):
            raise ConfigError(f"`eval.accuracy_threshold` is {self.accuracy_threshold}; it must be a finite number.")


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
    """The data sources actually used; None means [data_source]. Exactly one is supported; given, it
    replaces ``data_source``, which must then be left unset."""
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
    def boundary_mode(self) -> str:
        """How this run's step boundaries treat the requests in flight: ``wait``, ``abort`` or
        ``inflight`` (:attr:`RolloutConfig.boundary_mode`). In colocate ``auto`` reads ``abort``; an
        explicit ``inflight`` there freezes the over-dispatched requests in the engines, their KV cache
        kept, from the end of the rollout phase through training and the sync
        (:meth:`~lightning_fasync.pipeline.controller.FullyAsyncController.fetch`)."""
        mode = self.rollout.boundary_mode
        if mode == "inflight" and not self.fully_async.enable and self.rollout.weight_update_mode != "inflight":
            return "abort"
        return mode

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
