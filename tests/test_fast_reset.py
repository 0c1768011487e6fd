"""Faster resets in the environment workers (alfrl.fast_reset) against TextWorld's own, on real games."""

import os
import subprocess
import sys

from alfrl.envs import EnvFailure, EnvOp, EnvPool
from tests.conftest import one_game_per_task

_COUNT_TRANSLATIONS = """
import sys
game_path, action = sys.argv[1:3]  # now: each PDDL -> SAS translation (fast_downward.pddl2sas) rewrites sys.argv
import fast_downward, textworld
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
from alfrl.envs import _state_of
from alfrl.fast_reset import PLANNER_SKIPPED, enable_fast_reset

calls = []
translate = fast_downward.pddl2sas
def counting(*args, **kwargs):
    calls.append(kwargs.get("optimize", False))
    return translate(*args, **kwargs)
fast_downward.pddl2sas = counting
infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])

def start_and_reset():
    env = textworld.start(game_path, infos, wrappers=[AlfredDemangler(), AlfredInfos])
    return env, _state_of(env.reset(), False)

def counted(f):
    n = len(calls)
    out = f()
    return out, len(calls) - n

(plain, first), plain_calls = counted(start_and_reset)
assert enable_fast_reset() == (True, True)
(env, fast), fast_calls = counted(start_and_reset)
again, again_calls = counted(lambda: _state_of(env.reset(), False))
same_step = _state_of(*plain.step(action)[::2]) == _state_of(*env.step(action)[::2])
try:
    env._wrapped_env._wrapped_env._pddl_state.replan({})
    planner = "planned"
except RuntimeError as e:
    planner = "refused" if str(e) == PLANNER_SKIPPED else str(e)
print(plain_calls, fast_calls, again_calls, first == fast == again, same_step, planner)
"""


def test_a_reset_translates_the_game_once_and_plays_the_same(valid_games):
    """TextWorld translates a game four times per start + reset (its start state twice, each time also for
    its planner); with fast resets once: the same first state, the same state after a step, and asking
    the state for a plan is refused in words."""
    game = one_game_per_task(valid_games, "valid_seen")[0]
    out = subprocess.run([sys.executable, "-c", _COUNT_TRANSLATIONS, game.path, game.walkthrough()[0]],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["4", "1", "1", "True", "True", "refused"]


def test_the_pool_resets_and_steps_the_same_with_fast_resets(valid_games):
    games = one_game_per_task(valid_games, "valid_unseen")[:3]
    states = {}
    for fast in (False, True):
        with EnvPool(num_workers=1, step_timeout=20, fast_reset=fast) as pool:
            ids = [pool.create(g.path) for g in games]
            states[fast] = pool.run([EnvOp(i, "reset") for i in ids])
            for turn in range(2):
                states[fast] += pool.run([EnvOp(i, "step", g.walkthrough()[turn]) for i, g in zip(ids, games)])
    assert states[False] == states[True]
    assert all(not isinstance(s, EnvFailure) for s in states[True])
