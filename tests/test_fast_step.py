"""Faster steps in the environment workers (alfrl.fast_step) against TextWorld's own, on real games."""

import os
import subprocess
import sys

from alfrl.envs import EnvFailure, EnvOp, EnvPool
from tests.conftest import one_game_per_task

_COUNT_PARSES = """
import sys
game_path, actions = sys.argv[1], sys.argv[2].split("|")
import textworld
from textworld.envs.pddl import textgen
from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
from alfrl.envs import _state_of
from alfrl.fast_step import enable_fast_step

calls = []
parse = textgen._parse_and_convert
def counting(*args, **kwargs):
    calls.append(args[0])
    return parse(*args, **kwargs)
textgen._parse_and_convert = counting  # the parser the memo wraps
infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])

def episode(env):
    n = len(calls)
    states = [_state_of(env.reset(), False)] + [_state_of(*env.step(a)[::2]) for a in actions]
    return states, len(calls) - n

start = lambda: textworld.start(game_path, infos, wrappers=[AlfredDemangler(), AlfredInfos])
plain = start()
(plain_states, plain_parses), (again_states, again_parses) = episode(plain), episode(plain)
assert enable_fast_step() == (True, True) and enable_fast_step() == (True, True)  # installed once
fast = start()
(fast_states, fast_parses), (second, second_parses) = episode(fast), episode(fast)
print(plain_states == again_states == fast_states == second, plain_parses == again_parses > 0, 0 < fast_parses < plain_parses,
      second_parses)
"""


def test_a_step_parses_each_grammar_string_once_and_plays_the_same(valid_games):
    """TextWorld parses the feedback grammar's strings again at every step; with fast steps each once per process:
    the same states through two episodes of one game, and the second episode parses nothing."""
    game = one_game_per_task(valid_games, "valid_seen")[0]
    actions = game.walkthrough()[:4] + ["take the moon", "look"]
    out = subprocess.run([sys.executable, "-c", _COUNT_PARSES, game.path, "|".join(actions)],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "True", "0"]


def test_the_pool_steps_the_same_with_fast_steps(valid_games):
    """Every task type, the expert's actions, then commands that are not admissible and a repeated look."""
    games = one_game_per_task(valid_games, "valid_unseen")
    states = {}
    for fast in (False, True):
        with EnvPool(num_workers=2, step_timeout=30, fast_step=fast) as pool:
            ids = [pool.create(g.path) for g in games]
            states[fast] = {(i, 0): s for i, s in zip(ids, pool.run([EnvOp(i, "reset") for i in ids]))}
            plans = [g.walkthrough() + ["take the moon", "look", "inventory"] for g in games]
            for turn in range(max(len(p) for p in plans)):
                live = [(i, p[turn]) for i, p in zip(ids, plans) if turn < len(p)]
                states[fast].update({(i, turn + 1): s for (i, _), s in zip(live, pool.run([EnvOp(i, "step", a) for i, a in live]))})
    assert states[False] == states[True]
    assert all(not isinstance(s, EnvFailure) for s in states[True].values())
    won = [states[True][(i, len(g.walkthrough()))].won for i, g in zip(ids, games)]
    assert won == [True] * len(games)  # every expert plan still wins
