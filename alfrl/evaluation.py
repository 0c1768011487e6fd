"""Evaluation: one trajectory per game on the standard games, written to JSONL and summarised.

The reference protocol: valid_seen (140) + valid_unseen (134) = 274 games in sorted order,
temperature 0.01, top_p 1.0, seed 42, 50 steps, 12,000 trajectory tokens, with the same prompts
and tool protocol as training. Each game's record is appended (and synced to disk) the moment its
trajectory ends, so an interrupted evaluation keeps every finished game and a rerun plays only the
others; every request's seed depends only on the run seed, the game and the turn, so a game plays
the same whatever it is batched with (up to the engine's numerics). When all games are done the file
is rewritten in the games' order with the summary last. The output starts with a header that records
the configuration; a different configuration on an existing file is refused unless ``overwrite``.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from alfrl.games import EVAL_SPLITS, SPLITS, Game, discover_games
from alfrl.rollout import RolloutConfig, RolloutRunner
from alfrl.types import Trajectory, TrajectoryGroup, repeated_turns


class EvalError(RuntimeError):
    """An evaluation cannot start or resume; the message says why."""


@dataclass(frozen=True)
class EvalConfig:
    """The evaluation protocol (defaults: the reference's)."""

    splits: tuple[str, ...] = EVAL_SPLITS
    """Evaluation splits: ``valid_seen`` (140 games) and/or ``valid_unseen`` (134 games)."""
    limit_per_split: int | None = None
    """Evaluate only N games of each split, spread over its task types (the same N every time)."""
    temperature: float = 0.01
    """Sampling temperature of the evaluation (the reference's 0.01: near greedy)."""
    top_p: float = 1.0
    """Nucleus sampling of the evaluation (1.0: off)."""
    seed: int = 42
    """The run seed: each request's sampling seed depends only on it, the game and the turn."""
    max_episode_steps: int = 50
    """Environment steps before a game counts as lost."""
    max_trajectory_tokens: int = 12000
    """Tokens of one game at most (prompt, completions, observations): a completion gets what is left, and the game
    ends (lost) when its next prompt reaches it."""
    max_assistant_tokens: int = 2048
    """Tokens one completion (one turn) may sample."""
    games_per_chunk: int = 64
    """Games handed to the rollout runner at a time (their environments are created together)."""
    max_live_games: int = 0
    """Within a chunk, at most this many games played at once (0: the whole chunk); the next game
    starts when one ends. Keeps the KV cache from thrashing when the engine has a small share of the GPU."""
    deterministic: bool = True
    """``alfrl eval`` starts its engine batch-invariant, so the same adapter plays the same games to the bit in every run
    (vLLM: ``VLLM_BATCH_INVARIANT=1`` wherever its engine core runs; the hf engine always is). A fit's periodic evaluation
    plays on the fit's engine: ``data.rollout.deterministic`` decides there."""

    def problems(self, prefix: str = "data.eval") -> list[str]:
        out = []
        for s in self.splits:
            if s not in SPLITS:
                out.append(f"{prefix}.splits has {s!r}: choose from {', '.join(SPLITS)}")
        if self.limit_per_split is not None and self.limit_per_split < 1:
            out.append(f"{prefix}.limit_per_split={self.limit_per_split} must be >= 1 (or null for all games)")
        if self.temperature < 0:
            out.append(f"{prefix}.temperature={self.temperature} must be >= 0")
        for name in ("max_episode_steps", "max_trajectory_tokens", "max_assistant_tokens", "games_per_chunk"):
            if getattr(self, name) < 1:
                out.append(f"{prefix}.{name}={getattr(self, name)} must be >= 1")
        if self.max_live_games < 0:
            out.append(f"{prefix}.max_live_games={self.max_live_games} must be >= 0 (0: the whole chunk at once)")
        return out

    def rollout_config(self, training: RolloutConfig) -> RolloutConfig:
        """The training rollout settings (format, context) with this protocol's sampling and limits."""
        return dataclasses.replace(
            training,
            temperature=self.temperature,
            top_p=self.top_p,
            max_episode_steps=self.max_episode_steps,
            max_trajectory_tokens=self.max_trajectory_tokens,
            max_assistant_tokens=self.max_assistant_tokens,
            max_live_games=self.max_live_games,
        )


def eval_games(data_dir: str | None, splits: tuple[str, ...] | list[str], limit_per_split: int | None) -> list[Game]:
    """Every game of each split in sorted order, or with ``limit_per_split`` a fixed subset of each that
    covers the task types evenly: the first game of every type, then the second of every type, ...
    (the first N in sorted order would be one or two task types: 13 of valid_seen's first 20 are
    look_at_obj_in_light)."""
    games: list[Game] = []
    for split in splits:
        found = discover_games(data_dir, [split])
        games.extend(spread_over_task_types(found, limit_per_split) if limit_per_split else found)
    return games


def spread_over_task_types(games: list[Game], n: int) -> list[Game]:
    """``n`` of ``games`` taken round-robin over their task types (each type's games in the given
    order, the types in name order), returned in the given order."""
    seen: Counter[str] = Counter()
    order = []  # (the game's place within its type, its type, its place in games)
    for pos, g in enumerate(games):
        order.append((seen[g.task_type], g.task_type, pos))
        seen[g.task_type] += 1
    keep = {pos for *_, pos in sorted(order)[:n]}
    return [g for pos, g in enumerate(games) if pos in keep]


def game_record(t: Trajectory) -> dict:
    """The JSONL record of one evaluated game (turns included, token ids left out)."""
    return {
        "type": "game",
        "game_id": t.game_id,
        "split": t.split,
        "task_type": t.task_type,
        "task": t.task,
        "won": t.won,
        "steps": t.steps,
        "invalid_actions": t.invalid_actions,
        "stop_reason": t.stop_reason,
        "reward": t.reward,
        "turns": [dataclasses.asdict(turn) for turn in t.turns],
    }


# ------------------------------------------------------------------ summary


def _rate(num: float, den: float) -> float:
    return num / den if den else 0.0


SUMMARY_BLOCK_KEYS = ("games", "wins", "success_rate", "mean_reward", "mean_steps", "mean_invalid_actions", "valid_format_rate",
                      "admissible_rate")
"""The figures of a split's (and the overall) block of a summary, as ``_block`` writes them (``read_summary`` checks them)."""


def _block(records: list[dict]) -> dict:
    n = len(records)
    turns = [turn for r in records for turn in r["turns"]]
    return {
        "games": n,
        "wins": sum(bool(r["won"]) for r in records),
        "success_rate": _rate(sum(bool(r["won"]) for r in records), n),
        "mean_reward": _rate(sum(r["reward"] for r in records), n),
        "mean_steps": _rate(sum(r["steps"] for r in records), n),
        "mean_invalid_actions": _rate(sum(r["invalid_actions"] for r in records), n),
        "valid_format_rate": _rate(sum(bool(t["valid_format"]) for t in turns), len(turns)),
        "admissible_rate": _rate(sum(bool(t["admissible"]) for t in turns), len(turns)),
    }


def summarize(records: list[dict], deterministic: bool | None = None) -> dict:
    """Per split and overall (all games pooled) figures, and success per task type per split; ``deterministic``: whether
    the engine that played them was batch-invariant (None: not recorded, as in files written before the key existed)."""
    games = [r for r in records if r.get("type", "game") == "game"]
    by_split: dict[str, list[dict]] = defaultdict(list)
    for r in games:
        by_split[r["split"]].append(r)
    task_success: dict[str, dict[str, dict]] = {}
    for split, rs in sorted(by_split.items()):
        per_task: dict[str, list[dict]] = defaultdict(list)
        for r in rs:
            per_task[r["task_type"]].append(r)
        task_success[split] = {
            task: {"games": len(v), "wins": sum(bool(r["won"]) for r in v), "success_rate": _rate(sum(bool(r["won"]) for r in v), len(v))}
            for task, v in sorted(per_task.items())
        }
    return {
        "type": "summary",
        "overall": _block(games),
        "splits": {split: _block(rs) for split, rs in sorted(by_split.items())},
        "task_types": task_success,
        "deterministic": deterministic,
    }


def task_type_wins(summary: dict) -> dict[str, tuple[int, int]]:
    """(wins, games) per task type, every split pooled."""
    out: dict[str, tuple[int, int]] = {}
    for tasks in summary["task_types"].values():
        for task, v in tasks.items():
            wins, games = out.get(task, (0, 0))
            out[task] = (wins + v["wins"], games + v["games"])
    return dict(sorted(out.items()))


def game_repeats(game: dict) -> tuple[int, int] | None:
    """``alfrl.types.repeated_turns`` of one game record; None when a turn's ``state_key`` or action is missing or not a
    string (records written before it existed)."""
    turns = [t for t in game.get("turns", []) if t.get("action")]
    if any(not isinstance(t.get("state_key"), str) or not isinstance(t["action"], str) for t in turns):
        return None  # written before turns had a state_key, or not by alfrl: no loop count rather than a wrong one
    return repeated_turns((t["state_key"], t["action"]) for t in turns)


def percent(x: float | None) -> str:
    """A rate as the reports write it: 0.4270 -> "42.70%" (None -> "-")."""
    return "-" if x is None else f"{100 * x:.2f}%"


def format_summary(summary: dict) -> str:
    lines = [f"{'split':<14}{'games':>6}{'wins':>6}{'success':>9}{'reward':>8}{'steps':>7}{'invalid':>9}{'valid fmt':>10}{'admiss.':>9}"]
    rows = list(summary["splits"].items()) + [("overall", summary["overall"])]
    for name, b in rows:
        lines.append(
            f"{name:<14}{b['games']:>6}{b['wins']:>6}{b['success_rate']:>9.2%}{b['mean_reward']:>8.3f}{b['mean_steps']:>7.1f}"
            f"{b['mean_invalid_actions']:>9.2f}{b['valid_format_rate']:>10.2%}{b['admissible_rate']:>9.2%}"
        )
    lines.append("")
    lines.append("success per task type:")
    for split, tasks in summary["task_types"].items():
        for task, v in tasks.items():
            lines.append(f"  {split:<13} {task:<32} {v['wins']:>3}/{v['games']:<3} {v['success_rate']:.2%}")
    return "\n".join(lines)


# ------------------------------------------------------------------ running


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def results_header(config: dict, game_ids: list[str], **extra) -> dict:
    """The first record of an ``alfrl eval`` output: the run's configuration and its games."""
    return {"type": "header", "config": config, "config_hash": config_hash(config), "games": game_ids, **extra}


def write_results(path: Path, header: dict, records: list[dict], summary: dict | None = None) -> None:
    """Write header, game records (and the summary) to ``path`` atomically (a temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        f.write("".join(json.dumps(rec) + "\n" for rec in [header, *records, *([summary] if summary else [])]))
    os.replace(tmp, path)


def changed_keys(old, new, prefix: str = "") -> list[str]:
    """``key: old -> new`` for every leaf that differs between two (nested) configurations."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            out += changed_keys(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} -> {new!r}"]


def _read_existing(path: Path) -> tuple[dict | None, list[dict]]:
    """(header, game records) of an existing output; a torn tail (an interrupted write: a cut line, bytes that are not
    UTF-8) is dropped, every whole record before it kept."""
    with open(path, "rb") as f:
        try:
            return _parse_records(f.read())
        except EvalError as e:
            raise EvalError(f"{path}: {e}: it is not an `alfrl eval` output to resume; give another --out (or --overwrite)") from None


GAME_FIELDS = {"game_id": str, "split": str, "task_type": str, "won": (bool, int), "reward": (int, float), "steps": int,
               "invalid_actions": int, "turns": list}
"""What a game record must hold for the summary and the reports (their types): ``turns`` a list of objects with
``valid_format`` and ``admissible``."""


def _game_problem(rec: dict) -> str | None:
    wrong = [k for k, kind in GAME_FIELDS.items() if not isinstance(rec.get(k), kind)]
    if not wrong and not all(isinstance(t, dict) and "valid_format" in t and "admissible" in t for t in rec["turns"]):
        wrong = ["turns"]
    return f"a game record without {', '.join(wrong)} (or not of its type)" if wrong else None


def _parse_records(data: bytes) -> tuple[dict | None, list[dict]]:
    """(header, game records); a torn tail (a cut line, bytes that are not UTF-8) ends the reading, every whole record
    before it kept; a whole line that is a game record without the fields a summary needs is an ``EvalError`` (naming it)."""
    header, games = None, []
    lines = data.split(b"\n")
    for n, line in enumerate(lines, 1):
        try:
            rec = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            break
        if not isinstance(rec, dict):
            break
        if rec.get("type") == "header":
            header = rec
        elif rec.get("type") == "game":
            problem = _game_problem(rec)
            if problem:
                raise EvalError(f"line {n} is {problem}")
            games.append(rec)
    return header, games


SPENT_KEYS = ("engine_seconds", "env_wait_seconds", "submit_seconds", "requests", "engine_steps")
"""The ``RolloutStats`` fields an evaluation adds up over its chunks (where its time went)."""


def run_eval(
    runner: RolloutRunner,
    games: list[Game],
    cfg: EvalConfig,
    out: str | Path,
    config: dict,
    overwrite: bool = False,
    on_game: Callable[[int, int], None] | None = None,
    spent: dict | None = None,
) -> dict:
    """Play ``games`` (one trajectory each) into ``out`` and return the summary (also written last).

    ``config`` describes the run (model, adapter, protocol) and is stored in the header; resuming
    needs the same config. ``on_game(done, total)`` is called after each game's record is written.
    ``spent``, if given, gets where the time went: engine and environment-wait seconds, requests.
    """
    out = Path(out)
    header = results_header(config, [g.id for g in games])
    done: dict[str, dict] = {}
    if out.exists() and not overwrite:
        old_header, records = _read_existing(out)
        if old_header is not None and old_header.get("config_hash") != header["config_hash"]:
            changed = changed_keys(old_header.get("config"), header["config"])
            raise EvalError(
                f"{out} holds an evaluation with a different configuration ({'; '.join(changed[:8]) or 'the game list'}"
                f"{'; ...' if len(changed) > 8 else ''}): pass --overwrite (make eval OVERWRITE=1) to replace it or choose another --out"
            )
        if old_header is not None:
            done = {r["game_id"]: r for r in records}
    records = [done[g.id] for g in games if g.id in done]
    write_results(out, header, records)  # header + the games already played; then append as games end
    todo = [g for g in games if g.id not in done]
    with open(out, "a") as f:

        def write(_index: int, group: TrajectoryGroup) -> None:
            if group.failed is not None:
                raise EvalError(f"game {group.game.id} could not be played: {group.failed}")
            rec = game_record(group.trajectories[0])
            records.append(rec)
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
            if on_game:
                on_game(len(records), len(games))

        spent = {} if spent is None else spent
        for key in SPENT_KEYS:
            spent.setdefault(key, 0)
        for i in range(0, len(todo), cfg.games_per_chunk):
            runner.run(todo[i : i + cfg.games_per_chunk], group_size=1, seed=cfg.seed, on_group=write)
            for key in SPENT_KEYS:  # each chunk's runner.run starts its stats afresh
                spent[key] += getattr(runner.stats, key)
    order = {g.id: i for i, g in enumerate(games)}
    records.sort(key=lambda r: order[r["game_id"]])
    summary = summarize(records, config.get("deterministic"))
    write_results(out, header, records, summary)
    return summary


def _is_summary(summary) -> bool:
    """Whether a parsed JSON value has the shape ``summarize`` gives (what the report reads from it)."""
    def block(b) -> bool:
        return isinstance(b, dict) and all(isinstance(b.get(k), (int, float)) for k in SUMMARY_BLOCK_KEYS)

    def counts(b) -> bool:
        return isinstance(b, dict) and isinstance(b.get("wins"), int) and isinstance(b.get("games"), int)

    if not (isinstance(summary, dict) and isinstance(summary.get("splits"), dict) and isinstance(summary.get("task_types"), dict)):
        return False
    overall = summary.get("overall")
    return (block(overall) and counts(overall) and 0 <= overall["wins"] <= overall["games"] > 0
            and all(map(block, summary["splits"].values()))
            and all(isinstance(tasks, dict) and all(map(counts, tasks.values())) for tasks in summary["task_types"].values()))


def read_summary(path: str | Path) -> dict:
    """The summary ``alfrl eval --out X.jsonl`` wrote beside its records (``X.summary.json``), checked: for a run whose
    per-game records are gone (it can be set beside others, not paired with them)."""
    fix = "give the .summary.json that `alfrl eval --out` wrote beside its .jsonl"
    try:
        summary = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise EvalError(f"{path}: no such file: {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EvalError(f"{path} cannot be read as JSON ({type(e).__name__}): {fix}") from None
    if not _is_summary(summary):
        raise EvalError(f"{path} is not an `alfrl eval` summary (overall, splits and task_types with games, wins and rates): {fix}")
    summary.setdefault("deterministic", None)
    return summary


def read_results(path: str | Path) -> tuple[dict | None, list[dict], dict]:
    """(header, game records, summary) of an ``alfrl eval`` output (``.jsonl``, or gzipped ``.jsonl.gz`` as results folders
    keep them); the summary is recomputed from the records."""
    if not Path(path).is_file():
        raise EvalError(f"{path}: no such file: give the .jsonl that `alfrl eval --out` wrote")
    try:
        with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as f:
            header, games = _parse_records(f.read())
    except (UnicodeDecodeError, OSError, EOFError) as e:  # gzip's BadGzipFile is an OSError; a cut .gz ends in EOFError
        raise EvalError(f"{path} cannot be read ({type(e).__name__}): is it an `alfrl eval` output?") from None
    except EvalError as e:
        raise EvalError(f"{path}: {e}: is it an `alfrl eval` output?") from None
    if not games:
        raise EvalError(f"{path} holds no evaluated games: is it an `alfrl eval` output?")
    config = header.get("config") if isinstance(header, dict) else None
    return header, games, summarize(games, config.get("deterministic") if isinstance(config, dict) else None)
