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
from alfrl.rollout import RolloutConfig, RolloutRunner, rollout_metrics
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
    # trajectory 0's completion of turn 1 takes 1.5 s; every other 10 ms (1.5 s leaves room for five
    # environment steps of trajectory 1 on a loaded CPU: 0.5 s did not, with a background job)
    engine = LatencyEngine(fmt, LOOKS, latency=lambda k, turn: 1.5 if (k == 0 and turn == 1) else 0.01)
    (group,), trace = _play(engine, fmt, game, "async")
    assert all(t.steps == 6 for t in group.trajectories)
    # trajectory 1 asked for its last turn before trajectory 0's second turn came back
    assert _first(trace, "request", 1, 5) < _first(trace, "completion", 0, 1)
    # under the round barrier, nobody starts turn 2 before trajectory 0's turn 1 is back
    engine = LatencyEngine(fmt, LOOKS, latency=lambda k, turn: 1.5 if (k == 0 and turn == 1) else 0.01)
    (rounds_group,), rounds_trace = _play(engine, fmt, game, "rounds")
    assert _first(rounds_trace, "request", 1, 2) > _first(rounds_trace, "completion", 0, 1)
    assert rounds_group.trajectories == group.trajectories  # and the trajectories are the same


def test_the_stats_record_when_each_trajectory_ended_and_the_tail_shows(game, fmt):
    # trajectory 0's completions take 1 s from turn 1 on: the other three end while it is still playing
    engine = LatencyEngine(fmt, LOOKS, latency=lambda k, turn: 1.0 if (k == 0 and turn >= 1) else 0.01)
    cfg = RolloutConfig(max_episode_steps=6, max_trajectory_tokens=20000, max_assistant_tokens=200)
    with EnvPool(num_workers=4, step_timeout=30) as pool:
        runner = RolloutRunner(engine, pool, fmt, cfg, RewardConfig())
        runner.trace = []
        (group,) = runner.run([game], len(LOOKS), seed=3)
    ends = [e for e in runner.trace if e[0] == "end"]
    assert [e[2] for e in ends][-1] == 0 and sorted(e[2] for e in ends) == [0, 1, 2, 3]  # the slow one ended last
    assert all(e[3] == 6 for e in ends)  # each after its sixth turn
    assert _first(runner.trace, "end", 3, 6) < _first(runner.trace, "completion", 0, 2)  # before its third turn came back
    stats = runner.stats
    assert len(stats.trajectory_end_seconds) == 4 and stats.trajectory_end_seconds == sorted(stats.trajectory_end_seconds)
    assert 0 < stats.trajectory_end_seconds[-1] <= stats.seconds
    assert len(stats.group_start_seconds) == 1 and 0 < stats.group_start_seconds[0] < stats.trajectory_end_seconds[0]  # one group's start-up
    # the tail: the engine steps once two of the four had ended, all spent on the slow one's 1 s turns (4+ of them left)
    assert 0 < stats.tail_engine_steps < stats.engine_steps and 2.0 < stats.tail_engine_seconds <= stats.engine_seconds
    # the critical path: the slow one's life split into its phases, which add up to when it ended
    last = stats.last_ended
    assert set(last) == set(stats.LAST_ENDED) and last["turns"] == 6
    assert last["tokens"] == sum(turn.completion_tokens for turn in group.trajectories[0].turns)
    assert last["generate"] >= 5.0 and last["start"] > 0 and last["environment"] > 0 and last["local"] >= 0
    assert abs(sum(last[k] for k in ("start", "generate", "environment", "local")) - stats.trajectory_end_seconds[-1]) < 0.05
    metrics = rollout_metrics([group])
    tokens = [sum(turn.completion_tokens for turn in t.turns) for t in group.trajectories]
    assert min(tokens) > 0
    assert metrics["rollout/completion_tokens_max"] == max(tokens)
    assert metrics["rollout/completion_tokens_mean"] == sum(tokens) / 4
    assert stats.tail_output_figures() == {}  # a scripted engine: outputs made where they are taken, no times of its own


def test_the_tail_shows_the_engines_own_step_and_how_late_its_outputs_were_taken(game, fmt):
    """vLLM's core stamps each step's outputs (VLLMEngine.last_output_times): the tail's core step and the lag, as medians."""

    class Clocked(LatencyEngine):
        made = 100.0

        def step(self):
            out = super().step()
            Clocked.made += 0.004  # the core stepped every 4 ms; its outputs were taken 20 ms after it made them
            self.last_output_times = (Clocked.made, Clocked.made + 0.020)
            return out

    engine = Clocked(fmt, LOOKS, latency=lambda k, turn: 0.3 if (k == 0 and turn >= 1) else 0.01)
    cfg = RolloutConfig(max_episode_steps=6, max_trajectory_tokens=20000, max_assistant_tokens=200)
    with EnvPool(num_workers=4, step_timeout=30) as pool:
        runner = RolloutRunner(engine, pool, fmt, cfg, RewardConfig())
        runner.run([game], len(LOOKS), seed=3)
    stats = runner.stats
    assert 2 < len(stats.tail_output_times) == stats.tail_engine_steps < stats.engine_steps  # the tail's steps only
    figures = stats.tail_output_figures()
    assert figures == {"rollout/tail_core_step_ms": pytest.approx(4.0), "rollout/tail_output_lag_ms": pytest.approx(20.0)}


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


def test_the_pool_is_made_from_its_settings():
    from alfrl.envs import EnvConfig

    with EnvConfig(num_workers=1, step_timeout=7, reset_timeout=9).make_pool() as pool:  # the one place a config becomes a pool
        assert (pool.num_workers, pool.step_timeout, pool.reset_timeout) == (1, 7, 9)
    assert EnvConfig(num_workers=0).problems() == ["data.env.num_workers=0 must be >= 1 (or null for the CPU count)"]


def test_each_finished_group_is_handed_over_with_its_index_while_the_rollout_plays(valid_games, fmt):
    """``on_group(index, group)``: what the update of finished groups trains on during the rollout."""
    games = valid_games[:2]
    engine = ScriptedEngine(fmt, [["look", "inventory"], ["inventory"]])
    cfg = RolloutConfig(max_episode_steps=2, max_trajectory_tokens=20000, max_assistant_tokens=200, max_live_games=1)
    handed = []
    with EnvPool(num_workers=2) as pool:
        runner = RolloutRunner(engine, pool, fmt, cfg, RewardConfig())
        runner.trace = []

        def on_group(gi, group):
            runner.trace.append(("group", gi, -1, -1))
            handed.append((gi, group))

        groups = runner.run(games, 2, seed=0, on_group=on_group)
    assert [gi for gi, _ in handed] == [0, 1] and [g for _, g in handed] == groups
    assert [g.game for g in groups] == games
    # game 0's group was handed over before game 1 (one game at a time) asked for its first turn
    handed_0 = runner.trace.index(("group", 0, -1, -1))
    assert handed_0 < next(i for i, e in enumerate(runner.trace) if e[0] == "request" and e[1] == 1)


def test_prefetched_resets_are_played_by_the_next_rollout_of_those_games_and_dropped_by_anything_else(valid_games, fmt):
    """Sampler.prefetch: the next step's resets run before its rollout (the same trajectories, no reset in the rollout);
    a rollout of other games or an evaluation first collects them and releases their environments."""
    from alfrl.evaluation import EvalConfig
    from alfrl.sampler import Sampler
    from alfrl.sampler_config import EngineConfig

    games = [g for g in valid_games if g.id == GAME] + [g for g in valid_games if g.id != GAME][:1]
    cfg = RolloutConfig(max_episode_steps=3, max_trajectory_tokens=20000, max_assistant_tokens=200)
    scripts = [["look"] * 3, ["inventory"] * 3]
    with EnvPool(num_workers=2, step_timeout=30) as pool:
        def sampler():
            return Sampler(ScriptedEngine(fmt, scripts), pool, fmt, cfg, RewardConfig(), EvalConfig(), EngineConfig())

        plain = sampler().rollout(games, 2, seed=3).groups
        s = sampler()
        s.prefetch(games, 2)
        assert len(pool._envs) == 4  # two groups of two, resetting: two workers, one reset each at a time
        s._prefetch.collector.join(60)  # its thread polled the pool until every reset was back (the next ones sent as each ended)
        assert sorted(s._prefetch.early) == sorted(t for tickets in s._prefetch.tickets for t in tickets)
        assert s.prefetch_counts() == (4, 4)  # every reset back, of four
        kinds, submit = [], pool.submit
        pool.submit = lambda ops: (kinds.extend(op.kind for op in ops), submit(ops))[1]
        fetched = s.rollout(games, 2, seed=3)
        assert kinds and "reset" not in kinds  # every reset was submitted before the rollout
        assert s.prefetch_counts() is None  # the rollout took it
        assert [g.trajectories for g in fetched.groups] == [g.trajectories for g in plain]
        assert not pool._envs and not pool.busy  # the rollout released them as its own
        s.prefetch(games, 2)  # taken at once: some resets back, the others still running or queued
        assert [g.trajectories for g in s.rollout(games, 2, seed=3).groups] == [g.trajectories for g in plain]
        s.prefetch(games, 2)
        kinds.clear()
        other = s.rollout(games[:1], 2, seed=3).groups  # other games: the prefetch collected and released first
        assert kinds.count("reset") == 2 and [g.trajectories for g in other] == [plain[0].trajectories]
        assert not pool._envs and not pool.busy and not pool._results
        s.prefetch(games, 1)
        records = s.evaluate_records(games[:1], EvalConfig(max_episode_steps=2, games_per_chunk=1))
        assert len(records) == 1 and not pool._envs and not pool._results
        s.prefetch(games, 2)
        s.close()  # closes the pool with the prefetch in it
        assert s.pool is None and s._prefetch is None


def test_a_max_live_games_rollout_is_not_prefetched(valid_games, fmt):
    from alfrl.evaluation import EvalConfig
    from alfrl.sampler import Sampler
    from alfrl.sampler_config import EngineConfig

    cfg = RolloutConfig(max_episode_steps=2, max_trajectory_tokens=20000, max_assistant_tokens=200, max_live_games=1)
    with EnvPool(num_workers=2, step_timeout=30) as pool:
        s = Sampler(ScriptedEngine(fmt, [["look"] * 2]), pool, fmt, cfg, RewardConfig(), EvalConfig(), EngineConfig())
        s.prefetch(valid_games[:2], 1)  # its games start one by one
        assert s._prefetch is None and not pool._envs


def test_each_training_batch_prefetches_the_next_steps_resets(valid_games, fmt):
    """RolloutDataModule.next_step names the next step's games; after the rollout, Sampler.probe starts their resets in the
    workers (data.env.prefetch_resets), as a training step calls them."""
    from types import SimpleNamespace

    from alfrl.datamodule import RolloutDataModule
    from alfrl.evaluation import EvalConfig
    from alfrl.envs import EnvConfig
    from alfrl.sampler import Sampler
    from alfrl.sampler_config import EngineConfig

    cfg = RolloutConfig(max_episode_steps=2, max_trajectory_tokens=20000, max_assistant_tokens=200)
    for prefetch in (True, False):
        dm = RolloutDataModule(games_per_batch=2, group_size=2, rollout=cfg, env=EnvConfig(prefetch_resets=prefetch))
        dm.train_games = list(valid_games[:5])
        dm.trainer = SimpleNamespace(lightning_module=None, global_rank=0, world_size=1)

        def play():
            step = dm.next_step()
            dm.sampler.rollout(step.games, step.group_size, step.seed)
            dm.sampler.probe(step.next_games, step.group_size)
            return step

        with EnvPool(num_workers=2, step_timeout=30) as pool:
            dm.sampler = Sampler(ScriptedEngine(fmt, [["look"] * 2, ["inventory"] * 2]), pool, fmt, cfg, RewardConfig(),
                                 EvalConfig(), EngineConfig())
            kinds, submit = [], pool.submit
            pool.submit = lambda ops: (kinds.extend(op.kind for op in ops), submit(ops))[1]
            play()
            assert kinds[:4] == ["reset"] * 4  # the first rollout resets its own
            assert (dm.sampler._prefetch is not None) == prefetch and kinds[-1] == ("reset" if prefetch else "step")
            if prefetch:
                assert dm.sampler._prefetch.matches(dm.step_games(advance=False), 2)
            kinds.clear()
            batch = play()
            assert [g.id for g in batch.games] == [g.id for g in valid_games[2:4]]
            rollout_kinds = kinds[:-4] if prefetch else kinds  # with a prefetch, the next one's 4 resets come last
            assert rollout_kinds.count("reset") == (0 if prefetch else 4) and set(kinds[-4:]) == {"reset" if prefetch else "step"}
            dm.sampler.close()

