"""A fit's updates from its CSV log (Lightning's CSVLogger ``metrics.csv``), figures truncated (never rounded up).

    python bench/fit_table.py runs/x/csv/version_0/metrics.csv [more.csv ...]          # a markdown table, one row per update
    python bench/fit_table.py --line base.metrics.csv                                   # one line per fit (gpu_bisect's outcome)

step = ``rollout/seconds`` + ``train/update_seconds`` (what the step waited for after the rollout) + ``sync/total_seconds``
(``alfrl report``'s ``seconds_step``, read by its ``training_rows``), as the leases in bench/leases/ count it. A column
whose metric the fit did not log is left out (the table) or "-" (the line)."""

from __future__ import annotations

import argparse
import statistics
import sys
from decimal import ROUND_DOWN, Decimal

from alfrl.report import TRAIN_COLUMNS, training_rows

COLUMNS = (  # (metric, header, decimals)
    ("rollout/seconds", "rollout s", 2), ("train/update_seconds", "update after it s", 2),
    ("train/update_during_rollout_seconds", "during s", 2), ("sync/total_seconds", "sync s", 2), ("sync/seconds", "adapter s", 3),
    ("sync/gather_seconds", "gather s", 3), ("sync/write_seconds", "write s", 3), ("sync/load_seconds", "load s", 3),
    ("sync/swap_seconds", "swap s", 3), ("tokens/generated", "generated tokens", 0),
    ("rollout/completion_tokens_max", "longest trajectory", 0), ("rollout/last_group_started_seconds", "last group started s", 3),
    ("rollout/half_ended_seconds", "half ended s", 2), ("rollout/engine_step_ms", "engine step ms", 3),
    ("rollout/tail_steps", "tail steps", 0), ("rollout/tail_step_ms", "tail step ms", 3),
    ("rollout/tail_core_step_ms", "core step ms", 3), ("rollout/tail_output_lag_ms", "output lag ms", 3),
    ("rollout/valid_turn_tokens_max", "longest well-formed turn", 0),
)


def truncated(x: float, decimals: int) -> str:
    """``x`` cut (toward zero) to ``decimals`` places, with thousands separators: 26.9629 -> 26.962, 0.29 -> 0.29 (the
    shortest decimal that reads back as ``x`` is cut, not the binary value: 0.29 * 100 is 28.999...)."""
    cut = Decimal(repr(float(x))).quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_DOWN)
    return f"{cut:,.{decimals}f}"


def updates(path: str) -> list[dict]:
    """Each logged update's ``COLUMNS`` (None where not logged) and ``seconds_step``, read as ``alfrl report`` reads them."""
    rows = training_rows([path], {**TRAIN_COLUMNS, **{metric: metric for metric, _, _ in COLUMNS}})
    return [r for r in rows if r["seconds_step"] is not None]


def table(paths: list[str]) -> str:
    rows = [(p, i, m) for p in paths for i, m in enumerate(updates(p))]
    cols = [c for c in COLUMNS if any(m[c[0]] is not None for _, _, m in rows)]
    lines = ["| fit | update | step s | " + " | ".join(h for _, h, _ in cols) + " |", "|---" * (len(cols) + 3) + "|"]
    for p, i, m in rows:
        cells = [truncated(m[k], d) if m[k] is not None else "-" for k, _, d in cols]
        lines.append(f"| `{p.rsplit('/', 1)[-1].split('.')[0]}` | {i} | {truncated(m['seconds_step'], 3)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def line(path: str) -> str:
    ms = updates(path)
    if not ms:
        return "no update logged"

    def series(key: str, decimals: int) -> str:
        return "/".join(truncated(m[key], decimals) if m[key] is not None else "-" for m in ms)

    steps = [m["seconds_step"] for m in ms]
    return (f"steps s {'/'.join(truncated(s, 3) for s in steps)} (mean {truncated(statistics.mean(steps), 3)}); longest "
            f"{series('rollout/completion_tokens_max', 0)} tok; tail ms {series('rollout/tail_step_ms', 3)}; core ms "
            f"{series('rollout/tail_core_step_ms', 3)}; lag ms {series('rollout/tail_output_lag_ms', 3)}; sync s "
            f"{series('sync/total_seconds', 2)}; load s {series('sync/load_seconds', 3)}; groups started s "
            f"{series('rollout/last_group_started_seconds', 3)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", help="a fit's metrics.csv")
    parser.add_argument("--line", action="store_true", help="one line per fit instead of the table")
    args = parser.parse_args(argv)
    print("\n".join(line(p) for p in args.csv) if args.line else table(args.csv))


if __name__ == "__main__":
    sys.exit(main())
