"""The PPO-clip loss over trained tokens, as a pure function with an explicit normalizer.

Per trained token i with ratio r_i = exp(clamp(logp_i - old_i, -L, L)) and advantage A_i:

    loss_i = -min(r_i A_i, clip(r_i, clip_low, clip_high) A_i) * is_i
    and for A_i < 0 with dual clip c:  loss_i = min(loss_i, -c A_i)

(verl's ``compute_policy_loss``: the log-ratio clamp L = 20 keeps exp finite when the old log-probs are
the sampler's and a token was nearly impossible for the trainer; the dual clip bounds the loss of a
negative-advantage token whose ratio ran far above 1, where plain PPO-clip is unbounded.)

and the minibatch loss is sum_i w_i loss_i, where the weights w_i say how tokens are aggregated:

- ``token_sum`` (the reference): every token of a sequence counts fully, sequences are averaged:
  w_i = 1 / (number of sequences in the minibatch).
- ``token_mean``: w_i = 1 / (number of trained tokens in the minibatch).
- ``seq_mean``: each sequence's token mean, averaged: w_i = 1 / (tokens of i's sequence x sequences).

The weights are computed once per minibatch, so splitting it into micro-batches for gradient
accumulation gives exactly the same gradient. ``is_i`` is the optional truncated importance
weight min(exp(old_i - sampler_i), C) that corrects the sampler/trainer mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token_sum", "token_mean", "seq_mean")


def token_weights(tokens_per_sequence: list[int], aggregation: str, num_sequences: float | None = None, num_tokens: float | None = None) -> torch.Tensor:
    """w_i for the trained tokens of a minibatch, flattened sequence by sequence.

    ``num_sequences`` / ``num_tokens`` override the counts used as normalizers (several ranks
    training together pass the global count divided by the number of ranks).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {aggregation!r}: choose one of {', '.join(AGGREGATIONS)}")
    n_seq = float(num_sequences if num_sequences is not None else len(tokens_per_sequence))
    n_tok = float(num_tokens if num_tokens is not None else sum(tokens_per_sequence))
    pieces = []
    for n in tokens_per_sequence:
        if aggregation == "token_sum":
            w = 1.0 / n_seq
        elif aggregation == "token_mean":
            w = 1.0 / n_tok
        else:
            w = 1.0 / (max(n, 1) * n_seq)
        pieces.append(torch.full((n,), w, dtype=torch.float32))
    return torch.cat(pieces) if pieces else torch.zeros(0)


@dataclass(frozen=True)
class PPOStats:
    """Detached statistics of one loss evaluation (sums, so micro-batches add up). Each figure but ``tokens`` is a 0-dim
    tensor on the loss's device: reading it (``float``, ``int``) waits for the GPU, so the update reads them once, after
    its rows (``alfrl.ppo.Totals``)."""

    tokens: int
    clipped: torch.Tensor
    """Tokens whose clipped objective was the smaller one (their gradient is zero)."""
    dual_clipped: torch.Tensor
    """Negative-advantage tokens held at the dual-clip bound (their gradient is zero)."""
    approx_kl_sum: torch.Tensor
    """Sum over tokens of (r - 1) - log r, an estimate of KL(old || new)."""
    ratio_min: torch.Tensor
    ratio_max: torch.Tensor
    ratio_sum: torch.Tensor


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    clip_low: float = 0.8,
    clip_high: float = 1.2,
    is_weights: torch.Tensor | None = None,
    dual_clip: float | None = None,
    log_ratio_clamp: float | None = None,
) -> tuple[torch.Tensor, PPOStats]:
    """The weighted PPO-clip loss of N trained tokens (all inputs shaped (N,)) and its statistics.

    ``dual_clip`` (c > 1, e.g. 3) bounds the loss of negative-advantage tokens at -c A;
    ``log_ratio_clamp`` (e.g. 20) clamps logp - old before the exponential. None turns either off.
    """
    log_ratio = logprobs - old_logprobs
    if log_ratio_clamp is not None:
        log_ratio = torch.clamp(log_ratio, -log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, clip_low, clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    dual = torch.zeros_like(per_token, dtype=torch.bool)
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual = (advantages < 0) & (bound < per_token)
        per_token = torch.where(dual, bound, per_token)
    if is_weights is not None:
        per_token = per_token * is_weights
    loss = (per_token * weights).sum()
    with torch.no_grad():
        n = int(logprobs.numel())
        one = torch.ones((), device=ratio.device)
        stats = PPOStats(
            tokens=n,
            clipped=(clipped < unclipped).sum(),
            dual_clipped=dual.sum(),
            approx_kl_sum=((ratio - 1) - log_ratio).sum(),
            ratio_min=ratio.min() if n else one,
            ratio_max=ratio.max() if n else one,
            ratio_sum=ratio.sum(),
        )
    return loss, stats


def truncated_is_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """min(exp(old - sampler), cap): how much more likely the trainer finds a token than the sampler did."""
    return torch.clamp(torch.exp(old_logprobs - sampler_logprobs), max=cap)
