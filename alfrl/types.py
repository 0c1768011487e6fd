"""The data that flows through alfrl, in one place: turns, trajectories, groups, training samples and a rollout's timings.

games -> environments -> Sampler (Trajectory: token ids, masks, log-probs) -> advantages ->
Sample (per-token tensors, already shifted) -> PPO update. Shape suffixes: ``_T`` is one entry per
token of a sequence.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from alfrl.games import Game

STOP_REASONS = ("won", "env_done", "max_steps", "trajectory_too_long", "env_error")


@dataclass(frozen=True)
class Turn:
    """One model turn and what the environment made of it."""

    completion_text: str
    """The sampled text (final stop token removed)."""
    action: str | None
    """The canonical action parsed from the completion; None when the format is invalid."""
    valid_format: bool
    format_error: str | None
    admissible: bool
    """The action was in the admissible list the model was shown (False when the format is invalid)."""
    invalid: bool
    """Counts as an invalid action under the reward config."""
    status: str
    """One of protocol.STATUS_*."""
    observation: str
    """What the environment answered ("Nothing happens." when it was not stepped)."""
    observation_before: str
    """The raw observation the agent saw before acting (the HGPO anchor)."""
    state_key: str
    """A hash of the observation and admissible actions before acting (the GiGPO anchor state)."""
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


@dataclass(frozen=True)
class TokenSequence:
    """One training sequence: token ids, which of them were sampled, and the sampler's log-probs."""

    token_ids: tuple[int, ...]
    sampler_logprobs: tuple[float, ...]
    """Aligned to ``token_ids``: the sampler's log-prob of each sampled token; 0.0 on the others."""
    spans: tuple[tuple[int, int, int], ...]
    """(turn index, start, end): ``token_ids[start:end]`` is that turn's sampled completion."""

    @property
    def assistant_mask(self) -> list[int]:
        """1 on sampled completion tokens, 0 elsewhere (prompt, template and feedback tokens)."""
        mask = [0] * len(self.token_ids)
        for _, start, end in self.spans:
            mask[start:end] = [1] * (end - start)
        return mask


@dataclass(frozen=True)
class Trajectory:
    """One episode of one game played by the policy."""

    game_id: str
    split: str
    task_type: str
    group_id: int
    """Index of the group (game) in its batch."""
    index: int
    """Index of the trajectory within its group."""
    task: str
    turns: tuple[Turn, ...]
    won: bool
    invalid_actions: int
    stop_reason: str
    """One of STOP_REASONS."""
    reward: float
    step_rewards: tuple[float, ...]
    """r_t per turn (win reward on the winning turn, penalties on invalid turns)."""
    sequences: tuple[TokenSequence, ...]
    """One sequence for the full context, one per turn for the window context."""

    @property
    def steps(self) -> int:
        return len(self.turns)


@dataclass(frozen=True)
class TrajectoryGroup:
    """The K trajectories of one game, which started from the identical state."""

    game: Game
    trajectories: tuple[Trajectory, ...]
    failed: str | None = None
    """Why the group could not be played (then ``trajectories`` is empty)."""


@dataclass(frozen=True)
class RolloutProgress:
    """Reported while a rollout runs, for progress bars."""

    turns: int
    """Turns played so far, over all trajectories."""
    live: int
    """Trajectories still playing."""
    total: int


@dataclass(frozen=True)
class Sample:
    """One training sequence as the update consumes it: per-token tensors of length T, already shifted.

    Position t predicts token t+1, so every field at t is about ``token_ids_T[t + 1]``: it is trained
    when ``loss_mask_T[t]`` (token t+1 was sampled by the policy); the last position is never trained.
    This is the one place where the "trained position" rule lives (``advantages.make_samples``).
    """

    token_ids_T: torch.Tensor
    """(T,) int64: the sequence."""
    loss_mask_T: torch.Tensor
    """(T,) bool: position t is trained (token t+1 was sampled)."""
    sampler_logprobs_T: torch.Tensor
    """(T,) float32: the sampler's log-prob of token t+1 (0 where not trained)."""
    advantages_T: torch.Tensor
    """(T,) float32: the advantage of token t+1's turn (0 where not trained)."""
    group: int
    trajectory: int

    def __len__(self) -> int:
        return int(self.token_ids_T.numel())

    @property
    def trained_tokens(self) -> int:
        return int(self.loss_mask_T.sum())


def repeated_turns(turns: Iterable[tuple[str, str | None]]) -> tuple[int, int]:
    """(turns that take an action already taken earlier in the same episode from the same state, turns with an action) of
    one episode's (state_key, action) pairs in order. The same state is the same observation and available actions
    (``Turn.state_key``): the environment answers such a turn as it did the first time, so it is a loop."""
    seen: set[tuple[str, str]] = set()
    repeats = turns_with_action = 0
    for state, action in turns:
        if not action:
            continue
        turns_with_action += 1
        repeats += (state, action) in seen
        seen.add((state, action))
    return repeats, turns_with_action


# ---------------------------------------------------------------- JSONL


def trajectory_to_dict(t: Trajectory) -> dict:
    return asdict(t)


def trajectory_from_dict(d: dict) -> Trajectory:
    d = dict(d)
    d["turns"] = tuple(Turn(**turn) for turn in d["turns"])
    d["sequences"] = tuple(
        TokenSequence(tuple(s["token_ids"]), tuple(s["sampler_logprobs"]), tuple(tuple(x) for x in s["spans"])) for s in d["sequences"]
    )
    d["step_rewards"] = tuple(d["step_rewards"])
    return Trajectory(**d)


def write_jsonl(path: str | Path, trajectories: list[Trajectory]) -> None:
    with open(path, "w") as f:
        for t in trajectories:
            f.write(json.dumps(trajectory_to_dict(t)) + "\n")


def read_jsonl(path: str | Path) -> list[Trajectory]:
    with open(path) as f:
        return [trajectory_from_dict(json.loads(line)) for line in f if line.strip()]
