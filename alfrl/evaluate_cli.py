"""``alfrl eval``: evaluate a base model or trained adapters with the reference protocol.

Several adapters (``--adapter A B --out a.jsonl b.jsonl``) are evaluated one after the other by one engine: the model
loads, the engine starts (and compiles) once, and each adapter reaches it as a fit's weight sync does; each file is what
a separate ``alfrl eval`` of that adapter writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

from alfrl.evaluation import EvalError, eval_games, format_summary
from alfrl.games import EVAL_SPLITS, SPLITS


def _splits(value: str) -> tuple[str, ...]:
    if value == "all":
        return EVAL_SPLITS
    parts = tuple(v.strip() for v in value.split(",") if v.strip())
    for p in parts:
        if p not in SPLITS:
            raise argparse.ArgumentTypeError(f"unknown split {p!r}: use valid_seen, valid_unseen, all or a comma list of {', '.join(SPLITS)}")
    return parts


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: give a number of games >= 1 (leave the flag out for every game)")
    return n


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def _distributed() -> tuple[int, int]:
    """(rank, world size) under torchrun / SLURM launchers; initialises the process group once."""
    import os

    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def _merge(parts: list[Path], games: list, out: Path, config: dict) -> dict:
    """One result file from the ranks' files, games in the evaluation's order."""
    from alfrl.evaluation import read_results, results_header, summarize, write_results

    records = {}
    for part in parts:
        _, part_games, _ = read_results(part)
        records.update({r["game_id"]: r for r in part_games})
    ordered = [records[g.id] for g in games]
    summary = summarize(ordered, config.get("deterministic"))
    write_results(out, results_header(config, [g.id for g in games], ranks=len(parts)), ordered, summary)
    return summary


def parser() -> argparse.ArgumentParser:
    """``alfrl eval``'s own flags (the rest are recipe keys)."""
    own = argparse.ArgumentParser(prog="alfrl eval", add_help=False)
    own.add_argument("--adapter", nargs="+", default=None, metavar="ADAPTER",
                     help="checkpoint folder, its adapter/ folder or trainer.ckpt (default: the base model); several: each "
                          "evaluated in turn by one engine (one start), into the --out of the same place")
    own.add_argument("--split", type=_splits, default=None, help="valid_seen, valid_unseen or all (default: the recipe's data.eval.splits)")
    own.add_argument("--limit-per-split", type=_positive, default=None, help="evaluate N games of each split, spread over its task types (the same N every time)")
    own.add_argument("--out", nargs="+", required=True, metavar="OUT",
                     help="JSONL of every game (an unfinished file is resumed); one per --adapter")
    own.add_argument("--overwrite", action="store_true", help="start the file afresh when its evaluation settings differ")
    return own


def _problems(adapters: list[str], outs: list[str]) -> list[str]:
    """What is wrong with the adapters and outputs asked for, one line each, before the recipe is read or a model loads."""
    if len(outs) != max(len(adapters), 1):
        return [f"{len(outs)} --out files for {len(adapters) or 'no'} --adapter{'s' * (len(adapters) != 1)}: give one .jsonl per adapter "
                "(one without --adapter), in the same order"]
    out = []
    if len(set(map(str, map(Path, outs)))) != len(outs):
        out.append("--out names one file twice: give each adapter its own file")
    for o in outs:
        if o.endswith(".gz"):  # the output is appended to and resumed as plain lines
            out.append(f"--out {o}: alfrl eval writes plain JSONL (resumable): give a .jsonl name and gzip the file afterwards "
                       "(alfrl report reads .jsonl.gz)")
    for a in adapters:
        if not Path(a).exists():
            out.append(f"--adapter {a}: no such file or folder: give a checkpoint folder (runs/NAME/checkpoints/last), its adapter/ "
                       "folder or its trainer.ckpt")
    return out


def main(argv: list[str]) -> int:
    own = parser()
    if "-h" in argv or "--help" in argv:  # before --out is required
        own.print_help()
        print("\nand recipe options: alfrl eval --config RECIPE [--data.eval.temperature 0.01 ...]")
        return 0
    args, rest = own.parse_known_args(argv)
    adapters = args.adapter or []
    problems = _problems(adapters, args.out)
    if problems:
        for line in problems:
            print(f"alfrl eval: {line}", file=sys.stderr)
        return 2
    from alfrl.recipe import load_recipe

    if adapters:  # the adapter evaluated replaces whatever warm start the recipe names (a fit's init_adapter)
        rest = [*rest, "--model.init_adapter", "null"]
    cli = load_recipe(rest)
    dm, policy = cli.datamodule, cli.model
    cfg = dm.eval_cfg
    if args.split is not None:
        cfg = dataclasses.replace(cfg, splits=args.split)
    if args.limit_per_split is not None:
        cfg = dataclasses.replace(cfg, limit_per_split=args.limit_per_split)
    dm.eval_cfg = cfg
    games = eval_games(dm.data_dir, cfg.splits, cfg.limit_per_split)
    rank, world = _distributed()

    import torch

    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    from alfrl.checkpoints import check_adapter

    for adapter in adapters:  # a missing, damaged or mismatched adapter: one line before the model loads
        try:
            check_adapter(adapter, policy.lora.rank, policy.lora.alpha)
        except (FileNotFoundError, ValueError) as e:
            print(f"alfrl eval: --adapter {adapter}: {e}", file=sys.stderr)
            return 2
    if dm.engine_cfg.kind == "hf" or adapters:
        policy.configure_model()
        policy.to(device)
    sampler = None
    try:
        for adapter, out in zip(adapters or [None], args.out):
            adapter_file = None
            if adapter:
                try:
                    adapter_file = policy.load_adapter(adapter)
                except (FileNotFoundError, ValueError) as e:
                    print(f"alfrl eval: {e}", file=sys.stderr)
                    return 2
            if sampler is None:
                sampler = dm.connect(policy, deterministic=cfg.deterministic)
            if adapter and not sampler.engine.shares_policy:
                sampler.sync(policy)  # this adapter into the engine (unmerged by default), counted and probed; the last one out
            code = _evaluate(sampler, dm, policy, cfg, games, adapter, adapter_file, Path(out), rank, world, args.overwrite)
            if code:
                return code
    finally:
        dm.close()
    if len(args.out) > 1 and rank == 0:
        print(f"\ncompare them: alfrl report {' '.join(args.out)} --out reports/eval")
    return 0


def _evaluate(sampler, dm, policy, cfg, games: list, adapter: str | None, adapter_file: str | None, out: Path, rank: int,
              world: int, overwrite: bool) -> int:
    """The protocol on this rank's share of ``games`` with the adapter the engine serves now, into ``out`` (the ranks'
    files merged by rank 0), and its summary printed and written beside it."""
    part = out if world == 1 else out.with_name(f"{out.stem}.rank{rank}-of-{world}{out.suffix}")
    config = {
        "model_name": policy.hparams.model_name,
        "gguf_file": policy.hparams.gguf_file,
        "adapter": str(Path(adapter).resolve()) if adapter else None,
        "adapter_digest": _file_digest(adapter_file) if adapter_file else None,
        "engine": dm.engine_cfg.kind,
        "weight_sync": dm.engine_cfg.weight_sync if adapter else None,
        # how many games run together changes no result (every request's seed is its own): a rerun may change it; whether the
        # engine was batch-invariant is recorded as it ran (the Sampler adds "deterministic")
        "protocol": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("games_per_chunk", "max_live_games", "deterministic")},
        "rollout": {k: v for k, v in dataclasses.asdict(cfg.rollout_config(dm.rollout)).items() if k != "deterministic"},
        "reward": dataclasses.asdict(dm.reward),
        "deterministic": sampler.deterministic,
    }
    mine = games[rank::world]  # each rank plays a disjoint share; the merged file keeps the sorted order
    print(f"alfrl eval: {len(mine)} of {len(games)} games on rank {rank}/{world} ({', '.join(cfg.splits)}), "
          f"model {config['model_name']}, adapter {config['adapter'] or 'none'}, "
          f"{'deterministic' if sampler.deterministic else 'not deterministic (data.eval.deterministic: false)'}", file=sys.stderr)

    def progress(done: int, total: int) -> None:
        if done % 10 == 0 or done == total:
            print(f"  rank {rank}: {done}/{total} games", file=sys.stderr)

    try:
        summary = sampler.evaluate(mine, part, config, cfg, overwrite=overwrite, on_game=progress)
    except EvalError as e:
        print(f"alfrl eval: {e}", file=sys.stderr)
        return 2
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        if rank != 0:
            return 0
        summary = _merge([out.with_name(f"{out.stem}.rank{r}-of-{world}{out.suffix}") for r in range(world)], games, out, config)
    seconds = summary.pop("seconds", None)  # this process's evaluation time, not part of the results
    spent = summary.pop("time", None)
    print(format_summary(summary))
    summary_file = out.with_suffix(".summary.json")
    summary_file.write_text(json.dumps(summary, indent=2))
    print(f"\nresults: {out}\nsummary: {summary_file}" + (f"\nevaluation time: {seconds:.1f} s" if seconds is not None else ""))
    if spent and seconds:
        cached = spent.get("cached_prompt_tokens", 0) / max(spent.get("prompt_tokens", 0), 1)
        steps = spent.get("engine_steps", 0)
        print(f"  in engine steps {spent['engine_seconds']:.1f} s ({spent['engine_seconds'] / seconds:.0%}; {steps} steps, "
              f"{1000 * spent['engine_seconds'] / max(steps, 1):.1f} ms each), handing requests to the engine "
              f"{spent.get('submit_seconds', 0.0):.1f} s, waiting for environments "
              f"{spent['env_wait_seconds']:.1f} s; {spent['requests']} requests, {spent.get('generated_tokens', 0)} generated tokens, "
              f"{spent.get('prompt_tokens', 0)} prompt tokens ({cached:.1%} from the prefix cache)")
    return 0
