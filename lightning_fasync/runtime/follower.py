"""The trainer's half of the step protocol, written once for both drivers.

:class:`DriverHooks` is what the controller (``pipeline/controller.py``) calls on global rank 0,
besides ``save_checkpoint``: the weight sync and the five colocate stages (``ColocateHooks``).
The Lightning callback and the Fabric loop both inherit it and say only where their module,
optimizers and runtime are.

:data:`FOLLOWER_TABLE` is what every other rank does in step with rank 0: for each point of rank
0's step at which the trainer's devices or collectives are involved, the actions this rank takes
in rank 0's order. :class:`Follower` replays it; the callback reaches the points through
Lightning's hooks, the Fabric loop through rank 0's broadcast words, and both call
:meth:`Follower.replay`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from lightning_fasync.weights.tensor_stream import TensorStream

__all__ = ["FOLLOWER_TABLE", "DriverHooks", "Follower"]

FOLLOWER_TABLE: dict[str, tuple[str, ...]] = {
    # rank 0 ...                                                          this rank
    "first_sync": ("drain",),  # the driver's sync before start(), trainer on its device
    "start": ("offload",),  # controller.start(): the trainer's state leaves the device
    "batch": ("onload",),  # controller.fetch(): back before the step's first training call
    "save": ("save",),  # step_boundary(): the checkpoint's collectives
    "sync": ("offload", "drain"),  # step_boundary(): off after the checkpoint, then the weight sync
}
"""Rank 0's points, in the order they come, → this rank's actions: ``drain`` takes part in the
weight sync's gathers (a sharded module's stream), ``save`` in the checkpoint's collectives;
``offload`` and ``onload`` move the trainer's state only under ``colocate_offload``, and only when
it is not where they move it already."""


class DriverHooks:
    """The controller's weight sync and colocate stages, as both drivers implement them.

    A driver sets ``runtime`` (the :class:`~lightning_fasync.runtime.rollout_runtime.RolloutRuntime`
    on rank 0, None elsewhere) and implements :meth:`_driver_hooks` (the module's
    ``FullyAsyncHooks``) and :meth:`_driver_optimizers`.
    """

    runtime: Any = None

    def _driver_hooks(self) -> Any:
        raise NotImplementedError

    def _driver_optimizers(self) -> Sequence[Any]:
        raise NotImplementedError

    def _require_runtime(self) -> Any:
        if self.runtime is None:
            raise RuntimeError("Only global rank 0 holds the rollout runtime; this call belongs there.")
        return self.runtime

    # ------------------------------------------------------------------ the weight sync (StepHooks)

    def sync_weights(self, version: int) -> None:
        """Push the module's engine weights as ``version`` (rank 0). A sharded module's stream is
        drained whatever happens, so the other ranks' gathers (:meth:`follow_sync`) are matched."""
        weights = self._driver_hooks().engine_state_dict()
        try:
            self._require_runtime().sync_weights(weights, version)
        finally:
            if isinstance(weights, TensorStream):  # what a failed push left: the other ranks gather it too
                weights.drain()

    def follow_sync(self) -> None:
        """A rank other than 0 at rank 0's weight sync: take part in each gather, drop the tensors."""
        weights = self._driver_hooks().engine_state_dict()
        if isinstance(weights, TensorStream):
            weights.drain()

    # ------------------------------------------------------------------ ColocateHooks (colocate_offload)

    def offload_rollout(self) -> None:
        self._require_runtime().offload_rollout()

    def onload_train(self) -> None:
        self._driver_hooks().onload_train(list(self._driver_optimizers()))

    def offload_train(self) -> None:
        self._driver_hooks().offload_train(list(self._driver_optimizers()))

    def onload_rollout_weights(self) -> None:
        self._require_runtime().onload_rollout_weights()

    def onload_rollout_kv(self) -> None:
        self._require_runtime().onload_rollout_kv()


class Follower:
    """A rank other than global rank 0, replaying :data:`FOLLOWER_TABLE`.

    Arguments:
        driver: the driver on this rank (its :class:`DriverHooks`).
        offload: whether the run offloads the trainer (``colocate_offload`` resolved for its device).
    """

    def __init__(self, driver: DriverHooks, offload: bool) -> None:
        self.driver = driver
        self.offload = offload
        self.on_device = True  # the trainer's state, as rank 0's controller has it at the same point

    def replay(self, point: str, save: Optional[Callable[[], None]] = None) -> None:
        """This rank's part at rank 0's ``point`` (a key of :data:`FOLLOWER_TABLE`); ``save`` runs
        the checkpoint's collectives on this rank (for ``"save"``)."""
        try:
            actions = FOLLOWER_TABLE[point]
        except KeyError:
            raise ValueError(f"{point!r} is not a point of the step protocol ({', '.join(FOLLOWER_TABLE)}).") from None
        for action in actions:
            if action == "offload":
                if self.offload and self.on_device:
                    self.driver.offload_train()
                    self.on_device = False
            elif action == "onload":
                if self.offload and not self.on_device:
                    self.driver.onload_train()
                    self.on_device = True
            elif action == "save":
                if save is None:
                    raise ValueError("replay('save') needs the driver's save.")
                save()
            elif action == "drain":
                self.driver.follow_sync()
