"""``alfrl eval``: evaluate a base model or a trained adapter with the reference protocol."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

from alfrl.evaluation import EvalError, eval_games, format_summary, run_eval
from alfrl.games import EVAL_SPLITS, SPLITS


def _splits(value: str) -> tuple[str, ...]:
    if value == "all":
        return EVAL_SPLITS
    parts = tuple(v.strip() for v in value.split(",") if v.strip())
    for p in parts:
        if p not in SPLITS:
            raise argparse.ArgumentTypeError(f"unknown split {p!r}: use valid_seen, valid_unseen, all or a comma list of {', '.join(SPLITS)}")
    return parts


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def main(argv: list[str]) -> int:
    own = argparse.ArgumentParser(prog="alfrl eval", add_help=False)
    own.add_argument("--adapter", default=None, help="checkpoint folder, its adapter/ folder or trainer.ckpt (default: the base model)")
    own.add_argument("--split", type=_splits, default=None, help="valid_seen, valid_unseen or all (default: the recipe's data.eval.splits)")
    own.add_argument("--limit-per-split", type=int, default=None)
    own.add_argument("--out", required=True)
    own.add_argument("--overwrite", action="store_true")
    args, rest = own.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        own.print_help()
        print("\nand recipe options: alfrl eval --config RECIPE [--data.eval.temperature 0.01 ...]")
        return 0

    from alfrl.recipe import load_recipe

    cli = load_recipe(rest)
    dm, policy = cli.datamodule, cli.model
    cfg = dm.eval_cfg
    if args.split is not None:
        cfg = dataclasses.replace(cfg, splits=args.split)
    if args.limit_per_split is not None:
        cfg = dataclasses.replace(cfg, limit_per_split=args.limit_per_split)
    dm.eval_cfg = cfg
    games = eval_games(dm.data_dir, cfg.splits, cfg.limit_per_split)

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    adapter_file = None
    if dm.engine_cfg.kind == "hf" or args.adapter:
        policy.configure_model()
        policy.to(device)
    if args.adapter:
        try:
            adapter_file = policy.load_adapter(args.adapter)
        except (FileNotFoundError, ValueError) as e:
            print(f"alfrl eval: {e}", file=sys.stderr)
            return 2
    dm.connect(policy)
    if args.adapter and dm.engine.name != "hf":
        dm.engine.update_weights(policy.merged_weights())
    config = {
        "model_name": policy.hparams.model_name,
        "gguf_file": policy.hparams.gguf_file,
        "adapter": str(Path(args.adapter).resolve()) if args.adapter else None,
        "adapter_digest": _file_digest(adapter_file) if adapter_file else None,
        "engine": dm.engine_cfg.kind,
        "protocol": dataclasses.asdict(cfg),
        "rollout": dataclasses.asdict(cfg.rollout_config(dm.rollout)),
        "reward": dataclasses.asdict(dm.reward),
    }
    print(f"alfrl eval: {len(games)} games ({', '.join(cfg.splits)}), model {config['model_name']}, adapter {config['adapter'] or 'none'}", file=sys.stderr)
    try:
        summary = run_eval(
            dm.eval_runner(), games, cfg, args.out, config, overwrite=args.overwrite,
            on_chunk=lambda done, total: print(f"  {done}/{total} games", file=sys.stderr),
        )
    except EvalError as e:
        print(f"alfrl eval: {e}", file=sys.stderr)
        return 2
    finally:
        dm.close()
    print(format_summary(summary))
    summary_file = Path(args.out).with_suffix(".summary.json")
    summary_file.write_text(json.dumps(summary, indent=2))
    print(f"\nresults: {args.out}\nsummary: {summary_file}")
    return 0
