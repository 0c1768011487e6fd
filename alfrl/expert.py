"""Expert trajectories: each game's own walkthrough played through the exact protocol the policy sees.

``alfrl expert --config RECIPE --out expert.jsonl [--split train] [--limit N]`` replays the expert
plan stored in every game file (``walkthrough``) through the real environments, the recipe's
prompts, tool responses, chat template and token chaining (the same ``RolloutRunner`` as training),
with a short rationale in front of each action (inside ``<think>`` for ``action_tag``). Every written
trajectory wins; a game whose plan does not win within the recipe's limits is counted and skipped.
Games are played many at a time over the worker pool, written in fixed chunks of the sorted game
list (so an interrupted run resumes where it stopped and gives the same file) and never committed.

The engine here is not a model: ``ExpertEngine`` answers each request with the next expert action of
its game, found from the request's seed (every request of a rollout carries a seed derived from the
game id, the trajectory and the turn).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from alfrl import protocol
from alfrl.chat import ChatFormat
from alfrl.engines import Completion, InProcessEngine, SamplingRequest
from alfrl.games import DataError, Game
from alfrl.rollout import RolloutRunner, request_seed
from alfrl.types import Trajectory, trajectory_from_dict, trajectory_to_dict

SEED = 0
"""The request seed of expert replays (any fixed number; it only identifies requests)."""


def rationale(action: str, task: str) -> str:
    """A one-sentence reason for ``action``, from its verb (deterministic)."""
    rules = [
        (r"^go to (.+)$", "The task is to {task}. I go to the {0} to look for what I need."),
        (r"^take (.+) from (.+)$", "The {0} is on the {1}; I take it."),
        (r"^(?:put|move) (.+?) (?:in/on|in|on) (.+)$", "I have the {0}; I put it in/on the {1} as the task asks."),
        (r"^open (.+)$", "The {0} is closed; I open it to see inside."),
        (r"^close (.+)$", "I close the {0}."),
        (r"^clean (.+) with (.+)$", "I clean the {0} with the {1}."),
        (r"^heat (.+) with (.+)$", "I heat the {0} with the {1}."),
        (r"^cool (.+) with (.+)$", "I cool the {0} with the {1}."),
        (r"^use (.+)$", "I turn on the {0} to look at the object under it."),
        (r"^examine (.+)$", "I examine the {0}."),
    ]
    for pattern, text in rules:
        m = re.match(pattern, action)
        if m:
            return text.format(*m.groups(), task=task.rstrip("."))
    return f"The task is to {task.rstrip('.')}. Next: {action}."


class ExpertEngine(InProcessEngine):
    """Answers every request with its game's next walkthrough action, as a well-formed completion."""

    name = "expert"

    def __init__(self, fmt: ChatFormat, games: list[Game], max_steps: int, seed: int = SEED):
        super().__init__()
        self.fmt = fmt
        self.max_steps = max_steps
        self.seed = seed
        self.plans: dict[str, list[str]] = {}
        self.tasks: dict[str, str] = {}
        """Each game's task, read once from its first prompt."""
        self.by_seed: dict[int, tuple[str, int]] = {}
        if not self.play(games):
            raise AssertionError("two expert requests share a seed: play fewer games at a time")

    def play(self, games: list[Game]) -> bool:
        """Answer for ``games`` from now on; False (and nothing changed) when two of their requests
        would share a seed. Request seeds are 31-bit hashes, so over all 3,553 training games x 21
        turns some collide; within a chunk of 64 games a collision is unlikely, within one game
        practically impossible."""
        by_seed: dict[int, tuple[str, int]] = {}
        for g in games:
            for turn in range(self.max_steps + 1):
                for index in (-1, 0):  # a group of one asks for turn 0 as trajectory 0
                    by_seed[request_seed(self.seed, g.id, index, turn)] = (g.id, turn)
        if len(by_seed) != 2 * len(games) * (self.max_steps + 1):
            return False
        self.by_seed = by_seed
        self.plans = {g.id: g.walkthrough() for g in games}
        return True

    def generate(self, requests: list[SamplingRequest]) -> list[list[Completion]]:
        out = []
        for r in requests:
            game_id, turn = self.by_seed[r.seed]
            plan = self.plans[game_id]
            action = plan[turn] if turn < len(plan) else "look"
            if game_id not in self.tasks:
                self.tasks[game_id] = self._task(r)
            task = self.tasks[game_id]
            reason = rationale(action, task) + ("\n" if self.fmt.action_format == "tool_call" else "")
            text = protocol.format_action(action, self.fmt.action_format, reason)
            ids = tuple(self.fmt.encode(text) + [self.fmt.end_of_turn_id])
            out.append([Completion(ids, (0.0,) * len(ids), "stop")] * r.n)
        return out

    def _task(self, r: SamplingRequest) -> str:
        text = self.fmt.tokenizer.decode(list(r.prompt_ids[:4096]), skip_special_tokens=False)
        m = re.search(r"Your task is to: ([^\n]*)", text)
        return m.group(1).strip() if m else "finish the task"


def replay(runner_for: Callable[[ExpertEngine], RolloutRunner], fmt: ChatFormat, games: list[Game], max_steps: int, out: str | Path,
           chunk: int = 64, progress: Callable[[int, int, int], None] | None = None) -> dict:
    """Play every game's walkthrough; append the winning trajectories to ``out`` chunk by chunk.

    Resumes: games already in ``out`` (and the skipped ones, listed in ``out``.skipped.json) are not
    played again. Returns {"games", "written", "skipped", "skipped_games"}.
    """
    out = Path(out)
    skipped_file = out.with_suffix(out.suffix + ".skipped.json")
    done: set[str] = set()
    if out.exists():
        with open(out) as f:
            lines = f.readlines()
        good = []
        for line in lines:  # a torn last line (interrupted write) is dropped
            try:
                done.add(json.loads(line)["game_id"])
                good.append(line)
            except (json.JSONDecodeError, KeyError):
                break
        out.write_text("".join(good))
    skipped: dict[str, str] = {}
    if skipped_file.exists():
        try:
            skipped = json.loads(skipped_file.read_text())
            assert isinstance(skipped, dict)
        except (ValueError, AssertionError):
            raise DataError(f"{skipped_file} is damaged (not the JSON object `alfrl expert` writes): delete it and run again "
                            "(the games it listed are played again)") from None
    todo = [g for g in games if g.id not in done and g.id not in skipped]
    engine = ExpertEngine(fmt, [], max_steps)
    runner = runner_for(engine)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        for start in range(0, len(todo), chunk):
            games_now = todo[start : start + chunk]
            if engine.play(games_now):
                groups = runner.run(games_now, 1, SEED)
            else:  # two requests of this chunk share a seed: one game at a time
                groups = []
                for g in games_now:
                    if not engine.play([g]):
                        raise AssertionError(f"two expert requests of {g.id} share a seed")
                    groups += runner.run([g], 1, SEED)
            for group in groups:
                t = group.trajectories[0] if group.trajectories else None
                if t is not None and t.won:
                    f.write(json.dumps(trajectory_to_dict(t)) + "\n")
                    done.add(group.game.id)
                else:
                    skipped[group.game.id] = group.failed or (t.stop_reason if t else "no trajectory")
            f.flush()
            os.fsync(f.fileno())
            skipped_file.write_text(json.dumps(skipped, indent=1, sort_keys=True))
            if progress:
                progress(len(done) + len(skipped), len(games), len(skipped))
    return {"games": len(games), "written": len(done), "skipped": len(skipped), "skipped_games": skipped}


def tokenizer_problem(path: str | Path, tokenizer, model_name: str, trajectories: int = 3) -> str | None:
    """None when the first ``trajectories`` of the expert file at ``path`` were tokenized by ``tokenizer``, else the problem
    in one line: each turn's trained tokens must decode to the text the file records for that turn (an expert file is
    written for one model's tokenizer; another model's would train on other words, or index past its vocabulary)."""
    vocabulary = len(tokenizer)
    for t in read_expert(path, trajectories):
        for seq in t.sequences:
            for turn, start, end in seq.spans[:2]:
                ids = list(seq.token_ids[start:end])
                text = t.turns[turn].completion_text if turn < len(t.turns) else ""
                if ids and max(ids) >= vocabulary:
                    decoded = f"token id {max(ids)}, past this tokenizer's {vocabulary}"
                else:
                    decoded = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
                    if decoded.startswith(text):
                        continue
                    decoded = f"decodes to {decoded[:40]!r}"
                return (f"{path} was not tokenized by {model_name}'s tokenizer: turn {turn} of {t.game_id} {decoded}, its text "
                        f"is {text[:40]!r}; write the file for this model with `alfrl expert --config RECIPE --out FILE` "
                        "(the recipe naming this model)")
    return None


def read_expert(path: str | Path, limit: int | None = None) -> list[Trajectory]:
    """Expert trajectories written by ``replay`` (the first ``limit``). A line that is not one (another file, a damaged
    one, or the last line cut by an interrupted ``alfrl expert``) is a ``DataError`` naming the file, the line and the fix."""
    out = []
    fix = f"write it again with `alfrl expert --config RECIPE --out {path}` (it resumes, dropping a cut last line)"
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                out.append(trajectory_from_dict(json.loads(raw)))
            except (ValueError, KeyError, TypeError) as e:  # JSON, UTF-8, or fields not a trajectory's
                cut = "" if raw.endswith(b"\n") else " (the file's last line, cut short)"
                raise DataError(f"{path}: line {n}{cut} is not an expert trajectory ({type(e).__name__}: {str(e)[:80]}); {fix}") from None
            if limit is not None and len(out) >= limit:
                break
    return out
