"""Test doubles: a scripted engine that plays given action lists through the real token machinery; the CLI run in
the test's process."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable

from alfrl import protocol
from alfrl.chat import ChatFormat
from alfrl.engines import Completion, InProcessEngine, SamplingRequest
from alfrl.rollout import RolloutConfig

_PLAN = re.compile(r"plan (\d+)\.")
_STEP = re.compile(r"You are now at step (\d+)\.")
_ACTION = re.compile(r"Action \d+: '([^']*)'\]")


RAW = "RAW:"
"""A script entry starting with this is used as the completion text itself (e.g. a malformed answer)."""


class ScriptedEngine(InProcessEngine):
    """Trajectory k of a group plays ``scripts[k]`` (a list of completion texts or actions).

    The first completion of trajectory k starts with the marker ``plan k.``; later requests find k
    in their prompt and the turn number from the number of completions already in it. Completions
    are tokenized with the real tokenizer and end with the end-of-turn token, so the rollout's
    token machinery runs exactly as with a model. ``raw=True`` entries are used as completion text.
    """

    name = "scripted"

    def __init__(self, fmt: ChatFormat, scripts: list[list[str]], raw: bool = False, logprob: float = -0.5,
                 cut: Callable[[int, int], bool] | None = None):
        super().__init__()
        self.fmt = fmt
        self.scripts = scripts
        self.raw = raw
        self.logprob = logprob
        self.cut = cut or (lambda k, turn: False)
        self.requests: list[SamplingRequest] = []

    def _completion(self, k: int, turn: int, budget: int) -> Completion:
        script = self.scripts[k]
        entry = script[turn] if turn < len(script) else script[-1]
        marker = f"plan {k}. " if turn == 0 else ""
        if self.raw or entry.startswith(RAW):
            text = marker + entry.removeprefix(RAW)
        else:
            text = protocol.format_action(entry, self.fmt.action_format, marker)
        if self.raw and turn == 0 and self.fmt.action_format == "action_tag" and entry.startswith("<think>"):
            text = "<think>" + marker + entry[len("<think>"):]
        ids = self.fmt.encode(text)
        if self.cut(k, turn):
            ids = ids[: max(1, min(budget, len(ids) - 2))]
            return Completion(tuple(ids), tuple([self.logprob] * len(ids)), "length")
        ids = ids + [self.fmt.end_of_turn_id]
        ids = ids[:budget]
        reason = "stop" if ids[-1] == self.fmt.end_of_turn_id else "length"
        return Completion(tuple(ids), tuple([self.logprob] * len(ids)), reason)

    def generate(self, requests: list[SamplingRequest]) -> list[list[Completion]]:
        self.requests.extend(requests)
        out = []
        for r in requests:
            text = self.fmt.tokenizer.decode(list(r.prompt_ids), skip_special_tokens=False)
            window = _STEP.search(text)
            if window:  # window context: the turn is the step shown, the trajectory the one whose actions match
                turn = int(window.group(1)) - 1
                if turn == 0:
                    out.append([self._completion(k, 0, r.max_new_tokens) for k in range(r.n)])
                    continue
                taken = _ACTION.findall(text)
                k = next(k for k, script in enumerate(self.scripts) if [protocol.canonical_action(a) for a in script[turn - len(taken) : turn]] == taken)
                out.append([self._completion(k, turn, r.max_new_tokens)])
                continue
            found = _PLAN.findall(text)
            if not found:  # the shared first prompt of a group: n completions, one per trajectory
                out.append([self._completion(k, 0, r.max_new_tokens) for k in range(r.n)])
                continue
            k = int(found[0])
            turn = text.count("<|im_start|>assistant") - 1  # completions already in the prompt
            out.append([self._completion(k, turn, r.max_new_tokens)])
        return out


class WalkthroughEngine(ScriptedEngine):
    """Plays each game's expert walkthrough, games taken in order (evaluate with games_per_chunk=1)."""

    def __init__(self, fmt: ChatFormat, games):
        super().__init__(fmt, [[]])
        self.games = list(games)
        self.current = -1

    def generate(self, requests: list[SamplingRequest]) -> list[list[Completion]]:
        (r,) = requests
        text = self.fmt.tokenizer.decode(list(r.prompt_ids), skip_special_tokens=False)
        if text.count("<|im_start|>assistant") == 1:
            self.current += 1  # a new game's opening prompt (no completion in it yet)
            self.scripts = [self.games[self.current].walkthrough()]
        return super().generate(requests)


class LatencyEngine(ScriptedEngine):
    """A scripted engine whose request for turn ``turn`` of trajectory ``k`` takes ``latency(k, turn)`` seconds
    (k = -1: a group's shared first request). ``on_complete(k, turn)`` is called as each one comes back."""

    name = "latency"

    def __init__(self, fmt: ChatFormat, scripts: list[list[str]], latency: Callable[[int, int], float],
                 on_complete: Callable[[int, int], None] | None = None):
        super().__init__(fmt, scripts)
        self.latency = latency
        self.on_complete = on_complete or (lambda k, turn: None)
        self._timed: list[tuple[float, str, SamplingRequest, int, int]] = []

    def _who(self, r: SamplingRequest) -> tuple[int, int]:
        text = self.fmt.tokenizer.decode(list(r.prompt_ids), skip_special_tokens=False)
        found = _PLAN.findall(text)
        return (int(found[0]), text.count("<|im_start|>assistant") - 1) if found else (-1, 0)

    def submit(self, requests: list[SamplingRequest]) -> list[str]:
        ids = []
        for r in requests:
            k, turn = self._who(r)
            ids.append(str(self._submitted))
            self._submitted += 1
            self._timed.append((time.monotonic() + self.latency(k, turn), ids[-1], r, k, turn))
        return ids

    def step(self) -> list[tuple[str, list[Completion]]]:
        if not self._timed:
            return []
        now = time.monotonic()
        due = [x for x in self._timed if x[0] <= now]
        if not due:
            time.sleep(min(0.005, min(x[0] for x in self._timed) - now))
            return []
        self._timed = [x for x in self._timed if x[0] > now]
        out = []
        for _, rid, r, k, turn in sorted(due):
            out.append((rid, self.generate([r])[0]))
            self.on_complete(k, turn)
        return out

    @property
    def busy(self) -> bool:
        return bool(self._timed)


def alfrl_here(capfd, *args: str) -> subprocess.CompletedProcess:
    """``alfrl ARGS`` in this process (a process start costs ~9 s of imports on a 2-core CPU machine; the entry point itself runs as a
    process in tests/test_recipes.py): its exit code and what it wrote, as ``subprocess.run`` gives them. An exception
    other than SystemExit fails the test, as its traceback would in a process."""
    from alfrl.cli import main

    capfd.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)  # as Python prints a SystemExit's message before the process exits
    out = capfd.readouterr()
    return subprocess.CompletedProcess(["alfrl", *args], code, out.out, out.err)


EMPTY_SAFETENSORS = b"\x02\x00\x00\x00\x00\x00\x00\x00{}"  # a whole safetensors file that holds no tensor


def tail_sample(ids, trained_from, advantage, group=0, traj=0, sampler_logprob=-1.0):
    """A training sample whose tokens ``trained_from`` .. end were sampled in one turn, each with the sampler log-prob given."""
    from alfrl.advantages import sample_of
    from alfrl.types import TokenSequence

    n = len(ids)
    seq = TokenSequence(tuple(ids), tuple(sampler_logprob if i >= trained_from else 0.0 for i in range(n)), ((0, trained_from, n),))
    return sample_of(seq, [advantage], group, traj)


# four games of alfrl eval's records, written by hand: 2 wins of 4 (seen 2/3, unseen 0/1), exact figures known
def _turn(valid, admissible):
    return {"valid_format": valid, "admissible": admissible}


HAND_MADE = [
    {"type": "game", "game_id": "valid_seen:a", "split": "valid_seen", "task_type": "pick_and_place_simple", "won": True, "steps": 2,
     "invalid_actions": 0, "stop_reason": "won", "reward": 1.0, "turns": [_turn(True, True), _turn(True, True)]},
    {"type": "game", "game_id": "valid_seen:b", "split": "valid_seen", "task_type": "pick_and_place_simple", "won": False, "steps": 4,
     "invalid_actions": 2, "stop_reason": "max_steps", "reward": -0.2, "turns": [_turn(False, False), _turn(True, False), _turn(True, True), _turn(True, True)]},
    {"type": "game", "game_id": "valid_seen:c", "split": "valid_seen", "task_type": "look_at_obj_in_light", "won": True, "steps": 3,
     "invalid_actions": 1, "stop_reason": "won", "reward": 0.9, "turns": [_turn(True, False), _turn(True, True), _turn(True, True)]},
    {"type": "game", "game_id": "valid_unseen:d", "split": "valid_unseen", "task_type": "look_at_obj_in_light", "won": False, "steps": 1,
     "invalid_actions": 1, "stop_reason": "trajectory_too_long", "reward": -0.1, "turns": [_turn(False, False)]},
]


EXPERT_CFG = RolloutConfig(action_format="action_tag", max_episode_steps=8, max_trajectory_tokens=6000, max_assistant_tokens=200)
"""The protocol the expert plans of the ``expert`` fixture (conftest.py) are replayed through."""

