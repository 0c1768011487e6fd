"""The policy's settings (LoRA, optimizer, PPO) and the update's micro-batches.

Settings are small typed dataclasses, recipe keys under ``model.lora``, ``model.optim`` and
``model.ppo``; each lists its problems naming the key, like the data side's configs.

Micro-batches are packed by tokens without padding: sequences (sorted by length) are concatenated
into one row of at most ``microbatch_tokens`` tokens, with ``position_ids`` restarting at 0 for each,
so attention stays inside each sequence (transformers reads the boundaries from the position ids).
A sequence longer than the budget is a row of its own. Models whose layers carry state across a row
(Gated DeltaNet linear attention) get one sequence per row. Every per-token field is cut from the
samples' tensors with masks: no Python loop per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alfrl.loss import AGGREGATIONS
from alfrl.types import Sample

OLD_LOGPROBS = ("sampler", "recompute")


@dataclass(frozen=True)
class LoRAConfig:
    """The adapter trained on the frozen base model."""

    rank: int = 32
    alpha: int = 64
    """Scaling = alpha / rank."""
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"
    """``all-linear`` (every linear layer but the output layer, of every layer kind) or module names."""

    def problems(self, prefix: str = "model.lora") -> list[str]:
        out = []
        if self.rank < 1:
            out.append(f"{prefix}.rank={self.rank} must be >= 1")
        if self.alpha <= 0:
            out.append(f"{prefix}.alpha={self.alpha} must be > 0")
        if not 0 <= self.dropout < 1:
            out.append(f"{prefix}.dropout={self.dropout} must be in [0, 1)")
        if not self.target_modules:
            out.append(f"{prefix}.target_modules is empty: all-linear or a list of module names")
        return out


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW on the LoRA weights."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    eps: float = 1e-8
    grad_clip_norm: float = 1.0
    """Clip the LoRA gradient norm to this (0 = no clipping)."""

    def problems(self, prefix: str = "model.optim") -> list[str]:
        out = []
        if self.lr <= 0:
            out.append(f"{prefix}.lr={self.lr}: the learning rate must be > 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            out.append(f"{prefix}.betas={list(self.betas)}: two numbers in [0, 1), e.g. [0.9, 0.95]")
        if self.weight_decay < 0:
            out.append(f"{prefix}.weight_decay={self.weight_decay} must be >= 0")
        if self.eps <= 0:
            out.append(f"{prefix}.eps={self.eps} must be > 0")
        if self.grad_clip_norm < 0:
            out.append(f"{prefix}.grad_clip_norm={self.grad_clip_norm} must be >= 0 (0 turns clipping off)")
        return out


@dataclass(frozen=True)
class PPOConfig:
    """The PPO-clip update (README: conventions)."""

    clip_low: float = 0.8
    clip_high: float = 1.2
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
    tokens_per_sequence: list[int]
    """Trained tokens of each member (for the loss weights)."""
    advantages: torch.Tensor
    """(N,) float32, the trained tokens in row order."""
    sampler_logprobs: torch.Tensor
    """(N,) float32."""


def collate(samples: list[Sample], members: list[int], device: torch.device | str) -> MicroBatch:
    """The row of ``samples[members]``: tensors concatenated, nothing padded."""
    picked = [samples[i] for i in members]
    mask = torch.cat([s.loss_mask_T for s in picked])
    return MicroBatch(
        members=list(members),
        input_ids=torch.cat([s.token_ids_T for s in picked]).unsqueeze(0).to(device),
        position_ids=torch.cat([torch.arange(len(s)) for s in picked]).unsqueeze(0).to(device),
        predict_mask=mask.unsqueeze(0).to(device),
        tokens_per_sequence=[s.trained_tokens for s in picked],
        advantages=torch.cat([s.advantages_T for s in picked])[mask].to(device),
        sampler_logprobs=torch.cat([s.sampler_logprobs_T for s in picked])[mask].to(device),
    )
