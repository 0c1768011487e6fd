"""The ``alfrl`` command.

    alfrl data prepare --data-dir DIR (--archive PATH | --download)
    alfrl data summary [--data-dir DIR] [--json]
    alfrl tiny-model DIR [--seed N]
    alfrl play GAME [--walkthrough] [--format tool_call|action_tag] [--model DIR]
    alfrl convert-gguf MODEL_DIR --gguf-file FILE --out DIR
    alfrl random-model --shape qwen3.5-4b|qwen3-4b|qwen3.5-small --out DIR     # random weights, the real structure
    alfrl fit --config RECIPE [--trainer.max_steps 1] [--model.optim.lr 2e-6] [--ckpt_path DIR] [--print_config]
    alfrl rollout --config RECIPE --games N --out FILE.jsonl [--data.rollout.temperature 0.7]
    alfrl expert --config RECIPE --out FILE.jsonl [--limit N] [--data.env.num_workers 8]   # expert plans through the protocol
    alfrl sft --config SFT_RECIPE [--trainer.max_steps 40] [--data.expert_file FILE]    # supervised warm start
    alfrl eval --config RECIPE [--adapter CKPT [CKPT ...]] [--split all] [--limit-per-split N] --out FILE.jsonl [FILE.jsonl ...] [--overwrite]
    alfrl report A.jsonl B.jsonl [--names a b] --out DIR

``fit`` is LightningCLI; ``rollout`` and ``eval`` read the same recipes (and overrides) through it.
"""

from __future__ import annotations

import argparse
import json
import sys

from alfrl.games import DataError


def _data_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alfrl data", description="Prepare and inspect the ALFWorld games.")
    sub = parser.add_subparsers(dest="action", required=True)
    prep = sub.add_parser("prepare", help="unpack an archive or download the games")
    prep.add_argument("--data-dir", default=None, help="target folder (default $ALFWORLD_DATA or ~/.cache/alfworld)")
    source = prep.add_mutually_exclusive_group(required=True)
    source.add_argument("--archive", help="path of json_2.1.1.tar.xz")
    source.add_argument("--download", action="store_true", help="run alfworld-download (needs internet)")
    summ = sub.add_parser("summary", help="games per split and task type")
    summ.add_argument("--data-dir", default=None, help="the games' folder (default $ALFWORLD_DATA or ~/.cache/alfworld)")
    summ.add_argument("--json", action="store_true", help="print the counts as JSON")
    return parser


def _data(argv: list[str]) -> int:
    from alfrl import games

    args = _data_parser().parse_args(argv)
    if args.action == "prepare":
        target = games.prepare_from_archive(args.data_dir, args.archive) if args.archive else games.prepare_by_download(args.data_dir)
        found = games.discover_games(args.data_dir, games.available_splits(args.data_dir))
        print(f"ALFWorld games ready in {target}: {len(found)} games")
        return 0
    splits = games.available_splits(args.data_dir)
    if not splits:
        raise DataError(f"no ALFWorld data in {games.resolve_data_dir(args.data_dir)}: " + games._how_to_prepare(games.resolve_data_dir(args.data_dir)))
    scan = games.scan_games(args.data_dir, splits)
    summary = games.summarize(scan.games)
    summary["unreadable"] = [{"path": path, "error": why} for path, why in scan.unreadable]
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    if scan.warning():
        print(f"warning: {scan.warning()}", file=sys.stderr)
    print(f"{summary['total']} games in {games.resolve_data_dir(args.data_dir)}")
    for split, n in summary["splits"].items():
        print(f"  {split:<13} {n:>5}")
        for task, m in summary["task_types"][split].items():
            print(f"    {task:<32} {m:>5}")
    return 0


def _tiny_model_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alfrl tiny-model", description="Write the tiny random-weight test model.")
    parser.add_argument("dir", help="folder to write (a Hugging Face model folder)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    return parser


def _tiny_model(argv: list[str]) -> int:
    from alfrl.tiny import write_tiny_model

    args = _tiny_model_parser().parse_args(argv)
    out = write_tiny_model(args.dir, args.seed)
    print(f"tiny model written to {out}")
    return 0


def _random_model(argv: list[str]) -> int:
    from alfrl.shapes import main

    return main(argv)


def _convert_gguf_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alfrl convert-gguf", description="Write a GGUF model as a Hugging Face folder.")
    parser.add_argument("model_dir", help="folder that holds the .gguf file")
    parser.add_argument("--gguf-file", required=True, help="the .gguf file's name inside MODEL_DIR")
    parser.add_argument("--out", required=True, help="folder to write (safetensors, config, tokenizer)")
    parser.add_argument("--dtype", default="bfloat16", help="the written weights' dtype (default bfloat16)")
    return parser


def _convert_gguf(argv: list[str]) -> int:
    from alfrl.models import convert_gguf

    args = _convert_gguf_parser().parse_args(argv)
    print(f"written {convert_gguf(args.model_dir, args.gguf_file, args.out, args.dtype)}")
    return 0


def _play_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alfrl play", description="Play one game through the model's exact prompts.")
    parser.add_argument("game", help="game id (split:task/trial), a unique part of it, or a path to its folder")
    parser.add_argument("--data-dir", default=None, help="the games' folder (default $ALFWORLD_DATA or ~/.cache/alfworld)")
    parser.add_argument("--walkthrough", action="store_true", help="replay the expert actions")
    parser.add_argument("--format", dest="action_format", default="tool_call", choices=["tool_call", "action_tag"],
                        help="the action protocol the prompts show (default tool_call)")
    parser.add_argument("--context", default="full", choices=["full", "window"], help="the prompt's history (default full)")
    parser.add_argument("--max-steps", type=int, default=50, help="environment steps before the game ends (default 50)")
    parser.add_argument("--model", default=None, help="tokenizer/template folder (default: the tiny model's tokenizer)")
    return parser


def _play(argv: list[str]) -> int:
    from alfrl.play import play

    args = _play_parser().parse_args(argv)
    traj = play(args.game, args.data_dir, args.walkthrough, args.action_format, args.context, args.max_steps, args.model)
    return 0 if traj is None or traj.stop_reason in ("won", "max_steps", "env_done") else 1


def _split_own_args(argv: list[str], own: argparse.ArgumentParser) -> tuple[argparse.Namespace, list[str]]:
    """This subcommand's own flags, and the recipe's (the rest); ``-h`` prints both kinds' usage and exits 0 before any
    required flag is asked for."""
    if "-h" in argv or "--help" in argv:
        own.print_help()
        print(f"\nand recipe options: {own.prog} --config RECIPE [--data.rollout.temperature 0.7 ...] "
              "(`alfrl fit --config RECIPE --help` lists every key)")
        raise SystemExit(0)
    return own.parse_known_args(argv)


def _rollout_parser() -> argparse.ArgumentParser:
    own = argparse.ArgumentParser(prog="alfrl rollout", add_help=False)
    own.add_argument("--games", type=int, default=4, help="games to play (the recipe's seeded shuffle), each group_size times")
    own.add_argument("--split", default=None, help="default: the recipe's train split")
    own.add_argument("--out", required=True, help="JSONL of the trajectories")
    return own


def _rollout(argv: list[str]) -> int:
    from alfrl.rollout import rollout_metrics
    from alfrl.types import write_jsonl
    from alfrl.recipe import load_recipe

    args, rest = _split_own_args(argv, _rollout_parser())
    cli = load_recipe(rest)
    dm, policy = cli.datamodule, cli.model
    from alfrl.games import discover_games, shuffled

    games = shuffled(discover_games(dm.data_dir, [args.split or dm.train_split]), dm.seed)[: args.games]
    sampler = dm.connect(policy)
    try:
        groups = sampler.rollout(games, dm.group_size, dm.seed).groups
    finally:
        dm.close()
    trajectories = [t for g in groups for t in g.trajectories]
    write_jsonl(args.out, trajectories)
    print(json.dumps(rollout_metrics(groups), indent=2))
    print(f"{len(trajectories)} trajectories written to {args.out}")
    return 0


def _expert_parser() -> argparse.ArgumentParser:
    own = argparse.ArgumentParser(prog="alfrl expert", add_help=False)
    own.add_argument("--out", required=True, help="JSONL of winning expert trajectories (appended; an existing file is resumed)")
    own.add_argument("--split", default="train", choices=["train", "valid_train"], help="training games only")
    own.add_argument("--limit", type=int, default=None, help="the first N games of the recipe's seeded shuffle (a mix of task types)")
    return own


def _expert(argv: list[str]) -> int:
    from tqdm import tqdm

    from alfrl.chat import chat_format
    from alfrl.expert import replay
    from alfrl.games import discover_games, shuffled
    from alfrl.recipe import load_recipe
    from alfrl.rollout import RolloutRunner

    args, rest = _split_own_args(argv, _expert_parser())
    if args.limit is not None and args.limit < 1:
        raise DataError(f"--limit {args.limit}: give a number of games >= 1 (leave it out for every game)")
    cli = load_recipe(rest)
    dm, policy = cli.datamodule, cli.model
    games = discover_games(dm.data_dir, [args.split])
    if args.limit is not None:
        games = sorted(shuffled(games, dm.seed)[: args.limit], key=lambda g: g.id)
    fmt = chat_format(policy.load_tokenizer(), dm.rollout.action_format, dm.rollout.enable_thinking)
    bar = tqdm(total=len(games), desc="expert games", unit="game")

    def progress(done: int, total: int, skipped: int) -> None:
        bar.n = done
        bar.set_postfix_str(f"skipped {skipped}")
        bar.refresh()

    with dm.env_cfg.make_pool() as pool:
        result = replay(lambda engine: RolloutRunner(engine, pool, fmt, dm.rollout, dm.reward), fmt, games,
                        dm.rollout.max_episode_steps, args.out, progress=progress)
    bar.close()
    print(f"{result['written']} winning expert trajectories in {args.out}; {result['skipped']} of {result['games']} games skipped "
          f"(their plan did not win within the recipe's limits: {args.out}.skipped.json)")
    return 0


def _sft(argv: list[str]) -> int:
    from alfrl.recipe import SFTCLI, main_fit

    return main_fit(argv, SFTCLI, "sft")


def _eval(argv: list[str]) -> int:
    from alfrl.evaluate_cli import main as eval_main

    return eval_main(argv)


def _report(argv: list[str]) -> int:
    from alfrl.report import main as report_main

    return report_main(argv)


def _eval_parser() -> argparse.ArgumentParser:
    from alfrl.evaluate_cli import parser

    return parser()


def _report_parser() -> argparse.ArgumentParser:
    from alfrl.report import parser

    return parser()


def _random_model_parser() -> argparse.ArgumentParser:
    from alfrl.shapes import parser

    return parser()


# each command's own flags (recipe keys, for rollout, expert and eval, go to `alfrl fit`'s parser); tests/test_cli.py
# checks every command line of README, docs/ and this module's docstring against them
PARSERS = {
    "data": _data_parser,
    "tiny-model": _tiny_model_parser,
    "convert-gguf": _convert_gguf_parser,
    "random-model": _random_model_parser,
    "play": _play_parser,
    "rollout": _rollout_parser,
    "expert": _expert_parser,
    "eval": _eval_parser,
    "report": _report_parser,
}

COMMANDS = {
    "data": _data,
    "tiny-model": _tiny_model,
    "convert-gguf": _convert_gguf,
    "random-model": _random_model,
    "play": _play,
    "rollout": _rollout,
    "expert": _expert,
    "sft": _sft,
    "eval": _eval,
    "report": _report,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "fit":
        from alfrl.recipe import main_fit

        return main_fit(rest)
    if command not in COMMANDS:
        print(f"alfrl: unknown command {command!r}\n{__doc__}", file=sys.stderr)
        return 2
    from alfrl.recipe import RecipeError, report_stop

    try:
        return COMMANDS[command](rest)
    except RecipeError as e:
        print(e, file=sys.stderr)
        return 2
    except DataError as e:
        print(f"alfrl {command}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # an engine or a weight sync stopped it: everything printed, its message last
        code = report_stop(e, command)
        if code is None:
            raise
        return code


if __name__ == "__main__":
    sys.exit(main())
