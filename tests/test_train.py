"""End to end on CPU: `make train` on the tiny recipe, and resuming gives the uninterrupted weights."""

import csv
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file


REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def _env(data_dir):
    return dict(os.environ, ALFWORLD_DATA=data_dir, PYTHONUNBUFFERED="1")


def _metrics(root: Path) -> list[dict]:
    (csv_file,) = root.glob("csv/version_*/metrics.csv")
    with open(csv_file) as f:
        return list(csv.DictReader(f))


def _adapter(root: Path, step: int) -> dict:
    return load_file(str(root / "checkpoints" / f"step-{step:06d}" / "adapter" / "adapter_model.safetensors"))


def test_make_train_runs_the_tiny_recipe(tmp_path, data_dir, tiny_model_dir):
    root = tmp_path / "run"
    # the engine gets weights only through the sync (as vLLM does), and after the first update a sync that skips its push is tried
    args = (f"--trainer.default_root_dir {root} --model.model_name {tiny_model_dir} "
            "--data.engine.separate_weights true --weight_sync.canary_at_step 1 --checkpoint.keep_resume_states 1")
    out = subprocess.run(["make", "train", "RECIPE=recipes/tiny.yaml", f"ARGS={args}", f"DATA_DIR={data_dir}", f"TINY_MODEL={tiny_model_dir}"],
                         cwd=REPO, env=_env(data_dir), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "update: 100%" in out.stdout and "2/2 [" in out.stdout and "Epoch 0" not in out.stdout  # the bar counts updates
    # where the outputs are, and the next commands, ready to paste
    assert f"alfrl fit: finished at update 2; the run is in {root}" in out.stdout
    assert f"evaluate it: alfrl eval --config recipes/tiny.yaml --adapter {root}/checkpoints/last --out {root}/eval.jsonl" in out.stdout
    assert "weights_only" not in out.stdout + out.stderr and "dataloader_iter" not in out.stderr  # no library noise
    assert (root / "checkpoints" / "step-000002" / "adapter" / "adapter_config.json").is_file()
    assert (root / "checkpoints" / "step-000002" / "trainer.ckpt").is_file()
    assert (root / "checkpoints" / "last").read_text() == "step-000002"
    # keep_resume_states 1: the older checkpoint keeps its adapter, not its training state
    assert (root / "checkpoints" / "step-000001" / "adapter" / "adapter_model.safetensors").is_file()
    assert not (root / "checkpoints" / "step-000001" / "trainer.ckpt").exists()
    rows = [r for r in _metrics(root) if r.get("train/loss")]
    assert len(rows) == 2
    for key in ("train/loss", "train/clip_fraction", "train/approx_kl", "train/ratio_mean", "train/grad_norm", "train/trained_tokens",
                "train/sampler_minus_trainer_logprob", "rollout/reward_mean", "rollout/success_rate", "rollout/invalid_actions_mean",
                "rollout/repeated_turns_mean", "rollout/steps_mean", "rollout/degenerate_groups", "tokens/generated", "rollout/seconds", "sync/probe_abs_logprob_diff",
                "train/prepare_seconds", "sync/total_seconds", "checkpoint/seconds"):  # the step's seconds by phase
        assert key in rows[0], key
    assert float(rows[0]["train/trained_tokens"]) > 0
    # the rollout's tail: half the trajectories had ended by then; the longest trajectory's sampled tokens
    assert 0 < float(rows[0]["rollout/half_ended_seconds"]) <= float(rows[0]["rollout/seconds"])
    assert 0 < float(rows[0]["rollout/tail_steps"]) < float(rows[0]["rollout/engine_steps"]) and float(rows[0]["rollout/tail_step_ms"]) > 0
    # its start-up (the last group's environments reset, its first request ready) and the waits for environments
    assert 0 < float(rows[0]["rollout/last_group_started_seconds"]) < float(rows[0]["rollout/half_ended_seconds"])
    assert 0 <= float(rows[0]["rollout/env_wait_seconds"]) < float(rows[0]["rollout/seconds"])
    assert float(rows[0]["rollout/completion_tokens_max"]) >= float(rows[0]["rollout/completion_tokens_mean"]) > 0
    assert all(float(rows[0][k]) > 0 for k in ("train/prepare_seconds", "sync/total_seconds", "checkpoint/seconds"))
    # the step's wall clock holds its three timed parts and what lies between them
    for r in rows:
        assert float(r["step/seconds"]) > float(r["rollout/seconds"]) + float(r["train/update_seconds"]) + float(r["sync/total_seconds"])
    # the hf engine runs on torch's allocator: no memory guard (alfrl.guard: for vLLM in this process)
    assert "train/memory_guard_seconds" not in rows[0]
    assert float(rows[0]["sync/canary_caught"]) == 1.0  # the skipped sync was caught
    assert rows[1]["sync/canary_caught"] == ""  # and only that update's row says so (Lightning would repeat it in every row)
    assert float(rows[0]["sync/engine_response"]) == pytest.approx(1.0, abs=0.05)  # and the real sync after it went through
    # after each rollout the engine scored the probe exactly as right after the sync before it
    assert [float(r["engine/probe_drift"]) for r in rows] == [0.0, 0.0]
    # the HF engine's copy has the trainer's weights: sampler and trainer log-probs agree
    assert abs(float(rows[0]["train/sampler_minus_trainer_logprob"])) < 1e-3
    _dashboard_shows(root / "swanlog", rows)


def _dashboard_shows(logdir: Path, rows: list[dict]) -> None:
    """README's command, `swanlab watch RUN/swanlog`, serves the run: its experiment and charts read back over the
    dashboard's API on localhost; then it stops."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    swanlab = Path(sys.executable).parent / "swanlab"
    server = subprocess.Popen([str(swanlab), "watch", str(logdir), "-h", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        api = f"http://127.0.0.1:{port}/api/v1/project"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(api, timeout=5) as r:
                    project = json.load(r)["data"]
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, server.stdout.read() if server.poll() is not None else "no answer in 60 s"
                time.sleep(0.5)
        assert project["name"] == "alfrl" and [e["name"] for e in project["experiments"]] == ["tiny"]
        with urllib.request.urlopen(api + "/summaries", timeout=10) as r:
            summaries = json.load(r)["data"]
        assert {"train/loss", "rollout/success_rate", "sync/total_seconds"} <= set(summaries["tags"])
        assert list(summaries["summaries"]) == ["tiny"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/experiment/{project['experiments'][0]['id']}/chart", timeout=10) as r:
            charts = json.load(r)["data"]
        assert len(charts["charts"]) >= len([k for k in rows[0] if "/" in k]) // 2  # a chart per logged metric
    finally:
        server.terminate()
        server.wait(timeout=30)


def _fit(root: Path, data_dir: str, model: str, *extra: str, logger: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "alfrl.cli", "fit", "--config", "recipes/tiny.yaml", "--trainer.default_root_dir", str(root),
           "--model.model_name", model, *(() if logger else ("--trainer.logger", "false")), *extra]
    out = subprocess.run(cmd, cwd=REPO, env=_env(data_dir), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_resume_gives_the_same_lora_weights_as_an_uninterrupted_run(tmp_path, data_dir, tiny_model_dir):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    short = ("--data.rollout.max_episode_steps", "4", "--data.save_rollouts", "true")  # resuming is checked, not the episode's length
    _fit(whole, data_dir, tiny_model_dir, "--trainer.max_steps", "2", *short)
    _fit(parts, data_dir, tiny_model_dir, "--trainer.max_steps", "1", *short)
    out = _fit(parts, data_dir, tiny_model_dir, "--trainer.max_steps", "2", "--ckpt_path", str(parts / "checkpoints" / "last"), *short)
    assert "update: 100%" in out.stdout and "| 2/2 [" in out.stdout and "?" not in out.stdout.split("update:")[-1]  # not "1/?"
    # the same fit in another process (data.rollout.deterministic: the hf engine always is), stopped after update 1 and resumed
    # for update 2: the same trajectories and adapters to the bit (update N's rollouts beside checkpoint step-N)
    for name in ("step-000001-rank0.jsonl", "step-000002-rank0.jsonl"):
        assert (whole / "rollouts" / name).read_bytes() == (parts / "rollouts" / name).read_bytes(), name
    one, two = _adapter(whole, 1), _adapter(whole, 2)
    assert any(not (one[k] == two[k]).all() for k in one), "step 2 changed nothing: the test would prove nothing"
    first = _adapter(parts, 1)
    assert set(first) == set(one) and all(torch.equal(first[k], one[k]) for k in one)
    resumed = _adapter(parts, 2)
    assert set(resumed) == set(two)
    for k in two:
        assert (resumed[k] == two[k]).all(), k
