"""``alfrl report``: runs side by side, from what ``alfrl eval`` wrote and nothing else.

Writes ``report.md`` (seen / unseen / overall success, wins, mean reward, invalid actions, and
per-task-type success with the change from the first run; how the games ended: stop reasons, what the
lost games spent, and loops, the turns that repeat an action in the same state) and three PNG charts:
success by split, success by task type, invalid actions per episode.

With ``--train-log RUN_DIR`` (a training run's ``default_root_dir``, or its ``metrics.csv`` files) it
also writes the training curves from the run's CSV logs: ``training.csv`` (one row per update: rollout
reward, success and invalid actions; later logs win for a step logged twice, as after a resume) and
``training_curves.png``; where the run evaluated itself (``periodic_eval``), ``eval_curves.csv`` and ``eval_curves.png``
(success per task type against updates) and their table in the report (``alfrl.curves``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from alfrl.curves import eval_markdown, eval_outputs, eval_rows, log_records, start_row, training_markdown, training_outputs, training_rows
from alfrl.evaluation import EvalError, game_repeats, percent, read_results, read_summary, summarize, task_type_wins
from alfrl.games import EVAL_SPLITS, TASK_TYPES
from alfrl.types import STOP_REASONS


def _delta(x: float | None, base: float | None) -> str:
    if x is None or base is None:
        return ""
    d = 100 * (x - base)
    return f" ({'+' if d >= 0 else ''}{d:.2f})"


def load_runs(paths: list[str], names: list[str] | None) -> list[tuple[str, dict, list[dict] | None]]:
    """(name, summary, game records) of every result file; a ``.summary.json`` (a run whose records are gone) has no
    records (None): it stands in the tables and is compared without pairing (``unpaired_markdown``)."""
    if names and len(names) != len(paths):
        raise SystemExit(f"alfrl report: {len(names)} names for {len(paths)} result files: give one name per file")
    runs = []
    for i, path in enumerate(paths):
        summary_only = str(path).endswith(".summary.json")
        name = names[i] if names else (Path(path).name.removesuffix(".summary.json") if summary_only
                                       else Path(path).name.removesuffix(".gz").removesuffix(".jsonl"))
        if summary_only:
            runs.append((name, read_summary(path), None))
        else:
            _header, games, summary = read_results(path)
            runs.append((name, summary, games))
    if runs[0][2] is None:
        raise SystemExit(f"alfrl report: the first result ({paths[0]}) is the baseline and must hold the games: give an "
                         "`alfrl eval` .jsonl first, summaries after it")
    return runs


def common_games(loaded: list[tuple[str, dict, list[dict] | None]]) -> tuple[list[tuple[str, dict, list[dict] | None]], str | None]:
    """The runs as given when they played the same games; else each cut to the games every run played (its summary
    recomputed), with a line saying so: a 274-game evaluation beside a 60-game periodic one compares 60 games. A run
    with only its summary is left as it is."""
    sets = [{g["game_id"] for g in games} for _, _, games in loaded if games is not None]
    if all(s == sets[0] for s in sets):
        return loaded, None
    common = set.intersection(*sets)
    counts = ", ".join(f"{name} {len(games)}" for name, _, games in loaded if games is not None)
    if not common:
        raise SystemExit(f"alfrl report: no game was played by every run ({counts} games): compare evaluations of the same "
                         "splits, or report them separately")
    cut = []
    for name, summary, games in loaded:
        kept = None if games is None else [g for g in games if g["game_id"] in common]
        cut.append((name, summary if kept is None else summarize(kept, summary.get("deterministic")), kept))
    alone = " (a run given by its summary alone keeps all of its games)" if any(g is None for _, _, g in loaded) else ""
    return cut, (f"The runs played different games ({counts}): every table and chart below is over the {len(common)} "
                 f"games all of them played{alone}.")


def unpaired_markdown(runs: list[tuple[str, dict, list[dict] | None]]) -> str:
    """Every run with records against every run given by its summary alone: Newcombe's interval (``alfrl.stats``)."""
    from alfrl.stats import unpaired_comparison

    lines = []
    for s_name, s_summary, s_games in runs:
        if s_games is not None:
            continue
        lines += ["", f"## Unpaired comparison against {s_name} (its summary only: no game-by-game pairing)", "",
                  "| run | split | games | success A -> B | difference | Newcombe 95% interval | B better? |", "|---|---|---|---|---|---|---|"]
        for name, summary, games in runs:
            if games is None:
                continue
            for split in ("all", *EVAL_SPLITS):
                a = s_summary["overall"] if split == "all" else s_summary["splits"].get(split)
                b = summary["overall"] if split == "all" else summary["splits"].get(split)
                if not a or not b:
                    continue
                if a["games"] != b["games"]:
                    lines.append(f"| {name} | {split} | {b['games']} against {a['games']} | | | not compared: other games | |")
                    continue
                c = unpaired_comparison(a["wins"], a["games"], b["wins"], b["games"])
                better = "yes" if c["ci_low"] > 0 else ("worse" if c["ci_high"] < 0 else "not shown")
                lines.append(f"| {name} | {split} | {b['games']} | {percent(c['a_success'])} -> {percent(c['b_success'])} | "
                             f"{100 * c['difference']:+.2f} pts | [{100 * c['ci_low']:+.2f}, {100 * c['ci_high']:+.2f}] pts | {better} |")
        lines += ["", f"{s_name}'s games are taken to be the same set (same split and count); without its records the two "
                  "runs are treated as independent samples, so this interval is wider than a paired one."]
    return "\n".join(lines) + "\n" if lines else ""


def paired_markdown(runs: list[tuple[str, dict, list[dict]]]) -> str:
    """Every run against the first on the games both played: McNemar's exact test and a bootstrap interval ("" with
    fewer than two runs that have their records: a run given by its summary alone cannot be paired)."""
    from alfrl.stats import paired_comparison

    runs = [r for r in runs if r[2] is not None]
    if len(runs) < 2:
        return ""
    base_name, _, base_games = runs[0]
    lines = ["", f"## Paired comparison against {base_name} (same games)", "",
             "| run | split | games | success A -> B | difference | B only / A only | McNemar p | bootstrap 95% interval | B better? |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, _, games in runs[1:]:
        for split in ("all", *EVAL_SPLITS):
            pick = (lambda r: True) if split == "all" else (lambda r, s=split: r["split"] == s)  # noqa: E731
            a = {r["game_id"]: bool(r["won"]) for r in base_games if pick(r)}
            b = {r["game_id"]: bool(r["won"]) for r in games if pick(r)}
            if not set(a) & set(b):
                continue
            c = paired_comparison(a, b)
            better = "yes" if c["ci_low"] > 0 and c["p_value"] < 0.05 else ("worse" if c["ci_high"] < 0 and c["p_value"] < 0.05 else "not shown")
            lines.append(f"| {name} | {split} | {c['games']} | {percent(c['a_success'])} -> {percent(c['b_success'])} | "
                         f"{100 * c['difference']:+.2f} pts | {c['b_only']} / {c['a_only']} | {c['p_value']:.4f} | "
                         f"[{100 * c['ci_low']:+.2f}, {100 * c['ci_high']:+.2f}] pts | {better} |")
    lines += ["", "B better: the 95% interval excludes 0 and McNemar's p < 0.05 (discordant games only; 10,000 bootstrap resamples of games).",
              "", f"### Games played identically to {base_name}", "",
              "| run | games | identical (every turn's text, action and token counts) | first different turn (median) | outcome changed |",
              "|---|---|---|---|---|"]
    for name, _, games in runs[1:]:
        same = identical_games(base_games, games)
        firsts = sorted(v for v in same["first_difference"].values() if v is not None)
        median = "-" if not firsts else str(firsts[len(firsts) // 2])
        lines.append(f"| {name} | {same['games']} | {same['identical']} | {median} | {same['outcome_changed']} |")
    lines += ["", "Two evaluations of one adapter on a deterministic engine play every game identically; on a non-deterministic "
              "engine some games diverge (bf16 near-ties flip with what shares an engine step)."]
    return "\n".join(lines) + "\n"


def _repeat_share(games: list[dict]) -> str:
    counts = [game_repeats(g) for g in games]
    if not counts or any(c is None for c in counts):
        return "-"
    total = sum(n for _, n in counts)
    return percent(sum(r for r, _ in counts) / total) if total else "-"


def endings_markdown(runs: list[tuple[str, dict, list[dict] | None]]) -> str:
    """How each run's games ended (the rollout's stop reasons), what the lost games spent, and the share of turns that
    repeat an earlier action in the same state (loops), overall and per task type ("" without records)."""
    runs = [(name, games) for name, _, games in runs if games is not None]
    if not runs:
        return ""
    lines = ["", "## How the games ended", "",
             "| run | games | " + " | ".join(STOP_REASONS) + " | lost: mean steps | lost: invalid actions / game | repeated turns |",
             "|---|---|" + "---|" * len(STOP_REASONS) + "---|---|---|"]
    for name, games in runs:
        lost = [g for g in games if not g["won"]]
        ends = [sum(g.get("stop_reason") == reason for g in games) for reason in STOP_REASONS]
        spent = [f"{sum(g[key] for g in lost) / len(lost):.2f}" if lost else "-" for key in ("steps", "invalid_actions")]
        lines.append(f"| {name} | {len(games)} | " + " | ".join(map(str, [*ends, *spent])) + f" | {_repeat_share(games)} |")
    lines += ["", "Stop reasons: max_steps, the episode's step limit; trajectory_too_long, the token budget (the next prompt "
              "would not have fit); env_done, the environment ended the game; env_error, its worker failed. Repeated turns: "
              "turns whose action was already taken earlier in the same game in the same state (the same observation and "
              "available actions), which the environment answers as before: loops.", "",
              "### Repeated turns per task type", "", "| task type | " + " | ".join(name for name, _ in runs) + " |",
              "|---|" + "---|" * len(runs)]
    for task in TASK_TYPES:
        lines.append(f"| {task} | " + " | ".join(_repeat_share([g for g in games if g.get("task_type") == task]) for _, games in runs) + " |")
    return "\n".join(lines) + "\n"


PLAYED_FIELDS = ("completion_text", "action", "prompt_tokens", "completion_tokens", "finish_reason", "observation")
"""What two plays of one turn must share to be the same play (texts, tokens, what the environment answered)."""


def identical_games(a: list[dict], b: list[dict]) -> dict:
    """Of the games both runs played: how many were played identically (every turn the same by ``PLAYED_FIELDS``, the
    same stop), each game's first different turn (None: identical), and how many changed outcome."""
    first_difference: dict[str, int | None] = {}
    by_id = {r["game_id"]: r for r in b}
    changed = 0
    for ra in a:
        rb = by_id.get(ra["game_id"])
        if rb is None:
            continue
        ta, tb = ra.get("turns", []), rb.get("turns", [])
        turn = next((i for i, (x, y) in enumerate(zip(ta, tb)) if any(x.get(f) != y.get(f) for f in PLAYED_FIELDS)), None)
        if turn is None and (len(ta) != len(tb) or ra.get("stop_reason") != rb.get("stop_reason")):
            turn = min(len(ta), len(tb))
        first_difference[ra["game_id"]] = turn
        changed += bool(ra.get("won")) != bool(rb.get("won"))
    return {"games": len(first_difference), "identical": sum(v is None for v in first_difference.values()),
            "first_difference": first_difference, "outcome_changed": changed}


def _task_rate(summary: dict, task: str, split: str | None) -> float | None:
    if split is not None:
        v = summary["task_types"].get(split, {}).get(task)
        return v["success_rate"] if v else None
    wins, games = task_type_wins(summary).get(task, (0, 0))
    return wins / games if games else None


DETERMINISTIC_CELL = {True: "yes", False: "no", None: "not recorded"}


def determinism_warning(runs: list[tuple[str, dict]]) -> str | None:
    """A warning when deterministic runs are compared with runs that were not (or did not record it), else None."""
    exact = [name for name, s in runs if s.get("deterministic") is True]
    noisy = [name for name, s in runs if s.get("deterministic") is not True]
    if not exact or not noisy:
        return None
    return (f"{', '.join(exact)} {'was' if len(exact) == 1 else 'were'} evaluated deterministically and {', '.join(noisy)} "
            f"{'was' if len(noisy) == 1 else 'were'} not (or did not record it): differences against "
            f"{'it' if len(noisy) == 1 else 'them'} include that engine's run-to-run noise; evaluate both with "
            "data.eval.deterministic: true")


def markdown(runs: list[tuple[str, dict]], cut: str | None = None) -> str:
    """The success tables; ``cut``: the line saying the runs were cut to their common games (``common_games``)."""
    base = runs[0][1]
    lines = ["# alfrl evaluation report", "", "## Success", "", *([cut, ""] if cut else [])]
    lines.append("| run | seen | unseen | overall | wins | mean reward | invalid actions / episode | valid format | admissible | deterministic |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for name, s in runs:
        cells = []
        for split in EVAL_SPLITS:
            block = s["splits"].get(split)
            b0 = base["splits"].get(split)
            cells.append(percent(block and block["success_rate"]) + (_delta(block["success_rate"], b0 and b0["success_rate"]) if block and s is not base else ""))
        o, o0 = s["overall"], base["overall"]
        cells.append(percent(o["success_rate"]) + (_delta(o["success_rate"], o0["success_rate"]) if s is not base else ""))
        cells += [f"{o['wins']}/{o['games']}", f"{o['mean_reward']:.3f}", f"{o['mean_invalid_actions']:.2f}", percent(o["valid_format_rate"]),
                  percent(o["admissible_rate"]), DETERMINISTIC_CELL[s.get("deterministic")]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"Changes in parentheses are percentage points against {runs[0][0]}. Deterministic: the engine was batch-invariant "
              "(a second run of the same adapter plays the same games to the bit); no: two runs of one adapter differed by up to 3 "
              "points (results/qwen15b_warmstart/README.md); not recorded: written before alfrl recorded it."]
    warning = determinism_warning(runs)
    if warning:
        lines += ["", f"**Warning:** {warning}"]
    lines += ["", "## Success per task type (all splits)", ""]
    lines.append("| task type | " + " | ".join(name for name, _ in runs) + " |")
    lines.append("|---|" + "---|" * len(runs))
    for task in TASK_TYPES:
        b = _task_rate(base, task, None)
        row = [percent(_task_rate(s, task, None)) + (_delta(_task_rate(s, task, None), b) if s is not base else "") for _, s in runs]
        lines.append(f"| {task} | " + " | ".join(row) + " |")
    for split in EVAL_SPLITS:
        if not any(split in s["task_types"] for _, s in runs):
            continue
        lines += ["", f"### {split}", "", "| task type | " + " | ".join(name for name, _ in runs) + " |", "|---|" + "---|" * len(runs)]
        for task in TASK_TYPES:
            b = _task_rate(base, task, split)
            row = [percent(_task_rate(s, task, split)) + (_delta(_task_rate(s, task, split), b) if s is not base else "") for _, s in runs]
            lines.append(f"| {task} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def charts(runs: list[tuple[str, dict]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [n for n, _ in runs]
    width = 0.8 / len(runs)
    files = []

    def bars(ax, groups: list[str], values: list[list[float]], ylabel: str, percent: bool):
        x = np.arange(len(groups))
        for i, (name, vals) in enumerate(zip(names, values)):
            shown = [100 * v if percent else v for v in vals]
            drawn = ax.bar(x + (i - (len(runs) - 1) / 2) * width, shown, width, label=name)
            ax.bar_label(drawn, fmt="%.1f", fontsize=7, padding=1)
        ax.set_xticks(x, groups, rotation=20 if len(groups) > 3 else 0, ha="right" if len(groups) > 3 else "center")
        ax.set_ylabel(ylabel)
        if percent:
            ax.set_ylim(0, 110)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        ax.grid(axis="y", alpha=0.3)

    def chart(name: str, title: str, size, groups: list[str], values, ylabel: str, percent: bool) -> None:
        fig, ax = plt.subplots(figsize=size)
        bars(ax, groups, values, ylabel, percent)
        ax.set_title(title)
        fig.tight_layout()
        files.append(out / name)
        fig.savefig(files[-1], dpi=120)
        plt.close(fig)

    def split_values(key: str) -> list[list[float]]:
        blocks = lambda s: [s["splits"].get("valid_seen"), s["splits"].get("valid_unseen"), s["overall"]]  # noqa: E731
        return [[(b or {key: 0.0})[key] for b in blocks(s)] for _, s in runs]

    splits = ["valid_seen", "valid_unseen", "overall"]
    short = [t.replace("_then_place_in_recep", "").replace("_and_place", "").replace("pick_", "") for t in TASK_TYPES]
    chart("success_by_split.png", "Success by split", (7, 4), splits, split_values("success_rate"), "success rate (%)", True)
    chart("success_by_task.png", "Success by task type (all splits)", (10, 4.5), short,
          [[_task_rate(s, t, None) or 0.0 for t in TASK_TYPES] for _, s in runs], "success rate (%)", True)
    chart("invalid_actions.png", "Invalid actions", (7, 4), splits, split_values("mean_invalid_actions"), "invalid actions per episode", False)
    return files


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alfrl report", description="Compare alfrl eval results side by side.")
    parser.add_argument("results", nargs="*", help="alfrl eval output files (.jsonl; the first is the baseline), or a "
                        "run's .summary.json where its records are gone (compared unpaired); none with --train-log: its curves alone")
    parser.add_argument("--names", nargs="+", default=None, help="one name per results file (default: the files' stems)")
    parser.add_argument("--out", required=True, help="folder for report.md, summaries.json, the charts (and report.html)")
    parser.add_argument("--train-log", nargs="+", default=None, metavar="RUN_DIR_OR_CSV",
                        help="also plot the training curves of this run (its default_root_dir or metrics.csv files)")
    parser.add_argument("--start", default=None, metavar="RECORDS",
                        help="with --train-log: the starting adapter's alfrl eval records; the periodic evaluation's curves begin "
                        "at update 0 with its success on their games")
    parser.add_argument("--evals", nargs="+", default=[], metavar="EVAL_JSONL",
                        help="with --start: a periodic evaluation's records (a run's evals/update-N.jsonl) naming its games "
                        "(default: those in each --train-log run folder)")
    parser.add_argument("--html", action="store_true", help="also write report.html: every game and trajectory, filterable, self-contained")
    parser.add_argument("--html-games", type=int, default=None, metavar="N",
                        help="report.html shows N games that every run played, spread over the task types (default: every game)")
    parser.add_argument("--rollouts", nargs="+", default=[], metavar="STEP_JSONL",
                        help="training rollout files (data.save_rollouts) to show in report.html with their group rewards")
    return parser


def spread_games(runs: list[tuple[str, list[dict]]], n: int) -> set[str]:
    """``n`` game ids that every run played, taken in turn from each task type (each type's games in id order), so that
    a page of before/after trajectories shows every task type; every common game when there are fewer."""
    if n < 1:
        raise SystemExit(f"alfrl report: --html-games {n}: give a number of games >= 1")
    common = set.intersection(*({g["game_id"] for g in games} for _, games in runs))
    by_type: dict[str, list[str]] = {}
    for g in sorted(runs[0][1], key=lambda g: g["game_id"]):
        if g["game_id"] in common:
            by_type.setdefault(g.get("task_type") or "", []).append(g["game_id"])
    in_turn = (g for row in itertools.zip_longest(*(by_type[t] for t in sorted(by_type))) for g in row if g is not None)
    return set(itertools.islice(in_turn, n))


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if not args.results and not args.train_log:
        print("alfrl report: give alfrl eval output files to compare, or --train-log RUN_DIR for a run's curves (or both)", file=sys.stderr)
        return 2
    if not args.results and (args.html or args.rollouts):
        print("alfrl report: --html shows evaluated games: give alfrl eval output files too", file=sys.stderr)
        return 2
    try:
        loaded = load_runs(args.results, args.names) if args.results else []
    except EvalError as e:
        print(f"alfrl report: {e}", file=sys.stderr)
        return 2
    games_played = [(name, games) for name, _, games in loaded if games is not None]  # every game, for the HTML page
    loaded, cut = common_games(loaded) if loaded else ([], None)
    runs = [(name, summary) for name, summary, _ in loaded]
    warning = determinism_warning(runs)
    if warning:
        print(f"alfrl report: warning: {warning}", file=sys.stderr)
    if cut:
        print(f"alfrl report: {cut}", file=sys.stderr)
    text = markdown(runs, cut) + endings_markdown(loaded) + paired_markdown(loaded) + unpaired_markdown(loaded) if runs else ""
    records = log_records(args.train_log) if args.train_log else []
    train_rows = training_rows(records)
    text += training_markdown(train_rows) if train_rows else ""
    evals = eval_rows(records)
    if args.start:
        eval_files = args.evals or [str(p) for d in args.train_log or [] if Path(d).is_dir() for p in sorted(Path(d).glob("evals/update-*.jsonl"))]
        if not args.train_log or not eval_files:
            print("alfrl report: --start scores the starting adapter on the periodic evaluation's games: give --train-log RUN_DIR "
                  "(with its evals/ folder) or --evals RUN/evals/update-N.jsonl", file=sys.stderr)
            return 2
        try:
            evals = [start_row(args.start, eval_files), *[r for r in evals if r["update"] != 0]]
        except EvalError as e:
            print(f"alfrl report: {e}", file=sys.stderr)
            return 2
    text += eval_markdown(evals) if evals else ""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    files = []
    if runs:
        (out / "summaries.json").write_text(json.dumps({name: s for name, s in runs}, indent=2))
        files = charts(runs, out)
    if train_rows:
        files += training_outputs(train_rows, out)
    if evals:
        files += eval_outputs(evals, out)
    if args.html:
        from alfrl.html_report import build_page

        if args.html_games is not None:
            keep = spread_games(games_played, args.html_games)
            games_played = [(name, [g for g in games if g["game_id"] in keep]) for name, games in games_played]
        page = build_page(games_played, text, [f for f in files if f.suffix == ".png"],
                          [(Path(p).stem, Path(p)) for p in args.rollouts])
        (out / "report.html").write_text(page)
        files.append(out / "report.html")
    print(text)
    print("written: " + ", ".join(str(p) for p in [out / "report.md", *([out / "summaries.json"] if runs else []), *files]))
    return 0
