"""RolloutRuntime: the engines, the agent flow, the datasource, the reward and the step-protocol
controller for one training run. The Lightning callback and the Fabric loop both build one;
neither starts engines or syncs weights on its own.

The rollout side is injected: a datasource, reward, agent flow or engine client passed in is used
as it is; what is not passed is built from the config's ``package.module:Name`` entries by
:mod:`lightning_fasync.components` (built-ins by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from lightning_fasync.components import instantiate, load_object
from lightning_fasync.config import ConfigError, DataSourceConfig, FasyncConfig, check_offload
from lightning_fasync.fleet.resources import ResourcePlan, pin_trainer
from lightning_fasync.pipeline.controller import FullyAsyncController
from lightning_fasync.pipeline.datasource import DataSource, ListDataSource
from lightning_fasync.pipeline.engine_client import EngineClient, SamplingParams
from lightning_fasync.pipeline.evaluator import EvalSource, Evaluator
from lightning_fasync.pipeline.flow import AgentFlow, RewardFn
from lightning_fasync.pipeline.state import PipelineError
from lightning_fasync.registry import ENGINE_BACKENDS, WEIGHT_PATHS, EngineStart, weight_sync_choices
from lightning_fasync.types import PromptSample
from lightning_fasync.weights.tensor_stream import TensorStream


@dataclass
class _EvalSet:
    """One ``eval.data_source`` entry, built: its prompts, reward runner and stop tokens."""

    name: str
    samples: list[PromptSample]
    reward: Any  # RewardRunner, closed with the runtime
    stop: list[int]
    longest_prompt: int


class RolloutRuntime:
    """Start the rollout side of a run; stop it idempotently.

    Arguments:
        cfg: the validated plugin config.
        engine_model: what the engines load (the policy's preset name or local directory).
        plan: the resource split (cores per engine replica and for the trainer).
        log_dir: where ``events.jsonl`` and ``ledger.jsonl`` go.
        pin: pin this (trainer) process to ``plan.trainer_cores`` after the engines start.
        engine_threads: torch threads per engine (default: its core count).
        engine_startup_timeout: seconds each replica has to become healthy; None:
            ``rollout.engine_startup_timeout``.
        admin_timeout: seconds one weight sync may take.
        weight_sync: the weight-sync path (``distributed``, ``tensor``, ``disk``; see
            :mod:`~lightning_fasync.weights.sync`), or ``auto``; None: ``rollout.weight_sync``.
            An engine client of your own (not an ``SGLangClient``) receives the weights through the
            path's ``client_method`` (``update_weights_from_<path>(tensors, weight_version=...)``).
        datasource, reward, flow: the rollout side's objects; None builds them from the config.
        client: an engine client for engines someone else runs; None: the engines of
            ``rollout.backend`` (embedded or SGLang servers started here, or ``rollout.engine_urls``).
        colocate_offload: colocate mode hands the devices over between rollout and training (the
            driver resolves ``colocate_offload`` for its device): embedded engines start with
            ``--enable-memory-saver`` and :meth:`offload_rollout` and the ``onload_rollout_*``
            methods release and resume their memory.
    """

    def __init__(
        self,
        cfg: FasyncConfig,
        engine_model: Optional[str],
        plan: ResourcePlan,
        log_dir: Optional[str],
        pin: bool = True,
        engine_threads: Optional[int] = None,
        engine_startup_timeout: Optional[float] = None,
        admin_timeout: float = 600.0,
        weight_sync: Optional[str] = None,
        datasource: Optional[DataSource] = None,
        reward: Optional[RewardFn] = None,
        flow: Optional[AgentFlow] = None,
        client: Optional[EngineClient] = None,
        colocate_offload: bool = False,
    ) -> None:
        from lightning_fasync.weights.sync import resolve_weight_sync

        check_offload(cfg, colocate_offload)  # before any engine starts
        if weight_sync is not None and weight_sync not in weight_sync_choices():
            raise ConfigError(f"`weight_sync` is {weight_sync!r}; it must be one of {', '.join(weight_sync_choices())}.")
        weight_sync = resolve_weight_sync(cfg, weight_sync)
        self.cfg = cfg
        self.admin_timeout = admin_timeout
        self.weight_sync = weight_sync
        self._sync: Any = None  # the WeightSync, built at the first sync
        self.log_dir = log_dir
        self.pool: Any = None
        self._closed = False
        src = cfg.sources[0]
        self._task: Any = None
        self._engine_model = engine_model
        self._tokenizer: Any = None
        self._flows: list[Any] = []  # flows built here, closed at shutdown (a tool flow owns sandboxes)
        # Whether the training prompts come from the config's task (else: files, a datasource named
        # in the config, or one passed in), which decides whose EOS ends a response by default.
        self._prompts_from_task = datasource is None and not (src.path or src.datasource)
        self._reward_given = reward is not None
        backend = ENGINE_BACKENDS.get(cfg.rollout.backend)
        prepared: Any = None
        if client is None and backend.prepare is not None:
            # What the backend cannot serve as configured is refused before anything is read, built or started.
            prepared = backend.prepare(cfg, engine_model, plan.num_replicas, engine_threads)
        if flow is None:  # the python tool's sandbox this host cannot give is refused before any engine starts
            from lightning_fasync.agents.sandbox import check_config as check_sandbox

            check_sandbox(cfg.agentflow)
        if datasource is None:
            datasource = self._build_datasource()
        # The synthetic task's reward reads token ids: no decoding of every response for it.
        decode = True
        if reward is None:
            if src.reward:
                reward = load_object(src.reward, "data_source.reward")
            elif src.path or src.datasource:
                raise ConfigError(
                    f"`data_source.{'path' if src.path else 'datasource'}` is set but `data_source.reward` is not; name "
                    "the reward, e.g. lightning_fasync.data.rewards:math_reward (math-verify) or "
                    "lightning_fasync.data.gym:gym_reward (reasoning-gym)."
                )
            else:
                reward, decode = self.task.reward, False
        from lightning_fasync.pipeline.reward_runner import RewardRunner

        if src.reward_processes == 0 and getattr(reward, "__module__", "") == "lightning_fasync.data.rewards":
            warnings.warn(
                "`data_source.reward` is a math-verify reward and `data_source.reward_processes` is 0: a pathological "
                "answer (a tower of powers) can hold the GIL for minutes in threads, past its timeout; set "
                "`data_source.reward_processes` to 1 or more.",
                stacklevel=2,
            )

        # Off the producer's event loop (threads, or processes for CPU-heavy verifiers), with a
        # per-call timeout; text-level rewards find the decoded response in trajectory.metadata.
        self.reward_runner = RewardRunner(
            reward, timeout_s=src.reward_timeout, processes=src.reward_processes,
            tokenizer=self._try_tokenizer() if decode else None,
            name="the reward passed to the driver" if self._reward_given else "data_source.reward",
        )
        reward = self.reward_runner
        # The eval sets (prompts read once, rewards) before the engines start: they size the context too.
        self._eval_sets: list[_EvalSet] = []
        try:
            self._eval_sets = self._build_eval_sets()
        except BaseException:
            self.reward_runner.close()
            raise
        context = cfg.rollout.sglang_args.context_length
        if context is None:
            longest = datasource.max_prompt_length
            if longest is None:
                raise ConfigError(
                    f"`rollout.sglang_args.context_length` is null and the datasource {type(datasource).__name__} does not "
                    "know its longest prompt; set the context length."
                )
            context = longest + cfg.rollout.max_response_length + 1
            eval_budget = cfg.eval.sampling.max_response_length or cfg.rollout.max_response_length
            context = max([context, *(e.longest_prompt + eval_budget + 1 for e in self._eval_sets)])
        self._client_given = client is not None
        # What ends a response, before anything starts (an agent flow passed in sets its own).
        self.stop_token_ids: Optional[list[int]] = None
        self.stop_source = "as the agent flow passed to the driver says"
        if flow is None:
            try:
                self.stop_token_ids, self.stop_source = self._stop_token_ids(src, self._prompts_from_task)
            except BaseException:
                self.reward_runner.close()
                for eval_set in self._eval_sets:
                    eval_set.reward.close()
                raise
        from lightning_fasync.fleet.client import SGLangClient

        if (client is not None and not isinstance(client, SGLangClient)
                and not callable(getattr(client, WEIGHT_PATHS.get(weight_sync).client_method, None))):
            raise ConfigError(
                f"The engine client {type(client).__name__} has no {WEIGHT_PATHS.get(weight_sync).client_method}(); weight sync "
                f"`{weight_sync}` needs it (an SGLangClient speaks every path itself)."
            )
        self.colocate_offload = colocate_offload
        self.resume_hint: Callable[[str], str] = lambda path: "`--ckpt_path last`"
        """A checkpoint's path -> how the driver in use resumes from it (the driver sets its own)."""
        missing = [m for m in ("release_memory_occupation", "resume_memory_occupation")
                   if client is not None and not callable(getattr(client, m, None))]
        if colocate_offload and missing:
            raise ConfigError(
                f"`colocate_offload` is on but the engine client {type(client).__name__} has no {missing[0]}(); the "
                "colocate step releases and resumes the engines' memory through it (SGLangClient has both)."
            )
        startup_timeout = cfg.rollout.engine_startup_timeout if engine_startup_timeout is None else engine_startup_timeout
        if client is None:
            self.pool = backend.start(EngineStart(
                cfg=cfg, engine_model=engine_model, plan=plan, prepared=prepared, context_length=context,
                log_dir=log_dir, startup_timeout=startup_timeout, engine_threads=engine_threads,
                # SGLang's flag: without it /release_memory_occupation frees nothing.
                server_args=(["--enable-memory-saver"] if colocate_offload else [])
                + (["--enable-deterministic-inference"] if cfg.rollout.deterministic_inference else []),
            ))
        try:
            if pin:
                # Engines first (each pins itself), then the trainer's own pinning.
                pin_trainer(plan.trainer_cores, plan.trainer_threads)
            self._admin_client: Callable[[], Any] = (lambda: client) if client is not None else self.pool.client
            if client is None:
                client = self.pool.client(max_connections=cfg.agentflow.router.max_connections,
                                          generate_timeout_s=cfg.rollout.request_timeout)
            if flow is None:
                sampling = SamplingParams(
                    temperature=cfg.rollout.temperature,
                    top_p=cfg.rollout.top_p,
                    top_k=cfg.rollout.top_k,
                    stop_token_ids=self.stop_token_ids,
                    sampling_seed=cfg.rollout.sampling_seed,
                )
                flow = self._build_flow(client, sampling, cfg.rollout.max_response_length, reward)
            evaluator = self._build_evaluator(client)
            self.controller = FullyAsyncController(cfg, datasource, flow, client, log_dir=log_dir, evaluator=evaluator,
                                                   colocate_offload=colocate_offload)
            self.controller.metric_sources.append(self.reward_runner.metrics)
            if cfg.rollout.check_weights:
                self.controller.metric_sources.append(self._check_metrics)
            if callable(getattr(flow, "metrics", None)):  # e.g. ToolAgentFlow's agent/* counts
                self.controller.metric_sources.append(flow.metrics)
            if self.pool is not None and backend.supervised:  # nobody restarts the others' servers
                er = cfg.rollout.engine_restart
                state = self.controller.state
                supervisor = self.pool.supervise(
                    max_attempts=er.max_attempts, backoff_s=er.backoff_s, timeout_s=er.timeout_s,
                    hang_timeout_s=er.hang_timeout_s, poll_s=er.poll_interval_s,
                    emit=lambda event, **fields: state.events.emit(event, step=state.rollout_step, **fields),
                    on_fatal=state.set_fault,
                )
                self.controller.metric_sources.append(supervisor.metrics)
        except BaseException:
            if self.pool is not None:
                self.pool.stop()
            self.reward_runner.close()
            for eval_set in self._eval_sets:
                eval_set.reward.close()
            raise

    def describe(self, plan: ResourcePlan) -> str:
        """One line for the run's log: the mode, the resource split, the weight-sync path and the
        stop tokens in force (the drivers print it on global rank 0 before training starts)."""
        cfg = self.cfg
        fa = cfg.fully_async
        if fa.enable:
            mode = f"fully-async ({fa.sliding_window}, fully_async.stale_steps {fa.stale_steps:g})"
        else:
            mode = ("colocate, the baseline: rollout and training take turns on the same resources (for fully-async "
                    "set colocate: false and fully_async.enable: true)")
        mode += ", partial rollout" if cfg.rollout.partial else ""
        if self._client_given:
            engines = "engines of the client passed in"
        else:
            backend = ENGINE_BACKENDS.get(cfg.rollout.backend)
            engines = (backend.describe(cfg, plan) if backend.describe is not None
                       else f"engines of rollout.backend `{cfg.rollout.backend}`")
        stops = f"at token ids {self.stop_token_ids} ({self.stop_source})" if self.stop_token_ids is not None \
            else self.stop_source
        return (f"lightning-fasync: {mode}; trainer on cores {plan.trainer_cores}, {engines}; weight sync "
                f"`{self.weight_sync}`; responses end {stops}.")

    @property
    def task(self) -> Any:
        """The config's task (``data_source.task``), built on first use."""
        if self._task is None:
            from lightning_fasync.data.tasks import make_task

            src = self.cfg.sources[0]
            self._task = make_task(src.task, **src.task_args)
        return self._task

    @property
    def tokenizer(self) -> Any:
        """The policy's tokenizer (that of ``engine_model``), loaded on first use."""
        if self._tokenizer is None:
            if not self._engine_model:
                raise ConfigError(
                    "The datasource needs the policy's tokenizer, but the runtime was not given engine_model= "
                    "(a preset or a local Hugging Face directory)."
                )
            from lightning_fasync.policy import load_tokenizer

            self._tokenizer = load_tokenizer(self._engine_model)
        return self._tokenizer

    def _try_tokenizer(self) -> Any:
        try:
            return self.tokenizer
        except (ConfigError, ValueError, OSError):
            return None

    def _build_datasource(self, src: Optional[DataSourceConfig] = None, key: str = "data_source", task: Any = None) -> DataSource:
        """``src``'s datasource (default: the training one); ``key`` names it in errors; ``task``
        makes the prompts when neither ``path`` nor ``datasource`` is set (default: ``self.task``)."""
        src = src or self.cfg.sources[0]
        if src.path:
            from lightning_fasync.data.files import FileDataSource

            return FileDataSource(
                src.path, self.tokenizer, prompt_key=src.prompt_key, answer_key=src.answer_key,
                system_prompt=src.system_prompt, max_prompt_length=src.max_prompt_length, format=src.format,
                shuffle=src.shuffle, seed=src.seed,
            )
        if src.datasource:
            factory = load_object(src.datasource, f"{key}.datasource")
            # A datasource that renders prompts takes the policy's tokenizer (unless its args give one).
            injected = {}
            if "tokenizer" not in src.datasource_args and "tokenizer" in inspect.signature(factory).parameters:
                injected["tokenizer"] = self.tokenizer
            ds = instantiate(src.datasource, f"{key}.datasource", src.datasource_args, **injected)
            if not isinstance(ds, DataSource):
                raise ConfigError(f"`{key}.datasource` built a {type(ds).__name__}, which is not a DataSource.")
            return ds
        prompts = (task or self.task).make_prompts(src.num_prompts, src.seed)
        return ListDataSource(prompts, shuffle=src.shuffle, seed=src.seed)

    # ------------------------------------------------------------------ evaluation (eval.*)

    def _build_eval_sets(self) -> list["_EvalSet"]:
        """The ``eval.data_source`` sets, built as the training source is: prompts (the first epoch,
        at most ``num_prompts``, read once), reward (off the event loop, with its timeout) and stop tokens."""
        from lightning_fasync.data.tasks import make_task
        from lightning_fasync.pipeline.evaluator import take_samples
        from lightning_fasync.pipeline.reward_runner import RewardRunner

        out: list[_EvalSet] = []
        try:
            for i, src in enumerate(self.cfg.eval.data_source):
                key = f"eval.data_source[{i}]"
                task = None if src.path or src.datasource else make_task(src.task, **src.task_args)
                samples = take_samples(self._build_datasource(src, key, task), src.num_prompts)
                if not samples:
                    raise ConfigError(f"`{key}` ({src.name!r}) yields no prompts; an eval set needs at least one.")
                # validate() makes files and datasources name their reward; a task scores its own.
                reward = load_object(src.reward, f"{key}.reward") if src.reward else task.reward
                runner = RewardRunner(
                    reward, timeout_s=src.reward_timeout, processes=src.reward_processes,
                    tokenizer=self._try_tokenizer() if src.reward else None, name=f"{key}.reward",
                )
                out.append(_EvalSet(src.name, samples, runner, self._stop_token_ids(src, task is not None, task, key)[0],
                                    max(len(s.input_ids) for s in samples)))
        except BaseException:
            for eval_set in out:
                eval_set.reward.close()
            raise
        return out

    def _stop_token_ids(self, src: DataSourceConfig, from_task: bool, task: Any = None,
                        key: str = "data_source") -> tuple[list[int], str]:
        """The token ids that end a response, and where they come from: ``rollout.stop_token_ids``;
        else, when the config's task makes the prompts, the task's EOS; else the policy's own
        (:func:`~lightning_fasync.data.files.policy_stop_token_ids`: its tokenizer's EOS and
        end-of-turn token, its generation config's ``eos_token_id``)."""
        stop = self.cfg.rollout.stop_token_ids
        if stop is not None:
            return list(stop), "rollout.stop_token_ids"
        if from_task:
            return list((task or self.task).stop_token_ids), f"the `{src.task}` task's EOS"
        from lightning_fasync.data.files import policy_stop_token_ids

        try:
            ids, names = policy_stop_token_ids(self.tokenizer, self._engine_model)
        except (ConfigError, ValueError, OSError) as exc:
            raise ConfigError(
                f"`rollout.stop_token_ids` is not set and the policy's tokenizer cannot be loaded to find its EOS "
                f"({exc}); set rollout.stop_token_ids to the ids that end a response."
            ) from exc
        if not ids:
            raise ConfigError(
                f"`rollout.stop_token_ids` is not set and the policy's tokenizer and generation config name no EOS "
                f"token; set rollout.stop_token_ids to the ids that end a response (prompts of `{key}`)."
            )
        return ids, f"the policy's EOS ({', '.join(names)})"

    def _build_evaluator(self, client: EngineClient) -> Optional[Evaluator]:
        """The evaluator of ``eval.*`` (None without eval sets): per set, an agent flow built like the
        training flow (``agentflow.flow``) with the eval sampling, its own reward and request ids
        ``eval-<name>-``, on an engine client of its own."""
        if not self._eval_sets:
            return None
        cfg = self.cfg
        sp = cfg.eval.sampling
        # The evaluator runs on its own event loop, not the producer's, and an HTTP client's
        # connections belong to the loop that opened them: a client of its own.
        own = self.pool is not None or callable(getattr(client, "clone", None))
        if self.pool is not None:
            eval_client = self.pool.client(max_connections=cfg.agentflow.router.max_connections,
                                           generate_timeout_s=cfg.rollout.request_timeout)
        else:
            eval_client = client.clone() if own else client  # type: ignore[attr-defined]
        sources = []
        for eval_set in self._eval_sets:
            sampling = SamplingParams(
                temperature=0.0 if sp.greedy else sp.temperature,  # SGLang: temperature 0 is greedy
                top_p=1.0 if sp.greedy else sp.top_p,
                top_k=-1 if sp.greedy else sp.top_k,
                stop_token_ids=eval_set.stop,
            )
            flow = self._build_flow(eval_client, sampling, sp.max_response_length or cfg.rollout.max_response_length,
                                    eval_set.reward, rid_prefix=f"eval-{eval_set.name}-")
            sources.append(EvalSource(eval_set.name, flow, eval_set.samples))
        return Evaluator(sources, n=sp.n, timeout=cfg.eval.timeout, accuracy_threshold=cfg.eval.accuracy_threshold,
                         max_connections=cfg.agentflow.router.max_connections, client=eval_client if own else None)

    def _build_flow(self, client: EngineClient, sampling: SamplingParams, max_response_length: int, reward: Any,
                    rid_prefix: Optional[str] = None) -> AgentFlow:
        """``agentflow.flow`` built with the runtime's objects and ``agentflow.flow_args``; ``rid_prefix``
        replaces the flow's own request-id prefix (when it has one)."""
        af = self.cfg.agentflow
        args = dict(af.flow_args)
        injected: dict[str, Any] = {"client": client, "sampling": sampling, "max_response_length": max_response_length,
                                    "reward_fn": reward}
        if rid_prefix is not None:
            params = inspect.signature(load_object(af.flow, "agentflow.flow")).parameters
            if "rid_prefix" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                args.pop("rid_prefix", None)
                injected["rid_prefix"] = rid_prefix
        injected.update(self._agent_args(load_object(af.flow, "agentflow.flow"), args))
        flow = instantiate(af.flow, "agentflow.flow", args, **injected)
        if rid_prefix is not None and "rid_prefix" not in injected and hasattr(flow, "rid_prefix"):
            flow.rid_prefix = rid_prefix
        self._flows.append(flow)
        return flow

    def _agent_args(self, factory: Any, args: Mapping[str, Any]) -> dict[str, Any]:
        """What a multi-turn flow takes beyond the four objects every flow gets, each when its
        signature names it: the policy's ``tokenizer`` (unless ``flow_args`` give one, as a
        datasource gets it), ``max_turns``, ``tools`` and ``sandbox`` (``agentflow.*``) and
        ``max_connections`` (``agentflow.router.max_connections``, bounding each turn's request)."""
        params = inspect.signature(factory).parameters
        af = self.cfg.agentflow
        offered = {"max_turns": af.max_turns, "tools": list(af.tools), "sandbox": af.sandbox,
                   "max_connections": af.router.max_connections}
        out = {key: value for key, value in offered.items() if key in params}
        if "tokenizer" in params and "tokenizer" not in args:
            out["tokenizer"] = self.tokenizer
        return out

    def sync_weights(self, tensors: Mapping[str, torch.Tensor] | TensorStream, version: int) -> None:
        """Push ``tensors`` (Hugging Face names) to every engine as ``version`` over the
        ``weight_sync`` path (:mod:`~lightning_fasync.weights.sync`); the engines flush
        their caches. Only global rank 0 calls this. A :class:`TensorStream` (a sharded trainer's
        tensors, gathered one at a time) is consumed on this thread, bucket by bucket; if the push
        fails, the caller drains what is left of it so every rank's collectives match.

        Raises:
            WeightSyncError: an engine failed or the update was partial (names the engine, the step).
            PipelineError: the sync took longer than ``admin_timeout``.
        """
        controller = getattr(self, "controller", None)
        step = controller.state.rollout_step if controller is not None else None
        # The pool's lock: a replica restarting meanwhile joins before or after this version, whole.
        with self._pool_lock(f"The weight sync of step {step}"):
            try:
                asyncio.run(asyncio.wait_for(self._push(tensors, version, step), self.admin_timeout))
            except asyncio.TimeoutError:
                raise PipelineError(
                    f"The weight sync of step {step} to the engines took longer than {self.admin_timeout:.0f} s "
                    "(the driver's admin_timeout)."
                ) from None

    @contextlib.contextmanager
    def _pool_lock(self, what: str) -> Iterator[None]:
        """The engine pool's ``sync_lock`` (none without a pool of ours), waited for at most
        ``admin_timeout``: a replica or router restart holds it while it joins."""
        lock = self.pool.sync_lock if self.pool is not None else None
        if lock is None:
            yield
            return
        if not lock.acquire(timeout=self.admin_timeout):
            raise PipelineError(
                f"{what} waited {self.admin_timeout:g} s (the driver's admin_timeout) for the engine pool's sync lock, "
                "which a replica or router restart holds while it joins."
            )
        try:
            yield
        finally:
            lock.release()

    async def _push(self, tensors: Mapping[str, torch.Tensor] | TensorStream, version: int, step: Optional[int]) -> None:
        sync = self._weight_sync()
        if sync is None:  # an engine client of the caller's own: it takes a mapping
            if isinstance(tensors, TensorStream):  # gathered whole here (its interface has no stream)
                tensors = dict(tensors)
            method = WEIGHT_PATHS.get(self.weight_sync).client_method
            await getattr(self._admin_client(), method)(tensors, weight_version=version)
            return
        controller = getattr(self, "controller", None)
        if controller is not None:  # abort, or at an in-flight boundary in_place / retract
            sync.set_pause_mode(controller.sync_pause_mode)
        try:
            kept = await sync.push(tensors, version, step)
        finally:  # connections belong to this event loop, which ends with the push
            await sync.client.close()
            await sync.rpc.close()
        if kept is not None:
            self.pool.keep_weights(kept)

    def _check_metrics(self) -> dict[str, float]:
        """``weights/check_gap``: the last checked push's largest log-prob difference of the probe over
        the engines (``rollout.check_weights``; read at the boundary, before this step's push)."""
        gap = getattr(self._sync, "last_check_gap", None)
        return {} if gap is None else {"weights/check_gap": float(gap)}

    def _weight_sync(self) -> Any:
        """The :class:`~lightning_fasync.weights.sync.WeightSync` of ``weight_sync`` (built
        once: the ``distributed`` group lives across steps); None for a client of the caller's own."""
        from lightning_fasync.fleet.client import SGLangClient
        from lightning_fasync.weights.sync import make_weight_sync

        if self._sync is None:
            client = self._admin_client()
            if not isinstance(client, SGLangClient):
                return None
            if self._client_given:
                client = client.clone()  # its connections are the producer loop's
            client.admin_timeout_s = self.admin_timeout
            # Kept only where a supervisor restarts replicas (the embedded pool).
            keep = getattr(self.pool, "supervisor", None) is not None
            path = WEIGHT_PATHS.get(self.weight_sync)
            check_model = None
            if self.cfg.rollout.check_weights:
                if not self._engine_model:
                    raise ConfigError(
                        "`rollout.check_weights` is true, but the runtime was not given engine_model= (a preset or a "
                        "local Hugging Face directory): the check computes the probe's log-probs with the policy's "
                        "architecture. Pass it, or set rollout.check_weights false."
                    )
                check_model = self._engine_model
            self._sync = make_weight_sync(
                self.weight_sync, client, check_model=check_model,
                **(path.options(self.cfg, self._engine_model) if path.options is not None else {}),
                bucket_bytes=self.cfg.rollout.weight_sync_bucket_mb * 2**20,
                timeout_s=self.admin_timeout, keep=keep,
                work_dir=os.path.join(self.log_dir, "weights") if self.log_dir else None,
            )
            self._sync.keep_cache = self.cfg.rollout.resume_kv == "keep"
        return self._sync

    # ------------------------------------------------------------------ colocate offload (engine side)
    # The engines' half of the colocate stages (pipeline.controller.ColocateHooks), with SGLang's
    # memory tags in slime's order: everything goes, weights come back for the sync, then the rest.

    def offload_rollout(self) -> None:
        """Every engine releases its weights, KV cache and CUDA graphs (``timing/offload_rollout``)."""
        self._engine_memory("release", ["weights", "kv_cache", "cuda_graph"])

    def onload_rollout_weights(self) -> None:
        """Every engine takes its weights' memory back, before the weight sync fills it."""
        self._engine_memory("resume", ["weights"])

    def onload_rollout_kv(self) -> None:
        """Every engine takes its KV cache (and CUDA graphs) back, after the weight sync."""
        self._engine_memory("resume", ["kv_cache", "cuda_graph"])

    def _engine_memory(self, action: str, tags: list[str]) -> None:
        async def call() -> None:
            client = self._admin_client()
            try:
                await getattr(client, f"{action}_memory_occupation")(tags)
            finally:
                if not self._client_given:
                    await client.close()

        # The pool's lock, as a weight sync: a replica restarting meanwhile joins in the state the others are in.
        with self._pool_lock(f"/{action}_memory_occupation {tags}"):
            try:
                asyncio.run(asyncio.wait_for(call(), self.admin_timeout))
            except asyncio.TimeoutError:
                raise PipelineError(
                    f"/{action}_memory_occupation {tags} on the engines took longer than {self.admin_timeout:.0f} s "
                    "(the driver's admin_timeout)."
                ) from None
            if self.pool is not None and hasattr(self.pool, "released_tags"):
                self.pool.released_tags = (self.pool.released_tags | set(tags)) if action == "release" \
                    else (self.pool.released_tags - set(tags))

    @property
    def engine_lost(self) -> Optional[BaseException]:
        """The supervisor's fatal error once the engines are lost for good, else None."""
        supervisor = self.pool.supervisor if self.pool is not None else None
        return supervisor.fatal if supervisor is not None else None

    def save_after_fault(self, hooks: Any, last: Callable[[], Optional[str]], path: Callable[[int], str]) -> None:
        """After the engines are lost for good: save a checkpoint at the last consistent point if
        there is one (:meth:`FullyAsyncController.save_after_fault`) and say on stderr where a
        resume starts. Never raises: the run is already failing with the engines' error."""
        import sys

        try:
            step = self.controller.save_after_fault(hooks)
            where = path(step) if step is not None else last()
        except Exception as exc:  # noqa: BLE001 - report, keep the original error
            where = last()
            print(f"Could not save a checkpoint after the engines were lost: {type(exc).__name__}: {exc}", file=sys.stderr)
        print("The rollout engines are lost: "
              + (f"a resume with {self.resume_hint(where)} starts from {where}." if where
                 else "no checkpoint exists to resume from."),
              file=sys.stderr, flush=True)

    def shutdown(self, raise_errors: bool = True) -> None:
        """Stop the pipeline threads, then the engines (by pid). Idempotent."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        try:
            self.controller.shutdown(raise_errors=raise_errors)
        except BaseException as exc:  # noqa: BLE001 - stop the engines too, then report
            errors.append(exc)
        if self._sync is not None:  # before the engines stop: the distributed group is left cleanly
            try:
                asyncio.run(asyncio.wait_for(self._sync.close(), 30))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        if self.pool is not None:
            try:
                self.pool.stop()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        self.reward_runner.close()
        for eval_set in self._eval_sets:
            eval_set.reward.close()
        for flow in self._flows:
            if callable(getattr(flow, "close", None)):
                flow.close()
        if raise_errors and errors:
            raise errors[0]
