"""Weight sync: push the trainer's weights into the sampling engine, and check that they arrived.

A sync that silently does nothing would make every rollout come from an old policy (verl issue
7495). Four checks, each able to fail:

1. **Counts.** The engine says how many adapted modules (``lora``) or tensors (``merged``) it took;
   anything but all of them raises.
2. **Gap.** A fixed probe sequence is scored teacher-forced by the engine and by the trainer; the mean
   |engine - trainer| log-prob must stay below ``tolerance``. This catches wrong weights, but not a
   small update that never arrived: engine and trainer already differ by ~0.008 nats in bf16.
3. **Response.** The probe is also scored by the engine just before the push. Between two syncs the
   trainer's log-probs move by d_t (per token) and the engine's by d_e.
   - Whenever the trainer moved at all, an engine whose log-probs did not move at all (d_e = 0 exactly:
     scoring the same weights twice is deterministic) did not take the sync; this raises, at any size.
   - When the trainer moved by more than ``NOISE_FACTOR`` times the first sync's gap (at least 1e-5
     nats per token), the response sum(d_e d_t) / sum(d_t d_t), ~1 for a sync that reached the engine,
     is logged and its running value over every such sync so far must stay above ``min_response``.
     Below that the change is the numerical noise of the bf16 forward, which the engine cannot follow.
   Also logged, not checked: ``sync/engine_response_total``, the engine's change since the first sync
   against the trainer's.
4. **Finite.** Log-probs that are not finite (engine or trainer) raise: a NaN would pass every comparison.

Why a running response: on the H200 (raw-results-2026-12-06:bench/README.md) the LoRA-served engine followed 0.37 of the
first update of a run from a warm start at lr 1e-5, and about nothing of one update at lr 1e-6 from a
fresh adapter; in a 10-update run at lr 2e-5 it followed -0.04 to 0.50 per sync, 0.28 running. A
likely cause (not isolated): vLLM computes the LoRA product in bf16 and adds it to the bf16 output of
the base layer, which rounds part of a small change away; what is rounded away differs per sync, while
the weights the engine holds are always the latest (each sync sends them whole), so a single sync's
response is noisy and the running one much less. A sync that never arrives keeps it near 0.
"""

from __future__ import annotations

import copy
import math
import time

import torch

from alfrl.engines import EngineError

SYNC_MODES = ("lora", "merged")
NOISE_FACTOR = 2.0
"""The response is checked when the trainer's probe change is above this many times the first sync's gap.
On the H200 (raw-results-2026-12-06:bench/README.md, 2026-12-01) one update at lr 1e-6 or 1e-5 from a fresh adapter moved the
bf16 trainer's probe by 0.028-0.038 nats per token, about the engine-trainer gap (0.029-0.036): noise of
the bf16 forward, which the engine cannot follow (responses -0.09 to 0.07); at lr 1e-4 (0.10-0.14) the
engine followed 0.89-0.93."""


class WeightSyncError(RuntimeError):
    """The engine does not serve the trainer's weights after a sync."""


class NonFiniteProbeError(WeightSyncError):
    """The engine or the trainer scored the probe as NaN or infinite: it computes garbage, synced or not."""


def _mean_abs(xs: list[float]) -> float:
    return sum(abs(x) for x in xs) / max(len(xs), 1)


def _diff(before: list[float], after: list[float]) -> list[float]:
    """Per-token change of probe log-probs (the first token has none)."""
    return [b - a for a, b in zip(before[1:], after[1:])]


def _dot(xs: list[float], ys: list[float]) -> float:
    return sum(x * y for x, y in zip(xs, ys))


class WeightSync:
    """Pushes ``policy``'s weights into ``engine`` (``mode``: lora or merged) and checks them on ``probe``."""

    def __init__(self, engine, probe: list[int], mode: str = "lora", tolerance: float = 0.1, min_response: float = 0.1,
                 check: bool = True):
        if mode not in SYNC_MODES:
            raise ValueError(f"unknown weight sync {mode!r}: choose one of {', '.join(SYNC_MODES)}")
        self.engine = engine
        self.probe = list(probe)
        self.mode = mode
        self.tolerance = tolerance
        self.min_response = min_response
        self.check = check
        self.last_trainer: list[float] | None = None
        self.floor: float | None = None
        self.first: tuple[list[float], list[float]] | None = None
        """Engine and trainer probe log-probs at the first sync."""
        self.last_engine: list[float] | None = None
        """The engine's probe log-probs right after the last sync (no weights pushed since)."""
        self.cross = 0.0
        """Running sums over the syncs above the noise floor: sum(d_e d_t) and sum(d_t d_t)."""
        self.norm = 0.0

    def push(self, policy) -> tuple[int, int, float]:
        """(taken, expected, seconds): what the engine took of the adapter's modules / the merged tensors, and the seconds
        the trainer took to gather the adapter (before the engine's part)."""
        start = time.perf_counter()
        adapter = policy.adapter_weights()
        gathered = time.perf_counter() - start
        if self.mode == "lora":
            return self.engine.load_adapter(adapter), len(adapter.modules), gathered
        return self.engine.update_weights(policy.merged_weights()), len(adapter.modules), gathered

    def sync(self, policy, push: bool = True) -> dict[str, float]:
        """Push and check; returns the ``sync/`` metrics. ``push=False`` skips the push itself (the
        tests and the GPU bench use it to show that the checks catch a sync that did nothing)."""
        self.engine.wake_up()
        # scored now, not taken from ``check_engine``'s score after the rollout: on the H200 that one differed from the
        # score right after the sync before it (``engine/probe_drift`` up to 0.206 with no push between, 2026-12-04 fits),
        # while two scores at a sync came out bit-identical (the canary caught, raw-results-2026-12-06:bench/leases/2026-12-02e.md), which the
        # "did not move at all" check below needs
        before = self._score(f"before pushing weight version {policy.weight_version}") \
            if self.check and not self.engine.shares_policy else None
        start = time.perf_counter()
        taken, expected, gathered = self.push(policy) if push else (0, 0, 0.0)
        metrics = {"sync/seconds": time.perf_counter() - start, "sync/weight_version": float(policy.weight_version),
                   "sync/taken": float(taken), "sync/expected": float(expected), "sync/gather_seconds": gathered}
        # where a separate engine process's push went (vllm_engine: write, load, swap)
        if push:
            metrics.update({f"sync/{phase}_seconds": v for phase, v in self.engine.push_seconds.items()})
        if taken != expected:
            raise WeightSyncError(f"the {self.engine.name} engine took {taken} of the {expected} pushed {self.mode} weights")
        if not self.check:
            return metrics
        after = self._score(f"after pushing weight version {policy.weight_version}")
        trainer = policy.score(self.probe)
        for who, scores in ((f"{self.engine.name} engine before the push", before), (f"{self.engine.name} engine", after), ("trainer", trainer)):
            bad = 0 if scores is None else sum(not math.isfinite(x) for x in scores)
            if bad:
                # right after a wake-up: what the engine knows of its settings that broke this before (VLLMEngine)
                hint = getattr(self.engine, "wake_up_nan_hint", "") if scores is before else ""
                if scores is after:  # the engine before the push was finite: were the pushed weights, is the trainer?
                    hint = (f"; {self._weights_finite(policy)}; the trainer's probe: {sum(not math.isfinite(x) for x in trainer)} non-finite"
                            f"{getattr(self.engine, 'fault_hint', '')}")
                raise NonFiniteProbeError(
                    f"after syncing weight version {policy.weight_version}, {bad} of the {who}'s {len(scores)} probe log-probs are "
                    "not finite: it computes garbage (a NaN comparison would pass every other check, so this stops here)" + hint
                )
        gap = _mean_abs([a - b for a, b in zip(after[1:], trainer[1:])])
        metrics["sync/probe_abs_logprob_diff"] = gap
        if self.floor is None:
            self.floor = max(1e-5, gap)
            self.first = (after, trainer)
        elif before is not None:  # logged only: the engine's total change since the first sync against the trainer's
            total_t = _diff(self.first[1], trainer)
            total_norm = _dot(total_t, total_t)
            if total_norm > 0:
                metrics["sync/engine_response_total"] = _dot(_diff(self.first[0], after), total_t) / total_norm
        if gap > self.tolerance:
            raise WeightSyncError(
                f"after syncing weight version {policy.weight_version}, the {self.engine.name} engine's log-probs of the probe "
                f"differ from the trainer's by {gap:.4f} on average (tolerance {self.tolerance}): the engine is not serving the "
                "trained weights. Check the model's parameter names, or raise data.engine.sync_check_tolerance if this is "
                "numerical noise."
            )
        if before is not None and self.last_trainer is not None:
            d_t, d_e = _diff(self.last_trainer, trainer), _diff(before, after)
            change, cross, norm = _mean_abs(d_t), _dot(d_e, d_t), _dot(d_t, d_t)
            metrics["sync/trainer_change"] = change
            metrics["sync/engine_change"] = _mean_abs(d_e)
            if norm > 0:
                metrics["sync/engine_response"] = cross / norm
            if change > 0 and all(e == 0.0 for e in d_e):  # exact at any size: scoring the same weights twice is deterministic
                raise WeightSyncError(
                    f"after syncing weight version {policy.weight_version}, the trainer's probe log-probs moved by {change:.2e} nats per "
                    f"token but the {self.engine.name} engine's did not move at all: the sync did not reach the engine.{self._hint()}"
                )
            if change >= NOISE_FACTOR * self.floor:
                self._check_response(policy.weight_version, change, cross, norm, metrics)
        self.last_trainer = trainer
        self.last_engine = after
        return metrics

    def _score(self, when: str) -> list[float]:
        """The engine's probe log-probs. An engine that fails here (vLLM's CUDA faults on the H200 came on this request)
        raises an EngineError saying when, with the engine's note on what is known of such faults (``fault_hint``); the
        original is its cause. Without it, Lightning's teardown on the broken GPU raised a second CUDA error last."""
        try:
            return self.engine.score(self.probe)
        except (EngineError, WeightSyncError):
            raise
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise EngineError(f"the {self.engine.name} engine failed scoring the sync's probe {when} ({type(e).__name__}: "
                              f"{first}){getattr(self.engine, 'fault_hint', '')}") from e

    def _weights_finite(self, policy) -> str:
        """Whether every pushed tensor is finite (said in a non-finite probe's error: the trainer's weights or the engine)."""
        tensors = list(policy.adapter_weights().tensors.values()) if self.mode == "lora" else [t for _, t in policy.merged_weights()]
        bad = sum(not bool(torch.isfinite(t).all()) for t in tensors)
        return f"{bad} of the {len(tensors)} pushed {self.mode} tensors have non-finite values" if bad else \
            f"all {len(tensors)} pushed {self.mode} tensors are finite"

    def check_engine(self, when: str) -> dict[str, float]:
        """Score the probe again with no weights pushed since the last sync: it must come out as it did then.

        Returns ``engine/probe_drift`` (the largest change of a log-prob); raises ``NonFiniteProbeError`` when a log-prob
        is not finite: the engine computed garbage ``when`` (e.g. "after the rollout", which then sampled from it). On
        the H200 the random Qwen3.5-4B's engine scored NaN after a wake-up; this says whether it already did before the
        sleep. Nothing to compare before the first sync. ``engine/probe_seconds``: the scoring's time."""
        if not self.check or self.last_engine is None or self.engine.shares_policy:
            return {}
        started = time.perf_counter()
        scores = self._score(when)
        seconds = time.perf_counter() - started
        bad = sum(not math.isfinite(x) for x in scores)
        if bad:
            raise NonFiniteProbeError(
                f"{when}, {bad} of the {self.engine.name} engine's {len(scores)} probe log-probs are not finite although no "
                "weights were pushed since the last sync (when they were): the engine computes garbage"
            )
        return {"engine/probe_drift": max((abs(a - b) for a, b in zip(scores, self.last_engine)), default=0.0),
                "engine/probe_seconds": seconds}

    def canary(self, policy) -> dict:
        """A sync that skips the push, tried on a copy of this sync's state (this one is left as it was):
        ``sync/canary_caught`` 1.0 when the checks raised, else 0.0 with the trainer's probe change since
        the last sync (0 when the update did not move the probe: then there is nothing to catch). Non-finite
        log-probs are raised, not counted as caught: they say the engine computes garbage, not that a check
        noticed the missing push (the H200 run of 2026-12-02 had its canary "caught" that way)."""
        trial = copy.copy(self)
        try:
            metrics = trial.sync(policy, push=False)
        except NonFiniteProbeError:
            raise
        except WeightSyncError as e:
            return {"sync/canary_caught": 1.0, "sync/canary_message": str(e)}
        change = metrics.get("sync/trainer_change", 0.0)
        return {"sync/canary_caught": 0.0, "sync/canary_trainer_change": change,
                "sync/canary_message": f"the trainer's probe log-probs moved {change:.2e} per token since the last sync"}

    def _hint(self) -> str:
        return " In merged mode bf16 rounding swallows small updates: use data.engine.weight_sync: lora." if self.mode == "merged" else ""

    def _check_response(self, version: int, change: float, cross: float, norm: float, metrics: dict) -> None:
        hint = self._hint()
        self.cross += cross
        self.norm += norm
        running = self.cross / self.norm
        metrics["sync/engine_response_running"] = running
        if running < self.min_response:
            raise WeightSyncError(
                f"after syncing weight version {version}, the {self.engine.name} engine has followed only {running:.2f} of the "
                f"trainer's probe log-prob changes so far (at least {self.min_response} expected): the syncs are not reaching "
                f"the engine.{hint} (data.engine.sync_min_response sets the bound; 0 turns this check off)"
            )
