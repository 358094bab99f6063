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
identity (:mod:`~lightning_fasync.runtime.checkpoints`); SIGTERM or SIGINT finishes the step,
saves a checkpoint and exits with status 128 + signal (:mod:`~lightning_fasync.runtime.preemption`).

Several processes (Fabric's DDP, or ``ModelParallelStrategy`` for FSDP2 and tensor parallel): only
global rank 0 builds the rollout side and runs :meth:`FullyAsyncController.run_step`. From inside
the callbacks the controller calls (``prepare``, ``train``, ``save_checkpoint``, ``sync_weights``)
and around each step, rank 0 broadcasts what the other ranks do next; they do exactly that, in
that order, so every collective matches by construction:

- ``batch``: the call's groups. Every data-parallel rank trains on its share (the same number of
  groups each, balanced by tokens: ``dp_share(..., tokens=group_tokens)``; tensor-parallel peers on
  the same share) with ``fabric.backward`` and the optimizer step, and the call's metrics are
  all-reduced over the data-parallel group by the spec's naming rule
  (:mod:`~lightning_fasync.runtime.ranks`). At the step's last call the ranks also agree whether
  any of them got SIGTERM or SIGINT, so a signal to any rank makes that boundary save and end the
  run.
- ``save``: rank 0's boundary saves. The message carries the pipeline state, so every rank gives
  ``fabric.save`` the same state (each writes its part of a distributed checkpoint).
- ``sync``: every rank calls ``engine_state_dict()``; a sharded module's stream
  (:class:`~lightning_fasync.weights.tensor_stream.TensorStream`) is pushed by rank 0 and drained
  by the others, tensor by tensor.
- ``start``, ``step``, ``step_end``, ``end``: the Fabric callbacks fire on every rank (metrics are
  logged by rank 0).
- ``abort``: rank 0 failed, or stopped on a signal, while the others waited for its next word.
  They raise too, once rank 0 has stopped its engines: :class:`Preempted` with rank 0's exit
  status, else a ``PipelineError`` naming rank 0's error.

A failure on rank 0 in the middle of a collective (a training call, a checkpoint write, a weight
gather) cannot be announced: the others' collective fails when rank 0's process exits (its
connections close), or after the process group's timeout if it hangs (Fabric strategies'
``timeout=``, 30 minutes by default). The other ranks also wait for rank 0's next word while it
starts the engines, fetches (up to ``fully_async.fetch_timeout``) and evaluates: keep the process
group's timeout above those.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Mapping, Optional, Union

import torch

from lightning_fasync.config import ConfigError, FasyncConfig, colocate_offload_enabled, load_config, validate
from lightning_fasync.lightning.batch import RolloutBatch
from lightning_fasync.runtime.follower import DriverHooks, Follower
from lightning_fasync.runtime.checkpoints import CheckpointFiles, check_resume, run_identity, save_hf
from lightning_fasync.lightning.hooks import FullyAsyncHooks, require_hooks
from lightning_fasync.runtime.preemption import Preempted, Preemption
from lightning_fasync.runtime.ranks import check_minibatch_share, data_parallel, dp_share, group_tokens, reduce_metrics
from lightning_fasync.fleet.resources import pin_trainer, plan_cpu_resources, trainer_share
from lightning_fasync.runtime.rollout_runtime import RolloutRuntime
from lightning_fasync.pipeline.datasource import DataSource
from lightning_fasync.pipeline.engine_client import EngineClient
from lightning_fasync.pipeline.flow import AgentFlow, RewardFn
from lightning_fasync.pipeline.state import PipelineError
from lightning_fasync.types import TrajectoryGroup


def _loss_of(out: Any) -> torch.Tensor:
    """The loss a training step returned: a scalar tensor, or a mapping's ``"loss"``."""
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if isinstance(out, Mapping) and "loss" not in out:
        got = f"a {type(out).__name__} without a 'loss' entry (keys: {', '.join(map(str, out))})"
    elif not isinstance(loss, torch.Tensor):
        got = f"a {type(loss).__name__}"
    elif loss.numel() != 1:
        got = f"a tensor of shape {tuple(loss.shape)}"
    else:
        return loss
    raise TypeError(
        f"FullyAsyncFabricLoop: training_step returned {got}; it must return the loss to minimise, a scalar tensor "
        "(or a dict with a 'loss' entry), which the loop backpropagates with fabric.backward."
    )


class FullyAsyncFabricLoop(DriverHooks):
    """Train a Fabric-wrapped policy on fully-async (or colocate) rollouts.

    Arguments:
        fabric: the ``lightning.Fabric`` instance, launched (its loggers get the step metrics, on
            global rank 0).
        config: the plugin config (a :class:`FasyncConfig` or a dict of its keys).
        log_dir: where the event log, the ledger and checkpoints go (the same path on every rank).
        engine_startup_timeout, admin_timeout: as for ``FullyAsyncCallback``.
        datasource, reward, flow, client: rollout-side objects to use instead of the config's
            (used by global rank 0 only).
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
        self._engine_model: Optional[str] = None
        self._training_step: Optional[Callable[[RolloutBatch], torch.Tensor]] = None
        self._preemption: Optional[Preemption] = None
        self._rank, self._world = 0, 1
        self._dp_rank, self._dp_size, self._dp_group = 0, 1, None
        # Rank 0: whether the other ranks wait for its next word (not inside a collective it began).
        self._listening = True
        self._offload = False  # colocate_offload on this device
        self._clip: Optional[float] = None  # fit's gradient_clip_val
        self._scheduler: Any = None  # fit's lr_scheduler

    @property
    def controller(self):
        return None if self.runtime is None else self.runtime.controller

    def fit(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        rollout_steps: int,
        training_step: Optional[Callable[[RolloutBatch], Any]] = None,
        engine_model: Optional[str] = None,
        state: Optional[Mapping[str, Any]] = None,
        gradient_clip_val: Optional[float] = None,
        lr_scheduler: Optional[Any] = None,
    ) -> None:
        """Run ``rollout_steps`` outer steps. Every rank calls it with the same arguments (several
        processes: see the module docstring).

        Arguments:
            model, optimizer: as returned by ``fabric.setup`` (or ``setup_module`` and
                ``setup_optimizers``); the module implements ``FullyAsyncHooks``.
            rollout_steps: outer steps to run.
            training_step: ``batch -> loss`` for one training call on this rank's share (default:
                the module's ``training_step(batch, call_index)``). It returns the loss to
                minimise: a scalar tensor, or a dict with a ``"loss"`` entry (as Lightning's
                ``training_step`` may); anything else is refused. The loop does
                ``fabric.backward``, the clipping, ``optimizer.step``, the scheduler step and
                ``zero_grad``, and takes the call's metrics from ``rollout_metrics()``.
            engine_model: what the engines load (default: the module's ``engine_model``).
            state: a checkpoint's ``"fasync"`` entry, to resume the pipeline (a change of the
                config that breaks exactly-once accounting is refused; see ``check_resume``).
                Only global rank 0 reads it. To resume, every rank restores model and optimizer
                with ``fabric.load`` (a collective with several processes; each rank reads its
                part of a distributed checkpoint) and passes what remains::

                    rest = fabric.load(loop.files.last(), {"model": model, "optimizer": optimizer})
                    loop.fit(model, optimizer, rollout_steps, state=rest["fasync"])

                (with ``lr_scheduler``, add ``"lr_scheduler": scheduler`` to what ``fabric.load``
                restores: the checkpoints hold it).
            gradient_clip_val: clip the gradients' total norm to this before each optimizer step
                (``fabric.clip_gradients``, as Lightning's Trainer does with the same argument);
                None: no clipping.
            lr_scheduler: a ``torch.optim.lr_scheduler`` scheduler of ``optimizer``, stepped after
                every optimizer step (one per training call, (B × N) // M per rollout step) and
                saved in the checkpoints; None: no scheduler.

        Raises:
            ConfigError: M // N groups per training call cannot be shared evenly by the
                data-parallel ranks, ``rollout_steps`` differs from the config's ``trainer.rollout_steps``,
                or ``state`` was saved by a run this one cannot continue.
            Preempted: SIGTERM or SIGINT (on any rank) ended the run after a checkpoint.
            PipelineError: on a rank other than 0, rank 0 failed (its error is named).
        """
        fabric, cfg = self.fabric, self.cfg
        hooks = require_hooks(model, "FullyAsyncFabricLoop")
        hooks.check_fasync_config(cfg)
        if gradient_clip_val is not None and not gradient_clip_val > 0:
            raise ConfigError(f"`gradient_clip_val` is {gradient_clip_val}; it must be > 0 (None: no clipping).")
        if cfg.trainer.rollout_steps is not None and cfg.trainer.rollout_steps != rollout_steps:
            raise ConfigError(
                f"`trainer.rollout_steps` is {cfg.trainer.rollout_steps} but fit() got rollout_steps={rollout_steps}; "
                "the loop runs what fit() is given: pass the same number or leave `trainer.rollout_steps` unset."
            )
        if lr_scheduler is not None and not callable(getattr(lr_scheduler, "step", None)):
            raise TypeError(f"`lr_scheduler` is a {type(lr_scheduler).__name__}, which has no step(); pass a "
                            "torch.optim.lr_scheduler scheduler of the optimizer.")
        self._clip, self._scheduler = gradient_clip_val, lr_scheduler
        self._rank, self._world = fabric.global_rank, fabric.world_size
        if self._world > 1:
            self._dp_rank, self._dp_size, self._dp_group = data_parallel(fabric.strategy)
            check_minibatch_share(cfg, self._dp_size)
        self._model, self._hooks, self._optimizer = model, hooks, optimizer
        self._engine_model = engine_model or hooks.engine_model
        self._offload = colocate_offload_enabled(cfg, fabric.device.type)
        if training_step is None:
            calls = iter(range(1 << 62))
            training_step = lambda batch: model.training_step(batch, next(calls))  # noqa: E731
        self._training_step = training_step
        plan = plan_cpu_resources(1, colocate=not cfg.fully_async.enable, remote=cfg.rollout.placement != "local")
        if self._world > 1:  # every trainer process the same thread count (see trainer_share)
            plan = trainer_share(plan, fabric.local_rank, fabric.strategy.num_processes)
        if self._rank != 0:
            if fabric.device.type == "cpu":
                pin_trainer(plan.trainer_cores, plan.trainer_threads)
            self._follow()
            return
        ctl: Any = None  # the controller, once the rollout side is up

        def on_signal() -> None:  # in the handler: only a flag (the boundary saves and the run ends)
            if ctl is not None:
                ctl.schedule.force_save = True

        self._preemption = preemption = Preemption(cfg.trainer.preempt_grace_s, on_request=on_signal,
                                                   resume_hint=self.resume_hint)

        def prepare(groups: list[TrajectoryGroup]) -> RolloutBatch:
            preemption.check(self.files.last)  # before the other ranks start the call's collectives
            at = {"step": ctl.rollout_step, "call": ctl.schedule.calls, "calls": ctl.schedule.calls_per_step}
            self._send("batch", groups=groups, **at)
            return self._prepare(groups, **at)

        ok, aborted = False, False
        preemption.install()
        try:
            if state is not None:
                check_resume(state.get("identity"), run_identity(cfg, model), "the checkpoint given as state")
            self.runtime = RolloutRuntime(
                cfg, self._engine_model, plan, self.log_dir, pin=fabric.device.type == "cpu",
                engine_startup_timeout=self.engine_startup_timeout, admin_timeout=self.admin_timeout,
                colocate_offload=self._offload, **self._rollout_side,
            )
            self.runtime.resume_hint = self.resume_hint
            print(self.runtime.describe(plan), file=sys.stderr, flush=True)
            ctl = self.runtime.controller
            ctl.schedule.force_save = preemption.requested  # a signal while the engines started
            ctl.state.interrupt = lambda: preemption.check(self.files.last)
            if state is not None:
                ctl.load_state_dict(state)
            self.sync_weights(ctl.weight_version)
            ctl.schedule.final_step = ctl.rollout_step + rollout_steps - 1  # for eval.at_end
            if cfg.eval.at_start:
                at, val = ctl.evaluate_at_start()
                fabric.log_dict(val, step=at)
            ctl.start(self)
            self._send("start")
            fabric.call("on_fasync_train_start", loop=self)
            for _ in range(rollout_steps):
                self._send("step", step=ctl.rollout_step)
                self._begin_step(ctl.rollout_step)
                step, step_metrics = ctl.run_step(self._train_call, self, prepare=prepare)
                fabric.log_dict(step_metrics, step=step)
                self._send("step_end", step=step, metrics=step_metrics)
                fabric.call("on_rollout_step_end", loop=self, step=step, metrics=step_metrics)
                if preemption.requested and self._saved_step == step:  # the boundary saved: stop here
                    raise preemption.stop(self.files.path(step))
                if ctl.state.fault is not None:  # engines lost for good: the boundary saved; stop
                    raise ctl.state.fault
            self._send("end")
            fabric.call("on_fasync_train_end", loop=self)
            ok = True
        except BaseException as exc:
            if isinstance(exc, Exception) and self.runtime is not None and self.runtime.engine_lost is not None \
                    and self._listening:
                self.runtime.save_after_fault(self, self.files.last, self.files.path)
            aborted = self._abort_followers(exc)
            raise
        finally:
            preemption.restore()
            self._preemption = None
            try:
                if self.runtime is not None:
                    self.runtime.shutdown(raise_errors=ok)
            finally:
                self._finalize_loggers("success" if ok else "failed")
                if aborted:  # the other ranks wait for this: the engines are down, they may exit now
                    self._barrier()

    def resume_hint(self, path: Optional[str]) -> str:
        """How a Fabric script resumes from the checkpoint at ``path`` (the signal and lost-engine
        messages say it)."""
        extra = ', "lr_scheduler": scheduler' if getattr(self, "_scheduler", None) is not None else ""
        return (f'`rest = fabric.load("{path}", {{"model": model, "optimizer": optimizer{extra}}})` and '
                '`loop.fit(..., state=rest["fasync"])`')

    def _finalize_loggers(self, status: str) -> None:
        """Flush and close Fabric's loggers (rank 0 writes; a CSVLogger's metrics.csv appears only so)."""
        for logger in getattr(self.fabric, "loggers", []):
            try:
                logger.finalize(status)
            except Exception as exc:  # noqa: BLE001 - the run's own outcome stands
                print(f"Could not finalize the logger {type(logger).__name__}: {type(exc).__name__}: {exc}",
                      file=sys.stderr)

    # ------------------------------------------------------------------ one training call (every rank)

    def _begin_step(self, step: int) -> None:
        self._hooks.begin_rollout_step(step)
        self.fabric.call("on_rollout_step_start", loop=self, step=step)

    def _prepare(self, groups: list[TrajectoryGroup], step: int, call: int, calls: int) -> RolloutBatch:
        """This rank's share of a training call's groups, as the batch ``training_step`` gets."""
        groups = dp_share(groups, self._dp_rank, self._dp_size, tokens=group_tokens)
        self.fabric.call("on_rollout_batch_start", loop=self, groups=groups)
        return RolloutBatch(groups=groups, rollout_step=step, data=self._hooks.prepare_rollout_batch(groups),
                            call_index=call, calls_per_step=calls)

    def _train_call(self, batch: RolloutBatch) -> dict[str, float]:
        """Forward, backward, optimizer step; the call's metrics, reduced over the data-parallel ranks."""
        fabric, optimizer = self.fabric, self._optimizer
        loss = _loss_of(self._training_step(batch))
        fabric.backward(loss)
        if self._clip is not None:
            fabric.clip_gradients(self._model, optimizer, max_norm=self._clip)
        fabric.call("on_before_optimizer_step", optimizer)
        optimizer.step()
        if self._scheduler is not None:
            self._scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        metrics = dict(self._hooks.rollout_metrics())
        if self._world > 1:
            metrics = reduce_metrics(metrics, self._dp_size, self._dp_group, fabric.device)
            if batch.call_index == batch.calls_per_step - 1:
                self._agree_on_signal()
            self._listening = True
        fabric.call("on_rollout_batch_end", loop=self, metrics=metrics)
        return metrics

    def _agree_on_signal(self) -> None:
        """The step's last call, on every rank: a SIGTERM/SIGINT that any rank got (a launcher may
        signal only some) makes rank 0's coming boundary save and end the run, as its own would."""
        import torch.distributed as dist

        preemption = self._preemption
        mine = preemption.signum if preemption is not None and preemption.signum is not None else 0
        signum = torch.tensor([mine], dtype=torch.int64, device=self.fabric.device)
        dist.all_reduce(signum, op=dist.ReduceOp.MAX)
        got = int(signum.item())
        if self._rank == 0 and got and preemption is not None and not preemption.requested:
            preemption.signum = got
            preemption.deadline = time.monotonic() + preemption.grace_s
            self.controller.schedule.force_save = True

    # ------------------------------------------------------------------ several processes

    def _send(self, kind: str, **payload: Any) -> None:
        """Rank 0: tell the other ranks what comes next. ``batch``, ``save`` and ``sync`` begin
        collectives they take part in; until this rank has finished its own part it cannot tell
        them anything else (``_listening``)."""
        if self._world == 1:
            return
        self.fabric.broadcast((kind, payload), src=0)
        if kind in ("batch", "save", "sync"):
            self._listening = False

    def _abort_followers(self, exc: BaseException) -> bool:
        """Rank 0 failed: tell the other ranks, if they wait for its word. True when they were told."""
        if self._world == 1 or not self._listening:
            return False
        code = exc.code if isinstance(exc, Preempted) else None
        try:
            self._send("abort", error=f"{type(exc).__name__}: {exc}", code=code)
        except Exception:  # noqa: BLE001 - a rank already gone; keep the original error
            return False
        return True

    def _barrier(self) -> None:
        try:
            self.fabric.barrier()
        except Exception:  # noqa: BLE001 - a rank already gone; the run is failing anyway
            pass

    def _receive(self) -> tuple[str, dict[str, Any]]:
        """A rank > 0: rank 0's next word (a broadcast, bounded by the process group's timeout)."""
        try:
            return self.fabric.broadcast(None, src=0)
        except RuntimeError as exc:  # gloo/NCCL: the timeout, or rank 0's process went away
            raise PipelineError(
                f"Rank {self._rank} lost global rank 0 while waiting for its next instruction (it exited, or sent "
                f"nothing within the process group's timeout, the Fabric strategy's `timeout`): {exc}"
            ) from exc

    def _follow(self) -> None:
        """Global rank > 0: do what rank 0 says, in its order, until it says the run ended.

        A signal here is only recorded (rank 0 learns it at the step's last training call and ends
        the run at that boundary, with a checkpoint); this rank stops when rank 0 says so.
        """
        fabric, follower, started = self.fabric, Follower(self, self._offload), False
        self._preemption = preemption = Preemption(self.cfg.trainer.preempt_grace_s)
        preemption.install()
        try:
            while True:
                kind, msg = self._receive()
                if kind == "batch":
                    follower.replay("batch")
                    self._train_call(self._prepare(msg["groups"], msg["step"], msg["call"], msg["calls"]))
                elif kind == "save":
                    follower.replay("save", save=lambda: self._save(msg["step"], msg["fasync"]))
                elif kind == "sync":
                    follower.replay("sync" if started else "first_sync")
                elif kind == "start":
                    follower.replay("start")
                    started = True
                    fabric.call("on_fasync_train_start", loop=self)
                elif kind == "step":
                    self._begin_step(msg["step"])
                elif kind == "step_end":
                    fabric.call("on_rollout_step_end", loop=self, step=msg["step"], metrics=msg["metrics"])
                elif kind == "end":
                    fabric.call("on_fasync_train_end", loop=self)
                    return
                elif kind == "abort":
                    self._barrier()  # until rank 0 has stopped its engines
                    if msg["code"] is not None:
                        raise Preempted(msg["code"])
                    raise PipelineError(
                        f"Global rank 0 stopped the run ({msg['error']}); rank {self._rank} stops with it.")
                else:
                    raise PipelineError(f"Global rank 0 sent {kind!r}, which this FullyAsyncFabricLoop does not know.")
        finally:
            preemption.restore()
            self._preemption = None

    # ------------------------------------------------------------------ StepHooks

    def save_checkpoint(self, step: int) -> None:
        """Save model, optimizer and pipeline (``"fasync"``, with the run's identity) atomically.
        Rank 0's controller calls it; with several processes every rank saves the same state."""
        fasync = {**self.runtime.controller.state_dict(), "identity": run_identity(self.cfg, self._model)}
        self._send("save", step=step, fasync=fasync)
        self._save(step, fasync)
        self._listening = True

    def _save(self, step: int, fasync: dict[str, Any]) -> None:
        # Every rank calls fabric.save (a collective); global rank 0 writes, renames and links.
        state = {"model": self._model, "optimizer": self._optimizer, "fasync": fasync}
        if self._scheduler is not None:
            state["lr_scheduler"] = self._scheduler
        self.files.save(step, lambda path: self.fabric.save(path, state), self.fabric.is_global_zero)
        if self.cfg.trainer.save_hf:
            save_hf(self._hooks.engine_state_dict(), self._engine_model, self.files.hf_path(step), self.fabric.is_global_zero)
        self._saved_step = step

    def sync_weights(self, version: int) -> None:
        self._send("sync", version=version)
        try:
            super().sync_weights(version)
        finally:
            self._listening = True

    # ------------------------------------------------------------------ DriverHooks

    def _driver_hooks(self) -> Any:
        return self._hooks

    def _driver_optimizers(self) -> list[Any]:
        return [self._optimizer]
