"""The progress bar of a fully-async run: rollout steps, not Lightning's training calls.

Lightning counts training calls and epochs; a fully-async run is (B × N) // M training calls per
rollout step over an endless ticket stream, so Lightning's bar would show ``Epoch 0/-2`` and
four times the steps. This bar counts rollout steps, shows integers as integers, and leaves out
``v_num``. :class:`~lightning_fasync.lightning.FullyAsyncCallback` moves it at each rollout step's
end, after logging the step's metrics: Lightning runs a ``ModelCheckpoint`` (which the callback is)
after every other callback, so a bar moving in its own ``on_train_batch_end`` would show the
previous step's values.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override


class RolloutProgressBar(TQDMProgressBar):
    """A TQDM bar over rollout steps.

    Arguments:
        calls_per_step: (B × N) // M training calls per rollout step.
    """

    def __init__(self, calls_per_step: int, refresh_rate: int = 1) -> None:
        super().__init__(refresh_rate=refresh_rate)
        self.calls_per_step = calls_per_step

    def _total(self, trainer: "pl.Trainer") -> Optional[int]:
        return trainer.max_steps // self.calls_per_step if trainer.max_steps and trainer.max_steps > 0 else None

    @override
    def on_train_epoch_start(self, trainer: "pl.Trainer", *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        bar = self.train_progress_bar
        bar.reset(total=self._total(trainer))
        bar.initial = 0
        bar.set_description("Rollout step")

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int) -> None:
        pass  # the bar counts rollout steps: the callback calls show_rollout_step at each step's end

    def show_rollout_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Draw the bar once for the rollout step that just ended, with its metrics."""
        bar = self.train_progress_bar
        if bar is None or bar.disable:
            return
        bar.n = trainer.global_step // self.calls_per_step  # optimizer steps: one per training call
        bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
        bar.refresh()

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        pass  # the last step's values are on the bar already; closing it draws it a last time

    @override
    def get_metrics(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        out: dict[str, Any] = {}
        for key, value in metrics.items():
            if isinstance(value, float) and value.is_integer() and key in ("step", "buf"):
                value = int(value)
            out[key] = value
        return out
