"""The warm start (alfrl.sft): SFT on the expert plans' assistant tokens, held-out loss, RL from its adapter, a file of another
tokenizer refused. The plans themselves: test_expert.py."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alfrl.advantages import sample_of
from alfrl.expert import read_expert
from alfrl.models import parameter_counts, update_flops
from alfrl.policy import AlfrlPolicy, LoRAConfig
from tests.helpers import alfrl_here

REPO = Path(__file__).resolve().parent.parent


def test_sft_loss_covers_exactly_the_assistant_tokens(expert, tiny_model_dir):
    _, _, out, _ = expert
    t = read_expert(out)[0]
    (seq,) = t.sequences
    sample = sample_of(seq, [1.0] * t.steps, 0, 0)
    assert int(sample.loss_mask_T.sum()) == sum(seq.assistant_mask) == sum(turn.completion_tokens for turn in t.turns)
    # the trained targets are exactly the completion tokens (the same rule as RL)
    completions = [tok for _, start, end in seq.spans for tok in seq.token_ids[start:end]]
    assert torch.roll(sample.token_ids_T, -1)[sample.loss_mask_T].tolist() == completions
    from alfrl.sft import SFTPolicy

    policy = SFTPolicy(model_name=tiny_model_dir, dtype="float32", lora=LoRAConfig(rank=8, alpha=16))
    policy.configure_model()
    total, count = policy.nll([sample])
    assert count == len(completions) and float(total) > 0


@pytest.mark.slow
def test_sft_lowers_held_out_loss_and_rl_starts_from_its_adapter(expert, tmp_path, data_dir, tiny_model_dir, capfd, monkeypatch):
    from alfrl.sft import ExpertDataModule, SFTPolicy

    _, _, out, _ = expert
    env = dict(os.environ, ALFWORLD_DATA=data_dir)
    root = tmp_path / "sft"
    cmd = [sys.executable, "-m", "alfrl.cli", "sft", "--config", "recipes/sft_tiny.yaml", "--data.expert_file", str(out),
           "--model.model_name", tiny_model_dir, "--trainer.default_root_dir", str(root),
           "--trainer.max_steps", "8", "--data.tokens_per_step", "6000"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    adapter = root / "checkpoints" / "last"
    assert (root / "checkpoints" / "step-000008" / "adapter" / "adapter_model.safetensors").is_file()
    # held-out expert turns (the data module's validation games) are likelier after the warm start
    dm = ExpertDataModule(str(out), validation_fraction=0.25, seed=42)
    dm.setup("fit")
    assert dm.val_samples and dm.train_samples
    base = SFTPolicy(model_name=tiny_model_dir, dtype="float32", lora=LoRAConfig(rank=8, alpha=16))
    base.configure_model()
    warm = SFTPolicy(model_name=tiny_model_dir, dtype="float32", lora=LoRAConfig(rank=8, alpha=16), init_adapter=str(adapter))
    warm.configure_model()
    with torch.no_grad():
        (b_sum, n), (w_sum, m) = base.nll(dm.val_samples), warm.nll(dm.val_samples)
    assert n == m and float(w_sum) / m < float(b_sum) / n - 0.05
    # each step's model TFLOP/s by 6N, as the PPO update's (no MFU on a device without a known peak)
    body, head = parameter_counts(base.model)
    rows = [r for r in csv.DictReader(open(root / "csv" / "version_0" / "metrics.csv")) if r.get("sft/model_tflops")]
    assert len(rows) == 8 and "sft/mfu" not in rows[0] and float(rows[0]["sft/peak_memory_gib"]) == 0.0  # no GPU here
    assert float(rows[0]["sft/alloc_retries"]) == 0.0
    for r in rows:
        flops = update_flops(body, head, float(r["sft/sequence_tokens"]), float(r["sft/trained_tokens"]))
        assert float(r["sft/model_tflops"]) * float(r["sft/seconds"]) * 1e12 == pytest.approx(flops, rel=1e-3)
    # an RL run starts from that adapter
    rl = tmp_path / "rl"  # in this process (a process start costs ~9 s of imports)
    monkeypatch.setenv("ALFWORLD_DATA", data_dir)
    proc = alfrl_here(capfd, "fit", "--config", "recipes/tiny.yaml", "--model.model_name", tiny_model_dir, "--model.init_adapter", str(adapter),
                      "--trainer.default_root_dir", str(rl), "--trainer.logger", "false", "--trainer.max_steps", "1",
                      "--data.games_per_batch", "1", "--data.group_size", "2", "--data.rollout.max_episode_steps", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    start = AlfrlPolicy(model_name=tiny_model_dir, dtype="float32", lora=LoRAConfig(rank=8, alpha=16), init_adapter=str(adapter))
    start.configure_model()
    state, warm_state = start.adapter_state(), warm.adapter_state()
    assert state.keys() == warm_state.keys() and all(torch.equal(state[k], warm_state[k]) for k in state)
    assert any(float(v.abs().sum()) > 0 for k, v in state.items() if "lora_B" in k)  # not the B = 0 start
    assert (rl / "checkpoints" / "step-000001" / "adapter" / "adapter_model.safetensors").is_file()


def test_an_expert_file_of_another_tokenizer_is_one_line_before_the_model_loads(expert, tmp_path, data_dir, tiny_model_dir, tiny_tokenizer,
                                                                                capfd, monkeypatch):
    from alfrl.expert import tokenizer_problem

    _, _, out, _ = expert
    assert tokenizer_problem(out, tiny_tokenizer, "tiny") is None  # the file was written with this tokenizer
    vocabulary = len(tiny_tokenizer)
    for name, remap in [("shifted", lambda i: (i + 7) % vocabulary), ("past", lambda i: i + vocabulary)]:
        bad = tmp_path / f"{name}.jsonl"  # the same plans as another model's tokenizer would have written them
        with open(out) as f, open(bad, "w") as g:
            for line in f:
                d = json.loads(line)
                for s in d["sequences"]:
                    s["token_ids"] = [remap(i) for i in s["token_ids"]]
                g.write(json.dumps(d) + "\n")
        problem = tokenizer_problem(bad, tiny_tokenizer, "tiny")
        assert problem and "was not tokenized by tiny's tokenizer" in problem and "alfrl expert --config RECIPE" in problem
        assert ("past this tokenizer's" in problem) == (name == "past")
    monkeypatch.setenv("ALFWORLD_DATA", data_dir)
    root = tmp_path / "run"
    proc = alfrl_here(capfd, "sft", "--config", "recipes/sft_tiny.yaml", "--data.expert_file", str(bad), "--model.model_name", tiny_model_dir,
                      "--trainer.default_root_dir", str(root), "--trainer.logger", "false")
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("alfrl sft:")]
    assert len(lines) == 1 and str(bad) in lines[0] and "Traceback" not in proc.stderr
    assert not (root / "checkpoints").exists()


def test_alfrl_sft_on_a_file_that_is_not_expert_plans_is_one_line(tmp_path, data_dir, tiny_model_dir, capfd, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", data_dir)
    other = tmp_path / "notes.jsonl"
    other.write_text("these are not expert plans\n")
    proc = alfrl_here(capfd, "sft", "--config", "recipes/sft_tiny.yaml", "--data.expert_file", str(other), "--model.model_name", tiny_model_dir,
                      "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.logger", "false")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("alfrl sft:")]
    assert len(lines) == 1 and f"{other}: line 1 is not an expert trajectory" in lines[0]
