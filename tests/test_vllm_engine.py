"""alfrl.vllm_engine without a GPU: what the engine sets up before vLLM starts (a stand-in vLLM)."""

import torch


def _stand_in_envs():
    """A stand-in ``vllm.envs``: each variable read from the environment when asked, as vLLM's module does."""
    import os
    from types import ModuleType

    envs = ModuleType("vllm.envs")
    envs.__getattr__ = lambda name: bool(int(os.environ.get(name, "0")))
    return envs


def _llm():
    """A stand-in ``vllm.LLM``: its engine-core client (VLLMEngine clocks what it returns)."""
    from types import SimpleNamespace

    return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(get_output=lambda: None)))


def test_each_output_of_vllms_core_carries_when_it_was_made_and_when_this_process_took_it(monkeypatch):
    """VLLMEngine.last_output_times: the core's timestamp of the outputs LLMEngine.step just took, and the moment it took them."""
    import time
    from types import SimpleNamespace

    from alfrl.vllm_engine import VLLMEngine

    llm = _llm()
    llm.llm_engine.engine_core.get_output = lambda: SimpleNamespace(timestamp=12.5, outputs=["o"])
    _stand_in_vllm(monkeypatch, lambda **kw: llm)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # VLLMEngine sets it; put back after
    engine = VLLMEngine("a-model")
    assert engine.last_output_times is None  # nothing taken yet
    before = time.monotonic()
    assert llm.llm_engine.engine_core.get_output().outputs == ["o"]  # what vLLM's own step gets, unchanged
    made, taken = engine.last_output_times
    assert made == 12.5 and before <= taken <= time.monotonic()


def _stand_in_vllm(monkeypatch, llm):
    """A stand-in ``vllm`` whose LLM is ``llm(**kwargs)`` and whose LoRARequest keeps its fields."""
    import sys
    from dataclasses import dataclass
    from types import ModuleType

    @dataclass
    class LoRARequest:
        lora_name: str
        lora_int_id: int
        lora_path: str = ""

    modules = {name: ModuleType(name) for name in ("vllm", "vllm.lora", "vllm.lora.request")}
    modules["vllm.envs"] = _stand_in_envs()
    modules["vllm"].LLM = llm
    modules["vllm.lora.request"].LoRARequest = LoRARequest
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_a_separate_process_engine_is_spawned_by_vllm_and_an_inline_one_is_not(monkeypatch):
    """data.engine.separate_process: vLLM reads VLLM_ENABLE_V1_MULTIPROCESSING when the LLM is made; this process has CUDA."""
    import os

    import pytest

    from alfrl.engines import EngineError
    from alfrl.vllm_engine import VLLMEngine

    seen = []
    _stand_in_vllm(monkeypatch, lambda **kw: seen.append((os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"],
                                                           os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"))) or _llm())
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    inline, separate = VLLMEngine("a-model"), VLLMEngine("a-model", separate_process=True)
    assert seen == [("0", None), ("1", "spawn")]
    # only a core in this process allocates in the trainer's CUDA context: the training step's memory guard is for it alone
    assert (inline.guard_trainer_memory, separate.guard_trainer_memory) == (True, False)
    with pytest.raises(EngineError, match="separate process takes no sleep mode"):
        VLLMEngine("a-model", separate_process=True, enable_sleep_mode=True)


def test_a_deterministic_engine_starts_vllm_batch_invariant_wherever_its_core_runs(monkeypatch):
    """data.eval.deterministic / data.rollout.deterministic: VLLM_BATCH_INVARIANT is set before vLLM makes its engine, in this
    process or in the core it spawns (which inherits the environment); a process whose vLLM loaded the other mode refuses."""
    import os
    import sys
    from types import SimpleNamespace

    import pytest

    from alfrl.engines import EngineError
    from alfrl.vllm_engine import VLLMEngine

    seen = []
    _stand_in_vllm(monkeypatch, lambda **kw: seen.append((os.environ["VLLM_BATCH_INVARIANT"], os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]))
                   or _llm())
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engines = [VLLMEngine("a-model", batch_invariant=True), VLLMEngine("a-model", batch_invariant=True, separate_process=True),
               VLLMEngine("a-model")]
    assert seen == [("1", "0"), ("1", "1"), ("0", "0")]
    assert [e.batch_invariant for e in engines] == [True, True, False]
    # vLLM's LoRA kernels read the mode once, when they load: an engine of the other mode in the same process is refused
    monkeypatch.setitem(sys.modules, "vllm.lora.ops.triton_ops.utils", SimpleNamespace(is_batch_invariant=False))
    with pytest.raises(EngineError, match="batch-invariant mode off; an engine with it cannot start beside that"):
        VLLMEngine("a-model", batch_invariant=True)
    assert len(seen) == 3  # refused before vLLM made anything
    VLLMEngine("a-model")  # the mode it loaded with still starts
    # vLLM's envs cached (after a service started) with the other mode: refused too
    monkeypatch.delitem(sys.modules, "vllm.lora.ops.triton_ops.utils")
    monkeypatch.setattr(sys.modules["vllm.envs"], "VLLM_BATCH_INVARIANT", False, raising=False)
    with pytest.raises(EngineError, match="reads its batch-invariant mode as False, this engine asks for True"):
        VLLMEngine("a-model", batch_invariant=True)


def test_an_adapter_reaches_a_separate_engine_as_a_peft_folder_and_only_the_served_one_stays(monkeypatch, tiny_model_dir):
    """What vLLM's add_lora gets in the engine's process: a peft folder peft itself loads to the trainer's weights."""
    import os

    import pytest
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from alfrl.engines import EngineError
    from alfrl.policy import AlfrlPolicy
    from alfrl.policy import LoRAConfig
    from alfrl.vllm_engine import VLLMEngine

    calls = []

    class Core:
        def get_output(self):
            return None

        def shutdown(self):
            calls.append("shutdown")

    class LLMEngine:
        engine_core = Core()

        def add_lora(self, request):
            calls.append(("add", request.lora_int_id, sorted(os.listdir(request.lora_path))))
            return True

        def remove_lora(self, lora_id):
            calls.append(("remove", lora_id))

    class LLM:
        llm_engine = LLMEngine()

        def __init__(self, **kw):
            pass

        def reset_prefix_cache(self):
            calls.append("reset")

    _stand_in_vllm(monkeypatch, LLM)
    policy = AlfrlPolicy(model_name=tiny_model_dir, dtype="float32", lora=LoRAConfig(rank=8, alpha=16))
    policy.configure_model()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    engine = VLLMEngine("a-model", lora_rank=8, separate_process=True)
    adapter = policy.adapter_weights()
    assert engine.load_adapter(adapter) == len(adapter.modules)
    first = engine._lora
    files = ["adapter_config.json", "adapter_model.safetensors"]
    assert calls == [("add", first.lora_int_id, files), "reset"]
    assert sorted(engine.push_seconds) == ["load", "swap", "write"] and min(engine.push_seconds.values()) >= 0  # sync/<phase>_seconds
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # peft's loading would pin memory for the GPU
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), first.lora_path)
    mine = dict(policy.model.named_parameters())
    theirs = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert theirs and all(torch.equal(p, mine[n]) for n, p in theirs.items())

    calls.clear()
    engine.load_adapter(policy.adapter_weights())
    second = engine._lora
    engine.load_adapter(policy.adapter_weights())
    lora_id = engine._lora.lora_int_id
    assert calls[:3] == [("add", second.lora_int_id, files), ("remove", first.lora_int_id), "reset"]
    assert os.listdir(engine._adapter_root) == [engine._lora.lora_name]  # the served one's folder (vLLM may read it again)

    def refuse(request):
        raise ValueError("While loading x, expected target modules in [...]\nbut received ['lm_head']")

    monkeypatch.setattr(LLMEngine, "add_lora", lambda self, request: refuse(request))
    with pytest.raises(EngineError, match=r"did not load the pushed adapter \(ValueError: While loading .* but received") as e:
        engine.load_adapter(policy.adapter_weights())
    assert "\n" not in str(e.value) and engine._lora.lora_int_id == lora_id  # still serving the last one
    assert os.listdir(engine._adapter_root) == [engine._lora.lora_name]  # the refused folder removed
    # vLLM casts what it loads to its lora_dtype: the folder is written in it (half the bytes of float32), same values
    from types import SimpleNamespace

    from safetensors.torch import load_file

    monkeypatch.setattr(LLMEngine, "add_lora", lambda self, request: True)
    LLMEngine.vllm_config = SimpleNamespace(lora_config=SimpleNamespace(lora_dtype=torch.bfloat16))
    adapter = policy.adapter_weights()
    engine.load_adapter(adapter)
    written = load_file(os.path.join(engine._lora.lora_path, "adapter_model.safetensors"))
    assert len(written) == len(adapter.tensors) and {t.dtype for t in written.values()} == {torch.bfloat16}
    assert all(torch.equal(written[engine.checkpoint_name(k)], v.to(torch.bfloat16)) for k, v in adapter.tensors.items())
    with pytest.raises(EngineError, match="separate process .* not reachable"):
        engine.update_weights([])
    root = engine._adapter_root
    engine.close()
    assert calls[-1] == "shutdown" and not os.path.exists(root)


def test_a_separate_engine_process_needs_what_it_can_take():
    from alfrl.sampler_config import EngineConfig

    assert EngineConfig(kind="vllm", separate_process=True).problems() == []
    assert EngineConfig(kind="vllm", separate_process=True, weight_sync="merged", sleep_mode=True).problems() == [
        "data.engine.separate_process=true needs data.engine.weight_sync: lora, data.engine.sleep_mode: false (the engine's "
        "model and memory are in its own process): change those, or set it to false"]
    assert EngineConfig(separate_process=True).problems()[0].startswith("data.engine.separate_process=true needs data.engine.kind: vllm")


def test_a_dead_engine_core_process_stops_the_run_with_one_line_that_says_what_to_do(monkeypatch, capsys):
    """vLLM raises EngineDeadError from every call once its core's process died: a step, a submit or a push says so in one line."""
    import os
    import sys
    from types import ModuleType

    import pytest

    from alfrl.engines import AdapterWeights, EngineError, SamplingRequest
    from alfrl.recipe import EXIT_STOPPED, report_stop
    from alfrl.vllm_engine import VLLMEngine

    class EngineDeadError(Exception):
        pass

    class LLMEngine:
        engine_core = _llm().llm_engine.engine_core

        def step(self):
            raise EngineDeadError("EngineCore encountered an issue. See stack trace (above) for the root cause.")

        def add_request(self, *args, **kwargs):
            raise EngineDeadError()

        def add_lora(self, request):
            raise EngineDeadError()

    class LLM:
        llm_engine = LLMEngine()

        def __init__(self, **kw):
            pass

    _stand_in_vllm(monkeypatch, LLM)
    modules = {name: ModuleType(name) for name in ("vllm.inputs", "vllm.sampling_params")}
    modules["vllm.inputs"].TokensPrompt = dict
    modules["vllm.sampling_params"].RequestOutputKind = type("RequestOutputKind", (), {"FINAL_ONLY": 2})
    sys.modules["vllm"].SamplingParams = lambda **kw: type("Params", (), kw)()
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    engine = VLLMEngine("a-model", lora_rank=8, separate_process=True)
    with pytest.raises(EngineError, match=r"engine core process died .*\(--ckpt_path\).*data\.engine\.separate_process: false") as e:
        engine.step()
    assert "\n" not in str(e.value) and isinstance(e.value.__cause__, EngineDeadError)
    assert report_stop(RuntimeError("another error"), "fit") is None  # not ours: the caller raises it as is
    try:
        raise RuntimeError("the fit loop") from e.value
    except RuntimeError as wrapped:
        assert report_stop(wrapped, "fit") == EXIT_STOPPED
    assert capsys.readouterr().err.splitlines()[-1].startswith("alfrl fit: stopped: vLLM's engine core process died")
    tensors = {"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(8, 4)}
    with pytest.raises(EngineError, match="engine core process died"):  # a push: not "did not load the adapter"
        engine.load_adapter(AdapterWeights(tensors, {"r": 8, "target_modules": {"up_proj"}}, version=1))
    assert os.listdir(engine._adapter_root) == []  # its folder removed
    with pytest.raises(EngineError, match="engine core process died"):
        engine.submit([SamplingRequest(prompt_ids=(1, 2), n=1, temperature=1.0, top_p=1.0, max_new_tokens=4, stop_token_ids=(0,), seed=1)])

    def fails(self):
        raise ValueError("not a dead core")

    monkeypatch.setattr(LLMEngine, "step", fails)
    with pytest.raises(ValueError, match="not a dead core"):  # anything else goes through as it was
        engine.step()
