"""FullyAsyncFabricLoop: the fully-async step protocol for Lightning Fabric users.

The loop owns no protocol of its own: it builds the same :class:`RolloutRuntime` as
``FullyAsyncCallback`` and drives the same :class:`FullyAsyncController` (fetch, train, step
boundary), firing hooks on Fabric's callbacks with ``fabric.call``:

``on_fasync_train_start(loop)``, ``on_rollout_step_start(loop, step)``,
``on_rollout_batch_start(loop, groups)``, ``on_rollout_batch_end(loop, metrics)``,
``on_rollout_step_end(loop, step, metrics)``, ``on_fasync_train_end(loop)``. (Names of their own:
Fabric also calls hooks on a LightningModule it set up, whose ``on_train_*`` take other arguments.)
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional, Union

import torch

from lightning_fasync.config import FasyncConfig, config_from_dict, validate
from lightning_fasync.lightning.runtime import RolloutRuntime, engine_tensors
from lightning_fasync.lightning.strategy import plan_cpu_resources
from lightning_fasync.types import TrajectoryGroup

TrainingStep = Callable[[Any], tuple[torch.Tensor, Mapping[str, float]]]


class FullyAsyncFabricLoop:
    """Train a Fabric-wrapped policy on fully-async (or colocate) rollouts.

    Arguments:
        fabric: the ``lightning.Fabric`` instance (its loggers get the step metrics).
        config: the plugin config (a :class:`FasyncConfig` or a dict of its keys).
        log_dir: where the event log, the ledger and checkpoints go.
        engine_startup_timeout, admin_timeout: as for ``FullyAsyncCallback``.
    """

    def __init__(
        self,
        fabric: Any,
        config: Union[FasyncConfig, Mapping[str, Any]],
        log_dir: str,
        engine_startup_timeout: float = 180.0,
        admin_timeout: float = 600.0,
    ) -> None:
        self.fabric = fabric
        self.cfg = config if isinstance(config, FasyncConfig) else config_from_dict(dict(config))
        validate(self.cfg)
        self.log_dir = log_dir
        self.engine_startup_timeout = engine_startup_timeout
        self.admin_timeout = admin_timeout
        self.runtime: Optional[RolloutRuntime] = None
        self._model: Optional[torch.nn.Module] = None
        self._optimizer: Optional[torch.optim.Optimizer] = None

    @property
    def controller(self):
        return None if self.runtime is None else self.runtime.controller

    def fit(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        rollout_steps: int,
        training_step: TrainingStep,
        prepare: Optional[Callable[[list[TrajectoryGroup]], Any]] = None,
        engine_model: str = "tiny",
        state: Optional[Mapping[str, Any]] = None,
    ) -> None:
        """Run ``rollout_steps`` outer steps.

        Arguments:
            model, optimizer: as returned by ``fabric.setup``.
            rollout_steps: outer steps to run.
            training_step: ``batch -> (loss, metrics)`` for one training call; the loop does
                ``fabric.backward``, ``optimizer.step`` and ``zero_grad``.
            prepare: ``groups -> batch`` (timed as ``timing/process_traj``); identity by default.
            engine_model: preset or directory the engines load (they then get the model's weights).
            state: a checkpoint's ``"fasync"`` entry, to resume the pipeline.
        """
        fabric, cfg = self.fabric, self.cfg
        self._model, self._optimizer = model, optimizer
        plan = plan_cpu_resources(1, colocate=not cfg.fully_async.enable)
        self.runtime = RolloutRuntime(
            cfg, engine_model, plan, self.log_dir, pin=fabric.device.type == "cpu",
            engine_startup_timeout=self.engine_startup_timeout, admin_timeout=self.admin_timeout,
        )
        ctl = self.runtime.controller
        ok = False
        try:
            if state is not None:
                ctl.load_state_dict(state)
            self.sync_weights(ctl.weight_version)
            ctl.start()
            fabric.call("on_fasync_train_start", loop=self)
            for _ in range(rollout_steps):
                fabric.call("on_rollout_step_start", loop=self, step=ctl.rollout_step)
                while True:
                    groups = ctl.fetch()
                    fabric.call("on_rollout_batch_start", loop=self, groups=groups)
                    with ctl.timer.time("process_traj"):
                        batch = prepare(groups) if prepare is not None else groups
                    with ctl.train_block():
                        loss, metrics = training_step(batch)
                        fabric.backward(loss)
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                    metrics = dict(metrics)
                    ctl.record(metrics)
                    fabric.call("on_rollout_batch_end", loop=self, metrics=metrics)
                    if ctl.minibatch_done():
                        break
                step, step_metrics = ctl.step_boundary(self)
                fabric.log_dict(step_metrics, step=step)
                fabric.call("on_rollout_step_end", loop=self, step=step, metrics=step_metrics)
            fabric.call("on_fasync_train_end", loop=self)
            ok = True
        finally:
            self.runtime.shutdown(raise_errors=ok)

    # ------------------------------------------------------------------ StepHooks

    def save_checkpoint(self, step: int) -> None:
        path = os.path.join(self.log_dir, "checkpoints", f"step-{step:06d}.ckpt")
        self.fabric.save(path, {"model": self._model, "optimizer": self._optimizer, "fasync": self.runtime.controller.state_dict()})

    def sync_weights(self, version: int) -> None:
        self.runtime.sync_weights(engine_tensors(self._model), version)
