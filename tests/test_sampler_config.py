"""alfrl.sampler_config: the engine's settings reach the engine the Sampler builds (most of their checks are tested with the
part they configure: test_engines, test_vllm_engine)."""

from __future__ import annotations

import sys
from types import ModuleType

from alfrl.sampler_config import EngineConfig


def test_the_sampler_starts_vllm_with_the_recipes_settings_and_the_asked_determinism(monkeypatch, tiny_model_dir):
    """Sampler.build makes VLLMEngine (a stand-in here: no vLLM on the CPU) batch-invariant exactly when asked, with the
    pass-through arguments merged; the DataModule asks for data.rollout.deterministic unless told otherwise (alfrl eval)."""
    import dataclasses

    from alfrl.datamodule import RolloutDataModule
    from alfrl.envs import EnvConfig
    from alfrl.evaluation import EvalConfig
    from alfrl.policy import AlfrlPolicy
    from alfrl.policy import LoRAConfig
    from alfrl.rewards import RewardConfig
    from alfrl.rollout import RolloutConfig
    from alfrl.sampler import Sampler

    seen = []

    class StandIn:
        batch_invariant = False

        def __init__(self, path, **kwargs):
            seen.append(kwargs)
            self.batch_invariant = kwargs["batch_invariant"]

        def close(self):
            pass

    stand_in = ModuleType("alfrl.vllm_engine")
    stand_in.VLLMEngine = StandIn
    monkeypatch.setitem(sys.modules, "alfrl.vllm_engine", stand_in)
    policy = AlfrlPolicy(model_name=tiny_model_dir, dtype="float32", lora=LoRAConfig(rank=8, alpha=16))
    engine = EngineConfig(kind="vllm", vllm_args={"async_scheduling": False})
    for deterministic in (True, False):
        sampler = Sampler.build(policy, RolloutConfig(), RewardConfig(), engine, EnvConfig(), EvalConfig(), with_pool=False,
                                deterministic=deterministic)
        assert sampler.deterministic is deterministic
    assert [k["batch_invariant"] for k in seen] == [True, False]
    assert seen[0]["extra"] == {"async_scheduling": False} and seen[0]["lora_rank"] == 8

    def connect(rollout_deterministic, asked):
        dm = RolloutDataModule(rollout=dataclasses.replace(RolloutConfig(), deterministic=rollout_deterministic), engine=engine)
        return dm.connect(policy, with_pool=False, deterministic=asked).deterministic

    assert connect(True, None) is True and connect(False, None) is False  # a fit: data.rollout.deterministic
    assert connect(False, True) is True and connect(True, False) is False  # alfrl eval: data.eval.deterministic
