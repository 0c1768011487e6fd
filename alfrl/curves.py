"""A training run's curves from its CSV logs, for ``alfrl report --train-log RUN_DIR``.

``training_rows``: one row per update (rollout reward, success, invalid actions and loops, each part's seconds; later logs win
for a step logged twice, as after a resume), written as ``training.csv`` and ``training_curves.png`` with a table of
where the steps' time went. ``eval_rows``: the run's periodic evaluations (``callbacks/periodic_eval.py``), success
overall, per split and per task type against updates, written as ``eval_curves.csv`` and ``eval_curves.png``;
``start_row`` puts the starting adapter's records on the same games at update 0.
"""

from __future__ import annotations

from pathlib import Path

from alfrl.evaluation import EvalError, percent, read_results, summarize, task_type_wins
from alfrl.games import EVAL_SPLITS, TASK_TYPES

TRAIN_COLUMNS = {
    "reward": "rollout/reward_mean",
    "success": "rollout/success_rate",
    "invalid_actions": "rollout/invalid_actions_mean",
    "repeated_turns": "rollout/repeated_turns_mean",
    "trajectories": "rollout/trajectories",
    "dropped_groups": "rollout/dropped_groups",
    "seconds_rollout": "rollout/seconds",
    "seconds_update": "train/update_seconds",
    "seconds_sync": "sync/total_seconds",
    "seconds_wall": "step/seconds",
}
STEP_PARTS = ("seconds_rollout", "seconds_update", "seconds_sync")
"""A training step's three timed parts in the log: the rollout, the update and the weight sync; their sum is the row's ``seconds_step``. The step's wall clock,
``seconds_wall`` (``step/seconds``, logged since 2026-12-04), also holds what lies between them (the engine's probe after
the rollout, the samples, the memory guard, the logging): the row's ``seconds_other``, wall minus the parts."""


def _log_order(f: Path) -> tuple[int, float, str]:
    """CSVLogger's version_N folders in N order (a resume writes the next version)."""
    import re

    m = re.fullmatch(r"version_(\d+)", f.parent.name)
    return (int(m.group(1)) if m else -1, f.stat().st_mtime, str(f))


def _metric_files(sources: list[str]) -> list[Path]:
    """CSVLogger files under each source (``RUN_DIR/**/metrics.csv`` or the files themselves), oldest version first."""
    files: list[Path] = []
    for src in sources:
        p = Path(src)
        if p.is_dir():
            files += sorted(p.rglob("metrics.csv"), key=_log_order)
        elif p.is_file():
            files.append(p)
        else:
            raise SystemExit(f"alfrl report: --train-log {src} is neither a run folder nor a metrics.csv file")
    if not files:
        raise SystemExit(f"alfrl report: no metrics.csv under {', '.join(sources)}: give the run's trainer.default_root_dir "
                         "(its CSVLogger writes <dir>/csv/version_N/metrics.csv)")
    return files


def log_records(sources: list[str]) -> list[dict]:
    """Every row of the CSVLogger files under ``sources`` (``RUN_DIR/**/metrics.csv`` or the files themselves), oldest
    version first, so that a resumed run's rows come after (and replace) the ones it redid. A file may hold several
    processes' logs one after the other (``cat version_*/metrics.csv``): each header row starts its own columns."""
    import csv

    records: list[dict] = []
    for f in _metric_files(sources):
        with open(f, newline="") as fh:
            header: list[str] | None = None
            for cells in csv.reader(fh):
                if header is None or _is_header(cells):
                    header = cells
                elif cells:
                    records.append(dict(zip(header, cells)))
    return records


def _is_header(cells: list[str]) -> bool:
    """A CSVLogger header row: it names the ``step`` column and holds no number."""
    if "step" not in cells:
        return False
    for cell in cells:
        try:
            float(cell)
            return False
        except ValueError:
            pass
    return True


def training_rows(records: list[dict], columns: dict[str, str] = TRAIN_COLUMNS) -> list[dict]:
    """One row per update step from a run's log records (``log_records``): each of ``columns`` (name -> logged metric;
    None where not logged) and ``seconds_step``. ``columns`` must hold ``STEP_PARTS``."""
    by_step: dict[int, dict] = {}
    for rec in records:
        if not rec.get("step") or not rec.get(TRAIN_COLUMNS["reward"]):
            continue
        row = {"step": int(float(rec["step"]))}
        for name, col in columns.items():
            value = rec.get(col)
            row[name] = float(value) if value not in (None, "") else None
        parts = [row[k] for k in STEP_PARTS]
        row["seconds_step"] = None if None in parts else sum(parts)
        wall = row.get("seconds_wall")
        row["seconds_other"] = None if wall is None or row["seconds_step"] is None else wall - row["seconds_step"]
        by_step[row["step"]] = row
    return [by_step[k] for k in sorted(by_step)]


EVAL_PREFIX = "eval/"
"""The periodic evaluation's metrics (``callbacks/periodic_eval.py``): ``eval/success_rate``, ``eval/<split>/success_rate``
and ``eval/task/<task type>/success_rate``, logged every ``periodic_eval.every_n_steps`` updates on the same games."""


def eval_rows(records: list[dict]) -> list[dict]:
    """One row per periodic evaluation in a run's log records (``log_records``): ``update`` (the updates done before it)
    and every success rate it logged, by name without the prefix (``success_rate``, ``valid_seen``, ``task/<type>``); a
    resumed run's row wins for an update evaluated twice."""
    by_update: dict[int, dict] = {}
    for rec in records:
        if not rec.get("step") or rec.get(f"{EVAL_PREFIX}success_rate") in (None, ""):
            continue
        row: dict = {"update": int(float(rec["step"])) + 1}
        for col, value in rec.items():
            if col and col.startswith(EVAL_PREFIX) and col.endswith("success_rate") and value not in (None, ""):
                name = col[len(EVAL_PREFIX):].removesuffix("/success_rate") or "success_rate"
                row[name] = float(value)
        by_update[row["update"]] = row
    return [by_update[k] for k in sorted(by_update)]


def start_row(start: str, eval_files: list[str]) -> dict:
    """The periodic evaluation's row for update 0: the success of the starting adapter's `alfrl eval` records (``start``)
    on the games the periodic evaluations played (those of ``eval_files``: a run's ``evals/update-N.jsonl``), overall, per
    split and per task type. Its engine may differ from theirs (the training engine is not batch-invariant)."""
    games: set[str] = set()
    for f in eval_files:
        _header, played, _summary = read_results(f)
        games |= {g["game_id"] for g in played}
    _header, records, _summary = read_results(start)
    chosen = [g for g in records if g["game_id"] in games]
    missing = len(games) - len({g["game_id"] for g in chosen})
    if missing:
        raise EvalError(f"{start} lacks {missing} of the {len(games)} games of the periodic evaluation ({eval_files[0]}): "
                        "give the records of an evaluation of the starting adapter on every split (alfrl eval)")
    summary = summarize(chosen)
    row: dict = {"update": 0, "success_rate": summary["overall"]["success_rate"]}
    row.update({split: block["success_rate"] for split, block in summary["splits"].items() if split in EVAL_SPLITS})
    row.update({f"task/{task}": wins / n for task, (wins, n) in task_type_wins(summary).items() if n})
    return row


def _eval_columns(rows: list[dict]) -> list[str]:
    names = {k for r in rows for k in r if k != "update"}
    return ["success_rate", *[s for s in EVAL_SPLITS if s in names],
            *[f"task/{t}" for t in TASK_TYPES if f"task/{t}" in names]]


def eval_markdown(rows: list[dict]) -> str:
    """The periodic evaluations as a table: success overall, per split and per task type (all splits) at each one."""
    cols = _eval_columns(rows)
    head = ["update", *["all games" if c == "success_rate" else c.removeprefix("task/") for c in cols]]
    lines = [f"\n## Periodic evaluation ({len(rows)} evaluation{'s' * (len(rows) != 1)}, success, the same games each time)\n",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(["0 (start)" if r["update"] == 0 else str(r["update"]), *[percent(r.get(c)) for c in cols]]) + " |")
    return "\n".join(lines) + "\n"


def eval_outputs(rows: list[dict], out: Path) -> list[Path]:
    """``eval_curves.csv`` (the table) and ``eval_curves.png``: success per task type and overall against updates."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = _eval_columns(rows)
    table = out / "eval_curves.csv"
    with open(table, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["update", *cols], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    updates = [r["update"] for r in rows]
    for col in cols:
        if col in EVAL_SPLITS:
            continue
        overall = col == "success_rate"
        values = [None if r.get(col) is None else 100 * r[col] for r in rows]
        ax.plot(updates, values, marker="o", markersize=4 if overall else 3, linewidth=2.5 if overall else 1.2,
                color="black" if overall else None, label="all games" if overall else col.removeprefix("task/"))
    ax.set_ylim(-2, 102)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("update")
    ax.set_ylabel("success rate (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title("Periodic evaluation: success per task type")
    fig.tight_layout()
    png = out / "eval_curves.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return [table, png]


def training_markdown(rows: list[dict]) -> str:
    """Where the training steps' time went: mean, min, max and total seconds of each part over the updates that logged it
    (the total is the run's GPU time in that phase; the process's start, checkpoints and periodic evaluations are not in it)."""
    lines = [f"\n## Training steps ({len(rows)} updates, seconds)\n", "| part | mean | min | max | total | updates |",
             "|---|---|---|---|---|---|"]
    for key, label in (("seconds_wall", "step, wall clock"), ("seconds_step", "step, its three parts"), ("seconds_rollout", "rollout"),
                       ("seconds_update", "update after the rollout"), ("seconds_sync", "weight sync"),
                       ("seconds_other", "between the parts (wall clock - parts)")):
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            total = sum(values)
            lines.append(f"| {label} | {total / len(values):.2f} | {min(values):.2f} | {max(values):.2f} | {total:.2f} | {len(values)} |")
    walls = [r["seconds_wall"] for r in rows if r.get("seconds_wall") is not None]
    if walls:  # the figure to set beside other runs' GPU-hours (times the GPUs of the run)
        lines.append(f"\nIn all: {sum(walls):.2f} s of steps = {sum(walls) / 3600:.3f} h of wall clock over {len(walls)} updates "
                     "(each GPU of the run for that long; the processes' starts, checkpoints and periodic evaluations not in it).")
    return "\n".join(lines) + "\n" if len(lines) > 3 else ""


def training_outputs(rows: list[dict], out: Path) -> list[Path]:
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = out / "training.csv"
    with open(table, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["step", *TRAIN_COLUMNS, "seconds_step", "seconds_other"])
        writer.writeheader()
        writer.writerows(rows)
    steps = [r["step"] + 1 for r in rows]  # update number (1-based)
    panels = [("reward", "mean reward"), ("success", "success rate (%)"), ("invalid_actions", "invalid actions / trajectory")]
    if any(r["repeated_turns"] is not None for r in rows):  # logged since 2026-12-08
        panels.append(("repeated_turns", "loops (repeated turns) / trajectory"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.3 * len(panels), 3.6))
    for ax, (key, label) in zip(axes, panels):
        values = [None if r[key] is None else (100 * r[key] if key == "success" else r[key]) for r in rows]
        ax.plot(steps, values, marker="o", markersize=3)
        if key == "success":
            ax.set_ylim(-2, 102)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("update")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Training rollouts ({len(rows)} updates)")
    fig.tight_layout()
    png = out / "training_curves.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return [table, png]
