"""Push the policy's weights into the sampling engine after every update, and check they arrived.

A sync that silently does nothing would make every rollout come from the initial policy. So after
each sync the engine samples a short continuation of a fixed probe prompt, exactly as in a rollout,
and the log-probs it reports for those tokens are compared with the trainer's for the same tokens:
the mean absolute difference is logged (``sync/probe_abs_logprob_diff``) and must stay below
``data.engine.sync_check_tolerance``, or the run stops with an error. (The probe samples rather than
asking vLLM for prompt log-probs, so it uses the rollout's own code path.)
"""

from __future__ import annotations

import time

import lightning as L


class WeightSyncError(RuntimeError):
    """The engine does not serve the trainer's weights after a sync."""


class SamplerWeightSync(L.Callback):
    """Sync at the start of training and after every update."""

    def __init__(self, check: bool = True):
        """
        Args:
            check: compare engine and trainer log-probs of a probe sequence after each sync.
        """
        self.check = check
        self.last: dict[str, float] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module) -> None:
        self.sync(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.sync(trainer, pl_module)
        for key, value in self.last.items():
            pl_module.log(key, value, on_step=True, batch_size=1)

    def sync(self, trainer: L.Trainer, policy) -> dict[str, float]:
        dm = trainer.datamodule
        engine = dm.engine
        start = time.perf_counter()
        engine.wake_up()
        engine.update_weights(policy.merged_weights() if engine.name != "hf" else iter(()))
        seconds = time.perf_counter() - start
        self.last = {"sync/seconds": seconds, "sync/weight_version": float(policy.weight_version)}
        if self.check:
            diff = probe_difference(engine, policy, dm.probe_ids())
            self.last["sync/probe_abs_logprob_diff"] = diff
            tolerance = dm.engine_cfg.sync_check_tolerance
            if diff > tolerance:
                raise WeightSyncError(
                    f"after syncing weight version {policy.weight_version}, the {engine.name} engine's log-probs of the probe "
                    f"differ from the trainer's by {diff:.4f} on average (tolerance {tolerance}): the engine is not serving the "
                    "trained weights. Check the model's parameter names, or raise data.engine.sync_check_tolerance if "
                    "this is numerical noise."
                )
        return self.last


def probe_difference(engine, policy, probe: list[int], tokens: int = 16) -> float:
    """Mean |engine - trainer| log-prob of ``tokens`` tokens the engine samples after ``probe``."""
    from alfrl.engines import SamplingRequest

    request = SamplingRequest(tuple(probe), n=1, temperature=1.0, top_p=1.0, max_new_tokens=tokens, stop_token_ids=(), seed=0)
    (completion,), = engine.generate([request])
    trainer = policy.score(list(probe) + list(completion.token_ids))[len(probe) :]
    return sum(abs(a - b) for a, b in zip(completion.logprobs, trainer)) / max(len(trainer), 1)
