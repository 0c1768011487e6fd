"""alfrl.sampler_config: the engine's and the pool's settings, checked before anything starts (most of their checks are
tested with the part they configure: test_sampler, test_engines, test_mps, test_vllm_engine)."""

from __future__ import annotations

import multiprocessing
import os
import sys
from types import ModuleType

import pytest
import torch

from alfrl.engines import cpu_threads_for_children
from alfrl.sampler_config import EngineConfig


def report_threads(queue) -> None:
    """A child process's torch CPU threads (module level: a spawned child imports it)."""
    queue.put(torch.get_num_threads())


def child_threads(method: str) -> int:
    ctx = multiprocessing.get_context(method)
    queue = ctx.Queue()
    child = ctx.Process(target=report_threads, args=(queue,))
    child.start()
    try:
        return queue.get(timeout=120)
    finally:
        child.join(timeout=30)


def test_core_cpu_threads_is_checked():
    assert EngineConfig(kind="vllm", separate_process=True, core_cpu_threads=1).problems() == []
    fix = "(in one process they would be the trainer's threads): fix it, or set it to null"
    for bad in (EngineConfig(kind="vllm", separate_process=True, core_cpu_threads=0),
                EngineConfig(kind="vllm", core_cpu_threads=2),  # the engine in the trainer's own process
                EngineConfig(core_cpu_threads=2)):  # the hf engine
        assert bad.problems() == [f"data.engine.core_cpu_threads={bad.core_cpu_threads} must be >= 1 and needs data.engine.kind: "
                                  f"vllm with data.engine.separate_process: true {fix}"]


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_children_started_inside_run_at_the_asked_threads_and_this_process_keeps_its_own(monkeypatch, method):
    """vLLM starts its engine core with spawn (or fork, where CUDA is not yet initialized): both kinds of child get the
    count, and this process's count and environment come back."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    mine = torch.get_num_threads()
    default = child_threads(method)
    if default == 1:  # torch caps OMP_NUM_THREADS at the CPU count: on one CPU no count differs from the default
        pytest.skip("one CPU: a child's torch runs one thread whatever it is asked")
    asked = 1  # vLLM's count for its own worker processes
    with cpu_threads_for_children(asked):
        assert child_threads(method) == asked
    assert torch.get_num_threads() == mine and "OMP_NUM_THREADS" not in os.environ
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    with cpu_threads_for_children(None):  # null: nothing changes
        assert os.environ["OMP_NUM_THREADS"] == "7" and torch.get_num_threads() == mine
    with cpu_threads_for_children(asked):
        assert os.environ["OMP_NUM_THREADS"] == str(asked)
    assert os.environ["OMP_NUM_THREADS"] == "7" and torch.get_num_threads() == mine


def test_the_sampler_starts_the_engine_inside_them(monkeypatch, tiny_model_dir):
    """Sampler.build makes VLLMEngine (a stand-in here: no vLLM on the CPU) with the recipe's count in force."""
    from alfrl.evaluation import EvalConfig
    from alfrl.policy import AlfrlPolicy
    from alfrl.ppo import LoRAConfig
    from alfrl.rewards import RewardConfig
    from alfrl.rollout import RolloutConfig
    from alfrl.sampler import EnvConfig, Sampler

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    seen = []
    stand_in = ModuleType("alfrl.vllm_engine")
    stand_in.VLLMEngine = lambda path, **kwargs: seen.append((os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads())) or object()
    monkeypatch.setitem(sys.modules, "alfrl.vllm_engine", stand_in)
    policy = AlfrlPolicy(model_name=tiny_model_dir, dtype="float32", lora=LoRAConfig(rank=8, alpha=16))
    mine = torch.get_num_threads()
    for threads in (3, None):
        engine = EngineConfig(kind="vllm", separate_process=True, core_cpu_threads=threads)
        Sampler.build(policy, RolloutConfig(), RewardConfig(), engine, EnvConfig(), EvalConfig(), with_pool=False)
    assert seen == [("3", 3), (None, mine)]
    assert torch.get_num_threads() == mine and "OMP_NUM_THREADS" not in os.environ
