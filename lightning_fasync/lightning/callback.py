"""FullyAsyncCallback: makes a Lightning fit loop the spec's trainer consumer.

Hooks, in the order Lightning calls them:

- ``setup``: check the module against the config (nothing has started yet), plan resources,
  start the engine replicas (+ sglang-router when several), build the pipeline controller.
- ``load_state_dict`` (on resume): keep the pipeline state until the threads start.
- ``on_train_start``: restore the pipeline state, push the trainer's weights to the engines (and
  evaluate them with ``eval.at_start``), start producer and collector.
- ``on_train_batch_start``: fetch M // N groups from the PipelineBuffer into the batch ticket.
- ``on_train_batch_end``: record the call's metrics; when the controller's :class:`StepSchedule`
  says the step is over, run the step boundary through :class:`FullyAsyncController` (pause,
  metrics, checkpoint on ``save_freq``, weight sync, evaluation on ``eval.*``, resume) and log the
  step's metrics (``val/*`` included) once, at step = rollout step.
- ``on_save_checkpoint`` / ``on_load_checkpoint``: record the run's identity; refuse a resume that
  would break exactly-once accounting (:mod:`~lightning_fasync.runtime.checkpoints`).
- ``on_exception`` / ``teardown``: stop threads and engines, idempotently.

The callback is the run's checkpoint callback: a ``ModelCheckpoint`` (so the Trainer adds no
default one of its own) whose checkpoints follow ``trainer.save_freq``, and through which
``trainer.fit(..., ckpt_path="last")`` resumes from the newest ``checkpoints/last.ckpt`` under the
Trainer's root directory.

SIGTERM or SIGINT during ``fit`` finishes the step, saves a checkpoint and exits with status
128 + signal (:mod:`~lightning_fasync.runtime.preemption`).

The module must implement :class:`~lightning_fasync.lightning.hooks.FullyAsyncHooks`.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Mapping, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

from lightning_fasync.config import ConfigError, FasyncConfig, colocate_offload_enabled, load_config, validate
from lightning_fasync.lightning.batch import RolloutBatch
from lightning_fasync.lightning.progress import RolloutProgressBar
from lightning_fasync.runtime.follower import DriverHooks, Follower
from lightning_fasync.runtime.checkpoints import CheckpointFiles, check_hparams, check_resume, find_last, run_identity, save_hf
from lightning_fasync.lightning.hooks import FullyAsyncHooks, require_hooks
from lightning_fasync.runtime.preemption import Preemption
from lightning_fasync.runtime.ranks import check_minibatch_share, data_parallel, dp_share, group_tokens, reduce_metrics
from lightning_fasync.fleet.resources import pin_trainer, plan_cpu_resources, trainer_share
from lightning_fasync.runtime.rollout_runtime import RolloutRuntime
from lightning_fasync.pipeline.controller import FullyAsyncController, StepSchedule
from lightning_fasync.pipeline.datasource import DataSource
from lightning_fasync.pipeline.engine_client import EngineClient
from lightning_fasync.pipeline.flow import AgentFlow, RewardFn
from lightning_fasync.pipeline.state import PipelineError

#: How a run of a plain ``Trainer.fit`` resumes (the CLI and the Fabric loop say it their way).
TRAINER_RESUME = '`trainer.fit(..., ckpt_path="last")`'

PROGRESS_KEYS = {
    "rollout/reward_mean": "reward",
    "rollout/pipeline_buf_size": "buf",
    "perf/wait_ratio": "wait",
}


def _refuse_sharded(strategy: Any) -> None:
    """Refuse, before anything starts, the sharded strategies the weight sync cannot gather from:
    the legacy ``FSDPStrategy`` (FSDP1 flat parameters, CUDA only) and DeepSpeed. Lightning's
    ``ModelParallelStrategy`` (FSDP2 + tensor parallel, DTensor parameters) is supported."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy)):
        raise ConfigError(
            f"`trainer.strategy` is {type(strategy).__name__}, which FullyAsyncCallback cannot gather weights from; "
            "use ModelParallelStrategy for sharded training (FSDP2 and tensor parallel: --trainer.strategy="
            "ModelParallelStrategy --trainer.strategy.data_parallel_size=N), or DDP."
        )


def _check_fit_arguments(trainer: Any, pl_module: Any, calls_per_step: int, rollout_steps: Optional[int] = None) -> None:
    """Refuse, before anything starts, a ``max_steps`` that ends inside a rollout step or disagrees with
    the config's ``trainer.rollout_steps`` (under a plain Trainer ``max_steps`` decides, so a different
    value there would be ignored), gradient accumulation over training calls, and a fit without the
    rollout dataloader."""
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    if accumulate != 1:
        raise ConfigError(
            f"`accumulate_grad_batches` is {accumulate}, but each training call is one optimizer update (the spec's "
            "mini-batch M, and max_steps counts calls); train on more per update with trainer.mini_batch_size, or "
            "bound its memory with trainer.max_tokens_per_micro_batch."
        )
    max_steps = getattr(trainer, "max_steps", -1)
    if isinstance(max_steps, int) and max_steps > 0 and max_steps % calls_per_step:
        whole = -(-max_steps // calls_per_step) * calls_per_step
        raise ConfigError(
            f"`max_steps` is {max_steps}, which ends inside a rollout step: each rollout step is (B × N) // M = "
            f"{calls_per_step} training calls, so give a multiple of {calls_per_step} (e.g. {whole} for "
            f"{whole // calls_per_step} rollout steps)."
        )
    if rollout_steps is not None and max_steps != rollout_steps * calls_per_step:
        raise ConfigError(
            f"`trainer.rollout_steps` is {rollout_steps} ({rollout_steps * calls_per_step} training calls) but the "
            f"Trainer's `max_steps` is {max_steps}; under a Trainer of one's own, max_steps ends the run: pass "
            f"Trainer(max_steps={rollout_steps * calls_per_step}) or leave `trainer.rollout_steps` unset."
        )
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    if source is not None and callable(getattr(source, "is_defined", None)) and not source.is_defined():
        raise TypeError(
            f"FullyAsyncCallback: {type(pl_module).__name__} has no train_dataloader() and fit() got no "
            "train_dataloaders; return lightning_fasync.lightning.rollout_dataloader() from train_dataloader(), or "
            "call trainer.fit(module, train_dataloaders=rollout_dataloader())."
        )


def _module_logged(trainer: Any) -> bool:
    """Whether this call's ``self.log`` results hold something for the loggers (besides ``step``)."""
    results = getattr(trainer, "_results", None)
    if results is None:
        return False
    return any(getattr(m, "meta", None) is not None and m.meta.logger and m.meta.name != "step"
               for m in results.values())


class FullyAsyncCallback(DriverHooks, ModelCheckpoint):
    """Fully-async rollout for any LightningModule that implements ``FullyAsyncHooks`` and trains
    on :class:`RolloutBatch` tickets.

    It writes the run's checkpoints (every ``trainer.save_freq`` rollout steps, and on SIGTERM), so
    it is the Trainer's checkpoint callback: drop ``enable_checkpointing=False`` (Lightning refuses
    it beside a ``ModelCheckpoint``), and resume with ``trainer.fit(..., ckpt_path="last")``.

    ``self.log`` in ``training_step`` lands at the rollout step on the loggers, as the plugin's own
    metrics do (the callback logs Lightning's ``step`` key beside it); for one value per rollout
    step, return it from ``rollout_metrics()``, which the driver aggregates over the step's calls.

    With ``fully_async.enable: false`` and ``colocate: true`` the same callback runs the spec's
    colocate baseline: each step rolls out the whole batch, then trains on the same cores.

    Arguments:
        config: the plugin config (a :class:`FasyncConfig` or a nested dict of its keys).
        engine_model: what the engines load at start (a preset name or a local Hugging Face
            directory); default: the module's ``engine_model``. The engines get the trainer's
            weights before generating, so only the architecture must match.
        log_dir: where ``events.jsonl``, ``ledger.jsonl`` and checkpoints go (default: the
            trainer's log dir).
        engine_startup_timeout: seconds each engine replica has to become healthy; None:
            ``rollout.engine_startup_timeout``.
        admin_timeout: seconds a weight sync may take.
        datasource, reward, flow, client: rollout-side objects to use instead of the config's
            (see :class:`~lightning_fasync.runtime.rollout_runtime.RolloutRuntime`).
    """

    def __init__(
        self,
        config: Union[FasyncConfig, Mapping[str, Any], None] = None,
        engine_model: Optional[str] = None,
        log_dir: Optional[str] = None,
        engine_startup_timeout: Optional[float] = None,
        admin_timeout: float = 600.0,
        datasource: Optional[DataSource] = None,
        reward: Optional[RewardFn] = None,
        flow: Optional[AgentFlow] = None,
        client: Optional[EngineClient] = None,
    ) -> None:
        super().__init__(save_top_k=0, save_last=False, save_on_train_epoch_end=False)
        self.cfg = config if isinstance(config, FasyncConfig) else load_config(dict(config or {}))
        validate(self.cfg)  # refuse a bad config at construction, before any process exists
        self.engine_model = engine_model
        self.log_dir = log_dir
        self.engine_startup_timeout = engine_startup_timeout
        self.admin_timeout = admin_timeout
        self._rollout_side = {"datasource": datasource, "reward": reward, "flow": flow, "client": client}
        self.controller: Optional[FullyAsyncController] = None
        self.runtime: Optional[RolloutRuntime] = None
        self.schedule = StepSchedule.from_config(self.cfg)  # rank 0 uses the controller's own
        self._pending_state: Optional[dict[str, Any]] = None
        self._rank, self._world = 0, 1
        self._dp_rank, self._dp_size, self._dp_group = 0, 1, None
        self._step = 0  # the rollout step every rank is training
        self._trainer: Optional[pl.Trainer] = None
        self._hooks: Optional[FullyAsyncHooks] = None
        self._files: Optional[CheckpointFiles] = None
        self.preemption = Preemption(self.cfg.trainer.preempt_grace_s, resume_hint=lambda path: self.resume_hint)
        self._offload = False  # colocate_offload, resolved for the trainer's device in setup
        self._follower = Follower(self, False)  # the other ranks' half of the step (runtime/follower.py)
        self._closed = False
        self.resume_hint = TRAINER_RESUME
        """How the run's resume is spelled in its messages (the CLI sets ``--ckpt_path last``)."""

    @property
    def state_key(self) -> str:
        return Callback.state_key.fget(self)  # type: ignore[attr-defined] - not ModelCheckpoint's, keyed by its arguments

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """For ``trainer.fit(ckpt_path="last")`` (Lightning asks its ModelCheckpoints before ``setup``):
        the newest ``checkpoints/last.ckpt`` under ``log_dir``, else under the loggers' and the
        Trainer's root directories (each run of a default logger writes a new ``version_N``)."""
        roots = [self.log_dir] if self.log_dir else [
            *(lg.save_dir for lg in trainer.loggers[:1] if getattr(lg, "save_dir", None)), trainer.default_root_dir]
        found = [p for p in (find_last(str(r)) for r in roots) if p]
        return {max(found, key=os.path.getmtime)} if found else set()

    # ------------------------------------------------------------------ set-up

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        cfg = self.cfg
        _refuse_sharded(trainer.strategy)
        hooks = require_hooks(pl_module, "FullyAsyncCallback")
        hooks.check_fasync_config(cfg)
        _check_fit_arguments(trainer, pl_module, cfg.minibatches_per_step, cfg.trainer.rollout_steps)
        self._trainer, self._hooks = trainer, hooks
        # Colocate time-shares every core between the phases; fully-async splits them.
        colocate = not cfg.fully_async.enable
        strategy = trainer.strategy
        remote = {"remote": True} if cfg.rollout.placement != "local" else {}  # the replicas run on other nodes
        if hasattr(strategy, "resource_plan"):  # FullyAsyncStrategy, or a user's own
            plan = strategy.resource_plan(colocate=colocate, **remote)
            # FullyAsyncStrategy(weight_sync=...) overrides rollout.weight_sync; None keeps it.
            engine_threads, weight_sync = strategy.engine_threads, getattr(strategy, "weight_sync", None)
        else:
            plan, engine_threads, weight_sync = plan_cpu_resources(1, colocate=colocate, **remote), None, None
        self.log_dir = self.log_dir or trainer.log_dir or trainer.default_root_dir
        self._files = CheckpointFiles(os.path.join(self.log_dir, "checkpoints"), cfg.trainer.save_keep_last)
        self._rank, self._world = trainer.global_rank, trainer.world_size
        if self._world > 1:
            self._dp_rank, self._dp_size, self._dp_group = data_parallel(trainer.strategy)
        self._offload = colocate_offload_enabled(cfg, trainer.strategy.root_device.type)
        self._follower = Follower(self, self._offload)
        check_minibatch_share(cfg, self._dp_size)
        if self._world > 1:
            plan = trainer_share(plan, trainer.local_rank, trainer.strategy.num_processes)
            if self._rank != 0 and trainer.strategy.root_device.type == "cpu":
                pin_trainer(plan.trainer_cores, plan.trainer_threads)  # rank 0 pins itself once its engines run
        if self._rank != 0:
            # Only global rank 0 runs engines, producer and collector (docs/contract.md, "Processes").
            return
        self.runtime = RolloutRuntime(
            cfg,
            self.engine_model or hooks.engine_model,
            plan,
            self.log_dir,
            pin=trainer.strategy.root_device.type == "cpu",
            engine_threads=engine_threads,
            engine_startup_timeout=self.engine_startup_timeout,
            admin_timeout=self.admin_timeout,
            weight_sync=weight_sync,
            colocate_offload=self._offload,
            **self._rollout_side,
        )
        self.runtime.resume_hint = lambda path: self.resume_hint
        self.controller = self.runtime.controller
        self.schedule = self.controller.schedule
        print(self.runtime.describe(plan), file=sys.stderr, flush=True)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._pending_state = state_dict

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict() if self.controller is not None else {}

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint["fasync_identity"] = run_identity(self.cfg, pl_module)

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        where = str(trainer.ckpt_path)
        check_resume(checkpoint.get("fasync_identity"), run_identity(self.cfg, pl_module), where)
        check_hparams(checkpoint.get("hyper_parameters"), dict(pl_module.hparams), where)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.preemption.install()  # after Lightning's own signal handlers, which it restores at the end
        step = -1
        if self._rank == 0:
            ctl = self._require_controller()
            ctl.state.interrupt = self._check_preemption
            if self._pending_state is not None:
                ctl.load_state_dict(self._pending_state)
                self._pending_state = None
            # The engines start from the preset or directory; the trainer's weights may differ (a
            # restored checkpoint, a warm start), so they get the trainer's before any generation.
            self.sync_weights(ctl.weight_version)
            if trainer.max_steps > 0:  # the run's last rollout step, for eval.at_end
                ctl.schedule.final_step = trainer.max_steps // ctl.schedule.calls_per_step - 1
            if self.cfg.eval.at_start:
                at, val = ctl.evaluate_at_start()
                for logger in trainer.loggers:
                    logger.log_metrics(val, step=at)
            ctl.start(self)
            step = ctl.rollout_step
        else:
            self._follower.replay("first_sync")
            self._follower.replay("start")
        self._step = self._broadcast(trainer, step)
        self._require_hooks().begin_rollout_step(self._step)

    # ------------------------------------------------------------------ the step

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not isinstance(batch, RolloutBatch):
            raise TypeError(
                f"FullyAsyncCallback expects RolloutBatch tickets from the dataloader, got {type(batch).__name__}; "
                "return lightning_fasync.lightning.rollout_dataloader() from train_dataloader() or pass it to fit()."
            )
        ctl, hooks = self.controller, self._require_hooks()
        self._check_preemption()
        groups = ctl.fetch(self) if ctl is not None else None
        if ctl is None:
            self._follower.replay("batch")
        if self._world > 1:
            # Rank 0 fetched on its main thread; every data-parallel rank trains on its share of
            # the mini-batch, balanced by tokens (tensor-parallel peers on the same share).
            groups = dp_share(self._broadcast(trainer, groups), self._dp_rank, self._dp_size, tokens=group_tokens)
        batch.groups = groups
        batch.rollout_step = self._step
        batch.call_index, batch.calls_per_step = self.schedule.calls, self.schedule.calls_per_step
        if ctl is not None:
            with ctl.timer.time("process_traj"):  # wait, not training (docs/contract.md §4)
                batch.data = hooks.prepare_rollout_batch(groups)
            ctl.begin_train()
        else:
            batch.data = hooks.prepare_rollout_batch(groups)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        ctl = self.controller
        if ctl is not None:
            ctl.end_train()
        if _module_logged(trainer):
            # Lightning takes a logged `step` as the x-axis of what it flushes after this hook: what
            # the module logged with self.log lands at the rollout step, as the plugin's metrics do.
            pl_module.log("step", float(self._step), logger=True, on_step=True, on_epoch=False)
        metrics = dict(self._require_hooks().rollout_metrics())
        if self._world > 1:
            metrics = reduce_metrics(metrics, self._dp_size, self._dp_group, trainer.strategy.root_device)
        if ctl is not None:
            ctl.record(metrics)
        if not self.schedule.call_done():
            self._check_preemption()
            return
        # A signal received by now, or engines lost for good, make this boundary save and end the
        # run (rank 0 decides).
        preempted, lost = self._broadcast(
            trainer, (self.preemption.requested, ctl is not None and ctl.state.fault is not None))
        self.schedule.force_save = bool(preempted or lost)
        if ctl is not None:
            step, step_metrics = ctl.step_boundary(self)
            for logger in trainer.loggers:
                logger.log_metrics(step_metrics, step=step)
            shown = {short: step_metrics[key] for key, short in PROGRESS_KEYS.items() if key in step_metrics}
            if shown:
                pl_module.log_dict(shown, prog_bar=True, logger=False, on_step=True, on_epoch=False)
            for bar in trainer.callbacks:
                if isinstance(bar, RolloutProgressBar):
                    bar.show_rollout_step(trainer, pl_module)
        else:
            if self.schedule.save_due(self._step):
                self._follower.replay("save", save=lambda: self.save_checkpoint(self._step))
            self._follower.replay("sync")  # rank 0's controller syncs at every boundary
        if preempted:
            raise self.preemption.stop(self._files.path(self._step) if self._files is not None else None)
        if lost:
            raise ctl.state.fault if ctl is not None else PipelineError("Rank 0's rollout engines are lost; stopping.")
        self._step = self._broadcast(trainer, ctl.rollout_step if ctl is not None else -1)
        self._require_hooks().begin_rollout_step(self._step)

    def _broadcast(self, trainer: pl.Trainer, obj: Any) -> Any:
        return trainer.strategy.broadcast(obj, src=0) if self._world > 1 else obj

    # ------------------------------------------------------------------ StepHooks

    def save_checkpoint(self, step: int) -> None:
        trainer, files = self._trainer, self._files
        assert trainer is not None and files is not None
        # Every rank calls save_checkpoint (collectives); global rank 0 writes, renames and links
        # (a distributed checkpoint: every rank writes its part of the directory).
        self.last_model_path = files.save(step, lambda path: trainer.save_checkpoint(path, weights_only=False),
                                          trainer.is_global_zero)
        if self.cfg.trainer.save_hf:
            save_hf(self._require_hooks().engine_state_dict(), self.engine_model or self._require_hooks().engine_model,
                    files.hf_path(step), trainer.is_global_zero)

    def _check_preemption(self) -> None:
        """Abandon the step if a signal's grace period is over (rank 0's main thread decides; the
        other ranks follow at the next boundary or when the launcher stops them)."""
        if self._rank == 0:
            self.preemption.check(self._files.last if self._files is not None else (lambda: None))

    # ------------------------------------------------------------------ DriverHooks

    def _driver_hooks(self) -> FullyAsyncHooks:
        return self._require_hooks()

    def _driver_optimizers(self) -> list[Any]:
        assert self._trainer is not None
        return list(self._trainer.optimizers)

    # ------------------------------------------------------------------ shutdown

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.controller is not None:
            self.controller.end_train()  # a training_step that raised closes its timing block
        runtime = self.runtime
        if runtime is not None and runtime.engine_lost is not None and self._world == 1 and self._files is not None:
            # (With several ranks the others wait in a collective; the last periodic checkpoint stands.)
            runtime.save_after_fault(self, self._files.last, self._files.path)
        self._shutdown(raise_errors=False)

    # ModelCheckpoint's own saving (epoch ends, validation ends, the end of training) does not apply:
    # this callback saves at rollout-step boundaries.

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._shutdown(raise_errors=True)

    def _shutdown(self, raise_errors: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self.preemption.restore()
        if self.runtime is not None:
            self.runtime.shutdown(raise_errors=raise_errors)

    def _require_controller(self) -> FullyAsyncController:
        if self.controller is None:
            raise PipelineError("FullyAsyncCallback was not set up: it runs only in trainer.fit().")
        return self.controller

    def _require_hooks(self) -> FullyAsyncHooks:
        if self._hooks is None:
            raise PipelineError("FullyAsyncCallback was not set up: it runs only in trainer.fit().")
        return self._hooks
