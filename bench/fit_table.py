"""A fit's updates from its CSV log (Lightning's CSVLogger ``metrics.csv``), figures truncated (never rounded up).

    python bench/fit_table.py runs/x/csv/version_0/metrics.csv [more.csv ...]          # a markdown table, one row per update
    python bench/fit_table.py --line base.metrics.csv                                   # one line per fit
    python bench/fit_table.py base.metrics.csv --vllm-log base.log                      # its wall clock from vLLM's stamps

step = ``rollout/seconds`` + ``train/update_seconds`` (what the step waited for after the rollout) + ``sync/total_seconds``
(``alfrl report``'s ``seconds_step``, read by ``alfrl.curves.training_rows``), as the leases (tag raw-results-2026-12-06, bench/leases/) counted it. wall = the
step's wall clock (``step/seconds``, logged since 2026-12-04: Lightning's start of the batch to the end of its sync) and
other = wall - step, the time the three parts leave out (the engine's probe after the rollout, ``engine/probe_seconds``,
is part of it: probe s). A column whose metric the fit did not log is left out (the table)
or "-" (the line); the line names wall and other only for a fit that logged them."""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from decimal import ROUND_DOWN, Decimal

from alfrl.curves import TRAIN_COLUMNS, log_records, training_rows

COLUMNS = (  # (metric, header, decimals)
    ("rollout/seconds", "rollout s", 2), ("train/update_seconds", "update after it s", 2),
    ("train/update_during_rollout_seconds", "during s", 2), ("sync/total_seconds", "sync s", 2), ("sync/seconds", "adapter s", 3),
    ("sync/gather_seconds", "gather s", 3), ("sync/write_seconds", "write s", 3), ("sync/load_seconds", "load s", 3),
    ("sync/swap_seconds", "swap s", 3), ("engine/probe_seconds", "probe s", 3), ("tokens/generated", "generated tokens", 0),
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
    rows = training_rows(log_records([path]), {**TRAIN_COLUMNS, **{metric: metric for metric, _, _ in COLUMNS}})
    return [r for r in rows if r["seconds_step"] is not None]


def _cut(x: float | None, decimals: int) -> str:
    return truncated(x, decimals) if x is not None else "-"


def table(paths: list[str]) -> str:
    rows = [(p, i, m) for p in paths for i, m in enumerate(updates(p))]
    cols = [c for c in COLUMNS if any(m[c[0]] is not None for _, _, m in rows)]
    walls = any(m["seconds_wall"] is not None for _, _, m in rows)
    head = "| fit | update | step s | " + ("wall s | other s | " if walls else "")
    lines = [head + " | ".join(h for _, h, _ in cols) + " |", "|---" * (len(cols) + 3 + 2 * walls) + "|"]
    for p, i, m in rows:
        cells = [_cut(m[k], d) for k, _, d in cols]
        wall = f"{_cut(m['seconds_wall'], 3)} | {_cut(m['seconds_other'], 3)} | " if walls else ""
        lines.append(f"| `{p.rsplit('/', 1)[-1].split('.')[0]}` | {i} | {truncated(m['seconds_step'], 3)} | {wall}" + " | ".join(cells) + " |")
    return "\n".join(lines)


def line(path: str) -> str:
    ms = updates(path)
    if not ms:
        return "no update logged"

    def series(key: str, decimals: int) -> str:
        return "/".join(truncated(m[key], decimals) if m[key] is not None else "-" for m in ms)

    steps = [m["seconds_step"] for m in ms]
    walls = [m["seconds_wall"] for m in ms]
    wall = "" if all(w is None for w in walls) else (
        f"; wall s {series('seconds_wall', 3)}" + (f" (mean {truncated(statistics.mean(walls), 3)})" if None not in walls else "")
        + f"; other s {series('seconds_other', 3)}; probe s {series('engine/probe_seconds', 3)}")
    return (f"steps s {'/'.join(truncated(s, 3) for s in steps)} (mean {truncated(statistics.mean(steps), 3)}){wall}; longest "
            f"{series('rollout/completion_tokens_max', 0)} tok; tail ms {series('rollout/tail_step_ms', 3)}; core ms "
            f"{series('rollout/tail_core_step_ms', 3)}; lag ms {series('rollout/tail_output_lag_ms', 3)}; sync s "
            f"{series('sync/total_seconds', 2)}; load s {series('sync/load_seconds', 3)}; groups started s "
            f"{series('rollout/last_group_started_seconds', 3)}")


SWAP_STAMP = re.compile(r"INFO \d\d-\d\d (\d\d):(\d\d):(\d\d) \[block_pool\.py:\d+\] Successfully reset prefix cache")


def log_walls(log_path: str, csv_path: str) -> str:
    """The wall clock of a fit that did not log ``step/seconds``, from its log: vLLM's engine core stamps (to the second)
    the prefix-cache reset of each sync's swap (a core in its own process), the first at the sync before update 0. From
    the swap after update 0 to the last one: updates 1..n's wall clock, against the sum of their three parts (update 0,
    which compiles, left out). Each stamp is cut to its second, so the span is known to within 1 s either way."""
    stamps = []
    with open(log_path, errors="replace") as f:
        for text in f:
            m = SWAP_STAMP.search(text)
            if m:
                stamps.append(int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3]))
    ms = updates(csv_path)
    if len(stamps) != len(ms) + 1 or len(ms) < 2:
        return f"{len(stamps)} swap stamps for {len(ms)} updates: no wall clock from this log"
    span, n = (stamps[-1] - stamps[1]) % 86400, len(ms) - 1
    parts = sum(m["seconds_step"] for m in ms[1:])
    return (f"updates 1-{n}: wall {span} s (within 1 s), a mean of {truncated((span - 1) / n, 3)}-{truncated((span + 1) / n, 3)} s "
            f"a step (each to the second: {'/'.join(str((b - a) % 86400) for a, b in zip(stamps[1:], stamps[2:]))}); their three "
            f"parts {truncated(parts / n, 3)} s a step; other {truncated((span - 1 - parts) / n, 3)}-{truncated((span + 1 - parts) / n, 3)} s a step")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", help="a fit's metrics.csv")
    parser.add_argument("--line", action="store_true", help="one line per fit instead of the table")
    parser.add_argument("--vllm-log", nargs="+", default=None, metavar="LOG",
                        help="each fit's log (one per csv, same order): its wall clock from vLLM's stamps, for fits without step/seconds")
    args = parser.parse_args(argv)
    if args.vllm_log:
        if len(args.vllm_log) != len(args.csv):
            parser.error(f"--vllm-log got {len(args.vllm_log)} logs for {len(args.csv)} csv files: give one log per csv, same order")
        print("\n".join(log_walls(log, p) for log, p in zip(args.vllm_log, args.csv)))
        return
    print("\n".join(line(p) for p in args.csv) if args.line else table(args.csv))


if __name__ == "__main__":
    sys.exit(main())
