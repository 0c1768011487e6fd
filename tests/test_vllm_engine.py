"""alfrl.vllm_engine without a GPU: what the engine sets up before vLLM starts (a stand-in vLLM)."""

import torch


def test_a_high_priority_stream_is_the_threads_current_stream_before_the_engine_starts(monkeypatch):
    """data.engine.high_priority_stream: vLLM takes the thread's current stream for its steps and graphs, so it is set first."""
    import sys
    from types import ModuleType

    from alfrl.sampler import EngineConfig
    from alfrl.vllm_engine import VLLMEngine

    events = []
    vllm = ModuleType("vllm")
    vllm.LLM = lambda **kw: events.append("LLM")
    for name, mod in (("vllm", vllm), ("vllm.utils", ModuleType("vllm.utils")), ("vllm.utils.torch_utils", ModuleType("vllm.utils.torch_utils"))):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda priority=0: ("stream", priority))
    monkeypatch.setattr(torch.cuda, "set_stream", events.append)
    VLLMEngine("a-model", high_priority_stream=True)
    assert events == [("stream", -100), "LLM"]  # out of range: the device's highest priority
    events.clear()
    VLLMEngine("a-model")
    assert events == ["LLM"]
    assert EngineConfig(high_priority_stream=True).problems() == [
        "data.engine.high_priority_stream=true needs data.engine.kind: vllm (the hf engine runs no stream of its own): set it to false"]
