"""FullyAsyncFabricLoop: the fully-async step protocol for Lightning Fabric users.

The loop owns no protocol of its own: it builds the same :class:`RolloutRuntime` as
``FullyAsyncCallback``, requires the same :class:`~lightning_fasync.lightning.hooks.FullyAsyncHooks`
contract of the module, and runs :meth:`FullyAsyncController.run_step` (fetch → prepare → train,
(B × N) // M times, then the step boundary). It fires hooks on Fabric's callbacks with
``fabric.call``:

``on_fasync_train_start(loop)``, ``on_rollout_step_start(loop, step)``,
``on_rollout_batch_start(loop, groups)``, ``on_rollout_batch_end(loop, metrics)``,
``on_rollout_step_end(loop, step, metrics)``, ``on_fasync_train_end(loop)``. (Names of their own:
Fabric also calls hooks on a LightningModule it set up, whose ``on_train_*`` take other arguments.)

Checkpoints are written atomically with retention and a ``last.ckpt`` link, and carry the run's
identity (:mod:`~lightning_fasync.lightning.checkpoints`); SIGTERM or SIGINT finishes the step,
saves a checkpoint and exits with status 128 + signal (:mod:`~lightning_fasync.lightning.preemption`).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional, Union

import torch

from lightning_fasync.config import ConfigError, FasyncConfig, colocate_offload_enabled, load_config, validate
from lightning_fasync.lightning.batch import RolloutBatch
from lightning_fasync.lightning.checkpoints import CheckpointFiles, check_resume, run_identity
from lightning_fasync.lightning.hooks import FullyAsyncHooks, require_hooks
from lightning_fasync.lightning.preemption import Preemption
from lightning_fasync.lightning.resources import plan_cpu_resources
from lightning_fasync.lightning.runtime import RolloutRuntime
from lightning_fasync.pipeline.datasource import DataSource
from lightning_fasync.pipeline.engine_client import EngineClient
from lightning_fasync.pipeline.flow import AgentFlow, RewardFn
from lightning_fasync.types import TrajectoryGroup


class FullyAsyncFabricLoop:
    """Train a Fabric-wrapped policy on fully-async (or colocate) rollouts.

    Arguments:
        fabric: the ``lightning.Fabric`` instance (its loggers get the step metrics).
        config: the plugin config (a :class:`FasyncConfig` or a dict of its keys).
        log_dir: where the event log, the ledger and checkpoints go.
        engine_startup_timeout, admin_timeout: as for ``FullyAsyncCallback``.
        datasource, reward, flow, client: rollout-side objects to use instead of the config's.
    """

    def __init__(
        self,
        fabric: Any,
        config: Union[FasyncConfig, Mapping[str, Any]],
        log_dir: str,
        engine_startup_timeout: Optional[float] = None,
        admin_timeout: float = 600.0,
        datasource: Optional[DataSource] = None,
        reward: Optional[RewardFn] = None,
        flow: Optional[AgentFlow] = None,
        client: Optional[EngineClient] = None,
    ) -> None:
        self.fabric = fabric
        self.cfg = config if isinstance(config, FasyncConfig) else load_config(dict(config))
        validate(self.cfg)
        self.log_dir = log_dir
        self.engine_startup_timeout = engine_startup_timeout
        self.admin_timeout = admin_timeout
        self._rollout_side = {"datasource": datasource, "reward": reward, "flow": flow, "client": client}
        self.runtime: Optional[RolloutRuntime] = None
        self._model: Optional[torch.nn.Module] = None
        self._hooks: Optional[FullyAsyncHooks] = None
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self.files = CheckpointFiles(os.path.join(log_dir, "checkpoints"), self.cfg.trainer.save_keep_last)
        self._saved_step: Optional[int] = None

    @property
    def controller(self):
        return None if self.runtime is None else self.runtime.controller

    def fit(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        rollout_steps: int,
        training_step: Optional[Callable[[RolloutBatch], torch.Tensor]] = None,
        engine_model: Optional[str] = None,
        state: Optional[Mapping[str, Any]] = None,
    ) -> None:
        """Run ``rollout_steps`` outer steps.

        Arguments:
            model, optimizer: as returned by ``fabric.setup``; the module implements
                ``FullyAsyncHooks``.
            rollout_steps: outer steps to run.
            training_step: ``batch -> loss`` for one training call (default: the module's
                ``training_step(batch, call_index)``); the loop does ``fabric.backward``,
                ``optimizer.step`` and ``zero_grad``, and takes the call's metrics from
                ``rollout_metrics()``.
            engine_model: what the engines load (default: the module's ``engine_model``).
            state: a checkpoint's ``"fasync"`` entry, to resume the pipeline (a change of the
                config that breaks exactly-once accounting is refused; see ``check_resume``).
        """
        fabric, cfg = self.fabric, self.cfg
        if fabric.world_size > 1:
            raise ConfigError(
                f"FullyAsyncFabricLoop runs in one process; Fabric has world_size {fabric.world_size} (use "
                "FullyAsyncCallback with the DDP strategy for data-parallel training)."
            )
        hooks = require_hooks(model, "FullyAsyncFabricLoop")
        hooks.check_fasync_config(cfg)
        if state is not None:
            check_resume(state.get("identity"), run_identity(cfg, model), "the checkpoint given as state")
        self._model, self._hooks, self._optimizer = model, hooks, optimizer
        if training_step is None:
            calls = iter(range(1 << 62))
            training_step = lambda batch: model.training_step(batch, next(calls))  # noqa: E731
        plan = plan_cpu_resources(1, colocate=not cfg.fully_async.enable)
        self.runtime = RolloutRuntime(
            cfg, engine_model or hooks.engine_model, plan, self.log_dir, pin=fabric.device.type == "cpu",
            engine_startup_timeout=self.engine_startup_timeout, admin_timeout=self.admin_timeout,
            colocate_offload=colocate_offload_enabled(cfg, fabric.device.type), **self._rollout_side,
        )
        ctl = self.runtime.controller
        preemption = Preemption(cfg.trainer.preempt_grace_s, on_request=lambda: setattr(ctl.schedule, "force_save", True))
        ctl.state.interrupt = lambda: preemption.check(self.files.last)

        def prepare(groups: list[TrajectoryGroup]) -> RolloutBatch:
            fabric.call("on_rollout_batch_start", loop=self, groups=groups)
            return RolloutBatch(groups=groups, rollout_step=ctl.rollout_step, data=hooks.prepare_rollout_batch(groups),
                                call_index=ctl.schedule.calls, calls_per_step=ctl.schedule.calls_per_step)

        def train(batch: RolloutBatch) -> dict[str, float]:
            preemption.check(self.files.last)
            loss = training_step(batch)
            fabric.backward(loss)
            fabric.call("on_before_optimizer_step", optimizer)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            metrics = dict(hooks.rollout_metrics())
            fabric.call("on_rollout_batch_end", loop=self, metrics=metrics)
            return metrics

        ok = False
        preemption.install()
        try:
            if state is not None:
                ctl.load_state_dict(state)
            self.sync_weights(ctl.weight_version)
            ctl.schedule.final_step = ctl.rollout_step + rollout_steps - 1  # for eval.at_end
            if cfg.eval.at_start:
                at, val = ctl.evaluate_at_start()
                fabric.log_dict(val, step=at)
            ctl.start(self)
            fabric.call("on_fasync_train_start", loop=self)
            for _ in range(rollout_steps):
                hooks.begin_rollout_step(ctl.rollout_step)
                fabric.call("on_rollout_step_start", loop=self, step=ctl.rollout_step)
                step, step_metrics = ctl.run_step(train, self, prepare=prepare)
                fabric.log_dict(step_metrics, step=step)
                fabric.call("on_rollout_step_end", loop=self, step=step, metrics=step_metrics)
                if preemption.requested and self._saved_step == step:  # the boundary saved: stop here
                    raise preemption.stop(self.files.path(step))
                if ctl.state.fault is not None:  # engines lost for good: the boundary saved; stop
                    raise ctl.state.fault
            fabric.call("on_fasync_train_end", loop=self)
            ok = True
        except Exception:
            if self.runtime.engine_lost is not None:
                self.runtime.save_after_fault(self, self.files.last, self.files.path)
            raise
        finally:
            preemption.restore()
            self.runtime.shutdown(raise_errors=ok)

    # ------------------------------------------------------------------ StepHooks

    def save_checkpoint(self, step: int) -> None:
        """Save model, optimizer and pipeline (``"fasync"``, with the run's identity) atomically."""
        fasync = {**self.runtime.controller.state_dict(), "identity": run_identity(self.cfg, self._model)}
        state = {"model": self._model, "optimizer": self._optimizer, "fasync": fasync}
        self.files.save(step, lambda path: self.fabric.save(path, state), self.fabric.is_global_zero)
        self._saved_step = step

    def sync_weights(self, version: int) -> None:
        self.runtime.sync_weights(self._hooks.engine_state_dict(), version)

    # ------------------------------------------------------------------ ColocateHooks (colocate_offload)

    def offload_rollout(self) -> None:
        self.runtime.offload_rollout()

    def onload_train(self) -> None:
        self._hooks.onload_train([self._optimizer])

    def offload_train(self) -> None:
        self._hooks.offload_train([self._optimizer])

    def onload_rollout_weights(self) -> None:
        self.runtime.onload_rollout_weights()

    def onload_rollout_kv(self) -> None:
        self.runtime.onload_rollout_kv()
