"""Two ranks on CPU (gloo, HF engine, tiny model): disjoint games, identical LoRA weights, global metrics."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import alfrl_here

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_a_one_process_checkpoint_resumes_on_two_ranks_that_take_disjoint_games_and_stay_identical(tmp_path, data_dir, tiny_model_dir):
    """Update 1 in one process, update 2 resumed on two ranks (one fit of each kind: the suite's time): the ranks play the
    next games of the shuffled list, disjoint; their LoRA weights stay identical; the logged metrics count both ranks."""
    root = tmp_path / "run"
    env = dict(os.environ, ALFWORLD_DATA=data_dir, PYTHONPATH=str(REPO))
    base = [sys.executable, "-m", "alfrl.cli", "fit", "--config", "recipes/tiny.yaml", "--trainer.default_root_dir", str(root),
            "--model.model_name", tiny_model_dir, "--data.games_per_batch", "4", "--data.env.num_workers", "1", "--data.save_rollouts", "true",
            "--data.rollout.max_episode_steps", "4"]  # which games each rank plays is checked, not how long they last
    out = subprocess.run([*base, "--trainer.max_steps", "1", "--trainer.logger", "false"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    out = subprocess.run([*base, "--trainer.max_steps", "2", "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu",
                          "--ckpt_path", str(root / "checkpoints" / "last"),
                          "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(root),
                          "--trainer.callbacks+=tests.ddp_record.RecordRank", f"--trainer.callbacks.out={root / 'ranks'}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (root / "checkpoints" / "last").read_text() == "step-000002"
    records = {r: [json.loads(line) for line in (root / "ranks" / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)}
    assert [x["step"] for x in records[0]] == [2] and all(x["world"] == 2 for x in records[0] + records[1])
    assert records[0][0]["lora"] == records[1][0]["lora"], "the ranks' LoRA weights differ after an update"
    adapter = [(root / "checkpoints" / f"step-{s:06d}" / "adapter" / "adapter_model.safetensors").read_bytes() for s in (1, 2)]
    assert adapter[0] != adapter[1]  # update 2 did change the weights
    # update 1 (one process) played games 0-3 of the shuffled list; update 2 (two ranks) games 4-7, two each
    first = {json.loads(line)["game_id"] for line in (root / "rollouts" / "step-000001-rank0.jsonl").read_text().splitlines()}
    trajs = {r: [json.loads(line) for line in (root / "rollouts" / f"step-000002-rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)}
    second = [{t["game_id"] for t in trajs[r]} for r in (0, 1)]
    assert len(first) == 4 and [len(s) for s in second] == [2, 2] and [len(trajs[r]) for r in (0, 1)] == [8, 8]  # 2 games x 4 a rank
    assert not first & (second[0] | second[1]) and not second[0] & second[1]
    with open(next(root.glob("lightning_logs/version_*/metrics.csv"))) as f:
        logged = [r for r in csv.DictReader(f) if r.get("rollout/success_rate")][-1]
    both = trajs[0] + trajs[1]
    assert float(logged["rollout/trajectories"]) == 16.0
    assert float(logged["rollout/reward_mean"]) == pytest.approx(sum(t["reward"] for t in both) / 16, abs=1e-6)
    assert float(logged["rollout/success_rate"]) == pytest.approx(sum(t["won"] for t in both) / 16, abs=1e-6)


def test_eval_sharded_over_two_ranks_merges_to_the_single_process_result(tmp_path, data_dir, tiny_model_dir, capfd, monkeypatch):
    env = dict(os.environ, ALFWORLD_DATA=data_dir, PYTHONPATH=str(REPO))
    common = ["eval", "--config", "recipes/tiny.yaml", "--model.model_name", tiny_model_dir, "--limit-per-split", "2",
              "--data.eval.games_per_chunk", "1", "--data.env.num_workers", "1"]
    single = tmp_path / "single.jsonl"  # in this process (a process start costs ~9 s of imports)
    monkeypatch.setenv("ALFWORLD_DATA", data_dir)
    out = alfrl_here(capfd, *common, "--out", str(single))
    assert out.returncode == 0, out.stderr[-3000:]
    merged = tmp_path / "merged.jsonl"
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533", "-m", "alfrl.cli",
                          *common, "--out", str(merged)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    parts = sorted(p.name for p in tmp_path.glob("merged.rank*"))
    assert parts == ["merged.rank0-of-2.jsonl", "merged.rank1-of-2.jsonl"]
    games_of = {p: {json.loads(line)["game_id"] for line in (tmp_path / p).read_text().splitlines() if '"type": "game"' in line} for p in parts}
    assert not games_of[parts[0]] & games_of[parts[1]] and len(games_of[parts[0]]) == 2
    one = [json.loads(line) for line in single.read_text().splitlines()]
    two = [json.loads(line) for line in merged.read_text().splitlines()]
    assert [r for r in one if r["type"] == "game"] == [r for r in two if r["type"] == "game"]
    assert one[-1] == two[-1] and two[-1]["type"] == "summary"
