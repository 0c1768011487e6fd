"""Rewards of a finished trajectory, per episode and per step.

- ``episode`` (the reference): reward = ``win_reward`` x won - ``invalid_penalty`` x invalid actions,
  where an action is invalid when its format is invalid or it is not admissible. Step rewards put
  the win on the winning step and each penalty on its own step, so they sum to the reward.
- ``stepwise`` (verl-agent): the winning step earns ``win_reward`` (10); a step is invalid when its
  completion lacks ``<action>...</action>`` or ``<think>...</think>`` or contains CJK characters.
  Step returns are R_t = r_t + gamma R_(t+1) over the win rewards, and an invalid step gets
  ``-invalid_penalty`` added to its own return only (never discounted backwards).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

REWARD_KINDS = ("episode", "stepwise")


@dataclass(frozen=True)
class RewardConfig:
    """How trajectories are scored."""

    kind: str = "episode"
    """``episode`` (the reference) or ``stepwise`` (verl-agent's step returns)."""
    win_reward: float = 1.0
    """Reward for winning (the stepwise recipe uses 10)."""
    invalid_penalty: float = 0.1
    """Subtracted once per invalid action."""
    gamma: float = 0.95
    """Discount of step returns (used by gigpo, hgpo and stepwise rewards)."""
    noise: float = 0.0
    """Standard deviation of Gaussian noise added to each trajectory's reward (on its last step), seeded by the rollout's
    seed, the game and the trajectory. For checking the pipeline on weights that never win: a random checkpoint gives
    every trajectory of a group the same reward, so no group has an advantage and nothing trains. Keep 0 to learn."""

    def problems(self, prefix: str = "data.reward") -> list[str]:
        out = []
        if self.kind not in REWARD_KINDS:
            out.append(f"{prefix}.kind={self.kind!r} is not one of {', '.join(REWARD_KINDS)}")
        if self.invalid_penalty < 0:
            out.append(f"{prefix}.invalid_penalty={self.invalid_penalty} must be >= 0 (it is subtracted)")
        if not 0.0 <= self.gamma <= 1.0:
            out.append(f"{prefix}.gamma={self.gamma} must be in [0, 1]")
        if self.noise < 0:
            out.append(f"{prefix}.noise={self.noise} must be >= 0 (0: no noise, the setting for learning runs)")
        return out


def reward_noise(cfg: RewardConfig, seed: int, game_id: str, index: int) -> float:
    """The noise ``cfg.noise`` adds to trajectory ``index`` of ``game_id`` in the rollout with ``seed`` (0.0 when off)."""
    if cfg.noise <= 0:
        return 0.0
    return random.Random(zlib.crc32(f"{seed}|{game_id}|{index}|reward-noise".encode())).gauss(0.0, cfg.noise)


def step_rewards(won_at: int | None, invalid: list[bool], cfg: RewardConfig) -> list[float]:
    """r_t for each step: ``win_reward`` on the winning step, minus ``invalid_penalty`` on invalid steps."""
    rewards = [-cfg.invalid_penalty if bad else 0.0 for bad in invalid]
    if won_at is not None:
        rewards[won_at] += cfg.win_reward
    return rewards


def episode_reward(won: bool, invalid_actions: int, cfg: RewardConfig) -> float:
    return (cfg.win_reward if won else 0.0) - cfg.invalid_penalty * invalid_actions


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """R_t = r_t + gamma R_(t+1)."""
    out = [0.0] * len(rewards)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def step_returns(won_at: int | None, invalid: list[bool], cfg: RewardConfig) -> list[float]:
    """Per-step returns for step-level advantages.

    ``episode``: the discounted sum of later step rewards (penalties included).
    ``stepwise``: discounted win rewards, plus ``-invalid_penalty`` on each invalid step's own return.
    """
    if cfg.kind == "episode":
        return discounted_returns(step_rewards(won_at, invalid, cfg), cfg.gamma)
    wins = [0.0] * len(invalid)
    if won_at is not None:
        wins[won_at] = cfg.win_reward
    returns = discounted_returns(wins, cfg.gamma)
    return [r - (cfg.invalid_penalty if bad else 0.0) for r, bad in zip(returns, invalid)]
