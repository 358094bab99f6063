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
import shutil
import tempfile
import warnings
from typing import Any, Callable, Mapping, Optional

import torch

from lightning_fasync.components import instantiate, load_object
from lightning_fasync.config import ConfigError, FasyncConfig
from lightning_fasync.lightning.resources import ResourcePlan, pin_trainer
from lightning_fasync.pipeline.controller import FullyAsyncController
from lightning_fasync.pipeline.datasource import DataSource, ListDataSource
from lightning_fasync.pipeline.engine_client import EngineClient, SamplingParams
from lightning_fasync.pipeline.flow import AgentFlow, RewardFn
from lightning_fasync.pipeline.state import PipelineError

WEIGHT_SYNC_MODES = ("tensor", "disk")


class RolloutRuntime:
    """Start the rollout side of a run; stop it idempotently.

    Arguments:
        cfg: the validated plugin config.
        engine_model: what the engines load (the policy's preset name or local directory).
        plan: the resource split (cores per engine replica and for the trainer).
        log_dir: where ``events.jsonl`` and ``ledger.jsonl`` go.
        pin: pin this (trainer) process to ``plan.trainer_cores`` after the engines start.
        engine_threads: torch threads per engine (default: its core count).
        engine_startup_timeout: seconds each replica has to become healthy.
        admin_timeout: seconds one weight sync may take.
        weight_sync: ``tensor`` (one safetensors file in shared memory, same host) or ``disk``
            (a Hugging Face safetensors directory under ``log_dir``, SGLang's
            ``/update_weights_from_disk``).
        datasource, reward, flow: the rollout side's objects; None builds them from the config.
        client: an engine client for engines someone else runs; None starts the embedded engines.
    """

    def __init__(
        self,
        cfg: FasyncConfig,
        engine_model: Optional[str],
        plan: ResourcePlan,
        log_dir: Optional[str],
        pin: bool = True,
        engine_threads: Optional[int] = None,
        engine_startup_timeout: float = 180.0,
        admin_timeout: float = 600.0,
        weight_sync: str = "tensor",
        datasource: Optional[DataSource] = None,
        reward: Optional[RewardFn] = None,
        flow: Optional[AgentFlow] = None,
        client: Optional[EngineClient] = None,
    ) -> None:
        if weight_sync not in WEIGHT_SYNC_MODES:
            raise ConfigError(f"`weight_sync` is {weight_sync!r}; it must be one of {', '.join(WEIGHT_SYNC_MODES)}.")
        self.cfg = cfg
        self.admin_timeout = admin_timeout
        self.weight_sync = weight_sync
        self.log_dir = log_dir
        self.pool: Any = None
        self._closed = False
        src = cfg.sources[0]
        self._task: Any = None
        self._engine_model = engine_model
        self._tokenizer: Any = None
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
            tokenizer=self._try_tokenizer() if decode else None, name="data_source.reward",
        )
        reward = self.reward_runner
        context = cfg.rollout.sglang_args.context_length
        if context is None:
            longest = datasource.max_prompt_length
            if longest is None:
                raise ConfigError(
                    f"`rollout.sglang_args.context_length` is null and the datasource {type(datasource).__name__} does not "
                    "know its longest prompt; set the context length."
                )
            context = longest + cfg.rollout.max_response_length + 1
        self._client_given = client is not None
        if client is not None and not callable(getattr(client, f"update_weights_from_{weight_sync}", None)):
            raise ConfigError(
                f"The engine client {type(client).__name__} has no update_weights_from_{weight_sync}(); weight sync "
                f"`{weight_sync}` needs it (SGLangClient has both update_weights_from_tensor and update_weights_from_disk)."
            )
        if client is None:
            if not engine_model:
                raise PipelineError(
                    "The rollout engines need to know what to load: pass engine_model= (a preset such as 'tiny' or a "
                    "local Hugging Face directory) or set the module's engine_model."
                )
            from lightning_fasync.rollout.pool import RolloutPool

            threads = engine_threads or max(1, len(plan.replica_cores[0]))
            self.pool = RolloutPool(
                engine_model,
                num_replicas=plan.num_replicas,
                threads_per_replica=threads,
                max_running_requests=cfg.rollout.sglang_args.max_running_requests,
                cpu_cores=plan.replica_cores,
                context_length=context,
                startup_timeout=engine_startup_timeout,
            ).start()
        try:
            if pin:
                # Engines first (each pins itself), then the trainer's own pinning.
                pin_trainer(plan.trainer_cores)
            self._admin_client: Callable[[], Any] = (lambda: client) if client is not None else self.pool.client
            if client is None:
                client = self.pool.client(max_connections=cfg.agentflow.router.max_connections,
                                          generate_timeout_s=cfg.rollout.request_timeout)
            if flow is None:
                stop = cfg.rollout.stop_token_ids
                if stop is None:
                    if src.path or (src.datasource and self._try_tokenizer() is not None):
                        from lightning_fasync.data.files import stop_token_ids

                        stop = stop_token_ids(self.tokenizer)
                    else:
                        stop = self.task.stop_token_ids
                sampling = SamplingParams(
                    temperature=cfg.rollout.temperature,
                    top_p=cfg.rollout.top_p,
                    top_k=cfg.rollout.top_k,
                    stop_token_ids=list(stop),
                )
                flow = instantiate(
                    cfg.agentflow.flow, "agentflow.flow", cfg.agentflow.flow_args,
                    client=client, sampling=sampling, max_response_length=cfg.rollout.max_response_length, reward_fn=reward,
                )
            self.controller = FullyAsyncController(cfg, datasource, flow, client, log_dir=log_dir)
            self.controller.metric_sources.append(self.reward_runner.metrics)
            if self.pool is not None:
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
            raise

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

    def _build_datasource(self) -> DataSource:
        src = self.cfg.sources[0]
        if src.path:
            from lightning_fasync.data.files import FileDataSource

            return FileDataSource(
                src.path, self.tokenizer, prompt_key=src.prompt_key, answer_key=src.answer_key,
                system_prompt=src.system_prompt, max_prompt_length=src.max_prompt_length, format=src.format,
                shuffle=src.shuffle, seed=src.seed,
            )
        if src.datasource:
            factory = load_object(src.datasource, "data_source.datasource")
            # A datasource that renders prompts takes the policy's tokenizer (unless its args give one).
            injected = {}
            if "tokenizer" not in src.datasource_args and "tokenizer" in inspect.signature(factory).parameters:
                injected["tokenizer"] = self.tokenizer
            ds = instantiate(src.datasource, "data_source.datasource", src.datasource_args, **injected)
            if not isinstance(ds, DataSource):
                raise ConfigError(f"`data_source.datasource` built a {type(ds).__name__}, which is not a DataSource.")
            return ds
        prompts = self.task.make_prompts(src.num_prompts, src.seed)
        return ListDataSource(prompts, shuffle=src.shuffle, seed=src.seed)

    def sync_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Push ``tensors`` to every engine as ``version`` (they flush their caches)."""

        async def push() -> None:
            client = self._admin_client()
            try:
                if self.weight_sync == "tensor":
                    if self.pool is not None:  # our own client: keep the file for restarted replicas
                        kept = await client.update_weights_from_tensor(tensors, weight_version=version, keep=True)
                    else:
                        kept = await client.update_weights_from_tensor(tensors, weight_version=version)
                else:
                    kept = await self._push_disk(client, tensors, version)
                if kept is not None and self.pool is not None:
                    self.pool.keep_weights(self.weight_sync, kept, version)
            finally:
                if not self._client_given:
                    await client.close()

        # The pool's lock: a replica restarting meanwhile joins before or after this version, whole.
        lock = self.pool.sync_lock if self.pool is not None else contextlib.nullcontext()
        with lock:
            try:
                asyncio.run(asyncio.wait_for(push(), self.admin_timeout))
            except asyncio.TimeoutError:
                raise PipelineError(f"The weight sync to the engines took longer than {self.admin_timeout:.0f} s.") from None

    async def _push_disk(self, client: Any, tensors: Mapping[str, torch.Tensor], version: int) -> Optional[str]:
        """Write a safetensors directory and have every engine load it; then remove it, or, with
        a pool of our own, return it to be kept for restarted replicas."""
        from safetensors.torch import save_file

        root = os.path.join(self.log_dir, "weights") if self.log_dir else None
        if root:
            os.makedirs(root, exist_ok=True)
        directory = tempfile.mkdtemp(prefix=f"v{version}-", dir=root)
        keep = False
        try:
            cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
            await asyncio.get_running_loop().run_in_executor(None, save_file, cpu, os.path.join(directory, "model.safetensors"))
            await client.update_weights_from_disk(directory, weight_version=version)
            keep = self.pool is not None
        finally:
            if not keep:
                shutil.rmtree(directory, ignore_errors=True)
        return directory if keep else None

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
              + (f"a resume with `--ckpt_path last` starts from {where}." if where else "no checkpoint exists to resume from."),
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
        if self.pool is not None:
            try:
                self.pool.stop()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        self.reward_runner.close()
        if raise_errors and errors:
            raise errors[0]
