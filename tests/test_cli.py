"""The ``alfrl`` command: every subcommand's --help works, every recipe key has a line of help, and every command line
that README, docs/ and the command's own help show parses."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from alfrl import cli
from alfrl.recipe import SFTCLI, AlfrlCLI, RecipeError, main_fit, parse_recipe

ROOT = Path(__file__).resolve().parent.parent
RECIPE_SECTIONS = ("--model.", "--data.", "--checkpoint.", "--weight_sync.", "--periodic_eval.", "--progress_bar.")


def _help(capsys, *argv: str) -> str:
    try:
        code = cli.main(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr().out
    assert code in (0, None), f"alfrl {' '.join(argv)} exited {code}: {out[-500:]}"
    return out


@pytest.mark.parametrize("command", ["fit", *cli.COMMANDS])
def test_every_subcommand_has_help(command, capsys):
    out = _help(capsys, command, "--help")
    assert out.startswith(f"usage: alfrl {command}"), out[:200]
    if command in ("eval", "expert", "rollout"):  # their --help failed with "the following arguments are required: --out"
        assert "--out" in out and "recipe options" in out


def _options(help_text: str) -> dict[str, str]:
    """``--key`` -> its help text (argparse's layout: the option at two spaces, its text indented further)."""
    options: dict[str, str] = {}
    name = None
    for line in help_text.splitlines():
        m = re.match(r"^  (--[\w.\-]+)(?: (\S+))?(?:\s{2,}(.*))?$", line)
        if m:
            name = m.group(1)
            options[name] = (m.group(3) or "").strip()
        elif name and line.startswith("      "):
            options[name] += " " + line.strip()
        else:
            name = None
    return options


@pytest.mark.parametrize("command", ["fit", "sft"])
def test_every_recipe_key_has_a_line_of_help(command, capsys):
    options = _options(_help(capsys, command, "--help"))
    keys = {k: v for k, v in options.items() if k.startswith(RECIPE_SECTIONS)}
    assert len(keys) > (80 if command == "fit" else 30)
    bare = sorted(k for k, v in keys.items() if v.startswith("(") or not v)  # only "(type: ..., default: ...)"
    assert bare == [], f"recipe keys without a description: {bare}"


def test_enum_keys_list_their_choices(capsys):
    from alfrl import advantages, context, linear_attention, policy, protocol, rewards, rollout, sampler_config, sync
    from alfrl.loss import AGGREGATIONS
    from alfrl.ppo import OLD_LOGPROBS

    enums = {
        "--data.advantage.estimator": advantages.ESTIMATORS,
        "--data.advantage.norm": advantages.NORMS,
        "--data.advantage.std": advantages.STDS,
        "--data.advantage.episode_stats": advantages.EPISODE_STATS,
        "--data.rollout.action_format": protocol.ACTION_FORMATS,
        "--data.rollout.context": context.CONTEXT_MODES,
        "--data.rollout.schedule": rollout.SCHEDULES,
        "--data.reward.kind": rewards.REWARD_KINDS,
        "--data.engine.kind": sampler_config.ENGINE_KINDS,
        "--data.engine.cudagraph_mode": sampler_config.CUDAGRAPH_MODES,
        "--data.engine.weight_sync": sync.SYNC_MODES,
        "--model.dtype": policy.DTYPES,
        "--model.float32_matmul_precision": policy.MATMUL_PRECISIONS,
        "--model.adapter_dtype": policy.ADAPTER_DTYPES,
        "--model.linear_attention_kernel": linear_attention.KERNELS,
        "--model.ppo.loss_aggregation": AGGREGATIONS,
        "--model.ppo.old_logprobs": OLD_LOGPROBS,
    }
    options = _options(_help(capsys, "fit", "--help"))
    missing = {key: [c for c in choices if c not in options[key]] for key, choices in enums.items()}
    assert {k: v for k, v in missing.items() if v} == {}


# the placeholders of the documented command lines, as a user would fill them in
PLACEHOLDERS = {
    "RECIPE": "recipes/tiny.yaml", "SFT_RECIPE": "recipes/sft_tiny.yaml", "DIR": "runs/x", "MODEL_DIR": "runs/x",
    "N": "2", "FILE": "runs/x.jsonl", "FILE.jsonl": "runs/x.jsonl", "CKPT": "runs/x/checkpoints/last", "PATH": "x.tar.xz",
    "GAME": "valid_seen:look_at_obj", "A.jsonl": "a.jsonl", "B.jsonl": "b.jsonl",
}


def _normalise(line: str) -> list[str]:
    """A documented command line as the words a user would type: comments cut, [optional] flags kept, the first of
    ``a|b`` choices and ``(x | y)`` groups taken, placeholders filled in."""
    line = line.split("  #")[0].strip()
    line = re.sub(r"\(([^|()]+)\|[^()]*\)", r"\1", line)  # (--archive PATH | --download) -> --archive PATH
    line = line.replace("[", " ").replace("]", " ").replace("...", " ")
    words = []
    for word in shlex.split(line):
        word = word.split("|")[0] if "|" in word and not word.startswith("-") else word
        words.append(PLACEHOLDERS.get(word, word))
    return words


def _documented_lines() -> list[tuple[str, str]]:
    """(where, line) of every ``alfrl`` and ``make train|eval`` command line in README, docs/ and ``alfrl --help``."""
    found = [("alfrl --help", line.strip()) for line in (cli.__doc__ or "").splitlines() if line.strip().startswith("alfrl ")]
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for line in path.read_text().splitlines():
            text = line.strip().removeprefix(".venv/bin/")
            if re.match(r"^(alfrl [a-z]|make (train|eval)\b)", text):
                found.append((path.name, text))
    return found


def _make_commands(words: list[str]) -> list[list[str]]:
    """The alfrl command lines ``make`` would run (``make -n``: nothing runs)."""
    out = subprocess.run(["make", "-n", "-B", *words[1:]], cwd=ROOT, capture_output=True, text=True, check=True).stdout.replace("\\\n", " ")
    return [shlex.split(line)[1:] for line in out.splitlines() if re.match(r"^\S*bin/alfrl (fit|eval) ", line)]


def _check_parses(argv: list[str], capsys) -> None:
    command, args = argv[0], argv[1:]
    if command in ("fit", "sft"):
        try:
            code = main_fit([a for a in args if a != "--print_config"] + ["--print_config"], SFTCLI if command == "sft" else AlfrlCLI, command)
        except SystemExit as e:
            code = e.code
        assert code in (0, None), capsys.readouterr().err[-500:]
        capsys.readouterr()
        return
    parser = cli.PARSERS[command]()
    if command in ("rollout", "expert", "eval"):
        _, rest = parser.parse_known_args(args)
        try:
            parse_recipe(rest)
        except RecipeError as e:
            raise AssertionError(f"recipe part of {argv}: {e}") from None
    else:
        parser.parse_args(args)


DOCUMENTED = _documented_lines()


def test_the_documented_lines_were_found():
    places = {where for where, _ in DOCUMENTED}
    assert {"alfrl --help", "README.md"} <= places and len(DOCUMENTED) >= 20


@pytest.mark.parametrize("where,line", DOCUMENTED, ids=[f"{w}:{i}" for i, (w, _) in enumerate(DOCUMENTED)])
def test_every_documented_command_line_parses(where, line, capsys, monkeypatch):
    monkeypatch.setenv("SWANLAB_API_KEY", "a-saved-login")
    words = _normalise(line)
    runs = _make_commands(words) if words[0] == "make" else [words[1:]]
    assert runs, f"{where}: `{line}` names no alfrl command"
    for argv in runs:
        _check_parses(argv, capsys)


def test_a_wrong_key_in_a_command_line_is_caught(capsys):
    with pytest.raises(AssertionError):
        _check_parses(["fit", "--config", "recipes/tiny.yaml", "--model.lr", "2e-6"], capsys)
    with pytest.raises(AssertionError):
        _check_parses(["eval", "--config", "recipes/tiny.yaml", "--out", "x.jsonl", "--data.eval.temprature", "0.1"], capsys)
    with pytest.raises(SystemExit):
        _check_parses(["report", "a.jsonl"], capsys)  # --out is required
