"""The PPO update's passes over samples: ``backward_rows`` is the one place where packed rows are scored, their PPO-clip
loss formed and backpropagated (``AlfrlPolicy.update`` calls it once per minibatch); ``summary`` turns the rows' totals
into the update's ``train/...`` statistics; ``UpdateStart`` marks the update's start (preparation, memory).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from alfrl.loss import ppo_clip_loss, token_weights, truncated_is_weights
from alfrl.types import Sample

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
