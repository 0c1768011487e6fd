"""Advantages decided exactly: degenerate groups from the rewards, std conventions, GiGPO's step rows."""

import dataclasses
import math

import pytest
import torch

from alfrl.advantages import AdvantageConfig, group_advantages, hgpo_step_advantages, make_samples, normalise, sample_of
from alfrl.games import Game
from alfrl.rewards import RewardConfig
from alfrl.types import TokenSequence, TrajectoryGroup
from tests.test_stepwise import _traj

EPISODE = RewardConfig()
GAME = Game("train:g/t", "train", "pick_and_place_simple", "/nonexistent")


def _group(rewards_and_invalid, turns=3):
    """A group of K trajectories with the given (won, invalid count), each with one training sequence."""
    trajs = []
    for k, (won, invalid) in enumerate(rewards_and_invalid):
        t = _traj([f"s{i}" for i in range(turns)], won, [i < invalid for i in range(turns)], k)
        seq = TokenSequence(tuple(range(10)), tuple([0.0] * 5 + [-0.5] * 5), ((0, 5, 10),))
        trajs.append(dataclasses.replace(t, reward=EPISODE.win_reward * won - EPISODE.invalid_penalty * invalid, sequences=(seq,)))
    return TrajectoryGroup(game=GAME, trajectories=tuple(trajs))


def test_eight_equal_minus_point_one_rewards_are_a_degenerate_group():
    # r - mean(r) of eight -0.1 is -1.4e-17, not 0: the group used to be kept (16 samples instead of 8)
    rewards = [-0.1] * 8
    assert rewards[0] - sum(rewards) / 8 != 0.0
    lost = _group([(False, 1)] * 8)
    mixed = _group([(True, 0)] + [(False, 1)] * 7)
    result = make_samples([lost, mixed], AdvantageConfig("grpo_mean"), EPISODE)
    assert result.degenerate_groups == 1 and result.dropped_groups == 1
    assert len(result.samples) == 8 and {s.group for s in result.samples} == {1}


def test_the_mean_absolute_advantage_counts_the_turns_of_the_groups_kept():
    # group 0 degenerate and dropped; group 1: one win (+7/8 on each of its 3 turns) and seven losses (-1/8 on each)
    lost = _group([(False, 1)] * 8)
    mixed = _group([(True, 0)] + [(False, 0)] * 7)
    result = make_samples([lost, mixed], AdvantageConfig("grpo_mean"), EPISODE)
    assert result.abs_advantage_mean == pytest.approx((7 / 8 + 7 * (1 / 8)) / 8)
    assert make_samples([lost], AdvantageConfig("grpo_mean"), EPISODE).abs_advantage_mean == 0.0  # nothing kept
    kept = make_samples([lost], AdvantageConfig("grpo_mean", drop_degenerate_groups=False), EPISODE)
    assert kept.degenerate_groups == 1 and kept.dropped_groups == 0 and kept.abs_advantage_mean == 0.0


@pytest.mark.parametrize("estimator", ["grpo_mean", "grpo_std", "gigpo", "hgpo"])
def test_every_all_equal_reward_count_is_degenerate(estimator):
    # K = 8, every trajectory lost with k invalid actions (k = 0..30): all-equal rewards, equal returns per state
    missed = []
    for k in range(0, 31):
        trajs = _group([(False, min(k, 3))] * 8).trajectories
        trajs = tuple(dataclasses.replace(t, reward=-0.1 * k) for t in trajs)
        adv = group_advantages(list(trajs), AdvantageConfig(estimator), EPISODE, history_length=1)
        if any(a != 0.0 for row in adv for a in row):
            missed.append(k)
    assert missed == []


def test_normalise_is_exactly_zero_on_equal_values_and_never_divides_by_zero():
    assert normalise([-0.3] * 8, "mean_std_norm", 1e-6) == [0.0] * 8
    assert normalise([0.7] * 3, "mean_norm", 1e-6) == [0.0] * 3
    assert normalise([5.0], "mean_std_norm", 1e-6, "unbiased") == [0.0]


def test_unbiased_std_is_verl_agents_convention_and_population_is_an_option():
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    mean = 1 / 8
    pop = math.sqrt((7 / 8) ** 2 / 8 + 7 * mean**2 / 8)
    unb = pop * math.sqrt(8 / 7)
    assert unb / pop == pytest.approx(1.0690449)  # the x1.07 of K = 8
    assert normalise(rewards, "mean_std_norm", 1e-6)[0] == pytest.approx((1 - mean) / (unb + 1e-6))
    assert normalise(rewards, "mean_std_norm", 1e-6, "population")[0] == pytest.approx((1 - mean) / (pop + 1e-6))
    assert AdvantageConfig("grpo_std").std_kind == "unbiased" and AdvantageConfig("gigpo").std_kind == "unbiased"
    assert AdvantageConfig("hgpo").std_kind == "population"
    assert AdvantageConfig("grpo_std", std="population").std_kind == "population"


def test_gigpo_episode_statistics_over_step_rows_or_trajectories():
    # A wins in 2 steps (reward 1), B loses after 4 steps (0): step rows weigh A twice and B four times
    a = _traj(["x", "y"], True, [False, False], 0)
    b = _traj(["p", "q", "r", "s"], False, [False] * 4, 1)
    a, b = dataclasses.replace(a, reward=1.0), dataclasses.replace(b, reward=0.0)
    rows = group_advantages([a, b], AdvantageConfig("gigpo", norm="mean_norm", step_weight=0.0), EPISODE)
    per_traj = group_advantages([a, b], AdvantageConfig("gigpo", norm="mean_norm", step_weight=0.0, episode_stats="trajectory"), EPISODE)
    assert rows[0] == pytest.approx([1 - 2 / 6] * 2) and rows[1] == pytest.approx([-2 / 6] * 4)
    assert per_traj[0] == pytest.approx([0.5] * 2) and per_traj[1] == pytest.approx([-0.5] * 4)
    # mean_std_norm over step rows: values 1,1,0,0,0,0 -> mean 1/3, unbiased std sqrt(4/3 / 5)
    sd = math.sqrt((2 * (2 / 3) ** 2 + 4 * (1 / 3) ** 2) / 5)
    rows = group_advantages([a, b], AdvantageConfig("gigpo", step_weight=0.0), EPISODE)
    assert rows[0][0] == pytest.approx((2 / 3) / (sd + 1e-6))


def test_hgpo_level_with_equal_returns_is_dropped_even_when_the_floats_disagree():
    # level (P,) holds three returns of -0.1: their centred values are +-1e-17, the level must count as 0
    anchors = [["P", "Q"], ["P", "Q"], ["P", "R"]]
    returns = [[-0.1, 0.0], [-0.1, 0.0], [-0.1, 1.0]]
    adv = hgpo_step_advantages(anchors, returns, AdvantageConfig("hgpo", hgpo_alpha=1.0), 1)
    assert adv[0][0] == 0.0 and adv[1][0] == 0.0 and adv[2][0] == 0.0


def test_the_repeated_state_share_counts_the_turns_in_gigpo_step_groups_of_two_or_more():
    one = TrajectoryGroup(game=GAME, trajectories=(_traj(["a", "b", "c"], True, [False] * 3, 0), _traj(["a", "d", "c"], False, [False] * 3, 1)))
    other = TrajectoryGroup(game=GAME, trajectories=(_traj(["c", "e"], False, [False] * 2, 0), _traj(["f"], False, [False], 1)))
    # a and c twice in the first group (4 of its 6 turns); the second group's c is not the first group's: nothing repeats there
    result = make_samples([one, other], AdvantageConfig("grpo_mean"), EPISODE)
    assert result.repeated_state_share == pytest.approx(4 / 9)  # every scored group counts, the degenerate second one too
    assert result.metrics()["rollout/repeated_state_share"] == result.repeated_state_share and result.dropped_groups == 1
    adv = group_advantages(list(one.trajectories), AdvantageConfig("gigpo", norm="mean_norm"), EPISODE)
    episode = group_advantages(list(one.trajectories), AdvantageConfig("gigpo", norm="mean_norm", step_weight=0.0), EPISODE)
    steps = [[a - e for a, e in zip(row, erow)] for row, erow in zip(adv, episode)]
    assert steps[0][1] == 0.0 and steps[1][1] == 0.0  # b and d: singleton step groups, no step advantage
    assert steps[0][0] != 0.0 and steps[0][2] != 0.0  # a and c: step groups of two with different returns


def test_samples_are_shifted_once_with_every_length_checked():
    seq = TokenSequence((5, 6, 7, 8, 9, 10), (0.0, 0.0, -0.1, -0.2, 0.0, -0.3), ((0, 2, 4), (1, 5, 6)))
    s = sample_of(seq, [0.5, -1.0], 3, 4)
    # token 2 and 3 were sampled in turn 0, token 5 in turn 1: positions 1, 2 and 4 predict them
    assert s.loss_mask_T.tolist() == [False, True, True, False, True, False]
    assert s.sampler_logprobs_T.tolist() == pytest.approx([0.0, -0.1, -0.2, 0.0, -0.3, 0.0])
    assert s.advantages_T.tolist() == [0.0, 0.5, 0.5, 0.0, -1.0, 0.0]
    assert torch.roll(s.token_ids_T, -1)[s.loss_mask_T].tolist() == [7, 8, 10]
    with pytest.raises(AssertionError, match="5 sampler log-probs for 6 token ids"):
        sample_of(TokenSequence((1, 2, 3, 4, 5, 6), (0.0,) * 5, ((0, 2, 3),)), [0.0], 0, 0)
