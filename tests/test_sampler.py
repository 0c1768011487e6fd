"""The asynchronous rollout: no round barrier, and the same trajectories as the round-based runner."""

import dataclasses
import os
import signal
import threading
import time

import pytest

from alfrl.chat import chat_format
from alfrl.envs import EnvPool
from alfrl.rewards import RewardConfig
from alfrl.rollout import RolloutConfig, RolloutRunner
from tests.helpers import LatencyEngine, ScriptedEngine

GAME = "valid_seen:look_at_obj_in_light-AlarmClock-None-DeskLamp-323/trial_T20190909_044715_250790"
LOOKS = [["look"] * 6 for _ in range(4)]


def _first(trace, kind, k, turn):
    return next(i for i, e in enumerate(trace) if e[0] == kind and e[2] == k and e[3] == turn)


def _play(engine, fmt, game, schedule):
    cfg = RolloutConfig(max_episode_steps=6, max_trajectory_tokens=20000, max_assistant_tokens=200, schedule=schedule)
    with EnvPool(num_workers=4, step_timeout=30) as pool:
        runner = RolloutRunner(engine, pool, fmt, cfg, RewardConfig())
        runner.trace = []
        groups = runner.run([game], len(LOOKS), seed=3)
        return groups, runner.trace


@pytest.fixture(scope="module")
def game(valid_games):
    return next(g for g in valid_games if g.id == GAME)


@pytest.fixture(scope="module")
def fmt(tiny_tokenizer):
    return chat_format(tiny_tokenizer, "tool_call")


def test_a_slow_completion_does_not_delay_the_other_trajectories_turns(game, fmt):
    # trajectory 0's completions take 1.5 s from turn 1 on; the others' 10 ms (1.5 s leaves room for
    # five environment steps of trajectory 1 on a loaded CPU: 0.5 s did not, with a background job)
    engine = LatencyEngine(fmt, LOOKS, latency=lambda k, turn: 1.5 if (k == 0 and turn >= 1) else 0.01)
    (group,), trace = _play(engine, fmt, game, "async")
    assert all(t.steps == 6 for t in group.trajectories)
    # trajectory 1 asked for its last turn before trajectory 0's second turn came back
    assert _first(trace, "request", 1, 5) < _first(trace, "completion", 0, 1)
    # under the round barrier, nobody starts turn 2 before trajectory 0's turn 1 is back
    engine = LatencyEngine(fmt, LOOKS, latency=lambda k, turn: 1.5 if (k == 0 and turn >= 1) else 0.01)
    (rounds_group,), rounds_trace = _play(engine, fmt, game, "rounds")
    assert _first(rounds_trace, "request", 1, 2) > _first(rounds_trace, "completion", 0, 1)
    assert rounds_group.trajectories == group.trajectories  # and the trajectories are the same


def test_a_slow_environment_does_not_delay_the_other_trajectories_turns(game, fmt):
    # trajectory 0's environment worker stops for 1.5 s after its first action was sent
    box = {}

    def stall(k, turn):
        if turn == 0 and k == -1 and "pid" not in box:  # the group's first completions are back
            box["pid"] = box["pool"].worker_pid_of(0)  # a fresh pool numbers trajectory 0's environment 0
            os.kill(box["pid"], signal.SIGSTOP)
            threading.Timer(1.5, os.kill, (box["pid"], signal.SIGCONT)).start()

    engine = LatencyEngine(fmt, LOOKS, latency=lambda k, turn: 0.01, on_complete=stall)
    cfg = RolloutConfig(max_episode_steps=6, max_trajectory_tokens=20000, max_assistant_tokens=200)
    with EnvPool(num_workers=4, step_timeout=30) as pool:
        box["pool"] = pool
        runner = RolloutRunner(engine, pool, fmt, cfg, RewardConfig())
        runner.trace = []
        (group,) = runner.run([game], 4, seed=3)
    trace = runner.trace
    assert all(t.steps == 6 and t.stop_reason == "max_steps" for t in group.trajectories)
    # while trajectory 0's environment was stopped, trajectory 1 played its whole episode
    assert _first(trace, "request", 1, 5) < _first(trace, "env", 0, 0)


def test_async_and_rounds_give_the_same_trajectories_with_the_tiny_model(game, fmt, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from alfrl.engines import HFEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    results = {}
    for schedule in ("async", "rounds"):
        engine = HFEngine(model, fmt.tokenizer.pad_token_id)
        cfg = RolloutConfig(max_episode_steps=4, max_trajectory_tokens=6000, max_assistant_tokens=32, schedule=schedule)
        with EnvPool(num_workers=2) as pool:
            groups = RolloutRunner(engine, pool, fmt, cfg, RewardConfig()).run([game, game], 3, seed=11)
        results[schedule] = [dataclasses.astuple(t) for g in groups for t in g.trajectories]
    assert results["async"] == results["rounds"]  # temperature 1, but every request carries its own seed


def test_scripted_async_matches_rounds_turn_for_turn(game, fmt):
    scripts = [["go to desk 1", "use desklamp 1"], ["look", "go to desk 1", "look"], ["inventory"], ["go to desk 1"]]
    out = {}
    for schedule in ("async", "rounds"):
        engine = ScriptedEngine(fmt, scripts)
        cfg = RolloutConfig(max_episode_steps=4, max_trajectory_tokens=20000, max_assistant_tokens=200, schedule=schedule)
        with EnvPool(num_workers=2) as pool:
            out[schedule] = RolloutRunner(engine, pool, fmt, cfg, RewardConfig()).run([game], 4, seed=0)
    assert out["async"] == out["rounds"]


def test_the_stats_count_engine_steps_and_time_spent_handing_requests_over(game, fmt):
    class Counting(ScriptedEngine):
        steps = submits = 0

        def submit(self, requests):
            Counting.submits += 1
            time.sleep(0.02)  # as vLLM's input processing and prefix-cache hashing take time
            return super().submit(requests)

        def step(self):
            Counting.steps += 1
            return super().step()

    cfg = RolloutConfig(max_episode_steps=3, max_trajectory_tokens=20000, max_assistant_tokens=200)
    with EnvPool(num_workers=2) as pool:
        runner = RolloutRunner(Counting(fmt, LOOKS), pool, fmt, cfg, RewardConfig())
        runner.run([game], 4, seed=0)
    assert Counting.steps >= 3 and runner.stats.engine_steps == Counting.steps
    assert runner.stats.submit_seconds >= 0.02 * Counting.submits > 0


def test_max_live_games_starts_the_next_game_when_one_ends(valid_games, fmt):
    games = valid_games[:3]
    scripts = [["look", "inventory", "look"], ["inventory", "look"]]
    out, traces = {}, {}
    for window in (0, 1):
        engine = ScriptedEngine(fmt, scripts)
        cfg = RolloutConfig(max_episode_steps=3, max_trajectory_tokens=20000, max_assistant_tokens=200, max_live_games=window)
        with EnvPool(num_workers=2) as pool:
            runner = RolloutRunner(engine, pool, fmt, cfg, RewardConfig())
            runner.trace = []
            out[window] = runner.run(games, 2, seed=0)
            traces[window] = runner.trace
    assert out[1] == out[0]  # the same trajectories, game by game

    def first_request(trace, g):
        return next(i for i, e in enumerate(trace) if e[0] == "request" and e[1] == g)

    def last_event(trace, g):
        return max(i for i, e in enumerate(trace) if e[1] == g)

    for g in (1, 2):  # one game at a time: game g asks for its first turn after game g-1's last event
        assert first_request(traces[1], g) > last_event(traces[1], g - 1)
    assert first_request(traces[0], 1) < last_event(traces[0], 0)  # without the window they overlap
    assert RolloutConfig(max_live_games=-1).problems() == ["data.rollout.max_live_games=-1 must be >= 0 (0: every game at once)"]
