"""Every recipe parses and validates; bad recipes stop early with one line per problem."""

import subprocess
import sys
from pathlib import Path

import pytest

from alfrl.recipe import parse_recipe, recipe_problems
from tests.helpers import EMPTY_SAFETENSORS, alfrl_here

RECIPES = sorted(str(p) for p in (Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))


def test_there_are_recipes():
    names = {Path(r).name for r in RECIPES}
    assert {"tiny.yaml", "qwen4b_80step.yaml", "smoke_gpu.yaml", "eval.yaml"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: Path(r).name)
def test_every_recipe_parses_and_has_no_problems(recipe, monkeypatch):
    monkeypatch.setenv("SWANLAB_API_KEY", "a-saved-login")  # the online recipes' SwanLab needs one (tested below)
    if Path(recipe).name.startswith("sft_"):  # warm-start recipes: alfrl sft
        from alfrl.recipe import SFTCLI, sft_problems

        cfg = parse_recipe(["--config", recipe], SFTCLI)
        assert [p for p in sft_problems(cfg, check_model=False) if "expert_file" not in p] == []
    else:
        cfg = parse_recipe(["--config", recipe])
        assert recipe_problems(cfg, check_data=False, check_model=False) == []
    assert "${" not in str(cfg.checkpoint.dirpath)  # interpolation resolved
    if not Path(recipe).name.startswith("sft_"):  # an update takes seconds to minutes: its CSV row is written as it ends
        csv = [lg for lg in cfg.trainer.logger or [] if lg.class_path.endswith("CSVLogger")]
        assert all(lg.init_args.flush_logs_every_n_steps == 1 for lg in csv)


def test_the_reference_recipe_is_the_reference_run():
    cfg = parse_recipe(["--config", "recipes/qwen4b_80step.yaml"])
    m, d = cfg.model, cfg.data
    o, p = m.optim, m.ppo
    assert (m.model_name, o.lr, tuple(o.betas), o.weight_decay, o.grad_clip_norm, m.lora.rank, p.clip_low, p.clip_high, p.loss_aggregation) == (
        "Qwen/Qwen3.5-4B", 1e-6, (0.9, 0.95), 0.0, 1.0, 32, 0.8, 1.2, "token_sum")
    assert (cfg.trainer.max_steps, d.games_per_batch, d.group_size, d.seed, cfg.seed_everything) == (80, 8, 8, 42, 42)
    r = d.rollout
    assert (r.max_episode_steps, r.max_trajectory_tokens, r.max_assistant_tokens, r.temperature, r.top_p) == (50, 12000, 2048, 1.0, 1.0)
    assert (d.advantage.estimator, d.advantage.drop_degenerate_groups, d.engine.kind, cfg.checkpoint.save_every) == ("grpo_mean", True, "vllm", 20)
    e = d.eval
    assert (tuple(e.splits), e.temperature, e.top_p, e.seed) == (("valid_seen", "valid_unseen"), 0.01, 1.0, 42)
    swanlab = [lg for lg in cfg.trainer.logger if "SwanLab" in lg.class_path]
    assert swanlab and swanlab[0].init_args.mode == "online"
    # the seed's conventions: the rollout's log-probs are PPO's old log-probs, the adapter served unmerged
    assert (p.old_logprobs, p.dual_clip, p.log_ratio_clamp, d.engine.weight_sync) == ("sampler", 3.0, 20.0, "lora")


def test_training_refuses_a_sampling_distribution_the_trainer_cannot_score():
    cfg = parse_recipe(["--config", "recipes/tiny.yaml", "--data.rollout.top_p", "0.9", "--data.rollout.temperature", "0"])
    problems = recipe_problems(cfg, check_data=False, check_model=False)
    assert any(p.startswith("data.rollout.top_p=0.9: training needs top_p 1") for p in problems), problems
    assert any(p.startswith("data.rollout.temperature=0.0: training samples at a temperature > 0") for p in problems), problems
    # evaluation may use any of them
    cfg = parse_recipe(["--config", "recipes/tiny.yaml", "--data.eval.top_p", "0.9", "--data.rollout.temperature", "0.7"])
    assert recipe_problems(cfg, check_data=False, check_model=False) == []


def test_each_bad_value_is_reported_once_and_not_through_its_consequences(capfd):
    """A negative temperature was reported twice and a negative group size also as a minibatch problem; a folder given as
    --config was "no such recipe file" (issue "Nothing lost, nothing injected")."""
    cfg = parse_recipe(["--config", "recipes/tiny.yaml", "--data.rollout.temperature", "-0.5", "--data.group_size", "-2"])
    assert recipe_problems(cfg, check_data=False, check_model=False) == [
        "data.group_size=-2 must be >= 2: advantages compare the K trajectories of a game",
        "data.rollout.temperature=-0.5 must be >= 0"]
    out = _fit(capfd, "--config", "recipes")
    assert out.returncode != 0 and "--config recipes is a folder: give one recipe file in it, e.g. recipes/tiny.yaml" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("section,value,shown", [("model", [1, 2], "model in --config {f} is a list ([1, 2])"),
                                                  ("data", "x", "data in --config {f} is a str (x)"),
                                                  ("model.lora", 8, "model.lora in --config {f} is an int (8)"),
                                                  ("data.engine", ["vllm"], "data.engine in --config {f} is a list (['vllm'])")])
def test_a_recipe_section_that_is_not_a_mapping_is_named_in_one_line(tmp_path, section, value, shown):
    """`model: [1, 2]` said "fit.model.model_name is required" (issue "Nothing lost, nothing injected")."""
    import yaml

    from alfrl.recipe import RecipeError, check_recipe_files

    recipe = yaml.safe_load(open("recipes/tiny.yaml"))
    outer, _, inner = section.partition(".")
    if inner:
        recipe[outer][inner] = value
    else:
        recipe[outer] = value
    f = tmp_path / "recipe.yaml"
    f.write_text(yaml.safe_dump(recipe))
    with pytest.raises(RecipeError) as e:
        check_recipe_files(["--config", str(f)])
    assert str(e.value).startswith("alfrl: recipe error: " + shown.format(f=f)) and "must be a mapping of keys" in str(e.value) and "\n" not in str(e.value)
    for name in sorted(Path("recipes").glob("*.yaml")):  # every shipped recipe passes
        check_recipe_files(["--config", str(name)])


def test_overrides_and_interpolation_after_overrides():
    cfg = parse_recipe(["--config", "recipes/tiny.yaml", "--model.optim.lr", "2e-6", "--trainer.default_root_dir", "runs/other"])
    assert cfg.model.optim.lr == 2e-6
    assert cfg.checkpoint.dirpath == "runs/other/checkpoints"


def _fit(capfd, *args) -> subprocess.CompletedProcess:
    return alfrl_here(capfd, "fit", *args)


def test_unknown_key_is_one_clear_line():
    out = subprocess.run([sys.executable, "-m", "alfrl.cli", "fit", "--config", "recipes/tiny.yaml", "--model.lrr", "1e-5"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "alfrl: recipe error:" in out.stderr and "lrr" in out.stderr and "Traceback" not in out.stderr


def test_swanlab_online_without_a_login_or_a_terminal_is_one_line_before_any_model_loads(tmp_path, tiny_model_dir, data_dir,
                                                                                            capfd, monkeypatch):
    """A batch job (no TTY) with an online SwanLab logger and no saved or given API key: SwanLab would stop the run with a
    traceback once the model had loaded; the recipe check names the fix instead. With a key it is no problem."""
    online = tmp_path / "online.yaml"
    online.write_text(Path("recipes/tiny.yaml").read_text().replace("        mode: local", "        mode: online"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no saved login there
    monkeypatch.setenv("ALFWORLD_DATA", data_dir)  # the games stay where they are
    monkeypatch.delenv("SWANLAB_API_KEY", raising=False)
    out = _fit(capfd, "--config", str(online), "--model.model_name", tiny_model_dir)
    assert out.returncode == 2, out.stderr
    assert "trainer.logger[1]: SwanLab logs online, but no API key is saved (`swanlab login`)" in out.stderr
    assert "Traceback" not in out.stderr and "Loading weights" not in out.stderr
    cfg = parse_recipe(["--config", str(online)])
    from alfrl.recipe import _logger_problems

    monkeypatch.setenv("SWANLAB_API_KEY", "a-key")
    assert _logger_problems(cfg.trainer.logger) == []


def test_unknown_key_in_a_recipe_file(tmp_path, capfd):
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path("recipes/tiny.yaml").read_text().replace("  group_size: 4", "  group_size: 4\n  groupsize: 4"))
    out = _fit(capfd, "--config", str(bad))
    assert out.returncode != 0 and "groupsize" in out.stderr and "Traceback" not in out.stderr


def test_bad_values_are_listed_before_any_model_loads(tmp_path, tiny_model_dir, capfd):
    out = _fit(
        capfd,
        "--config", "recipes/tiny.yaml",
        "--model.model_name", tiny_model_dir,
        "--data.group_size", "1",
        "--model.ppo.clip_low", "1.5",
        "--model.ppo.clip_high", "0.9",
        "--model.optim.lr", "0",
        "--data.rollout.max_trajectory_tokens", "40000",
        "--data.data_dir", str(tmp_path / "no-data"),
    )
    assert out.returncode == 1 or out.returncode == 2
    err = out.stderr
    assert "the recipe has 6 problem(s)" in err, err
    for key in ("data.group_size=1", "model.ppo.clip_low=1.5", "model.ppo.clip_high=0.9", "model.optim.lr=0", "exceed the model's context of 32768", "alfrl data prepare"):
        assert key in err, key
    assert "Traceback" not in err and "Loading weights" not in err
    lines = [line for line in err.splitlines() if line.startswith("  - ")]
    assert len(lines) == 6


def test_print_config_shows_the_resolved_recipe(capfd):
    out = _fit(capfd, "--config", "recipes/tiny.yaml", "--print_config")
    assert out.returncode == 0, out.stderr
    assert "save_dir: runs/tiny" in out.stdout and "${" not in out.stdout
    assert "group_size: 4" in out.stdout and "max_trajectory_tokens: 6000" in out.stdout


def test_a_missing_warm_start_adapter_is_a_recipe_problem_before_any_model_loads(tmp_path, tiny_model_dir):
    def problems(adapter):
        cfg = parse_recipe(["--config", "recipes/tiny.yaml", "--model.model_name", tiny_model_dir, "--model.init_adapter", str(adapter)])
        return [p for p in recipe_problems(cfg, check_data=False) if p.startswith("model.init_adapter")]

    missing = problems(tmp_path / "runs" / "sft" / "checkpoints" / "last")
    assert len(missing) == 1 and "no LoRA adapter at" in missing[0] and "alfrl sft" in missing[0], missing
    step = tmp_path / "sft" / "checkpoints" / "step-000004" / "adapter"
    step.mkdir(parents=True)
    (step / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')  # the tiny recipe's LoRA
    (step / "adapter_model.safetensors").write_bytes(EMPTY_SAFETENSORS)
    (step.parent.parent / "last").write_text("step-000004")
    assert problems(step.parent.parent / "last") == [] and problems(step.parent) == [] and problems(step) == []
    # another LoRA's adapter, or a damaged one: named before any model loads
    (step / "adapter_config.json").write_text('{"r": 16, "lora_alpha": 16}')
    assert ["has r=16 but model.lora.rank=8" in p for p in problems(step)] == [True]
    (step / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (step / "adapter_model.safetensors").write_bytes(EMPTY_SAFETENSORS[:3])
    assert ["is damaged: its header is cut short" in p for p in problems(step)] == [True]
    # a warm start may itself start from an adapter: the same check
    from alfrl.recipe import SFTCLI, sft_problems

    cfg = parse_recipe(["--config", "recipes/sft_tiny.yaml", "--model.model_name", tiny_model_dir,
                        "--model.init_adapter", str(tmp_path / "nothing")], SFTCLI)
    assert [p for p in sft_problems(cfg) if p.startswith("model.init_adapter")], sft_problems(cfg)
