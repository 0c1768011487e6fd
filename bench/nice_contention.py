"""The trainer's CPU work while every environment worker resets a game, with the workers at this process's priority and
niced (``data.env.nice``): what a prefetched reset costs the work it overlaps on a machine with one worker per CPU.

    python bench/nice_contention.py [--nice 0 10] [--threads N ...] [--rounds 3] [--resets-per-worker 3] --out bench/out/nice_contention.json

In a fit the next step's resets (``data.env.prefetch_resets``) run while the update finishes and the weight sync loads
the adapter into vLLM's engine core (bench/leases/2026-12-04g.md: every push over 1 s came then). Here, per round and
per niceness (alternating, a fresh pool each, the same games), the pool's workers reset ``--resets-per-worker`` games
each while this process repeats two kinds of work until the resets end: ``tensors`` (a LoRA adapter of the 1.5B
model's shapes, rank 32 on every linear layer, 73.8 MB in bf16, read from a safetensors file and cast, as a loader
does) and ``python`` (a fixed pure-Python loop, as a scheduler's). ``tensors`` runs once per ``--threads`` value (torch's CPU
threads for it, ``torch.set_num_threads``; default torch's own, one per CPU, and 1): each of its ops waits for all of its threads,
so with every CPU taken by a worker the count matters (vLLM's engine core runs with torch's default unless
``data.engine.core_cpu_threads`` says otherwise). Each kind is timed alone first (``idle``: the workers started, nothing
submitted). The figures are this machine's CPU, not a GPU machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from alfrl.engines import cpu_threads_for_children
from alfrl.envs import EnvGroup, EnvPool
from alfrl.games import discover_games

# Qwen2.5-1.5B: hidden 1536, 2 KV heads of 128, MLP 8960, 28 layers; (in, out) of each adapted projection
SHAPES = {"q_proj": (1536, 1536), "k_proj": (1536, 256), "v_proj": (1536, 256), "o_proj": (1536, 1536),
          "gate_proj": (1536, 8960), "up_proj": (1536, 8960), "down_proj": (8960, 1536)}


def write_adapter(path: str, rank: int = 32, layers: int = 28) -> int:
    tensors = {}
    for layer in range(layers):
        for name, (fan_in, fan_out) in SHAPES.items():
            tensors[f"layers.{layer}.{name}.lora_A.weight"] = torch.randn(rank, fan_in, dtype=torch.bfloat16)
            tensors[f"layers.{layer}.{name}.lora_B.weight"] = torch.randn(fan_out, rank, dtype=torch.bfloat16)
    save_file(tensors, path)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def work_tensors(path: str, threads: int) -> None:
    """The adapter read and cast with torch at ``threads`` CPU threads: the setting alfrl starts vLLM's engine core with
    (``data.engine.core_cpu_threads``), set here the same way for this process and restored after."""
    with cpu_threads_for_children(threads):
        for t in load_file(path).values():
            t.float().to(torch.bfloat16).contiguous()


def work_python(n: int = 300_000) -> int:
    return sum(i % 7 for i in range(n))


def timed(kind) -> float:
    start = time.perf_counter()
    kind()
    return time.perf_counter() - start


def timed_until(kind, done: threading.Event) -> list[float]:
    """``kind`` timed again and again until ``done`` is set (at least once)."""
    out = [timed(kind)]
    while not done.is_set():
        out.append(timed(kind))
    return out


def one(games, workers: int, nice: int, per_worker: int, kinds: dict) -> dict:
    with EnvPool(num_workers=workers, nice=nice) as pool:
        EnvGroup.create(pool, games[0], workers).reset()  # every worker started (imports) before timing
        idle = {name: [timed(kind) for _ in range(3)] for name, kind in kinds.items()}  # nothing running
        row = {"nice": nice, "idle": idle, "busy": {}, "resets_seconds": {}}
        for name, kind in kinds.items():
            groups = [EnvGroup.create(pool, g, 1) for g in games[:workers * per_worker]]
            done = threading.Event()
            started = time.perf_counter()
            # the resets in a thread (the only one touching the pool meanwhile), this process's work in this one
            resets = threading.Thread(target=lambda: (pool.run([op for g in groups for op in g.reset_ops()]), done.set()), daemon=True)
            resets.start()
            row["busy"][name] = timed_until(kind, done)
            resets.join()
            row["resets_seconds"][name] = time.perf_counter() - started
            for g in groups:
                g.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nice", nargs="+", type=int, default=[0, 10])
    parser.add_argument("--threads", nargs="+", type=int, default=sorted({torch.get_num_threads(), 1}, reverse=True),
                        help="torch CPU threads for the tensors work, one kind each (default torch's own, then 1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--resets-per-worker", type=int, default=3)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--out", default="bench/out/nice_contention.json")
    args = parser.parse_args()
    if not all(0 <= n <= 19 for n in args.nice) or min(args.rounds, args.workers, args.resets_per_worker, *args.threads) < 1:
        parser.error(f"--nice {args.nice} (each 0-19), --threads {args.threads}, --rounds {args.rounds}, --workers {args.workers}, "
                     f"--resets-per-worker {args.resets_per_worker} (each >= 1)")
    games = sorted(discover_games(args.data_dir, ["valid_seen"]), key=lambda g: g.id)[: args.workers * args.resets_per_worker]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "adapter.safetensors")
        size = write_adapter(path)
        kinds = {f"tensors, {n} threads": (lambda n=n: work_tensors(path, n)) for n in args.threads}
        kinds["python"] = work_python
        rows = [one(games, args.workers, nice, args.resets_per_worker, kinds) for _ in range(args.rounds) for nice in args.nice]
    summary = {}
    for nice in args.nice:
        mine = [r for r in rows if r["nice"] == nice]
        for name in kinds:
            busy = [x for r in mine for x in r["busy"][name]]
            idle = [x for r in mine for x in r["idle"][name]]
            summary[f"nice {nice} {name}"] = {"idle_median_s": statistics.median(idle), "busy_median_s": statistics.median(busy),
                                             "busy_max_s": max(busy), "busy_runs": len(busy),
                                             "resets_seconds": [r["resets_seconds"][name] for r in mine]}
    report = {"machine": {"cpus": os.cpu_count(), "processor": platform.processor(), "torch_threads": torch.get_num_threads()},
              "workers": args.workers, "resets_per_worker": args.resets_per_worker, "adapter_bytes": size,
              "games": [g.id for g in games], "summary": summary, "rounds": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    for key, s in summary.items():
        print(f"{key}: idle {s['idle_median_s']:.3f} s, during resets median {s['busy_median_s']:.3f} s, max {s['busy_max_s']:.3f} s "
              f"({s['busy_runs']} runs); resets took {', '.join(f'{x:.2f}' for x in s['resets_seconds'])} s")


if __name__ == "__main__":
    main()
