"""The PPO update: its settings (``model.ppo``), its packed micro-batches, and ``ppo_update``, the one function that turns
a step's samples into new LoRA weights.

    stats = ppo_update(policy, optimizer, samples, temperature)   # PPO-clip epochs x minibatches, AdamW steps

Micro-batches are packed by tokens without padding: sequences (sorted by length) are concatenated
into one row of at most ``microbatch_tokens`` tokens, with ``position_ids`` restarting at 0 for each,
so attention stays inside each sequence (transformers reads the boundaries from the position ids).
A sequence longer than the budget is a row of its own. Models whose layers carry state across a row
(Gated DeltaNet linear attention) get one sequence per row. Every per-token field is cut from the
samples' tensors with masks: no Python loop per token. ``backward_rows`` is the one place where packed rows are scored,
their PPO-clip loss formed and backpropagated; ``summary`` turns the rows' totals into the ``train/...`` statistics.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from alfrl.loss import AGGREGATIONS, PPOStats, ppo_clip_loss, token_weights, truncated_is_weights
from alfrl.types import Sample

OLD_LOGPROBS = ("sampler", "recompute")


@dataclass(frozen=True)
class PPOConfig:
    """The PPO-clip update (docs/conventions.md)."""

    clip_low: float = 0.8
    """Lower bound of the clipped ratio pi / pi_old, in (0, 1]."""
    clip_high: float = 1.2
    """Upper bound of the clipped ratio pi / pi_old, >= 1."""
    dual_clip: float | None = 3.0
    """Bound the loss of negative-advantage tokens at -c A (verl's clip_ratio_c); null: off."""
    log_ratio_clamp: float | None = 20.0
    """Clamp logp - old to [-L, L] before exp; null: off."""
    loss_aggregation: str = "token_sum"
    """``token_sum`` (the reference), ``token_mean`` or ``seq_mean``."""
    epochs: int = 1
    """Passes over each rollout batch."""
    minibatches: int = 1
    """Optimizer steps per epoch."""
    old_logprobs: str = "sampler"
    """``sampler``: the rollout's log-probs (the reference; the clip then also bounds sampler-trainer
    drift) or ``recompute``: the trainer's, without grad, before the update."""
    tis_cap: float | None = None
    """If set, weight tokens by min(exp(old - sampler), cap) (truncated importance sampling)."""
    microbatch_tokens: int = 16384
    """Tokens of one forward/backward (a packed row)."""
    logprob_chunk_size: int = 1024
    """Positions per output-layer chunk (bounds the float32 logits' memory)."""

    def problems(self, prefix: str = "model.ppo") -> list[str]:
        out = []
        if not 0 < self.clip_low <= 1:
            out.append(f"{prefix}.clip_low={self.clip_low} must be in (0, 1] (the ratio is clipped to [clip_low, clip_high], e.g. 0.8)")
        if self.clip_high < 1:
            out.append(f"{prefix}.clip_high={self.clip_high} must be >= 1 (e.g. 1.2)")
        if self.dual_clip is not None and self.dual_clip <= 1:
            out.append(f"{prefix}.dual_clip={self.dual_clip} must be > 1, e.g. 3 (or null to turn the dual clip off)")
        if self.log_ratio_clamp is not None and self.log_ratio_clamp <= 0:
            out.append(f"{prefix}.log_ratio_clamp={self.log_ratio_clamp} must be > 0, e.g. 20 (or null to turn the clamp off)")
        if self.loss_aggregation not in AGGREGATIONS:
            out.append(f"{prefix}.loss_aggregation={self.loss_aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
        if self.old_logprobs not in OLD_LOGPROBS:
            out.append(f"{prefix}.old_logprobs={self.old_logprobs!r} is not one of {', '.join(OLD_LOGPROBS)}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            out.append(f"{prefix}.tis_cap={self.tis_cap} must be > 0 (or null to turn truncated importance sampling off)")
        for name in ("epochs", "minibatches", "microbatch_tokens", "logprob_chunk_size"):
            if getattr(self, name) < 1:
                out.append(f"{prefix}.{name}={getattr(self, name)} must be >= 1")
        return out


def pack_microbatches(lengths: list[int], token_budget: int, pack: bool = True) -> list[list[int]]:
    """Sequence indices grouped into rows of at most ``token_budget`` tokens (a longer sequence alone).

    Sorted by length, so each row holds sequences of similar length; ``pack=False`` gives one
    sequence per row.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if not pack:
        return [[i] for i in order]
    rows: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i in order:
        if current and used + lengths[i] > token_budget:
            rows.append(current)
            current, used = [], 0
        current.append(i)
        used += lengths[i]
    if current:
        rows.append(current)
    return rows


@dataclass(frozen=True)
class MicroBatch:
    """One packed row of sequences and its trained tokens' fields, on the device."""

    members: list[int]
    """Indices of the samples in the row, in row order."""
    input_ids: torch.Tensor
    """(1, R) the concatenated sequences."""
    position_ids: torch.Tensor
    """(1, R) restarting at 0 for each sequence."""
    predict_mask: torch.Tensor
    """(1, R) bool: positions whose next token is trained."""
    predict_index: torch.Tensor
    """(N,) int64: those positions, in row order (the mask's, found on the host: no device-to-host copy in the loop)."""
    targets: torch.Tensor
    """(N,) int64: the token each of them predicts."""
    tokens_per_sequence: list[int]
    """Trained tokens of each member (for the loss weights)."""
    advantages: torch.Tensor
    """(N,) float32, the trained tokens in row order."""
    sampler_logprobs: torch.Tensor
    """(N,) float32."""


def collate(samples: list[Sample], members: list[int], device: torch.device | str) -> MicroBatch:
    """The row of ``samples[members]``: tensors concatenated, nothing padded. Everything the row's scoring needs to know
    on the host (its sequences' lengths, the trained positions and their targets) is found here, on the CPU, so scoring
    and training a row never wait for the GPU (each device-to-host read would drain its queue)."""
    picked = [samples[i] for i in members]
    mask = torch.cat([s.loss_mask_T for s in picked])
    ids = torch.cat([s.token_ids_T for s in picked])
    if bool(mask[-1]):
        raise ValueError("the last position of a row has no next token to predict")
    index = torch.nonzero(mask).flatten()
    position_ids = torch.cat([torch.arange(len(s)) for s in picked]).unsqueeze(0).to(device)
    position_ids._alfrl_segments = tuple(len(s) for s in picked)  # alfrl.attention.segment_lengths: known, not read back
    return MicroBatch(
        members=list(members),
        input_ids=ids.unsqueeze(0).to(device),
        position_ids=position_ids,
        predict_mask=mask.unsqueeze(0).to(device),
        predict_index=index.to(device),
        targets=ids[index + 1].to(device),
        tokens_per_sequence=[s.trained_tokens for s in picked],
        advantages=torch.cat([s.advantages_T for s in picked])[mask].to(device),
        sampler_logprobs=torch.cat([s.sampler_logprobs_T for s in picked])[mask].to(device),
    )


class Totals:
    """Sums over the rows of one update (its statistics), kept on the device while the rows train (reading a figure back
    would wait for the GPU), in float64 as Python's floats summed them; ``values()`` reads them once, at the end."""

    def __init__(self):
        self.rows: list[tuple[torch.Tensor, PPOStats]] = []
        self.grad_norm = 0.0
        self.steps = 0

    def add(self, loss: torch.Tensor, st: PPOStats) -> None:
        self.rows.append((loss.detach(), st))

    def values(self) -> dict[str, float]:
        """loss (summed over rows), tokens, clipped, dual_clipped, kl, ratio_sum, ratio_min, ratio_max."""
        stats = [st for _, st in self.rows]
        return {"loss": sum_in_order([lo for lo, _ in self.rows]), "tokens": sum(st.tokens for st in stats),
                "clipped": int(sum_in_order([st.clipped for st in stats])),
                "dual_clipped": int(sum_in_order([st.dual_clipped for st in stats])),
                "kl": sum_in_order([st.approx_kl_sum for st in stats]), "ratio_sum": sum_in_order([st.ratio_sum for st in stats]),
                "ratio_min": float(torch.stack([st.ratio_min for st in stats]).min()) if stats else math.inf,
                "ratio_max": float(torch.stack([st.ratio_max for st in stats]).max()) if stats else -math.inf}


def sum_in_order(values: list[torch.Tensor]) -> float:
    """0-dim tensors kept on the device while rows train, read back at once and added one after the other in float64
    (the order and rounding of Python's floats, as when each was read after its row)."""
    total = 0.0
    for v in (torch.stack([v.double() for v in values]).cpu().tolist() if values else []):
        total += v
    return total


def backward_rows(policy, samples: list[Sample], part: list[int], old: list[torch.Tensor], n_seq: float, n_tok: float,
                  temperature: float, totals: Totals, diffs: list[torch.Tensor] | None) -> None:
    """Score ``samples[part]`` in packed rows, backpropagate their PPO-clip loss (normalized by ``n_seq`` / ``n_tok``,
    per ``ppo.loss_aggregation``) into the LoRA's gradients and add the rows' statistics to ``totals``. ``old[i]`` holds
    sample i's old log-probs; ``diffs`` (when given) gets sampler - trainer log-probs of every trained token."""
    ppo = policy.ppo
    rows = policy.microbatches(samples, part)  # every copy to the device before the rows' kernels: none waits on them
    row_weights = [token_weights(mb.tokens_per_sequence, ppo.loss_aggregation, n_seq, n_tok).to(policy.device) for mb in rows]
    for r, (mb, weights) in enumerate(zip(rows, row_weights)):
        logprobs = policy.logprobs_of(mb, temperature)  # (N,)
        old_mb = torch.cat([old[i] for i in mb.members])
        if diffs is not None:
            diffs.append((mb.sampler_logprobs - logprobs.detach()).float())
        is_w = truncated_is_weights(old_mb, mb.sampler_logprobs, ppo.tis_cap) if ppo.tis_cap is not None else None
        loss, st = ppo_clip_loss(logprobs, old_mb, mb.advantages, weights, ppo.clip_low, ppo.clip_high, is_w,
                                 ppo.dual_clip, ppo.log_ratio_clamp)
        with gradient_sync(policy, last=r == len(rows) - 1):
            _backward(policy, loss)
        totals.add(loss, st)


def summary(totals: Totals, samples: list[Sample], old: list[torch.Tensor], diffs: list[torch.Tensor]) -> dict[str, float]:
    """The update's statistics (``train/...``) from its totals."""
    t = totals.values()
    n = max(t["tokens"], 1)
    all_diffs = torch.cat(diffs) if diffs else torch.zeros(0)
    return {
        "loss": t["loss"] / max(totals.steps, 1),
        "clip_fraction": t["clipped"] / n,
        "dual_clip_fraction": t["dual_clipped"] / n,
        "approx_kl": t["kl"] / n,
        "ratio_mean": t["ratio_sum"] / n,
        "ratio_min": t["ratio_min"] if t["tokens"] else 1.0,
        "ratio_max": t["ratio_max"] if t["tokens"] else 1.0,
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
        self.retries_before = self._alloc_retries()

    def _alloc_retries(self) -> int:
        """torch's count of allocations that found no free cached block, emptied the cache (a device sync and cudaFree
        of every unused block) and tried again: fragmentation that costs time without running out of memory."""
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)) if self.cuda else 0

    def memory(self) -> dict[str, float]:
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else 0.0
        return {"peak_memory_gib": peak, "update_added_memory_gib": peak - self.memory_before,
                "alloc_retries": float(self._alloc_retries() - self.retries_before)}


def ppo_update(policy, optimizer, samples: list[Sample], temperature: float = 1.0) -> dict[str, float]:
    """PPO-clip epochs over ``samples`` on ``policy``'s LoRA, stepping ``optimizer``; returns the update's statistics.

    ``optimizer`` is Lightning's (``policy.optimizers()`` in a training step: the update's last optimizer step goes through
    it, so ``global_step`` counts rollout+update steps) or a plain torch optimizer (tests and benchmarks, no Trainer).
    ``temperature`` is the rollout's sampling temperature: the trainer scores softmax(logits / T), the distribution the
    samples came from.
    """
    from lightning.pytorch.core.optimizer import LightningOptimizer

    ppo = policy.ppo
    lightning_optimizer = optimizer if isinstance(optimizer, LightningOptimizer) else None
    raw_optimizer = optimizer.optimizer if lightning_optimizer is not None else optimizer
    world = policy.trainer.world_size if policy._trainer is not None else 1
    start = UpdateStart(policy)  # prepared, memory marked
    started = time.perf_counter()
    old = policy.old_logprobs(samples, temperature)
    old_seconds = time.perf_counter() - started
    diffs: list[torch.Tensor] = []  # sampler - trainer log-probs, from the forwards before the first optimizer step
    tot = Totals()
    rng = random.Random(policy.hparams.seed * 1_000_003 + policy.weight_version)
    minibatches = _minibatch_count(policy, len(samples), world)
    n_optimizer_steps = ppo.epochs * minibatches
    for _epoch in range(ppo.epochs):
        order = list(range(len(samples)))
        rng.shuffle(order)
        for part in [order[k::minibatches] for k in range(minibatches)]:
            tot.steps += 1
            n_seq, n_tok = global_counts(policy, len(part), sum(int(old[i].numel()) for i in part), world)
            backward_rows(policy, samples, part, old, n_seq, n_tok, temperature, tot, diffs if tot.steps == 1 else None)
            if not part:
                _touch_all_parameters(policy)
            tot.grad_norm += clip_gradients(policy)
            # the last optimizer step of a training step goes through Lightning so that
            # global_step counts rollout+update steps; the others step the optimizer directly
            if lightning_optimizer is not None and tot.steps == n_optimizer_steps:
                lightning_optimizer.step()
            else:
                raw_optimizer.step()
            raw_optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - started  # the old log-probs (when the trainer scores them) and the update
    sequence_tokens = sum(len(s) for s in samples)
    return {
        "prepare_seconds": start.prepare_seconds,
        "old_logprob_seconds": old_seconds,
        "update_seconds": seconds - old_seconds,
        **policy.throughput(sequence_tokens, sum(int(o.numel()) for o in old), seconds, ppo.epochs,
                            scored=ppo.old_logprobs == "recompute"),
        "sequence_tokens": float(sequence_tokens),
        **start.memory(),
        "skipped_steps": float(policy.skipped_steps),
        "minibatches": float(minibatches),
        **summary(tot, samples, old, diffs),
    }

def _minibatch_count(policy, n_samples: int, world: int) -> int:
    """``ppo.minibatches``, or fewer when a step has fewer samples than that on some rank (dropped
    groups): an empty minibatch would be an optimizer step on a zero gradient. Every rank takes the
    same count, so their all-reduces meet."""
    if world > 1:
        count = torch.tensor([float(n_samples)], device=policy.device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN)
        n_samples = int(count.item())
    return max(1, min(policy.ppo.minibatches, n_samples))

def global_counts(policy, n_seq: int, n_tok: int, world: int) -> tuple[float, float]:
    """Normalizers: the minibatch's sequence and token counts over all ranks, divided by the rank count.

    DDP averages gradients over ranks, so dividing by (global count / ranks) on every rank gives
    exactly the loss of the global minibatch.
    """
    if world <= 1:
        return float(max(n_seq, 1)), float(max(n_tok, 1))
    counts = torch.tensor([float(n_seq), float(n_tok)], device=policy.device)
    counts = policy.trainer.strategy.reduce(counts, reduce_op="sum")
    return max(float(counts[0]), 1.0) / world, max(float(counts[1]), 1.0) / world

def gradient_sync(policy, last: bool):
    """Under DDP, all-reduce gradients only on the last backward of a minibatch (the rest accumulate)."""
    from torch.nn.parallel import DistributedDataParallel

    wrapper = policy.trainer.model if policy._trainer is not None else None
    if not last and isinstance(wrapper, DistributedDataParallel):
        return wrapper.no_sync()
    return nullcontext()

def _backward(policy, loss: torch.Tensor) -> None:
    if policy._trainer is not None:
        policy.manual_backward(loss)
    else:
        loss.backward()

def _touch_all_parameters(policy) -> None:
    """A zero loss over every trainable parameter, for a rank with no samples, so DDP's all-reduce still meets."""
    _backward(policy, sum(p.sum() * 0.0 for p in policy.trainable_parameters()))

def clip_gradients(policy) -> float:
    """Clip the LoRA gradient; a non-finite gradient (a NaN or inf anywhere) is dropped, so the
    optimizer step that follows leaves the weights as they are instead of making them NaN."""
    params = [p for p in policy.trainable_parameters() if p.grad is not None]
    if not params:
        return 0.0
    max_norm = policy.optim.grad_clip_norm if policy.optim.grad_clip_norm > 0 else float("inf")
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    if not math.isfinite(norm):
        for p in params:
            p.grad = None  # AdamW skips parameters without a gradient: no step at all
        policy.skipped_steps += 1
    return norm
