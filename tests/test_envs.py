"""Environment groups on the real TextWorld engine and games: wins, invalid actions, failures."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from alfrl.envs import EnvFailure, EnvGroup, EnvOp, EnvPool, GroupStartMismatch, canonical_action
from tests.conftest import one_game_per_task


@pytest.fixture(scope="module")
def pool():
    with EnvPool(num_workers=2, step_timeout=20) as p:
        yield p


def _play_walkthrough(pool, game, size=2):
    group = EnvGroup.create(pool, game, size)
    try:
        states = group.reset()
        for action in game.walkthrough():
            assert canonical_action(action) in states[0].admissible, f"{game.id}: {action!r} not admissible"
            states = group.step([action] * size)
        return states
    finally:
        group.close()


@pytest.mark.parametrize("split", ["valid_seen", "valid_unseen"])
def test_walkthrough_wins_a_game_of_every_task_type(pool, valid_games, split):
    sample = one_game_per_task(valid_games, split)
    assert len(sample) == 6
    for game in sample:
        states = _play_walkthrough(pool, game)
        assert all(s.won and s.done for s in states), game.id


def test_inadmissible_action_leaves_the_state_unchanged(pool, valid_games):
    game = valid_games[0]
    group = EnvGroup.create(pool, game, 2)
    try:
        start = group.reset()
        after = group.step(["fly to the moon", None])
        assert after[0].observation == "Nothing happens."
        assert after[0].admissible == start[0].admissible and not after[0].won
        assert after[1] is None
        # the state really is unchanged: the walkthrough still wins from here
        states = after
        for action in game.walkthrough():
            states = group.step([action, action])
        assert states[0].won and states[1].won
    finally:
        group.close()


def test_help_is_legal_but_hidden(pool, valid_games):
    group = EnvGroup.create(pool, valid_games[0], 1)
    try:
        (state,) = group.reset()
        assert "help" in state.admissible and "help" not in state.shown_actions
        (after,) = group.step(["help"])
        assert "Available commands" in after.observation
    finally:
        group.close()


def test_mismatched_group_start_is_caught(pool, valid_games):
    a, b = valid_games[0], valid_games[1]
    group = EnvGroup(pool, a, [pool.create(a.path), pool.create(b.path)])
    try:
        with pytest.raises(GroupStartMismatch, match=a.id):
            group.reset()
    finally:
        group.close()


def test_a_worker_killed_during_a_command_fails_that_env_only_and_the_others_are_replayed(valid_games):
    game = valid_games[0]
    walkthrough = game.walkthrough()
    with EnvPool(num_workers=1, step_timeout=20) as pool:
        group = EnvGroup.create(pool, game, 2)  # both on the single worker
        group.reset()
        group.step([walkthrough[0], walkthrough[0]])
        late = pool.create(game.path)
        (ticket,) = pool.submit([EnvOp(late, "reset")])
        os.kill(pool.worker_pid_of(late), signal.SIGKILL)  # its reset is in flight (sent, not answered)
        results = []
        while not results:
            results = pool.poll(1.0)
        ((answered, result),) = results
        assert answered == ticket and isinstance(result, EnvFailure) and "died" in result.reason
        assert pool.restarts == 1
        states = group.step([walkthrough[1], walkthrough[1]])  # both rebuilt by replaying their first action
        for action in walkthrough[2:]:
            states = group.step([action, action])
        assert states[0].won and states[1].won
        # the failed env stays failed, without reaching a worker
        assert isinstance(pool.run([EnvOp(late, "step", "look")])[0], EnvFailure)


def test_a_worker_that_died_while_idle_is_replaced_before_work_is_sent_and_nothing_is_lost(valid_games):
    game = valid_games[0]
    walkthrough = game.walkthrough()
    with EnvPool(num_workers=1, step_timeout=20) as pool:
        group = EnvGroup.create(pool, game, 2)
        group.reset()
        group.step([walkthrough[0], walkthrough[0]])
        os.kill(pool.worker_pid_of(group.env_ids[0]), signal.SIGKILL)
        time.sleep(0.5)  # dead between steps
        result = group.step([walkthrough[1], walkthrough[1]])
        assert not any(isinstance(r, EnvFailure) for r in result)
        assert pool.restarts == 1
        fresh = EnvGroup.create(pool, game, 2)
        os.kill(pool.worker_pid_of(fresh.env_ids[0]), signal.SIGKILL)
        time.sleep(0.5)
        assert len(fresh.reset()) == 2  # the next group starts: it used to be skipped ("failed to start")
        assert pool.restarts == 2


def test_a_hung_step_times_out_and_the_worker_is_restarted(valid_games):
    game = valid_games[0]
    with EnvPool(num_workers=1, step_timeout=3) as pool:
        group = EnvGroup.create(pool, game, 1)
        group.reset()
        pid = pool.worker_pid_of(group.env_ids[0])
        os.kill(pid, signal.SIGSTOP)
        (result,) = group.step(["look"])
        assert isinstance(result, EnvFailure) and "timed out" in result.reason
        assert pool.worker_pid_of(group.env_ids[0]) != pid
        other = EnvGroup.create(pool, game, 1)
        assert other.reset()[0].observation  # the restarted worker serves new environments


def test_closing_leaves_no_child_processes(valid_games):
    pool = EnvPool(num_workers=2)
    group = EnvGroup.create(pool, valid_games[0], 2)
    group.reset()
    pids = pool.worker_pids()
    pool.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(os.getpid())], capture_output=True, text=True).stdout.split()
    assert not set(map(int, children)) & set(pids)


def test_a_worker_reuses_the_planner_library_copies_of_closed_environments(valid_games):
    """fast_downward loads a private copy of libdownward.so (33 MB) per environment from a folder it deletes at once: the
    copy's disk stays held while it is loaded. A worker that opened 2 environments at a time over 6 games holds 2 copies,
    not 12, and games played on reused copies still win by their walkthroughs (each planner state loads its own task)."""
    games = valid_games[:6]
    with EnvPool(num_workers=1) as pool:
        for game in games:
            group = EnvGroup.create(pool, game, 2)
            group.reset()
            for action in game.walkthrough():
                results = group.step([action, action])
            assert all(r.won for r in results), game.id
            group.close()
        maps = Path(f"/proc/{pool.worker_pids()[0]}/maps").read_text().splitlines()
    copies = {line.split()[5] for line in maps if "libdownward" in line and len(line.split()) > 5}
    assert len(copies) == 2, copies
