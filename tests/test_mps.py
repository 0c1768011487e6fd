"""alfrl.mps: the trainer's share of the SMs and its priority under a CUDA MPS daemon; the engine core spawned with all of them."""

import os
import subprocess
import sys

import pytest
import torch

from alfrl.mps import CLIENT_PRIORITY, THREAD_PERCENTAGE, context_sm_count, full_gpu_for_children, limit_this_process
from alfrl.sampler import EngineConfig


@pytest.fixture
def daemon(tmp_path, monkeypatch):
    """A folder standing in for a running MPS daemon's pipe directory (its control pipe a plain file here)."""
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    monkeypatch.delenv(THREAD_PERCENTAGE, raising=False)
    monkeypatch.delenv(CLIENT_PRIORITY, raising=False)
    return tmp_path


def test_the_limit_is_set_for_this_process_only_where_a_daemon_runs(daemon, monkeypatch):
    limit_this_process(None)
    assert THREAD_PERCENTAGE not in os.environ
    with pytest.raises(ValueError, match=r"trainer_sm_percentage=60 needs a CUDA MPS daemon .*nvidia-cuda-mps-control -d.*default") as e:
        limit_this_process(60)
    assert "\n" not in str(e.value) and THREAD_PERCENTAGE not in os.environ
    (daemon / "control").write_text("")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    limit_this_process(60)
    assert os.environ[THREAD_PERCENTAGE] == "60"
    limit_this_process(60)  # set again (a second fit in this process): the same limit stands
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    limit_this_process(60)  # the context started under this very limit
    with pytest.raises(ValueError, match=rf"context had started .* set {THREAD_PERCENTAGE}=70 in the environment"):
        limit_this_process(70)
    with pytest.raises(ValueError, match=rf"trainer_sm_percentage=60 and data.engine.trainer_mps_priority=below_normal: .*"
                                         rf"set {THREAD_PERCENTAGE}=60 {CLIENT_PRIORITY}=1 in the environment"):
        limit_this_process(60, "below_normal")
    assert os.environ[THREAD_PERCENTAGE] == "60" and CLIENT_PRIORITY not in os.environ


def test_a_lower_priority_alone_is_set_where_a_daemon_runs(daemon, monkeypatch):
    limit_this_process(None, "normal")
    assert CLIENT_PRIORITY not in os.environ
    with pytest.raises(ValueError, match=r"^data.engine.trainer_mps_priority=below_normal needs a CUDA MPS daemon"):
        limit_this_process(None, "below_normal")
    (daemon / "control").write_text("")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    limit_this_process(None, "below_normal")
    assert os.environ[CLIENT_PRIORITY] == "1" and THREAD_PERCENTAGE not in os.environ


def test_processes_started_inside_get_every_sm_at_the_normal_priority_and_the_limits_come_back(daemon, monkeypatch):
    def child() -> tuple[str, str]:
        code = f"import os; print(os.environ.get({THREAD_PERCENTAGE!r}), os.environ.get({CLIENT_PRIORITY!r}))"
        return tuple(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())

    monkeypatch.setenv(THREAD_PERCENTAGE, "60")
    monkeypatch.setenv(CLIENT_PRIORITY, "1")
    with full_gpu_for_children(True):
        assert child() == ("100", "0")
    assert child() == ("60", "1")
    with full_gpu_for_children(False):
        assert child() == ("60", "1")
    monkeypatch.delenv(THREAD_PERCENTAGE)
    with pytest.raises(RuntimeError), full_gpu_for_children(True):
        raise RuntimeError("the engine failed to start")
    assert THREAD_PERCENTAGE not in os.environ and os.environ[CLIENT_PRIORITY] == "1"


def test_the_recipe_keys_are_checked():
    assert EngineConfig(kind="vllm", separate_process=True, trainer_sm_percentage=60, trainer_mps_priority="below_normal").problems() == []
    for bad in ("low", "below_normal"):
        assert EngineConfig(kind="vllm", trainer_mps_priority=bad).problems() == [
            f"data.engine.trainer_mps_priority={bad!r} must be one of normal, below_normal, and below_normal needs "
            "data.engine.separate_process: true (in one process the engine would share it): fix it"]
    for bad in (dict(trainer_sm_percentage=0), dict(trainer_sm_percentage=101), dict(trainer_sm_percentage=60, separate_process=False)):
        cfg = {"kind": "vllm", "separate_process": True, **bad}
        assert EngineConfig(**cfg).problems() == [
            f"data.engine.trainer_sm_percentage={cfg['trainer_sm_percentage']} must be in 1..100 and needs data.engine.separate_process: "
            "true (in one process the engine would share the limit): fix it, or set it to null"]


def test_alfrl_fit_limits_its_process_before_any_model_loads(daemon, tiny_model_dir, capfd, monkeypatch):
    """The limit is set once the recipe is read, before anything asks CUDA (``is_available`` initializes the driver, which
    is when a client connects to the MPS daemon); no daemon: a recipe error."""
    from tests.helpers import alfrl_here

    args = ["fit", "--config", "recipes/tiny.yaml", "--model.model_name", tiny_model_dir, "--data.engine.kind", "vllm",
            "--data.engine.separate_process", "true", "--data.engine.trainer_sm_percentage", "60",
            "--trainer.default_root_dir", str(daemon / "run"), "--trainer.logger", "false"]
    out = alfrl_here(capfd, *args)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith(
        "alfrl: recipe error: data.engine.trainer_sm_percentage=60 needs a CUDA MPS daemon"), out.stderr
    assert "Traceback" not in out.stderr and THREAD_PERCENTAGE not in os.environ
    (daemon / "control").write_text("")
    asked = []  # the limit as each CUDA query found it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(os.environ.get(THREAD_PERCENTAGE)) or False)
    out = alfrl_here(capfd, *args)  # on to the engine, which needs a GPU
    assert out.returncode != 0 and "the vllm engine needs" in out.stderr, out.stderr[-2000:]
    assert os.environ[THREAD_PERCENTAGE] == "60" and asked and set(asked) == {"60"}


def test_the_sampler_spawns_the_engine_with_every_sm(daemon, monkeypatch, tiny_model_dir):
    """Sampler.build makes VLLMEngine (a stand-in here: no vLLM on the CPU) with the variable at 100, so vLLM's engine
    core process starts with every SM; this process's limit stands after it."""
    from types import ModuleType

    from alfrl.evaluation import EvalConfig
    from alfrl.policy import AlfrlPolicy
    from alfrl.ppo import LoRAConfig
    from alfrl.rewards import RewardConfig
    from alfrl.rollout import RolloutConfig
    from alfrl.sampler import EnvConfig, Sampler

    monkeypatch.setenv(THREAD_PERCENTAGE, "55")
    monkeypatch.setenv(CLIENT_PRIORITY, "1")
    seen = []
    stand_in = ModuleType("alfrl.vllm_engine")
    stand_in.VLLMEngine = lambda path, **kwargs: seen.append((os.environ.get(THREAD_PERCENTAGE), os.environ.get(CLIENT_PRIORITY))) or object()
    monkeypatch.setitem(sys.modules, "alfrl.vllm_engine", stand_in)
    policy = AlfrlPolicy(model_name=tiny_model_dir, dtype="float32", lora=LoRAConfig(rank=8, alpha=16))
    for engine in (EngineConfig(kind="vllm", separate_process=True, trainer_sm_percentage=55),
                   EngineConfig(kind="vllm", separate_process=True, trainer_mps_priority="below_normal")):
        Sampler.build(policy, RolloutConfig(), RewardConfig(), engine, EnvConfig(), EvalConfig(), with_pool=False)
    assert seen == [("100", "0"), ("100", "0")] and os.environ[THREAD_PERCENTAGE] == "55" and os.environ[CLIENT_PRIORITY] == "1"
    assert context_sm_count() is None  # no CUDA driver here (on the GPU machine: the SMs the context may use)
