"""Advantages per turn, computed within each group of K trajectories, and the training samples.

Estimators (``AdvantageConfig.estimator``):

- ``grpo_mean`` (the reference): A = R - mean of the group's rewards, on every turn.
- ``grpo_std``: (R - mean) / (std + eps).
- ``gigpo``: episode advantage (the group's rewards normalised with ``norm``) plus ``step_weight`` x
  step advantage, where the steps of the group that stand in the same environment state (same
  observation and admissible actions) form an anchor group and each step's discounted return is
  normalised within it. A singleton anchor group gives a step advantage of 0.
- ``hgpo``: hierarchical groups of steps keyed by the last k raw observations (k = 1 .. K+1, K the
  history length); singleton groups are skipped, zero levels dropped, and the level advantages
  are mixed with weights (k+1)^alpha. With ``base_group`` the episode advantage joins as k = 0.

``norm``: ``mean_std_norm`` = (x - mean) / (std + eps); ``mean_norm`` = x - mean. ``std: auto`` takes
each estimator's reference convention: the unbiased (n - 1) standard deviation for grpo_std and gigpo
(torch.std in verl / verl-agent), the population one for hgpo (its reference implementation);
``unbiased`` or ``population`` force one.
GiGPO's episode statistics are taken over step rows by default (verl-agent's
``compute_mean_std_cross_all_data``: a trajectory counts once per step) or once per trajectory.

Values that are all equal normalise to exactly 0.0 (decided from ``max == min`` of the values, never
from the floats ``x - mean``, which are often +-1e-17 for equal rewards such as eight -0.1). So a group
is degenerate exactly when every advantage is 0.0: for grpo when its rewards are all equal, for gigpo
/ hgpo when moreover every anchor group's returns are equal. The reference drops degenerate groups.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from alfrl.rewards import RewardConfig, step_returns
from alfrl.types import Sample, TokenSequence, Trajectory, TrajectoryGroup

ESTIMATORS = ("grpo_mean", "grpo_std", "gigpo", "hgpo")
NORMS = ("mean_std_norm", "mean_norm")
STDS = ("auto", "unbiased", "population")
EPISODE_STATS = ("step", "trajectory")


@dataclass(frozen=True)
class AdvantageConfig:
    """How advantages are computed from a group's rewards."""

    estimator: str = "grpo_mean"
    """``grpo_mean`` (the reference), ``grpo_std``, ``gigpo`` or ``hgpo``."""
    norm: str = "mean_std_norm"
    """Normalisation inside gigpo / hgpo groups: ``mean_std_norm`` or ``mean_norm``."""
    eps: float = 1e-6
    """Added to a standard deviation before dividing by it."""
    std: str = "auto"
    """``auto`` (unbiased for grpo_std / gigpo, population for hgpo: each one's reference), ``unbiased`` or ``population``."""
    episode_stats: str = "step"
    """gigpo: the episode level's mean / std over ``step`` rows (verl-agent's default: a trajectory
    counts once per step) or over ``trajectory`` rows (each trajectory once)."""
    step_weight: float = 1.0
    """gigpo: weight of the step advantage added to the episode advantage."""
    hgpo_alpha: float = 1.0
    """hgpo: level k weighs (k+1)^alpha (0 gives equal weights)."""
    hgpo_base_group: bool = False
    """hgpo: add the episode advantage as level k = 0."""
    drop_degenerate_groups: bool = True
    """Leave out of the training batch the groups whose advantages are all zero."""

    @property
    def std_kind(self) -> str:
        """The standard deviation actually used (``auto`` resolved)."""
        if self.std != "auto":
            return self.std
        return "population" if self.estimator == "hgpo" else "unbiased"

    def problems(self, prefix: str = "data.advantage") -> list[str]:
        out = []
        if self.estimator not in ESTIMATORS:
            out.append(f"{prefix}.estimator={self.estimator!r} is not one of {', '.join(ESTIMATORS)}")
        if self.norm not in NORMS:
            out.append(f"{prefix}.norm={self.norm!r} is not one of {', '.join(NORMS)}")
        if self.std not in STDS:
            out.append(f"{prefix}.std={self.std!r} is not one of {', '.join(STDS)}")
        if self.episode_stats not in EPISODE_STATS:
            out.append(f"{prefix}.episode_stats={self.episode_stats!r} is not one of {', '.join(EPISODE_STATS)}")
        if self.eps <= 0:
            out.append(f"{prefix}.eps={self.eps} must be > 0")
        return out


def normalise(values: list[float], norm: str, eps: float, std: str = "unbiased", weights: list[int] | None = None) -> list[float]:
    """``values`` centred (and scaled by std + eps); exactly 0.0 everywhere when the values are all equal.

    ``weights`` counts each value that many times in the mean and std (GiGPO's step rows).
    """
    if max(values) == min(values):
        return [0.0] * len(values)
    w = weights or [1] * len(values)
    n = sum(w)
    mean = sum(c * v for c, v in zip(w, values)) / n
    if norm == "mean_norm":
        return [v - mean for v in values]
    dof = n - 1 if std == "unbiased" else n
    sd = math.sqrt(sum(c * (v - mean) ** 2 for c, v in zip(w, values)) / dof) if dof > 0 else 0.0
    return [(v - mean) / (sd + eps) for v in values]


def _episode_advantages(trajs: list[Trajectory], cfg: AdvantageConfig) -> list[float]:
    rewards = [t.reward for t in trajs]
    if cfg.estimator == "grpo_mean":
        return normalise(rewards, "mean_norm", cfg.eps)
    if cfg.estimator == "grpo_std":
        return normalise(rewards, "mean_std_norm", cfg.eps, cfg.std_kind)
    weights = [max(len(t.turns), 1) for t in trajs] if cfg.estimator == "gigpo" and cfg.episode_stats == "step" else None
    return normalise(rewards, cfg.norm, cfg.eps, cfg.std_kind, weights)


def _returns(trajs: list[Trajectory], reward: RewardConfig) -> list[list[float]]:
    out = []
    for t in trajs:
        won_at = len(t.turns) - 1 if t.won else None
        out.append(step_returns(won_at, [turn.invalid for turn in t.turns], reward))
    return out


def state_groups(trajs: list[Trajectory]) -> list[list[tuple[int, int]]]:
    """GiGPO's step groups of one trajectory group: the (trajectory, turn) pairs that stood in the same environment state
    (observation and admissible actions)."""
    members: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for i, t in enumerate(trajs):
        for s, turn in enumerate(t.turns):
            members[turn.state_key].append((i, s))
    return list(members.values())


def _gigpo_step_advantages(trajs: list[Trajectory], returns: list[list[float]], cfg: AdvantageConfig) -> list[list[float]]:
    out = [[0.0] * len(t.turns) for t in trajs]
    for steps in state_groups(trajs):
        values = normalise([returns[i][s] for i, s in steps], cfg.norm, cfg.eps, cfg.std_kind)
        for (i, s), v in zip(steps, values):
            out[i][s] = v
    return out


def hgpo_step_advantages(
    anchors: list[list[str]], returns: list[list[float]], cfg: AdvantageConfig, history_length: int, episode: list[float] | None = None
) -> list[list[float]]:
    """HGPO advantages from each trajectory's anchors (raw observations before acting) and step returns.

    Level k of step t is the tuple of anchors t-k+1 .. t (levels that would start before step 0
    do not exist). Steps sharing a level-k key form a level-k group; singletons are skipped; each
    group's returns are normalised. A step's advantage mixes its non-zero level advantages with
    weights (k+1)^alpha renormalised over those levels; ``episode`` (if given) joins as level 0.
    """
    max_level = history_length + 1
    groups: dict[tuple[int, tuple[str, ...]], list[tuple[int, int]]] = defaultdict(list)
    for i, seq in enumerate(anchors):
        for t in range(len(seq)):
            for k in range(1, min(max_level, t + 1) + 1):
                groups[(k, tuple(seq[t - k + 1 : t + 1]))].append((i, t))
    level_adv: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
    for (k, _key), steps in groups.items():
        if len(steps) < 2:
            continue
        for (i, t), a in zip(steps, normalise([returns[i][t] for i, t in steps], cfg.norm, cfg.eps, cfg.std_kind)):
            level_adv[(i, t)][k] = a
    out = []
    for i, seq in enumerate(anchors):
        row = []
        for t in range(len(seq)):
            levels = dict(level_adv.get((i, t), {}))
            if episode is not None:
                levels[0] = episode[i]
            levels = {k: a for k, a in levels.items() if a != 0.0}
            if not levels:
                row.append(0.0)
                continue
            weights = {k: (k + 1) ** cfg.hgpo_alpha for k in levels}
            total = sum(weights.values())
            row.append(sum(weights[k] / total * a for k, a in levels.items()))
        out.append(row)
    return out


def group_advantages(trajs: list[Trajectory], cfg: AdvantageConfig, reward: RewardConfig, history_length: int = 2) -> list[list[float]]:
    """Advantage of every turn of every trajectory of one group (trajectory-major).

    ``history_length`` is K of the window context (hgpo levels run k = 1 .. K+1).
    """
    if not trajs:
        return []
    episode = _episode_advantages(trajs, cfg)
    if cfg.estimator in ("grpo_mean", "grpo_std"):
        return [[episode[i]] * len(t.turns) for i, t in enumerate(trajs)]
    returns = _returns(trajs, reward)
    if cfg.estimator == "gigpo":
        step = _gigpo_step_advantages(trajs, returns, cfg)
        return [[episode[i] + cfg.step_weight * a for a in step[i]] for i in range(len(trajs))]
    anchors = [[turn.observation_before for turn in t.turns] for t in trajs]
    return hgpo_step_advantages(anchors, returns, cfg, history_length, episode if cfg.hgpo_base_group else None)


def sample_of(seq: TokenSequence, turn_advantages: list[float], group: int, trajectory: int) -> Sample:
    """A training sample from one token sequence: the trained-position rule lives here and only here.

    Token i was sampled when it lies in a turn's span; it is predicted at position i - 1, so the
    shifted fields at position i - 1 carry its sampler log-prob, its turn's advantage and the loss mask.
    """
    n = len(seq.token_ids)
    if len(seq.sampler_logprobs) != n:
        raise AssertionError(f"{len(seq.sampler_logprobs)} sampler log-probs for {n} token ids")
    mask_T = torch.zeros(n, dtype=torch.bool)
    advantages_T = torch.zeros(n, dtype=torch.float32)
    for turn, start, end in seq.spans:
        if not 1 <= start <= end <= n:
            raise AssertionError(f"turn {turn} spans tokens {start}..{end} of a {n}-token sequence: a completion follows a prompt")
        mask_T[start - 1 : end - 1] = True
        advantages_T[start - 1 : end - 1] = turn_advantages[turn]
    sampler_T = torch.zeros(n, dtype=torch.float32)
    sampler_T[:-1] = torch.tensor(seq.sampler_logprobs[1:], dtype=torch.float32)
    sampler_T[~mask_T] = 0.0
    return Sample(torch.tensor(seq.token_ids, dtype=torch.long), mask_T, sampler_T, advantages_T, group, trajectory)


@dataclass(frozen=True)
class AdvantageResult:
    samples: list[Sample]
    degenerate_groups: int
    dropped_groups: int
    abs_advantage_mean: float = 0.0
    """Mean |advantage| over the turns of the groups kept for training (each sampled token of a turn has its turn's)."""
    repeated_state_share: float = 0.0
    """Of the scored groups' turns, the share in a step group of two or more (``state_groups``): the only turns GiGPO gives
    a step advantage. A property of the rollout, measured for every estimator so that the arms compare."""

    def metrics(self) -> dict[str, float]:
        """The ``rollout/`` metrics of what the samples left out and of their advantages."""
        return {"rollout/degenerate_groups": float(self.degenerate_groups), "rollout/dropped_groups": float(self.dropped_groups),
                "rollout/abs_advantage_mean": self.abs_advantage_mean, "rollout/repeated_state_share": self.repeated_state_share}


def make_samples(groups: list[TrajectoryGroup], cfg: AdvantageConfig, reward: RewardConfig, history_length: int = 2) -> AdvantageResult:
    """Training samples of every playable group, degenerate groups dropped when configured.

    Trajectories that ended with ``env_error`` are left out (the crash was not the policy's doing)
    and the group's advantages use the others; a group with fewer than two left is skipped.
    """
    samples: list[Sample] = []
    degenerate = dropped = turns = scored_turns = repeated = 0
    abs_sum = 0.0
    for g_index, group in enumerate(groups):
        trajs = [t for t in group.trajectories if t.stop_reason != "env_error"]
        if group.failed is not None or len(trajs) < 2:
            continue
        scored_turns += sum(len(t.turns) for t in trajs)
        repeated += sum(len(steps) for steps in state_groups(trajs) if len(steps) > 1)
        advantages = group_advantages(trajs, cfg, reward, history_length)
        if all(a == 0.0 for row in advantages for a in row):
            degenerate += 1
            if cfg.drop_degenerate_groups:
                dropped += 1
                continue
        abs_sum += sum(abs(a) for row in advantages for a in row)
        turns += sum(len(row) for row in advantages)
        samples += [sample_of(seq, turn_adv, g_index, traj.index) for traj, turn_adv in zip(trajs, advantages)
                    for seq in traj.sequences if seq.spans]
    return AdvantageResult(samples, degenerate, dropped, abs_sum / max(turns, 1), repeated / max(scored_turns, 1))
