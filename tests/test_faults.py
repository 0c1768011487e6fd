"""Nothing breaks a run: changed data is reported, and every bad input is one clear line with exit status 2."""

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from alfrl.cli import main
from alfrl.games import DataError, fingerprint, scan_games


@pytest.fixture(scope="module")
def corrupt_data(data_dir, valid_games, tmp_path_factory):
    """A data folder of four valid_seen games, one of them truncated half-way."""
    root = tmp_path_factory.mktemp("corrupt")
    games = [g for g in valid_games if g.split == "valid_seen"][:4]
    for g in games:
        src = g.path.rsplit("/", 1)[0]
        task, trial = src.split("/")[-2:]
        dst = root / "json_2.1.1" / "valid_seen" / task / trial
        shutil.copytree(src, dst)
    bad = root / "json_2.1.1" / "valid_seen" / games[0].id.split(":", 1)[1] / "game.tw-pddl"
    text = bad.read_text()
    bad.write_text(text[: len(text) // 2])
    return root, games, bad


def test_unreadable_games_are_reported_not_silently_dropped(corrupt_data, capsys):
    root, games, bad = corrupt_data
    scan = scan_games(root, ["valid_seen"])
    assert len(scan.games) == 3 and [p for p, _ in scan.unreadable] == [str(bad)]
    assert "1 game file(s) could not be read" in scan.warning() and str(bad) in scan.warning()
    assert main(["data", "summary", "--data-dir", str(root)]) == 0
    assert "could not be read" in capsys.readouterr().err
    assert main(["data", "summary", "--data-dir", str(root), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["total"] == 3 and summary["unreadable"][0]["path"] == str(bad)


def test_play_on_a_corrupt_game_is_one_line(corrupt_data, capsys):
    root, games, bad = corrupt_data
    assert main(["play", str(bad.parent), "--walkthrough", "--data-dir", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("alfrl play: game file") and "cannot be read (JSONDecodeError" in err and "Traceback" not in err


def test_a_resume_on_changed_games_stops_unless_accepted(valid_games):
    from alfrl.datamodule import RolloutDataModule

    dm = RolloutDataModule()
    dm.train_games = list(valid_games[:10])
    dm.cursor, dm.step = 16, 2
    state = dm.state_dict()
    assert state["games_fingerprint"] == fingerprint(valid_games[:10])
    dm.train_games = list(valid_games[1:10])  # one game gone
    with pytest.raises(DataError, match="trained on 10 training games .* this data has 9 .* --data.accept_changed_games true"):
        dm.load_state_dict(state)
    accepting = RolloutDataModule(accept_changed_games=True)
    accepting.train_games = list(valid_games[1:10])
    accepting.load_state_dict(state)
    assert (accepting.cursor, accepting.step) == (16, 2)


BAD_FIT = [
    (["--config", "recipes/tiny.yaml", "--trainer.default_root_dir", "${trainer.no_such_key}"], "Interpolation key 'trainer.no_such_key' not found"),
    (["--config", "recipes/tiny.yaml", "--trainer.default_root_dir", "${trainer.max_steps"], "recipe error: broken interpolation in trainer.default_root_dir"),
    (["--config", "EMPTY"], "is empty: start from a recipe in recipes/"),
    (["--config", "recipes/no_such.yaml"], "no such recipe file"),
    (["--config", "recipes/tiny.yaml", "--trainer.max_steps", "-3"], "trainer.max_steps=-3: the number of updates must be >= 1"),
    (["--config", "recipes/tiny.yaml", "--checkpoint.save_every", "-1"], "checkpoint.save_every=-1 must be >= 0"),
    (["--config", "recipes/tiny.yaml", "--trainer.log_every_n_steps", "5"], "trainer.log_every_n_steps=5: alfrl logs every update's row"),
    (["--config", "recipes/tiny.yaml", "--periodic_eval.every_n_steps", "-2"], "periodic_eval.every_n_steps=-2 must be >= 0"),
    (["--config", "recipes/tiny.yaml", "--weight_sync.canary_at_step", "-1"], "weight_sync.canary_at_step=-1 must be >= 0"),
    (["--config", "NOLOGGER"], "trainer.logger[1] in --config"),
    (["--config", "recipes/tiny.yaml", "--model.optim.weight_decay", "-0.1"], "model.optim.weight_decay=-0.1 must be >= 0"),
    (["--config", "recipes/tiny.yaml", "--model.lora.target_modules", "[q_proj,foo_proj]"], "model.lora.target_modules has ['foo_proj']"),
    (["--config", "recipes/tiny.yaml", "--model.ppo.minibatches", "20"], "model.ppo.minibatches=20 exceeds the 8 trajectories"),
    (["--config", "recipes/tiny.yaml", "--data.train_split", "trian"], "data.train_split='trian' is not a split"),
    (["--config", "recipes/tiny.yaml", "--model.model_name", ".cache/no-tiny-model"], "no model folder there: run `make tiny-model`"),
    (["--config", "recipes/tiny.yaml", "--model.lrr", "1"], "recipe error: unrecognized arguments: --model.lrr"),
    (["--config", "recipes/tiny.yaml", "--ckpt_path", "CKPT"], "the checkpoint's adapter has r=4 but model.lora.rank=8"),
    (["--config", "recipes/tiny.yaml", "--ckpt_path", "PRUNED"], "keeps only its adapter (checkpoint.keep_resume_states prunes"),
    (["--config", "recipes/tiny.yaml", "--checkpoint.keep_resume_states", "-1"], "checkpoint.keep_resume_states=-1 must be >= 0"),
]


@pytest.mark.parametrize("args,expected", BAD_FIT, ids=[e for _, e in BAD_FIT])
def test_bad_fit_input_is_one_clear_line_and_status_2(args, expected, tmp_path, tiny_model_dir, data_dir, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    monkeypatch.setattr(logging, "raiseExceptions", False)  # Lightning's handlers hold an earlier test's captured stderr
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    ckpt = tmp_path / "run" / "checkpoints" / "step-000002"
    (ckpt / "adapter").mkdir(parents=True)
    import zipfile

    with zipfile.ZipFile(ckpt / "trainer.ckpt", "w") as archive:  # whole (a damaged one is tests/test_checkpointing.py's)
        archive.writestr("data.pkl", b"")
    (ckpt / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 16}))
    pruned = tmp_path / "run" / "checkpoints" / "step-000001"  # an older checkpoint: its trainer.ckpt was pruned
    (pruned / "adapter").mkdir(parents=True)
    import yaml

    recipe = yaml.safe_load(open("recipes/tiny.yaml"))
    recipe["trainer"]["logger"] = [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path)}},
                                   {"class_path": "no_such_logging_pkg.Logger"}]  # e.g. SwanLab where swanlab is not installed
    nologger = tmp_path / "nologger.yaml"
    nologger.write_text(yaml.safe_dump(recipe))
    args = [str(empty) if a == "EMPTY" else str(ckpt) if a == "CKPT" else str(pruned) if a == "PRUNED" else str(nologger) if a == "NOLOGGER" else a for a in args]
    if "--model.model_name" not in args:
        args += ["--model.model_name", tiny_model_dir]
    assert main(["fit", *args]) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert "Traceback" not in err and "Loading weights" not in err
    if expected.startswith("trainer.logger"):
        assert "no_such_logging_pkg.Logger cannot be imported (No module named 'no_such_logging_pkg')" in err


def test_a_run_an_engine_stops_ends_with_its_message_even_when_the_teardown_fails_too(tmp_path, tiny_model_dir, data_dir, capsys,
                                                                                  monkeypatch):
    """On the H200 a CUDA fault in vLLM's probe scoring was followed by a second CUDA error from Lightning's teardown,
    printed last. The run stops with status 1, everything printed, and the engine's message as the last line."""
    from alfrl.engines import EngineError, HFEngine
    from alfrl.recipe import report_stop

    try:
        try:
            raise EngineError("the vllm engine failed scoring the sync's probe")
        except EngineError:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (teardown)")  # noqa: B904
    except RuntimeError as e:
        assert report_stop(e, "fit") == 1
    err = capsys.readouterr().err
    assert "teardown" in err and err.rstrip().splitlines()[-1] == "alfrl fit: stopped: the vllm engine failed scoring the sync's probe"
    assert report_stop(ValueError("not ours"), "fit") is None and capsys.readouterr().err == ""

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    monkeypatch.setattr(logging, "raiseExceptions", False)  # Lightning's handlers hold an earlier test's captured stderr

    def fault(self, ids):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(HFEngine, "score", fault)
    args = ["fit", "--config", "recipes/tiny.yaml", "--model.model_name", tiny_model_dir, "--trainer.logger", "false",
            "--data.engine.separate_weights", "true", "--trainer.default_root_dir", str(tmp_path / "run")]
    assert main(args) == 1
    last = capsys.readouterr().err.rstrip().splitlines()[-1]
    assert last == ("alfrl fit: stopped: the hf engine failed scoring the sync's probe before pushing weight version 0 "
                    "(RuntimeError: CUDA error: an illegal memory access was encountered)"), last
    children = subprocess.run(["ps", "-o", "args=", "--ppid", str(os.getpid())], capture_output=True, text=True).stdout
    assert "_worker_main" not in children, children  # the failed run stopped its environment workers


def test_bad_eval_and_report_input_is_one_clear_line(tmp_path, capsys):
    for limit in ("-1", "0"):
        with pytest.raises(SystemExit) as exit_:
            main(["eval", "--config", "recipes/tiny.yaml", "--limit-per-split", limit, "--out", str(tmp_path / "x.jsonl")])
        assert exit_.value.code == 2
        assert "give a number of games >= 1" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "r")]) == 2
    assert "no such file" in capsys.readouterr().err
    other = tmp_path / "other.jsonl"
    other.write_text('{"type": "trajectory"}\n')
    assert main(["report", str(other), "--out", str(tmp_path / "r")]) == 2
    assert "holds no evaluated games" in capsys.readouterr().err


def test_a_rollout_that_writes_into_the_trainers_weights_stops_the_run_at_once(tmp_path, tiny_model_dir, data_dir, capsys,
                                                                             monkeypatch):
    """The H200's graphs + LoRA fits ended with the trainer's own LoRA weights NaN an update later. A rollout that changes
    a trainer tensor (here: the engine's step writes into one after the first update) stops the fit in that step. The
    training step guards with an engine that says it could write there (vLLM's core in this process): the hf engine is
    made to say so; the first rollout, which writes nothing, passes the guard's check."""
    from alfrl.engines import HFEngine
    from alfrl.policy import AlfrlPolicy

    monkeypatch.setattr(HFEngine, "guard_trainer_memory", True)

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    monkeypatch.setattr(logging, "raiseExceptions", False)  # Lightning's handlers hold an earlier test's captured stderr
    trainer = {}
    start = AlfrlPolicy.on_train_start
    monkeypatch.setattr(AlfrlPolicy, "on_train_start", lambda self: (trainer.setdefault("policy", self), start(self))[1])
    step = HFEngine.step

    def writing_step(self):
        policy = trainer.get("policy")
        if policy is not None and policy.weight_version == 1 and not trainer.get("written"):
            lora = next(p for n, p in policy.model.named_parameters() if "lora_B" in n)
            lora.data.view(-1)[0] = float("nan")
            trainer["written"] = True
        return step(self)

    monkeypatch.setattr(HFEngine, "step", writing_step)
    args = ["fit", "--config", "recipes/tiny.yaml", "--model.model_name", tiny_model_dir, "--trainer.logger", "false",
            "--data.engine.separate_weights", "true", "--trainer.default_root_dir", str(tmp_path / "run")]
    assert main(args) == 1
    last = capsys.readouterr().err.rstrip().splitlines()[-1]
    assert trainer.get("written") and last.startswith("alfrl fit: stopped: 1 of the trainer's ") and "lora_B" in last, last
    assert "changed during the rollout and the weight sync since the last update" in last
