"""Hand the Sampler to the policy when training starts, and make the first weight sync.

The DataModule builds the Sampler (``RolloutDataModule.connect``) only now, when Lightning has put the policy's weights on
the device, made the optimizer with its state and restored a checkpoint: the trainer's long-lived GPU tensors exist before
the engine allocates anything (alfrl.guard says why). The policy's ``training_step`` then syncs after every update, with
this callback's settings; a failed check stops the run with ``WeightSyncError``.
"""

from __future__ import annotations

import lightning as L

from alfrl.sync import WeightSyncError  # noqa: F401  (re-exported: the error users see)


class SamplerWeightSync(L.Callback):
    """The Sampler to the policy at the start of training, and its first sync; the settings of every sync after."""

    def __init__(self, check: bool = True, canary_at_step: int = 0):
        """
        Args:
            check: compare engine and trainer log-probs of a probe sequence after each sync.
            canary_at_step: after this update (1 = the first; 0 = never), first try a sync that skips the
                push and log whether the checks caught it (``sync/canary_caught``), then sync for real: a check
                of the check on your model and settings. An update that did not move the probe at all
                leaves nothing to catch (``sync/canary_trainer_change`` 0).
        """
        if canary_at_step < 0:
            raise ValueError(f"weight_sync.canary_at_step={canary_at_step} must be >= 0 (0: no canary)")
        self.check = check
        self.canary_at_step = canary_at_step

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        sampler = trainer.datamodule.connect(pl_module)
        pl_module.attach(sampler, self.check, self.canary_at_step)
        sampler.sync(pl_module, check=self.check)
