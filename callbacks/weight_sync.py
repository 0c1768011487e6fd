"""Push the policy's weights into the sampling engine after every update, and check they arrived.

The pushing and the checks (counts, probe gap, probe response) live in the Sampler
(``alfrl.sync.WeightSync``); this callback asks for them at the start of training and after every update, and logs its ``sync/``
metrics. A failed check stops the run with ``WeightSyncError``.

The sync ends a training step, so this callback also logs the step's wall clock, ``step/seconds``: from Lightning's start
of the batch (the rollout begins in the training step) to the end of its sync. It holds what the parts logged apart
(``rollout/seconds``, ``train/update_seconds``, ``sync/total_seconds``) leave out: the engine's probe after the rollout, the
samples, the memory guard, the logging. A checkpoint or an evaluation after the sync is not in it (``checkpoint/seconds``).
"""

from __future__ import annotations

import logging
import time

import lightning as L

from alfrl.sync import WeightSyncError  # noqa: F401  (re-exported: the error users see)

log = logging.getLogger("alfrl")


class SamplerWeightSync(L.Callback):
    """Sync at the start of training and after every update."""

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
        self.last: dict[str, float] = {}
        self.step_started: float | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        self.step_started = time.perf_counter()

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        self.sync(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        started = time.perf_counter()
        canary = {}
        if self.check and self.canary_at_step and trainer.global_step == self.canary_at_step:
            canary = trainer.datamodule.connect(pl_module).weight_sync(self.check).canary(pl_module)
            log.warning("weight-sync canary after update %d: a sync that skipped the push was %s (%s)", trainer.global_step,
                        "caught" if canary["sync/canary_caught"] else "NOT caught", canary.get("sync/canary_message", ""))
        self.sync(trainer, pl_module)
        self.last.update({k: v for k, v in canary.items() if isinstance(v, float)})
        ended = time.perf_counter()
        self.last["sync/total_seconds"] = ended - started  # the engine's wake-up, the canary, push and checks
        if self.step_started is not None:
            self.last["step/seconds"] = ended - self.step_started
            self.step_started = None
        for key, value in self.last.items():
            pl_module.log(key, value, on_step=True, batch_size=1)

    def sync(self, trainer: L.Trainer, policy) -> dict[str, float]:
        self.last = trainer.datamodule.connect(policy).sync(policy, check=self.check)
        return self.last
