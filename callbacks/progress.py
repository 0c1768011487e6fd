"""A progress bar counted in updates ("update 3/80"), that also shows the rollout in progress."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import _update_n


class RolloutProgressBar(TQDMProgressBar):
    """TQDM training bar over the run's updates (a resumed run starts at its step, out of ``trainer.max_steps``);
    during a rollout its postfix reads ``rollout turns N, live L/T``."""

    @property
    def train_description(self) -> str:
        return "update"

    def on_train_start(self, trainer, *_: Any) -> None:
        super().on_train_start(trainer, *_)
        self._count_updates(trainer)  # a resumed run may start mid-epoch, with no epoch start

    def on_train_epoch_start(self, trainer, *_: Any) -> None:  # Lightning's, without its "Epoch N" description
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        self._count_updates(trainer)

    def _count_updates(self, trainer) -> None:
        bar = self.train_progress_bar
        bar.unit = "update"
        bar.reset(total=trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None)
        bar.initial = trainer.global_step  # the rate counts this process's updates only
        _update_n(bar, trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.train_progress_bar is not None:
            _update_n(self.train_progress_bar, trainer.global_step)
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the logger's version: not a number a user watches
        return metrics

    def rollout_progress(self, progress) -> None:
        bar = getattr(self, "_train_progress_bar", None)
        if bar is None or self.is_disabled:
            return
        bar.set_postfix_str(f"rollout turns {progress.turns}, live {progress.live}/{progress.total}", refresh=True)
