"""alfrl eval (alfrl.evaluation, alfrl.evaluate_cli): exact summaries, resumable output, the walkthrough wins, the tiny model end
to end (make eval, then alfrl report on its records), adapters checked before a model loads, several adapters on one engine.
Reports: test_report.py."""

import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from alfrl.chat import chat_format
from alfrl.envs import EnvPool
from alfrl.evaluation import EvalConfig, EvalError, eval_games, read_results, run_eval, summarize
from alfrl.rewards import RewardConfig
from alfrl.rollout import RolloutConfig, RolloutRunner
from tests.conftest import one_game_per_task
from tests.helpers import EMPTY_SAFETENSORS, HAND_MADE, WalkthroughEngine, alfrl_here

REPO = Path(__file__).resolve().parent.parent


def test_summary_of_a_hand_made_file_is_exact(tmp_path):
    path = tmp_path / "hand.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in HAND_MADE))
    _, games, s = read_results(path)
    assert len(games) == 4
    seen, unseen, overall = s["splits"]["valid_seen"], s["splits"]["valid_unseen"], s["overall"]
    assert (seen["games"], seen["wins"]) == (3, 2) and seen["success_rate"] == 2 / 3
    assert seen["mean_reward"] == pytest.approx((1.0 - 0.2 + 0.9) / 3) and seen["mean_steps"] == 3.0 and seen["mean_invalid_actions"] == 1.0
    assert seen["valid_format_rate"] == 8 / 9 and seen["admissible_rate"] == 6 / 9
    assert (unseen["games"], unseen["wins"], unseen["success_rate"], unseen["valid_format_rate"]) == (1, 0, 0.0, 0.0)
    # overall is game-weighted: 2 wins of 4 games, not the mean of the split rates
    assert overall["success_rate"] == 0.5 and overall["mean_steps"] == 2.5 and overall["admissible_rate"] == 6 / 10
    assert s["task_types"]["valid_seen"]["pick_and_place_simple"] == {"games": 2, "wins": 1, "success_rate": 0.5}
    assert s["task_types"]["valid_seen"]["look_at_obj_in_light"]["success_rate"] == 1.0
    assert s["task_types"]["valid_unseen"]["look_at_obj_in_light"] == {"games": 1, "wins": 0, "success_rate": 0.0}


def test_the_walkthrough_policy_wins_every_game_of_a_sample(valid_games, tiny_tokenizer, tmp_path):
    sample = one_game_per_task(valid_games, "valid_seen") + one_game_per_task(valid_games, "valid_unseen")
    fmt = chat_format(tiny_tokenizer, "tool_call")
    cfg = EvalConfig(games_per_chunk=1)
    with EnvPool(num_workers=2) as pool:
        runner = RolloutRunner(WalkthroughEngine(fmt, sample), pool, fmt, cfg.rollout_config(RolloutConfig()), RewardConfig())
        summary = run_eval(runner, sample, cfg, tmp_path / "walk.jsonl", {"policy": "walkthrough"})
    assert summary["overall"]["games"] == 12 and summary["overall"]["success_rate"] == 1.0
    assert summary["overall"]["valid_format_rate"] == 1.0 and summary["overall"]["admissible_rate"] == 1.0
    for split in ("valid_seen", "valid_unseen"):
        assert len(summary["task_types"][split]) == 6
        assert all(v["success_rate"] == 1.0 for v in summary["task_types"][split].values())


@pytest.fixture(scope="module")
def tiny_runner(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alfrl.engines import HFEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    fmt = chat_format(tok, "tool_call")
    cfg = EvalConfig(max_episode_steps=4, max_trajectory_tokens=5000, max_assistant_tokens=40, games_per_chunk=2, temperature=1.0)
    with EnvPool(num_workers=2) as pool:
        yield RolloutRunner(HFEngine(model, tok.pad_token_id), pool, fmt, cfg.rollout_config(RolloutConfig()), RewardConfig()), cfg


def test_an_interrupted_eval_keeps_every_finished_game_and_resumes_to_the_same_summary(valid_games, tiny_runner, tmp_path):
    runner, cfg = tiny_runner
    games = valid_games[:2] + valid_games[-2:]
    config = {"model": "tiny"}
    on_disk = []  # each game's record is on disk when on_game is called
    whole = run_eval(runner, games, cfg, tmp_path / "whole.jsonl", config,
                     on_game=lambda done, total: on_disk.append((done, total, len(read_results(tmp_path / "whole.jsonl")[1]))))
    assert on_disk == [(1, 4, 1), (2, 4, 2), (3, 4, 3), (4, 4, 4)]
    spent = {}
    run_eval(runner, games, cfg, tmp_path / "timed.jsonl", config, spent=spent)
    assert spent["requests"] >= 4 and spent["engine_seconds"] > 0 and spent["env_wait_seconds"] >= 0  # where the time went
    assert spent["engine_steps"] >= 1 and spent["submit_seconds"] > 0
    header, records, _ = read_results(tmp_path / "whole.jsonl")
    assert [r["game_id"] for r in records] == [g.id for g in games]  # rewritten in the games' order at the end
    # an evaluation cut after its first finished game (as the end of a machine loan would cut it)
    lines = (tmp_path / "whole.jsonl").read_text().splitlines()
    first = next(line for line in lines[1:] if json.loads(line)["game_id"] == games[2].id)
    (tmp_path / "parts.jsonl").write_text(lines[0] + "\n" + first + "\n" + first[: len(first) // 2])  # and a torn line
    played = []
    resumed = run_eval(runner, games, cfg, tmp_path / "parts.jsonl", config, on_game=lambda d, t: played.append(d))
    assert played == [2, 3, 4]  # only the three other games were played
    assert resumed == whole
    # a finished file re-run plays nothing and gives the same summary
    assert run_eval(runner, games, cfg, tmp_path / "parts.jsonl", config, on_game=lambda d, t: played.append(d)) == whole
    assert played == [2, 3, 4]
    # a different configuration is refused unless --overwrite
    changed = {**config, "model": "other"} if isinstance(config, dict) else {"model": "other"}
    with pytest.raises(EvalError, match="--overwrite") as refused:
        run_eval(runner, games, cfg, tmp_path / "parts.jsonl", changed)
    assert "model: " in str(refused.value) and "-> 'other'" in str(refused.value) and len(str(refused.value)) < 400  # the key, not the dict
    assert run_eval(runner, games[:2], cfg, tmp_path / "parts.jsonl", {"model": "other"}, overwrite=True)["overall"]["games"] == 2


def test_the_cpu_engine_plays_the_same_records_twice_and_the_files_say_it_was_deterministic(valid_games, tiny_runner, tmp_path):
    """data.eval.deterministic: the hf engine generates each request on its own under the request's seed, so two runs of the
    same games at temperature 1 (every turn sampled) write the same records, token counts included, whatever the
    environments' timing; the header and the summary record that the engine was batch-invariant."""
    runner, cfg = tiny_runner
    games = [valid_games[0], valid_games[-1], valid_games[1]]
    config = {"model": "tiny", "deterministic": runner.engine.batch_invariant}
    first = run_eval(runner, games, cfg, tmp_path / "a.jsonl", config)
    second = run_eval(runner, games, cfg, tmp_path / "b.jsonl", config)
    (ha, ga, sa), (_, gb, sb) = read_results(tmp_path / "a.jsonl"), read_results(tmp_path / "b.jsonl")
    assert ga == gb and first == second == sa == sb
    assert sum(t["completion_tokens"] for r in ga for t in r["turns"]) > 0 and all("prompt_tokens" in t for r in ga for t in r["turns"])
    assert ha["config"]["deterministic"] is True and sa["deterministic"] is True
    assert summarize(ga)["deterministic"] is None  # a summary made without the header does not claim it


def test_a_limited_evaluation_covers_every_task_type_of_each_split_with_the_same_games_every_time(data_dir):
    games = eval_games(data_dir, ("valid_seen", "valid_unseen"), 6)
    assert [g.split for g in games] == ["valid_seen"] * 6 + ["valid_unseen"] * 6
    for split in ("valid_seen", "valid_unseen"):
        mine = [g for g in games if g.split == split]
        assert len({g.task_type for g in mine}) == 6  # one of each of the six task types
        assert [g.id for g in mine] == sorted(g.id for g in mine)
        everything = [g for g in eval_games(data_dir, (split,), None) if g.task_type in {m.task_type for m in mine}]
        first_of_type = {}
        for g in everything:
            first_of_type.setdefault(g.task_type, g.id)
        assert {g.id for g in mine} == set(first_of_type.values())  # each type's first game in sorted order
    assert [g.id for g in eval_games(data_dir, ("valid_seen",), 20)] == [g.id for g in eval_games(data_dir, ("valid_seen",), 20)]
    twenty = eval_games(data_dir, ("valid_seen",), 20)
    counts = Counter(g.task_type for g in twenty)
    assert max(counts.values()) - min(counts.values()) <= 1, counts  # the first 20 sorted would be 13 of one type
    assert len(eval_games(data_dir, ("valid_seen", "valid_unseen"), None)) == 274
    assert len(eval_games(data_dir, ("valid_seen",), 1000)) == 140


def test_make_eval_runs_the_tiny_model_and_report_compares_runs(tmp_path, data_dir, tiny_model_dir, capfd, monkeypatch):
    env = dict(os.environ, ALFWORLD_DATA=data_dir)
    outputs = []
    for name, extra in (("base", ""), ("greedy", "--data.eval.temperature 0")):
        out = tmp_path / f"{name}.jsonl"
        args = f"--model.model_name {tiny_model_dir} {extra}"
        if name == "base":  # the documented command, a process of its own
            proc = subprocess.run(["make", "eval", "RECIPE=recipes/tiny.yaml", "LIMIT=2", f"OUT={out}", f"ARGS={args}", f"DATA_DIR={data_dir}",
                                   f"TINY_MODEL={tiny_model_dir}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        else:  # what it runs, in this process (a process start costs ~9 s of imports)
            monkeypatch.setenv("ALFWORLD_DATA", data_dir)
            proc = alfrl_here(capfd, "eval", "--config", "recipes/tiny.yaml", "--limit-per-split", "2", "--out", str(out), *args.split())
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "success per task type" in proc.stdout and "in engine steps" in proc.stdout and " ms each)" in proc.stdout  # where the time went
        header, games, summary = read_results(out)
        assert header["config"]["model_name"] == tiny_model_dir and len(games) == 4
        assert header["config"]["deterministic"] is True and summary["deterministic"] is True  # data.eval.deterministic, as played
        assert "deterministic" in proc.stderr
        assert json.loads(out.with_suffix(".summary.json").read_text()) == summary
        assert json.loads(out.read_text().splitlines()[-1])["type"] == "summary"
        outputs.append(str(out))
    report = tmp_path / "report"
    proc = subprocess.run(["alfrl" if False else str(REPO / ".venv/bin/alfrl") if (REPO / ".venv/bin/alfrl").exists() else "alfrl",
                           "report", *outputs, "--names", "base", "greedy", "--out", str(report)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    table = (report / "report.md").read_text()
    assert "| base |" in table and "| greedy |" in table and "pick_and_place_simple" in table
    assert table.count("% | yes |") == 2 and "Warning" not in table and "warning" not in proc.stderr  # both deterministic
    for png in ("success_by_split.png", "success_by_task.png", "invalid_actions.png"):
        data = (report / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_an_adapter_given_to_eval_replaces_the_warm_start_the_recipe_names(monkeypatch, tmp_path):
    """`alfrl eval --config recipes/rl_qwen15b_from_sft.yaml --adapter RUN/checkpoints/last` on a machine without the
    recipe's warm start (runs/sft_qwen15b/...) stopped with a recipe error (H100, 2026-12-06): the evaluated adapter is
    the model's whole adapter, so the recipe's init_adapter is dropped before the recipe is checked."""
    from alfrl import evaluate_cli, recipe

    seen = []

    def stop(argv):
        seen.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(recipe, "load_recipe", stop)
    for argv in (["--config", "recipes/rl_qwen15b_from_sft.yaml", "--adapter", str(tmp_path), "--out", "x.jsonl"],
                 ["--config", "recipes/rl_qwen15b_from_sft.yaml", "--out", "x.jsonl"]):
        with pytest.raises(SystemExit):
            evaluate_cli.main(argv)
    assert seen[0][-2:] == ["--model.init_adapter", "null"] and "--model.init_adapter" not in seen[1]


def test_an_evaluation_file_whose_tail_is_not_utf8_keeps_every_whole_game(tmp_path):
    """A file cut inside a multi-byte character (or with garbage after it) stopped the rerun with a UnicodeDecodeError
    traceback and recovered nothing; the whole records before the torn tail are kept, as for a cut line."""
    header = {"type": "header", "config": {"model": "x"}}
    lines = [json.dumps(header)] + [json.dumps(r) for r in HAND_MADE[:2]]
    path = tmp_path / "torn.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + '{"type": "game", "task": "caf\u00e9'.encode()[:-1] + b"\xff\xfe\n")
    got_header, games, summary = read_results(path)
    assert got_header == header and [g["game_id"] for g in games] == ["valid_seen:a", "valid_seen:b"]
    assert summary["overall"]["games"] == 2


def test_a_missing_adapter_is_one_line_before_any_model_loads(capfd):
    from alfrl.cli import main

    assert main(["eval", "--config", "recipes/tiny.yaml", "--out", "x.jsonl.gz"]) == 2  # appended plain lines under a .gz name
    assert capfd.readouterr().err.strip().splitlines() == [
        "alfrl eval: --out x.jsonl.gz: alfrl eval writes plain JSONL (resumable): give a .jsonl name and gzip the file "
        "afterwards (alfrl report reads .jsonl.gz)"]

    assert main(["eval", "--config", "recipes/tiny.yaml", "--adapter", "/no/such/path", "--out", "x.jsonl"]) == 2
    err = capfd.readouterr().err
    assert err.strip().splitlines() == ["alfrl eval: --adapter /no/such/path: no such file or folder: give a checkpoint folder "
                                        "(runs/NAME/checkpoints/last), its adapter/ folder or its trainer.ckpt"]


def test_adapters_and_outputs_that_do_not_pair_are_one_line_each_before_any_model_loads(capfd, tmp_path):
    from alfrl.cli import main

    (tmp_path / "a").mkdir()
    for argv, said in [(["--adapter", str(tmp_path / "a"), str(tmp_path / "a"), "--out", "x.jsonl"],
                        ["alfrl eval: 1 --out files for 2 --adapters: give one .jsonl per adapter (one without --adapter), in the same order"]),
                       (["--out", "x.jsonl", "y.jsonl"],
                        ["alfrl eval: 2 --out files for no --adapters: give one .jsonl per adapter (one without --adapter), in the same order"]),
                       (["--adapter", str(tmp_path / "a"), "/no/b", "--out", "x.jsonl", "./x.jsonl"],
                        ["alfrl eval: --out names one file twice: give each adapter its own file",
                         "alfrl eval: --adapter /no/b: no such file or folder: give a checkpoint folder (runs/NAME/checkpoints/last), "
                         "its adapter/ folder or its trainer.ckpt"])]:
        assert main(["eval", "--config", "recipes/tiny.yaml", *argv]) == 2
        assert capfd.readouterr().err.strip().splitlines() == said


def test_make_eval_of_several_checkpoints_gives_each_its_own_file():
    proc = subprocess.run(["make", "-n", "eval", "CKPT=runs/x/checkpoints/step-000010 runs/x/checkpoints/last"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    line = " ".join(proc.stdout.replace("\\\n", " ").split())
    assert proc.returncode == 0 and ("--adapter runs/x/checkpoints/step-000010 runs/x/checkpoints/last" in line), proc.stdout + proc.stderr
    assert "--out runs/eval/eval-runs_x_checkpoints_step-000010.jsonl runs/eval/eval-runs_x_checkpoints_last.jsonl" in line


def test_several_adapters_are_evaluated_by_one_engine_each_as_if_alone(tmp_path, data_dir, tiny_model_dir, policy, capfd, monkeypatch):
    """`alfrl eval --adapter A B --out a.jsonl b.jsonl`: one model load and one engine, each file what an evaluation of its
    adapter alone writes (B's games played identically), its header naming its own adapter."""
    import torch

    from alfrl.checkpoints import save_adapter
    from alfrl.report import identical_games

    save_adapter(policy.model, tmp_path / "a" / "adapter")
    torch.manual_seed(1)
    for name, param in policy.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.5)  # far from A: the two play differently
    save_adapter(policy.model, tmp_path / "b" / "adapter")
    monkeypatch.setenv("ALFWORLD_DATA", data_dir)
    common = ["eval", "--config", "recipes/tiny.yaml", "--model.model_name", tiny_model_dir, "--limit-per-split", "1"]
    outs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "b_alone.jsonl"]
    proc = alfrl_here(capfd, *common, "--adapter", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(outs[0]), str(outs[1]))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"compare them: alfrl report {outs[0]} {outs[1]} --out reports/eval" in proc.stdout
    proc = alfrl_here(capfd, *common, "--adapter", str(tmp_path / "b"), "--out", str(outs[2]))
    assert proc.returncode == 0, proc.stderr[-2000:]
    (ha, ga, sa), (hb, gb, sb), (hc, gc, sc) = (read_results(o) for o in outs)
    assert [h["config"]["adapter"] for h in (ha, hb, hc)] == [str((tmp_path / n).resolve()) for n in ("a", "b", "b")]
    assert ha["config"]["adapter_digest"] != hb["config"]["adapter_digest"] == hc["config"]["adapter_digest"]
    assert identical_games(gc, gb) == {"games": 2, "identical": 2, "first_difference": {g["game_id"]: None for g in gc}, "outcome_changed": 0}
    assert sb == sc and identical_games(ga, gb)["identical"] < 2  # B alone = B after A; A played otherwise
    assert all(o.with_suffix(".summary.json").is_file() for o in outs)


@pytest.mark.parametrize("problem,shown", [("rank", "has r=4 but model.lora.rank=8"), ("truncated", "is damaged: its header is cut short")])
def test_an_adapter_of_other_lora_settings_or_damaged_is_one_line_before_any_model_loads(capsys, tmp_path, tiny_model_dir, problem, shown):
    """Issue "Nothing lost, nothing injected": the rank mismatch loaded the model before its error; a truncated adapter was
    a SafetensorError traceback."""
    from alfrl.cli import main

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4 if problem == "rank" else 8, "lora_alpha": 16}))
    (adapter / "adapter_model.safetensors").write_bytes(EMPTY_SAFETENSORS[: 3 if problem == "truncated" else None])
    code = main(["eval", "--config", "recipes/tiny.yaml", "--model.model_name", tiny_model_dir, "--adapter", str(adapter),
                 "--out", str(tmp_path / "x.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and shown in err and len([x for x in err.splitlines() if "alfrl eval:" in x]) == 1, err[-2000:]
    # in this process an exception would have failed the test before here: no traceback to look for
    assert "Loading weights" not in err and not (tmp_path / "x.jsonl").exists()


def test_the_summary_reader_checks_the_keys_a_summary_block_has():
    from alfrl.evaluation import SUMMARY_BLOCK_KEYS, _block

    assert tuple(_block(HAND_MADE)) == SUMMARY_BLOCK_KEYS
