"""The PPO update's passes over samples, and the update of finished groups while the rollout still plays.

``backward_rows`` is the one place where packed rows are scored, their PPO-clip loss formed and backpropagated;
``AlfrlPolicy.update`` calls it once per minibatch after the rollout. ``GroupUpdate`` (``model.ppo.update_during_rollout``)
calls it for each group as soon as the rollout finished that group, so the update's forward and backward passes run
while the rollout's last trajectories still decode; the optimizer step waits for the last group.

The same update, not an approximation: with one epoch and one minibatch the update is one optimizer step on the sum of
the batch's per-token gradients, scaled by one normalizer (the batch's trained tokens for ``token_mean``, its sequences
for ``token_sum`` / ``seq_mean``). The weights do not change before that step, so a group's gradient is the same whether
it is computed during the rollout or after it (advantages are per group; ``old_logprobs: recompute`` scores with the
same weights too); ``GroupUpdate`` backpropagates each group with normalizer 1 and scales the summed gradient by the
batch's normalizer before clipping. Only the rows differ (a group's sequences are packed among themselves), which
changes float summation order, not the math. ``finish`` checks that the groups it trained are exactly the batch's samples.

On a GPU the groups' passes run in a worker thread on a CUDA stream of their own beside the engine's; the process's
GIL switch interval is lowered to 0.5 ms meanwhile (Python's 5 ms would let the worker's kernel launches hold up each
engine step; an unmeasured choice). On the CPU, and with the ``hf`` engine (which generates with the trained model
itself), they run inline, in the rollout's own loop.
"""

from __future__ import annotations

import math
import queue
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from alfrl.loss import ppo_clip_loss, token_weights, truncated_is_weights
from alfrl.types import Sample

SWITCH_INTERVAL_S = 0.0005


@dataclass
class Totals:
    """Sums over the rows of one update (its statistics)."""

    loss: float = 0.0
    tokens: int = 0
    clipped: int = 0
    dual_clipped: int = 0
    kl: float = 0.0
    ratio_sum: float = 0.0
    ratio_min: float = math.inf
    ratio_max: float = -math.inf
    grad_norm: float = 0.0
    steps: int = 0

    def add(self, loss: float, st) -> None:
        self.loss += loss
        self.tokens += st.tokens
        self.clipped += st.clipped
        self.dual_clipped += st.dual_clipped
        self.kl += st.approx_kl_sum
        self.ratio_sum += st.ratio_sum
        self.ratio_min = min(self.ratio_min, st.ratio_min)
        self.ratio_max = max(self.ratio_max, st.ratio_max)


def backward_rows(policy, samples: list[Sample], part: list[int], old: list[torch.Tensor], n_seq: float, n_tok: float,
                  temperature: float, totals: Totals, diffs: list[torch.Tensor] | None) -> None:
    """Score ``samples[part]`` in packed rows, backpropagate their PPO-clip loss (normalized by ``n_seq`` / ``n_tok``,
    per ``ppo.loss_aggregation``) into the LoRA's gradients and add the rows' statistics to ``totals``. ``old[i]`` holds
    sample i's old log-probs; ``diffs`` (when given) gets sampler - trainer log-probs of every trained token."""
    ppo = policy.ppo
    rows = policy.microbatches(samples, part)
    for r, mb in enumerate(rows):
        logprobs = policy.logprobs_of(mb, temperature)  # (N,)
        old_mb = torch.cat([old[i] for i in mb.members])
        if diffs is not None:
            diffs.append((mb.sampler_logprobs - logprobs.detach()).float())
        weights = token_weights(mb.tokens_per_sequence, ppo.loss_aggregation, n_seq, n_tok).to(policy.device)
        is_w = truncated_is_weights(old_mb, mb.sampler_logprobs, ppo.tis_cap) if ppo.tis_cap is not None else None
        loss, st = ppo_clip_loss(logprobs, old_mb, mb.advantages, weights, ppo.clip_low, ppo.clip_high, is_w,
                                 ppo.dual_clip, ppo.log_ratio_clamp)
        with policy._gradient_sync(last=r == len(rows) - 1):
            policy._backward(loss)
        totals.add(float(loss.detach()), st)


def summary(totals: Totals, samples: list[Sample], old: list[torch.Tensor], diffs: list[torch.Tensor]) -> dict[str, float]:
    """The update's statistics (``train/...``) from its totals."""
    n = max(totals.tokens, 1)
    all_diffs = torch.cat(diffs) if diffs else torch.zeros(0)
    return {
        "loss": totals.loss / max(totals.steps, 1),
        "clip_fraction": totals.clipped / n,
        "dual_clip_fraction": totals.dual_clipped / n,
        "approx_kl": totals.kl / n,
        "ratio_mean": totals.ratio_sum / n,
        "ratio_min": totals.ratio_min if totals.tokens else 1.0,
        "ratio_max": totals.ratio_max if totals.tokens else 1.0,
        "grad_norm": totals.grad_norm / max(totals.steps, 1),
        "trained_tokens": float(sum(int(o.numel()) for o in old)),
        "samples": float(len(samples)),
        "sampler_minus_trainer_logprob": float(all_diffs.mean()) if all_diffs.numel() else 0.0,
        "sampler_trainer_abs_logprob_diff": float(all_diffs.abs().mean()) if all_diffs.numel() else 0.0,
    }


class UpdateStart:
    """An update's start: the trainer prepared (its seconds) and the GPU's memory marked. torch's counts include a sleeping
    vLLM engine's memory pool (its pages unmapped, its blocks still counted: 2026-12-01, 123.45 GiB of which ~106 GiB were
    the asleep engine's), so the update's own share is the peak over what was allocated when it began."""

    def __init__(self, policy):
        self.device = policy.device
        started = time.perf_counter()
        policy.prepare_training()  # before the first update: the linear-attention kernel's choice (a GPU check for Qwen3.5)
        self.prepare_seconds = time.perf_counter() - started
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.memory_before = torch.cuda.memory_allocated(self.device) / 2**30 if self.cuda else 0.0

    def memory(self) -> dict[str, float]:
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else 0.0
        return {"peak_memory_gib": peak, "update_added_memory_gib": peak - self.memory_before}


def _key(s: Sample) -> tuple[int, int, int]:
    return s.group, s.trajectory, len(s)


class GroupUpdate:
    """One update fed group by group during the rollout (module docstring); ``finish`` takes the optimizer step."""

    def __init__(self, policy, temperature: float, threaded: bool):
        ppo = policy.ppo
        if ppo.epochs != 1 or ppo.minibatches != 1:
            raise ValueError(f"model.ppo.update_during_rollout needs one optimizer step per rollout (epochs 1, minibatches 1), "
                             f"not epochs {ppo.epochs} x minibatches {ppo.minibatches}: set it false or both to 1")
        world = policy.trainer.world_size if policy._trainer is not None else 1
        if world != 1:
            raise ValueError(f"model.ppo.update_during_rollout runs on one device, not {world}: set it false for multi-device runs")
        self.policy = policy
        self.temperature = temperature
        self.start = UpdateStart(policy)
        self.cuda = self.start.cuda
        self.totals = Totals(steps=1)
        self.diffs: list[torch.Tensor] = []
        self.samples: list[Sample] = []
        self.old: list[torch.Tensor] = []
        self.groups = 0
        self.busy_seconds = 0.0
        self.old_seconds = 0.0
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        if threaded:
            self.queue: queue.Queue[list[Sample] | None] = queue.Queue()
            self.stream = torch.cuda.Stream(policy.device) if self.cuda else None
            if self.stream is not None:  # the groups' passes read weights the last optimizer step wrote on this stream
                self.stream.wait_stream(torch.cuda.current_stream(policy.device))
            self.switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            self.thread = threading.Thread(target=self._work, name="alfrl-group-update", daemon=True)
            self.thread.start()

    # ------------------------------------------------------------ during the rollout
    def add(self, samples: list[Sample]) -> None:
        """One finished group's samples (none for a dropped or unplayable group)."""
        if self.error is not None:
            raise RuntimeError(f"the update of finished groups failed: {self.error!r}") from self.error
        if not samples:
            return
        self.groups += 1
        if self.thread is None:
            self._train(samples)
        else:
            self.queue.put(samples)

    def _train(self, samples: list[Sample]) -> None:
        started = time.perf_counter()
        old = self.policy.old_logprobs(samples, self.temperature)
        self.old_seconds += time.perf_counter() - started
        backward_rows(self.policy, samples, list(range(len(samples))), old, 1.0, 1.0, self.temperature, self.totals, self.diffs)
        self.samples.extend(samples)
        self.old.extend(old)
        if self.cuda:
            torch.cuda.current_stream(self.policy.device).synchronize()  # busy_seconds: until the GPU finished the group
        self.busy_seconds += time.perf_counter() - started

    def _work(self) -> None:
        while True:
            samples = self.queue.get()
            if samples is None:
                return
            try:
                with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                    self._train(samples)
            except BaseException as e:  # re-raised by add / finish in the training step's thread
                self.error = e
                return

    def _stop(self) -> None:
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join()
            self.thread = None
            sys.setswitchinterval(self.switch_interval)
        if self.cuda:
            torch.cuda.synchronize(self.policy.device)

    def _drop_gradients(self) -> None:
        for p in self.policy.trainable_parameters():
            p.grad = None
        if self.cuda:  # the optimizer step is done before the next update's stream can reuse the gradients' memory
            torch.cuda.synchronize(self.policy.device)

    def abort(self) -> None:
        """The rollout failed: stop the worker and drop the gradients."""
        self._stop()
        self._drop_gradients()

    # ------------------------------------------------------------ after the rollout
    def finish(self, samples: list[Sample], step: Callable[[], None]) -> dict[str, float]:
        """Wait for the last group, check the trained samples are ``samples`` (the batch), scale the summed gradient by
        the batch's normalizer, clip, and ``step()`` the optimizer (the gradients are dropped after). Returns the update's
        statistics."""
        started = time.perf_counter()
        self._stop()
        waited = time.perf_counter() - started
        if self.error is not None:
            raise RuntimeError(f"the update of finished groups failed: {self.error!r}") from self.error
        policy = self.policy
        trained = sorted(self.samples, key=_key)
        batch = sorted(samples, key=_key)
        if len(trained) != len(batch) or any(_key(a) != _key(b) or not torch.equal(a.token_ids_T, b.token_ids_T)
                                             or not torch.equal(a.advantages_T, b.advantages_T) for a, b in zip(trained, batch)):
            raise AssertionError(f"the groups trained during the rollout ({len(trained)} samples) are not the batch's "
                                 f"({len(batch)} samples): a bug in alfrl; set model.ppo.update_during_rollout false")
        n_tok = float(max(sum(int(o.numel()) for o in self.old), 1))
        n_seq = float(max(len(self.samples), 1))
        # the weight token_weights gives a one-token sequence: its normalizer for the whole batch (1 / n_tok or 1 / n_seq)
        scale = float(token_weights([1], policy.ppo.loss_aggregation, n_seq, n_tok)[0])
        with torch.no_grad():
            for p in policy.trainable_parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        self.totals.loss *= scale
        self.totals.grad_norm += policy._clip_gradients()
        step()
        self._drop_gradients()
        seconds = time.perf_counter() - started
        return {
            "prepare_seconds": self.start.prepare_seconds,
            "old_logprob_seconds": self.old_seconds,
            "update_seconds": seconds,
            "update_wait_seconds": waited,
            "update_during_rollout_seconds": self.busy_seconds,
            "groups_during_rollout": float(self.groups),
            **policy._throughput(self.samples, self.old, self.busy_seconds + seconds - waited),
            "sequence_tokens": float(sum(len(s) for s in self.samples)),
            **self.start.memory(),
            "skipped_steps": float(policy.skipped_steps),
            "minibatches": 1.0,
            **summary(self.totals, self.samples, self.old, self.diffs),
        }
