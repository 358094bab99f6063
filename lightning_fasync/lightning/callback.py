"""FullyAsyncCallback: makes a Lightning fit loop the spec's trainer consumer.

Hooks, in the order Lightning calls them:

- ``setup``: validate the config (nothing has started yet), plan resources, start the engine
  replicas (+ sglang-router when several), build the pipeline controller.
- ``load_state_dict`` (on resume): keep the pipeline state until the threads start.
- ``on_train_start``: restore the pipeline state, push the trainer's weights to the engines when
  resuming, start producer and collector.
- ``on_train_batch_start``: fetch M // N groups from the PipelineBuffer into the batch ticket.
- ``on_train_batch_end``: record the call's metrics; after (B × N) // M calls run the step boundary
  through :class:`FullyAsyncController` (pause, metrics, checkpoint on ``save_freq``, weight sync,
  resume) and log the step's metrics once, at step = rollout step.
- ``on_exception`` / ``teardown``: stop threads and engines, idempotently.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_fasync.config import ConfigError, FasyncConfig, config_from_dict, validate
from lightning_fasync.lightning.batch import RolloutBatch
from lightning_fasync.lightning.runtime import RolloutRuntime, engine_tensors
from lightning_fasync.lightning.strategy import plan_cpu_resources
from lightning_fasync.pipeline.controller import FullyAsyncController
from lightning_fasync.pipeline.state import PipelineError

PROGRESS_KEYS = {
    "rollout/reward_mean": "reward",
    "rollout/pipeline_buf_size": "buf",
    "perf/wait_ratio": "wait",
}


def _refuse_sharded(strategy: Any) -> None:
    """Sharded strategies need every rank in the weight sync's state-dict gather; until that
    path exists (and can be tested: Lightning's FSDP needs CUDA), refuse them up front rather than
    hang at the first step boundary."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
        raise ConfigError(
            f"`trainer.strategy` is {type(strategy).__name__}; FullyAsyncCallback supports single-device and DDP "
            "training (a sharded strategy would need every rank in the weight sync's state-dict gather)."
        )


class FullyAsyncCallback(Callback):
    """Fully-async rollout for any LightningModule that trains on :class:`RolloutBatch` tickets.

    With ``fully_async.enable: false`` and ``colocate: true`` the same callback runs the spec's
    colocate baseline: each step rolls out the whole batch, then trains on the same cores.

    Arguments:
        config: the plugin config (a :class:`FasyncConfig` or a nested dict of its keys).
        engine_model: what the engines load at start (a preset name or a local Hugging Face
            directory); default: the module's ``engine_model`` attribute. The engines get the
            trainer's weights before generating, so only the architecture must match.
        log_dir: where ``events.jsonl``, ``ledger.jsonl`` and checkpoints go (default: the
            trainer's log dir).
        engine_startup_timeout: seconds each engine replica has to become healthy.
        admin_timeout: seconds a weight sync may take.
    """

    def __init__(
        self,
        config: Union[FasyncConfig, Mapping[str, Any], None] = None,
        engine_model: Optional[str] = None,
        log_dir: Optional[str] = None,
        engine_startup_timeout: float = 180.0,
        admin_timeout: float = 600.0,
    ) -> None:
        if config is None:
            config = FasyncConfig()
        self.cfg = config if isinstance(config, FasyncConfig) else config_from_dict(dict(config))
        validate(self.cfg)  # refuse a bad config at construction, before any process exists
        self.engine_model = engine_model
        self.log_dir = log_dir
        self.engine_startup_timeout = engine_startup_timeout
        self.admin_timeout = admin_timeout
        self.controller: Optional[FullyAsyncController] = None
        self.runtime: Optional[RolloutRuntime] = None
        self._pending_state: Optional[dict[str, Any]] = None
        self._train_block = None
        self._rank, self._world = 0, 1
        self._step = 0  # the rollout step every rank is training
        self._calls = 0  # training calls in the current step
        self._trainer: Optional[pl.Trainer] = None
        self._module: Optional[pl.LightningModule] = None
        self._closed = False

    # ------------------------------------------------------------------ set-up

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        cfg = self.cfg
        self._trainer, self._module = trainer, pl_module
        _refuse_sharded(trainer.strategy)
        pl_module.fasync_config = cfg
        # Colocate time-shares every core between the phases; fully-async splits them.
        colocate = not cfg.fully_async.enable
        strategy = trainer.strategy
        if hasattr(strategy, "resource_plan"):
            plan = strategy.resource_plan(colocate=colocate)
            engine_threads = getattr(strategy, "engine_threads", None)
        else:
            plan, engine_threads = plan_cpu_resources(1, colocate=colocate), None
        self.log_dir = self.log_dir or trainer.log_dir or trainer.default_root_dir
        self._rank, self._world = trainer.global_rank, trainer.world_size
        if self._world > 1 and cfg.groups_per_minibatch % self._world:
            raise ConfigError(
                f"`trainer.mini_batch_size` is {cfg.M}: each training call has M // N = {cfg.groups_per_minibatch} "
                f"groups, which {self._world} data-parallel ranks cannot share evenly; make M // N a multiple of "
                "the world size."
            )
        if self._rank != 0:
            # Only global rank 0 runs engines, producer and collector (DESIGN.md, process model).
            return
        engine_model = self.engine_model or getattr(pl_module, "engine_model", None)
        if not engine_model:
            raise PipelineError(
                "FullyAsyncCallback needs to know what the engines load: pass engine_model= (a preset such as "
                "'tiny' or a local Hugging Face directory) or give the module an engine_model attribute."
            )
        self.runtime = RolloutRuntime(
            cfg,
            engine_model,
            plan,
            self.log_dir,
            pin=trainer.strategy.root_device.type == "cpu",
            engine_threads=engine_threads,
            engine_startup_timeout=self.engine_startup_timeout,
            admin_timeout=self.admin_timeout,
        )
        self.controller = self.runtime.controller

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._pending_state = state_dict

    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict() if self.controller is not None else {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = -1
        if self._rank == 0:
            ctl = self._require_controller()
            if self._pending_state is not None:
                ctl.load_state_dict(self._pending_state)
                self._pending_state = None
            # The engines start from the preset or directory; the trainer's weights may differ (a
            # restored checkpoint, a warm start), so they get the trainer's before any generation.
            self.sync_weights(ctl.weight_version)
            ctl.start()
            step = ctl.rollout_step
        self._step = self._broadcast(trainer, step)
        self._calls = 0
        self._begin_step(pl_module)

    # ------------------------------------------------------------------ the step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not isinstance(batch, RolloutBatch):
            raise TypeError(
                f"FullyAsyncCallback expects RolloutBatch tickets from the dataloader, got {type(batch).__name__}; "
                "return lightning_fasync.lightning.rollout_dataloader() from train_dataloader() or pass it to fit()."
            )
        ctl = self.controller
        groups = ctl.fetch() if self._rank == 0 else None
        if self._world > 1:
            # Rank 0 fetched on its main thread; every rank trains on its share of the mini-batch.
            groups = self._broadcast(trainer, groups)[self._rank :: self._world]
        batch.groups = groups
        batch.rollout_step = self._step
        prepare = getattr(pl_module, "prepare_rollout_batch", None)
        if callable(prepare):
            # Trajectory processing is wait, not training (spec section 4, perf/wait_ratio).
            if ctl is not None:
                with ctl.timer.time("process_traj"):
                    batch.data = prepare(batch.groups)
            else:
                batch.data = prepare(batch.groups)
        if ctl is not None:
            self._train_block = ctl.train_block()
            self._train_block.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        ctl = self.controller
        if self._train_block is not None:
            self._train_block.__exit__(None, None, None)
            self._train_block = None
        metrics = dict(getattr(pl_module, "last_metrics", {}) or {})
        if self._world > 1:
            metrics = self._reduce(trainer, metrics)
        self._calls += 1
        if ctl is not None:
            ctl.record(metrics)
        # Every rank counts the calls itself (the others have no controller), so the boundary
        # falls on the same call everywhere.
        if self._calls < self.cfg.minibatches_per_step:
            return
        self._calls = 0
        if ctl is not None:
            step, step_metrics = ctl.step_boundary(self)
            for logger in trainer.loggers:
                logger.log_metrics(step_metrics, step=step)
            shown = {"step": float(step)}
            shown.update({short: step_metrics[key] for key, short in PROGRESS_KEYS.items() if key in step_metrics})
            pl_module.log_dict(shown, prog_bar=True, logger=False, on_step=True, on_epoch=False)
        else:
            # The other ranks take part in the boundary's collectives in rank 0's order.
            save_freq = self.cfg.trainer.save_freq
            if save_freq > 0 and (self._step + 1) % save_freq == 0:
                self.save_checkpoint(self._step)
        self._step = self._broadcast(trainer, self.controller.rollout_step if ctl is not None else -1)
        self._begin_step(pl_module)

    def _begin_step(self, pl_module: pl.LightningModule) -> None:
        begin = getattr(pl_module, "begin_rollout_step", None)
        if callable(begin):
            begin(self._step)

    def _broadcast(self, trainer: pl.Trainer, obj: Any) -> Any:
        return trainer.strategy.broadcast(obj, src=0) if self._world > 1 else obj

    @staticmethod
    def _reduce(trainer: pl.Trainer, metrics: dict[str, float]) -> dict[str, float]:
        """Reduce one training call's metrics over ranks by the spec's naming rule (main thread)."""
        import torch
        import torch.distributed as dist

        from lightning_fasync.pipeline.metrics import aggregation_rule

        keys = sorted(metrics)
        out: dict[str, float] = {}
        for rule, op in (("mean", dist.ReduceOp.SUM), ("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
            names = [k for k in keys if aggregation_rule(k) == rule]
            if not names:
                continue
            t = torch.tensor([metrics[k] for k in names], dtype=torch.float64, device=trainer.strategy.root_device)
            dist.all_reduce(t, op=op)
            if rule == "mean":
                t /= trainer.world_size
            out.update(zip(names, t.tolist()))
        return out

    # ------------------------------------------------------------------ StepHooks

    def save_checkpoint(self, step: int) -> None:
        trainer = self._trainer
        assert trainer is not None and self.log_dir is not None
        directory = os.path.join(self.log_dir, "checkpoints")
        path = os.path.join(directory, f"step-{step:06d}.ckpt")
        trainer.save_checkpoint(path, weights_only=False)
        last = os.path.join(directory, "last.ckpt")
        tmp = last + ".tmp"
        trainer.save_checkpoint(tmp, weights_only=False)
        if trainer.is_global_zero:  # the rank that wrote it
            os.replace(tmp, last)  # atomic: a kill mid-save never leaves a torn last.ckpt

    def sync_weights(self, version: int) -> None:
        module, runtime = self._module, self.runtime
        assert module is not None and runtime is not None
        runtime.sync_weights(engine_tensors(module), version)

    # ------------------------------------------------------------------ shutdown

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._shutdown(raise_errors=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._shutdown(raise_errors=True)

    def _shutdown(self, raise_errors: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if self.runtime is not None:
            self.runtime.shutdown(raise_errors=raise_errors)

    def _require_controller(self) -> FullyAsyncController:
        if self.controller is None:
            raise PipelineError("FullyAsyncCallback was not set up: it runs only in trainer.fit().")
        return self.controller
