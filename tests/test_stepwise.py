"""Stepwise mode (verl-agent): step returns, HGPO and GiGPO on hand-built groups, window prompts, e2e."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from alfrl.advantages import AdvantageConfig, group_advantages, hgpo_step_advantages
from alfrl.chat import chat_format
from alfrl.envs import EnvPool
from alfrl.rewards import RewardConfig, step_returns
from alfrl.rollout import RolloutConfig, RolloutRunner
from alfrl.types import Trajectory, Turn
from tests.helpers import ScriptedEngine, alfrl_here

STEPWISE = RewardConfig(kind="stepwise", win_reward=10.0, invalid_penalty=0.1, gamma=0.95)
S = 1e-6  # the std epsilon


def test_stepwise_returns_with_invalid_penalties_not_discounted_backwards():
    # wins at step 3; steps 0 and 2 invalid. Win returns: 10 * 0.95^3, 10 * 0.95^2, 10 * 0.95, 10
    assert step_returns(3, [True, False, True, False], STEPWISE) == pytest.approx([8.57375 - 0.1, 9.025, 9.5 - 0.1, 10.0])
    assert step_returns(None, [False, True], STEPWISE) == pytest.approx([0.0, -0.1])


# Group 1, K = 1 (levels 1 and 2). Anchors are the raw observations before each step.
#   T0: A B C, no win          -> returns [0, 0, 0]
#   T1: A B D, wins at step 2  -> [9.025, 9.5, 10]
#   T2: E B,   step 1 invalid  -> [0, -0.1]
#   T3: A B,   no win          -> [0, 0]
ANCHORS_1 = [["A", "B", "C"], ["A", "B", "D"], ["E", "B"], ["A", "B"]]
RETURNS_1 = [[0.0, 0.0, 0.0], [9.025, 9.5, 10.0], [0.0, -0.1], [0.0, 0.0]]


def test_hgpo_levels_singletons_normalised_returns_and_weights_by_hand():
    cfg = AdvantageConfig("hgpo", norm="mean_std_norm", hgpo_alpha=1.0)
    adv = hgpo_step_advantages(ANCHORS_1, RETURNS_1, cfg, history_length=1)
    # level 1, key (A,):   T0_0, T1_0, T3_0 = [0, 9.025, 0]  -> std 9.025 * sqrt(2) / 3 = 4.25442 -> [-0.70711, 1.41421, -0.70711]
    # level 1, key (B,):   T0_1, T1_1, T2_1, T3_1 = [0, 9.5, -0.1, 0] -> mean 2.35, std sqrt(68.17 / 4) = 4.12826
    # level 2, key (A, B): T0_1, T1_1, T3_1 = [0, 9.5, 0]     -> [-0.70711, 1.41421, -0.70711]
    # singletons skipped: (C,), (D,), (E,), (B, C), (B, D), (E, B)
    std_b = math.sqrt(68.17 / 4)
    b = [(v - 2.35) / (std_b + S) for v in (0.0, 9.5, -0.1, 0.0)]
    assert std_b == pytest.approx(4.128256, abs=1e-6)
    a0, a1 = -1 / math.sqrt(2), math.sqrt(2)  # (x - mean) / std for [0, x, 0]
    w1, w2 = 2 / 5, 3 / 5  # (k + 1)^alpha normalised over levels 1 and 2
    assert adv[0] == pytest.approx([a0, w1 * b[0] + w2 * a0, 0.0], abs=1e-5)
    assert adv[1] == pytest.approx([a1, w1 * b[1] + w2 * a1, 0.0], abs=1e-5)
    assert adv[2] == pytest.approx([0.0, b[2]], abs=1e-5)  # level 2 (E, B) is a singleton: level 1 alone, weight 1
    assert adv[3] == pytest.approx([a0, w1 * b[3] + w2 * a0], abs=1e-5)
    assert adv[0][1] == pytest.approx(-0.651963, abs=1e-5) and adv[1][1] == pytest.approx(1.541314, abs=1e-5)


def test_hgpo_alpha_zero_gives_equal_weights_and_mean_norm():
    adv = hgpo_step_advantages(ANCHORS_1, RETURNS_1, AdvantageConfig("hgpo", norm="mean_std_norm", hgpo_alpha=0.0), 1)
    std_b = math.sqrt(68.17 / 4)
    assert adv[0][1] == pytest.approx(((0 - 2.35) / std_b + (-1 / math.sqrt(2))) / 2, abs=1e-5)
    adv = hgpo_step_advantages(ANCHORS_1, RETURNS_1, AdvantageConfig("hgpo", norm="mean_norm", hgpo_alpha=1.0), 1)
    # mean_norm: level 1 (A,): [0, 9.025, 0] - 3.008333; level 2 (A, B): [0, 9.5, 0] - 3.166667
    assert adv[1][0] == pytest.approx(9.025 - 9.025 / 3)
    assert adv[1][1] == pytest.approx(2 / 5 * (9.5 - 2.35) + 3 / 5 * (9.5 - 9.5 / 3))


# Group 2, K = 1: a level whose advantages are exactly 0 is dropped and the weights renormalise.
#   U0: P Q, no win; U1: P Q, no win; U2: R Q, wins at step 1 -> returns [0, 0], [0, 0], [9.5, 10]
ANCHORS_2 = [["P", "Q"], ["P", "Q"], ["R", "Q"]]
RETURNS_2 = [[0.0, 0.0], [0.0, 0.0], [9.5, 10.0]]


def test_hgpo_drops_zero_levels_and_base_group_joins_as_level_zero():
    adv = hgpo_step_advantages(ANCHORS_2, RETURNS_2, AdvantageConfig("hgpo", hgpo_alpha=1.0), 1)
    # (P,) = [0, 0] -> exactly 0: dropped, so U0_0 has no level -> 0
    # (Q,) = [0, 0, 10] -> [-0.70711, -0.70711, 1.41421]; (P, Q) = [0, 0] -> 0: dropped, so U0_1 = level 1 alone
    assert adv[0] == pytest.approx([0.0, -1 / math.sqrt(2)], abs=1e-5)
    assert adv[2] == pytest.approx([0.0, math.sqrt(2)], abs=1e-5)  # (R,) and (R, Q) are singletons
    episode = [-1 / math.sqrt(2), -1 / math.sqrt(2), math.sqrt(2)]  # rewards [0, 0, 10] normalised
    adv = hgpo_step_advantages(ANCHORS_2, RETURNS_2, AdvantageConfig("hgpo", hgpo_alpha=1.0, hgpo_base_group=True), 1, episode)
    # U0_0: level 0 (weight 1) alone; U0_1: level 0 (1) and level 1 (2), both -0.70711; U2_0: level 0 alone
    assert adv[0] == pytest.approx([-1 / math.sqrt(2), -1 / math.sqrt(2)], abs=1e-5)
    assert adv[2] == pytest.approx([math.sqrt(2), math.sqrt(2)], abs=1e-5)


def _traj(anchors, won, invalid, index):
    turns = tuple(
        Turn(completion_text="", action="look", valid_format=True, format_error=None, admissible=True, invalid=bad, status="",
             observation="", observation_before=a, state_key=a, prompt_tokens=0, completion_tokens=1, finish_reason="stop")
        for a, bad in zip(anchors, invalid)
    )
    reward = (10.0 if won else 0.0) - 0.1 * sum(invalid)
    return Trajectory("g", "train", "t", 0, index, "task", turns, won, sum(invalid), "won" if won else "max_steps", reward, (), ())


def test_group_advantages_compute_stepwise_returns_from_trajectories():
    trajs = [_traj(["A", "B", "C"], False, [False] * 3, 0), _traj(["A", "B", "D"], True, [False] * 3, 1),
             _traj(["E", "B"], False, [False, True], 2), _traj(["A", "B"], False, [False, False], 3)]
    adv = group_advantages(trajs, AdvantageConfig("hgpo", hgpo_alpha=1.0), STEPWISE, history_length=1)
    assert adv == hgpo_step_advantages(ANCHORS_1, RETURNS_1, AdvantageConfig("hgpo", hgpo_alpha=1.0), 1)
    # gigpo on the same step samples (state keys = anchors here), mean_norm, step weight 1:
    # episode rewards [0, 10, -0.1, 0] -> mean 2.475; step groups as HGPO level 1
    g = group_advantages(trajs, AdvantageConfig("gigpo", norm="mean_norm", step_weight=1.0, episode_stats="trajectory"), STEPWISE)
    ep = [0 - 2.475, 10 - 2.475, -0.1 - 2.475, 0 - 2.475]
    assert g[1] == pytest.approx([ep[1] + 9.025 - 9.025 / 3, ep[1] + 9.5 - 2.35, ep[1] + 0.0])
    assert g[2] == pytest.approx([ep[2] + 0.0, ep[2] + (-0.1 - 2.35)])


GAME = "valid_seen:pick_cool_then_place_in_recep"


def test_window_prompt_at_step_5_shows_exactly_the_last_k_steps(valid_games, tiny_tokenizer):
    game = next(g for g in valid_games if g.id.startswith(GAME) and len(g.walkthrough()) >= 6)
    fmt = chat_format(tiny_tokenizer, "action_tag")
    walk = game.walkthrough()
    engine = ScriptedEngine(fmt, [walk, walk])
    cfg = RolloutConfig(action_format="action_tag", context="window", history_length=2, max_episode_steps=6, max_assistant_tokens=100)
    with EnvPool(num_workers=1) as pool:
        (group,) = RolloutRunner(engine, pool, fmt, cfg, STEPWISE).run([game], 2, seed=0)
    traj = group.trajectories[0]
    assert len(traj.sequences) == traj.steps  # one training sample per step
    step5 = tiny_tokenizer.decode(list(traj.sequences[4].token_ids[: traj.sequences[4].spans[0][1]]))
    entries = re.findall(r"\[Observation (\d+): '(.*?)', Action (\d+): '(.*?)'\]", step5, re.DOTALL)
    assert [(e[0], e[2]) for e in entries] == [("3", "3"), ("4", "4")]
    for (n, obs, _, action), turn in zip(entries, traj.turns[2:4]):
        assert obs == turn.observation_before and action == turn.action
    assert "You are now at step 5." in step5 and f"Current observation: {traj.turns[4].observation_before}" in step5
    assert "Before this step you took 4 step(s)" in step5 and "<think>" in step5 and "<action>" in step5
    first = tiny_tokenizer.decode(list(traj.sequences[0].token_ids[: traj.sequences[0].spans[0][1]]))
    assert "[Observation" not in first and "You are now at step 1." in first


REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_tiny_recipe_in_stepwise_mode_trains_and_its_eval_sits_beside_a_full_history_run(tmp_path, data_dir, tiny_model_dir, capfd,
                                                                                     monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", data_dir)
    env = dict(os.environ, ALFWORLD_DATA=data_dir)
    stepwise = ["--data.rollout.context", "window", "--data.rollout.action_format", "action_tag", "--data.rollout.history_length", "2",
                "--data.reward.kind", "stepwise", "--data.reward.win_reward", "10", "--data.advantage.estimator", "hgpo",
                "--model.model_name", tiny_model_dir]
    root = tmp_path / "stepwise"
    cmd = [sys.executable, "-m", "alfrl.cli", "fit", "--config", "recipes/tiny.yaml", "--trainer.default_root_dir", str(root),
           "--trainer.logger", "false", "--data.rollout.max_episode_steps", "4", *stepwise]  # the mode is checked, not long games
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (root / "checkpoints" / "step-000002" / "adapter" / "adapter_model.safetensors").is_file()
    results = []  # the evaluations and the report in this process (a process start costs ~9 s of imports)
    for name, extra in (("full", ["--model.model_name", tiny_model_dir]), ("stepwise", stepwise)):
        path = tmp_path / f"{name}.jsonl"
        args = ["eval", "--config", "recipes/tiny.yaml", "--limit-per-split", "1", "--out", str(path), "--data.eval.max_episode_steps", "4", *extra]
        if name == "stepwise":
            args += ["--adapter", str(root / "checkpoints" / "last")]
        out = alfrl_here(capfd, *args)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        results.append(str(path))
    report = tmp_path / "report"
    out = alfrl_here(capfd, "report", *results, "--names", "full-history", "stepwise", "--out", str(report))
    assert out.returncode == 0, out.stderr
    table = (report / "report.md").read_text()
    assert "| full-history |" in table and "| stepwise |" in table
