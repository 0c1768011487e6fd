"""Environment throughput: steps per second for 1, 2 and N workers on the expert walkthroughs of a
fixed set of games (the first two games of each task type in valid_seen, sorted: 12 games).

    python bench/env_throughput.py [--workers 1 2 N] --out bench/out/env_throughput.json
    python bench/env_throughput.py --compare-reset [--workers 2] [--rounds 3] --out bench/out/env_reset.json   # also in `make bench`
    python bench/env_throughput.py --compare-step [--workers 2] [--rounds 3] --out bench/out/env_step.json     # also in `make bench`

``--compare-reset`` times the resets of the same games with TextWorld as it is (four PDDL -> SAS
translations per start + reset) and with alfrl's fast resets (one: ``alfrl.fast_reset``), in
alternating rounds with fresh pools, and checks both give the same first observation and admissible
commands. ``--compare-step`` does the same for steps: the games' expert plans, then two commands that are not
admissible and a ``look``, stepped in rounds with TextWorld as it is and with alfrl's fast steps (``alfrl.fast_step``:
the text grammar parsed once per string, its contexts copied shallow); every state must be the same.

Each worker count gets a fresh pool; all 12 environments are reset together (timed apart), then
stepped in rounds, one walkthrough action per live environment per round, through ``EnvPool.run``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

from alfrl.envs import EnvOp, EnvPool
from alfrl.games import discover_games


def fixed_games(data_dir: str | None, per_task: int = 2):
    chosen, seen = [], {}
    for g in discover_games(data_dir, ["valid_seen"]):
        if seen.get(g.task_type, 0) < per_task:
            seen[g.task_type] = seen.get(g.task_type, 0) + 1
            chosen.append(g)
    return chosen


def measure(games, workers: int) -> dict:
    with EnvPool(num_workers=workers) as pool:
        ids = [pool.create(g.path) for g in games]
        pool.run([EnvOp(i, "reset") for i in ids[:workers]])  # start the workers (imports) before timing
        start = time.perf_counter()
        pool.run([EnvOp(i, "reset") for i in ids])
        reset_seconds = time.perf_counter() - start
        plans = {i: g.walkthrough() for i, g in zip(ids, games)}
        steps, wins, start = 0, 0, time.perf_counter()
        for turn in range(max(len(p) for p in plans.values())):
            ops = [EnvOp(i, "step", p[turn]) for i, p in plans.items() if turn < len(p)]
            results = pool.run(ops)
            steps += len(ops)
            wins += sum(bool(getattr(r, "won", False)) for r in results)
        step_seconds = time.perf_counter() - start
    return {"workers": workers, "games": len(games), "steps": steps, "wins": wins, "reset_seconds": reset_seconds,
            "resets_per_second": len(games) / reset_seconds, "step_seconds": step_seconds, "steps_per_second": steps / step_seconds}


def compare_reset(games, workers: int, rounds: int) -> dict:
    times: dict[str, list[float]] = {"textworld": [], "fast": []}
    states: dict[str, list] = {}
    for _ in range(rounds):
        for mode in ("textworld", "fast"):
            with EnvPool(num_workers=workers, fast_reset=mode == "fast") as pool:
                ids = [pool.create(g.path) for g in games]
                pool.run([EnvOp(pool.create(games[0].path), "reset") for _ in range(workers)])  # imports, before timing
                start = time.perf_counter()
                results = pool.run([EnvOp(i, "reset") for i in ids])
                times[mode].append(time.perf_counter() - start)
                states[mode] = [(r.observation, r.admissible) for r in results]
    if states["textworld"] != states["fast"]:
        raise SystemExit("the fast resets' start states differ from TextWorld's own")
    best = {mode: min(t) for mode, t in times.items()}
    return {"workers": workers, "games": len(games), "rounds": rounds, "seconds": times, "same_start_states": True,
            "resets_per_second": {mode: len(games) / t for mode, t in best.items()}, "speedup": best["textworld"] / best["fast"]}


def step_actions(games, random_steps: int):
    """The benchmark's action for game k at a turn, given its last state: the expert's plan then two commands that are
    not admissible and a ``look``; with ``random_steps``, every other game instead takes that many random commands
    (admissible ones and one that is not), drawn from its state, so both modes draw the same ones from the same states."""
    plans = [g.walkthrough() + ["take the moon", "go to nowhere", "look"] for g in games]

    def action(k: int, turn: int, state) -> str | None:
        if random_steps and k % 2:
            rng = random.Random(k * 1000 + turn)
            return rng.choice(list(state.shown_actions) + ["take the moon"]) if turn < random_steps else None
        return plans[k][turn] if turn < len(plans[k]) else None

    return action, max([len(p) for p in plans] + [random_steps])


def compare_step(games, workers: int, rounds: int, random_steps: int = 0) -> dict:
    times: dict[str, list[float]] = {"textworld": [], "fast": []}
    states: dict[str, list] = {}
    action, turns = step_actions(games, random_steps)
    for _ in range(rounds):
        for mode in ("textworld", "fast"):
            with EnvPool(num_workers=workers, fast_step=mode == "fast") as pool:
                ids = [pool.create(g.path) for g in games]
                last = pool.run([EnvOp(i, "reset") for i in ids])
                states[mode], seconds = list(last), 0.0
                for turn in range(turns):
                    live = [(k, a) for k, a in ((k, action(k, turn, last[k])) for k in range(len(ids))) if a is not None]
                    start = time.perf_counter()
                    results = pool.run([EnvOp(ids[k], "step", a) for k, a in live])
                    seconds += time.perf_counter() - start
                    for (k, _), r in zip(live, results):
                        last[k] = r
                    states[mode] += results
                times[mode].append(seconds)
    if states["textworld"] != states["fast"]:
        raise SystemExit("the fast steps' states differ from TextWorld's own")
    steps = len(states["fast"]) - len(games)
    best = {mode: min(t) for mode, t in times.items()}
    return {"workers": workers, "games": len(games), "steps": steps, "random_steps": random_steps, "rounds": rounds,
            "seconds": times, "same_states": True, "wins": sum(bool(getattr(s, "won", False)) for s in states["fast"]),
            "steps_per_second": {mode: steps / t for mode, t in best.items()}, "speedup": best["textworld"] / best["fast"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--workers", type=int, nargs="+", default=sorted({1, 2, os.cpu_count() or 1}))
    parser.add_argument("--out", default="bench/out/env_throughput.json")
    parser.add_argument("--compare-reset", action="store_true", help="time resets, TextWorld's own vs alfrl's fast resets")
    parser.add_argument("--compare-step", action="store_true", help="time steps, TextWorld's own vs alfrl's fast steps")
    parser.add_argument("--games", choices=["fixed", "eval"], default="fixed", help="--compare-step: the 12 fixed games, or "
                        "all 274 evaluation games with --random-steps random commands in every other one")
    parser.add_argument("--random-steps", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    games = fixed_games(args.data_dir)
    if args.compare_step and args.games == "eval":
        games = discover_games(args.data_dir, ["valid_seen", "valid_unseen"])

    def write(key: str, value) -> None:
        report = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "processor": platform.processor()},
                  "games": [g.id for g in games], key: value}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))

    workers = min(args.workers)
    if args.compare_step:
        r = compare_step(games, workers, args.rounds, args.random_steps if args.games == "eval" else 0)
        write("compare_step", r)
        print(f"{workers} workers, {len(games)} games, {r['steps']} steps ({r['wins']} states won), best of {args.rounds}: "
              f"textworld {r['steps_per_second']['textworld']:.1f}/s, fast {r['steps_per_second']['fast']:.1f}/s ({r['speedup']:.2f}x), same states")
    elif args.compare_reset:
        r = compare_reset(games, workers, args.rounds)
        write("compare_reset", r)
        print(f"{workers} workers, {len(games)} resets, best of {args.rounds}: textworld {r['resets_per_second']['textworld']:.2f}/s, "
              f"fast {r['resets_per_second']['fast']:.2f}/s ({r['speedup']:.2f}x), same start states")
    else:
        results = [measure(games, w) for w in args.workers]
        write("results", results)
        for r in results:
            print(f"{r['workers']:>3} workers: {r['steps_per_second']:7.1f} steps/s ({r['steps']} steps, {r['wins']}/{r['games']} won), "
                  f"{r['resets_per_second']:.2f} resets/s")

if __name__ == "__main__":
    main()
