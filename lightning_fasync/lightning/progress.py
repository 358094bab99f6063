"""The progress bar of a fully-async run: rollout steps, not Lightning's training calls.

Lightning counts training calls and epochs; a fully-async run is (B × N) // M training calls per
rollout step over an endless ticket stream, so Lightning's bar would show ``Epoch 0/-2`` and
four times the steps. This bar counts rollout steps, shows integers as integers, and leaves out
``v_num``.
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
        calls = trainer.global_step  # optimizer steps: one per training call
        if calls % self.calls_per_step == 0:
            bar = self.train_progress_bar
            bar.n = calls // self.calls_per_step
            bar.set_postfix(self.get_metrics(trainer, pl_module))
            bar.refresh()

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

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
