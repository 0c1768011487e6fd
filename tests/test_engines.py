"""HFEngine's contract (the one VLLMEngine shares), and VLLMEngine's refusal without vLLM or a GPU."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from alfrl.chat import chat_format
from alfrl.engines import EngineError, HFEngine, SamplingRequest


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    fmt = chat_format(tok, "tool_call")
    prompt = tuple(fmt.first_prompt_ids("Your task is to: look.\nAvailable actions:\nlook"))
    return tok, model, fmt, prompt


def test_n_completions_with_one_logprob_each_matching_the_model(setup):
    tok, model, fmt, prompt = setup
    engine = HFEngine(model, tok.pad_token_id)
    short = SamplingRequest(prompt[:40], 2, 1.0, 1.0, 10, fmt.stop_token_ids, seed=1)
    outs = engine.generate([SamplingRequest(prompt, 3, 1.0, 1.0, 30, fmt.stop_token_ids, seed=1), short])
    assert [len(o) for o in outs] == [3, 2]
    for request, completions in zip([None, short], outs):
        for c in completions:
            assert len(c.logprobs) == len(c.token_ids) >= 1
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in fmt.stop_token_ids
                assert not set(c.token_ids[:-1]) & set(fmt.stop_token_ids)
            else:
                assert len(c.token_ids) == (30 if request is None else 10)
    # the sampler's log-probs are the model's own (temperature 1, raw logits)
    c = outs[0][0]
    ids = torch.tensor([list(prompt) + list(c.token_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    expected = logp.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)
    assert engine.counters().generated_tokens == sum(len(c.token_ids) for o in outs for c in o)


def test_same_seeds_same_samples_and_budget_cuts(setup):
    tok, model, fmt, prompt = setup
    engine = HFEngine(model, tok.pad_token_id)
    req = [SamplingRequest(prompt, 4, 1.0, 1.0, 20, fmt.stop_token_ids, seed=7)]
    assert engine.generate(req) == engine.generate(req)
    cut = engine.generate([SamplingRequest(prompt, 4, 1.0, 1.0, 3, (), seed=7)])[0]
    assert all(len(c.token_ids) == 3 and c.finish_reason == "length" for c in cut)
    greedy = SamplingRequest(prompt, 2, 0.0, 1.0, 12, fmt.stop_token_ids, seed=None)
    a, b = engine.generate([greedy])[0]
    assert a.token_ids == b.token_ids


def test_the_engine_leaves_the_models_mode_and_global_rng_alone(setup):
    tok, model, fmt, prompt = setup
    model.train()
    state = torch.get_rng_state()
    HFEngine(model, tok.pad_token_id).generate([SamplingRequest(prompt, 1, 1.0, 1.0, 5, fmt.stop_token_ids, seed=3)])
    assert model.training and torch.equal(state, torch.get_rng_state())
    model.eval()


def test_vllm_engine_without_vllm_or_gpu_says_what_to_do():
    from alfrl.vllm_engine import VLLMEngine

    with pytest.raises(EngineError, match="data.engine.kind: hf"):
        VLLMEngine("any-model")


def test_vllm_counters_read_cached_prompt_tokens_not_cache_queries():
    """The figures of the H200 rollout: prompt_tokens_cached is the token count; prefix_cache_hits is not."""
    from types import SimpleNamespace as M

    from alfrl.vllm_engine import counters_from_metrics

    seen = [M(name="vllm:prefix_cache_queries", value=34568), M(name="vllm:prefix_cache_hits", value=31920),
            M(name="vllm:prompt_tokens", value=16469304), M(name="vllm:prompt_tokens_cached", value=15979696),
            M(name="vllm:generation_tokens", value=265550), M(name="vllm:time_to_first_token_seconds", value=None)]
    c = counters_from_metrics(seen)
    assert (c.prompt_tokens, c.cached_prompt_tokens, c.generated_tokens) == (16469304, 15979696, 265550)
    older = [M(name="vllm:prompt_tokens", value=100), M(name="vllm:prefix_cache_hits", value=60)]
    assert counters_from_metrics(older).cached_prompt_tokens == 60
    assert c.minus(counters_from_metrics(older)).prompt_tokens == 16469304 - 100


def test_a_fixed_kv_cache_size_reaches_vllm_and_is_checked(tiny_model_dir):
    from alfrl.sampler_config import EngineConfig

    assert EngineConfig(kind="vllm", kv_cache_gib=20).vllm_extra(tiny_model_dir) == {"kv_cache_memory_bytes": 20 * 2**30}
    assert "kv_cache_memory_bytes" not in EngineConfig(kind="vllm").vllm_extra(tiny_model_dir)
    assert EngineConfig(kv_cache_gib=0).problems() == ["data.engine.kv_cache_gib=0 must be > 0 (or null: inferred from gpu_memory_utilization)"]


def test_the_cuda_graph_size_reaches_vllm_and_is_checked(tiny_model_dir):
    from alfrl.sampler_config import EngineConfig

    extra = EngineConfig(kind="vllm", cudagraph_max_tokens=2048).vllm_extra(tiny_model_dir)
    assert extra == {"compilation_config": {"max_cudagraph_capture_size": 2048}}
    assert "compilation_config" not in EngineConfig(kind="vllm").vllm_extra(tiny_model_dir)  # vLLM's default
    assert EngineConfig(cudagraph_max_tokens=0).problems() == ["data.engine.cudagraph_max_tokens=0 must be >= 1 (or null for vLLM's default)"]
    both = EngineConfig(kind="vllm", cudagraph_max_tokens=2048, cudagraph_mode="piecewise").vllm_extra(tiny_model_dir)
    assert both == {"compilation_config": {"max_cudagraph_capture_size": 2048, "cudagraph_mode": "PIECEWISE"}}
    # what no key covers goes to vllm.LLM as given; a compilation_config merges into the one the keys make
    passed = EngineConfig(kind="vllm", cudagraph_mode="full", vllm_args={"async_scheduling": False,
                                                                         "compilation_config": {"cudagraph_specialize_lora": False}})
    assert passed.vllm_extra(tiny_model_dir) == {"async_scheduling": False,
                                                 "compilation_config": {"cudagraph_mode": "FULL", "cudagraph_specialize_lora": False}}
    assert passed.problems() == []
    assert EngineConfig(vllm_args={"seed": 3, "enforce_eager": True}).problems() == [
        "data.engine.vllm_args sets enforce_eager, seed, which alfrl sets itself: use data.engine.enforce_eager, data.seed instead"]
    assert EngineConfig(vllm_args={"compilation_config": 3}).problems() == [
        "data.engine.vllm_args.compilation_config must be a mapping (vLLM's CompilationConfig fields)"]
    assert EngineConfig(cudagraph_mode="fast").problems() == [
        "data.engine.cudagraph_mode='fast' is not one of none, piecewise, full, full_decode_only, full_and_piecewise (or null for vLLM's)"]


def test_a_nan_after_a_wake_up_names_the_settings_that_broke_it_before():
    from alfrl.vllm_engine import wake_up_nan_hint

    assert "enforce_eager: true" in wake_up_nan_hint(True, False, {})
    assert "enforce_eager: true" in wake_up_nan_hint(True, False, {"compilation_config": {"cudagraph_mode": "PIECEWISE"}})
    assert wake_up_nan_hint(True, True, {}) == wake_up_nan_hint(False, False, {}) == ""
    assert wake_up_nan_hint(True, False, {"compilation_config": {"cudagraph_mode": "NONE"}}) == ""


def test_an_engine_fault_at_the_probe_names_the_settings_that_broke_it_before():
    from alfrl.vllm_engine import fault_hint

    assert "enforce_eager: true" in fault_hint(True, False, {}) and "LoRA served" in fault_hint(True, False, {})
    assert "enforce_eager: true" in fault_hint(True, False, {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}})
    assert fault_hint(True, True, {}) == fault_hint(False, False, {}) == ""  # eager, or merged weights: nothing known
    assert fault_hint(True, False, {"compilation_config": {"cudagraph_mode": "NONE"}}) == ""


class StandInLora(SimpleNamespace):
    """vLLM's LoRAModel as the engine uses it: an id, the layer weights, ``clone`` sharing them under a new id."""

    def clone(self, new_id):
        return StandInLora(id=new_id, loras=self.loras)


def stand_in_lora_request(monkeypatch) -> None:
    """vLLM's ``LoRARequest`` (a name and an id) where vLLM is not installed."""
    import sys
    from types import ModuleType

    request = ModuleType("vllm.lora.request")
    request.LoRARequest = lambda name, lora_int_id, lora_path: SimpleNamespace(lora_name=name, lora_int_id=lora_int_id)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)


def test_waking_the_vllm_engine_zeroes_its_kv_cache_and_registers_the_served_adapter_again(monkeypatch):
    """vLLM maps fresh, unzeroed memory back at wake-up: the engine zeroes every cache storage once (views share
    one), and serves the same adapter again under a new id, as a push does (its tensors shared)."""
    from types import SimpleNamespace

    from alfrl.vllm_engine import VLLMEngine

    stand_in_lora_request(monkeypatch)

    raw = torch.full((64,), float("nan"))
    mamba = [raw[:32].view(4, 8), raw[32:].view(8, 4)]  # a linear-attention layer's conv and recurrent state: views of one buffer
    attention = torch.full((2, 16), float("nan"))
    calls = []
    manager = SimpleNamespace(remove_adapter=lambda i: calls.append(("remove", i)), add_adapter=lambda lora: calls.append(("add", lora.id)),
                              activate_adapter=lambda i: calls.append(("activate", i)))
    runner = SimpleNamespace(kv_caches=[attention, mamba], lora_manager=SimpleNamespace(_adapter_manager=manager))
    engine = object.__new__(VLLMEngine)
    engine.llm = SimpleNamespace(wake_up=lambda: calls.append("wake"), reset_prefix_cache=lambda: calls.append("reset"))
    weights = {"layers.0.q_proj": object()}
    engine._asleep, engine._next_lora_id = True, 4
    engine._lora_model, engine._lora = StandInLora(id=3, loras=weights), SimpleNamespace(lora_name="alfrl-v2-3", lora_int_id=3)
    engine._runner = lambda: runner
    engine.wake_up()
    assert calls == ["wake", ("remove", 3), ("add", 4), ("activate", 4), "reset"]
    assert engine._lora.lora_int_id == 4 and engine._lora_model.id == 4 and engine._lora_model.loras is weights
    assert not torch.isnan(raw).any() and (raw == 0).all() and (attention == 0).all()
    assert engine._zero_kv_cache() == raw.nbytes + attention.nbytes  # each storage once
    engine.wake_up()  # awake already: nothing happens
    assert len(calls) == 5


def test_sleep_keeps_every_engine_buffer_but_the_kv_cache_pages():
    """Level-1 sleep keeps only allocations tagged `weights`; the rest of what vLLM built with its cache is kept too."""
    from types import SimpleNamespace

    from alfrl.vllm_engine import keep_across_sleep

    def alloc(tag, size):
        return SimpleNamespace(tag=tag, handle=(0, size, None, None))

    allocations = {0: alloc("weights", 100), 1000: alloc("kv_cache", 50), 2000: alloc("kv_cache", 500),
                   3000: alloc("kv_cache", 64), 4000: alloc("default", 8)}
    kv = [(2000, 200), (2200, 300), (3032, 16)]  # two cache tensors in one segment; one inside another segment
    assert keep_across_sleep(allocations, kv) == 50 + 8
    assert [allocations[a].tag for a in sorted(allocations)] == ["weights", "weights", "kv_cache", "kv_cache", "weights"]
    assert keep_across_sleep(allocations, kv) == 0  # kept already


def test_each_vllm_request_gets_its_own_sampling_params_which_vllm_need_not_deep_copy(monkeypatch):
    """vLLM deep-copies a request's SamplingParams unless told they are the request's alone (skip_clone)."""
    import sys
    from types import ModuleType, SimpleNamespace

    from alfrl.engines import SamplingRequest
    from alfrl.vllm_engine import VLLMEngine

    made, added = [], []

    class SamplingParams(SimpleNamespace):
        def __init__(self, **kw):
            super().__init__(**kw)
            made.append(self)

    vllm = ModuleType("vllm")
    vllm.SamplingParams = SamplingParams
    inputs = ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    sp = ModuleType("vllm.sampling_params")
    sp.RequestOutputKind = SimpleNamespace(FINAL_ONLY="final")
    for name, mod in (("vllm", vllm), ("vllm.inputs", inputs), ("vllm.sampling_params", sp)):
        monkeypatch.setitem(sys.modules, name, mod)
    engine = object.__new__(VLLMEngine)
    engine._submitted, engine._lora, engine.stop_strings = 0, None, False
    engine.llm = SimpleNamespace(llm_engine=SimpleNamespace(add_request=lambda rid, prompt, params, lora_request: added.append(params)))
    req = SamplingRequest(prompt_ids=(1, 2, 3), max_new_tokens=8, temperature=1.0, top_p=1.0, stop_token_ids=(7,), seed=5, n=2)
    engine.submit([req, req])
    assert len(made) == 2 and added == made and made[0] is not made[1]
    assert all(p.skip_clone and p.stop_token_ids == [7] for p in made) and made[0].stop_token_ids is not made[1].stop_token_ids
    # stop strings: an engine started with them (its tokenizer loaded) stops on them as it samples; one without does not
    with_stops = SamplingRequest(prompt_ids=(1,), max_new_tokens=8, temperature=1.0, top_p=1.0, stop_token_ids=(7,), stop_strings=("</action>",), n=1)
    assert not engine.sampling_params(with_stops).detokenize and not hasattr(engine.sampling_params(with_stops), "stop")
    engine.stop_strings = True
    p = engine.sampling_params(with_stops)
    assert p.stop == ["</action>"] and p.include_stop_str_in_output and p.detokenize
    assert not engine.sampling_params(req).detokenize and not hasattr(engine.sampling_params(req), "stop")


def test_the_recipes_vllm_settings_reach_the_engine(monkeypatch, tiny_model_dir):
    """Sampler.build hands the recipe's vLLM settings to VLLMEngine (a stand-in here: no vLLM on the CPU)."""
    import sys
    from types import ModuleType

    from alfrl.evaluation import EvalConfig
    from alfrl.policy import AlfrlPolicy
    from alfrl.policy import LoRAConfig
    from alfrl.rewards import RewardConfig
    from alfrl.rollout import RolloutConfig
    from alfrl.envs import EnvConfig
    from alfrl.sampler import Sampler
    from alfrl.sampler_config import EngineConfig

    seen = {}
    stand_in = ModuleType("alfrl.vllm_engine")
    stand_in.VLLMEngine = lambda path, **kwargs: seen.update(kwargs, path=path) or object()
    monkeypatch.setitem(sys.modules, "alfrl.vllm_engine", stand_in)
    policy = AlfrlPolicy(model_name=tiny_model_dir, dtype="float32", lora=LoRAConfig(rank=8, alpha=16))
    engine = EngineConfig(kind="vllm", sleep_mode=True, enforce_eager=True, prefix_caching=False, cudagraph_mode="piecewise",
                          gpu_memory_utilization=0.3)
    Sampler.build(policy, RolloutConfig(max_trajectory_tokens=3000), RewardConfig(), engine, EnvConfig(), EvalConfig(), with_pool=False)
    assert seen["enable_prefix_caching"] is False and seen["enable_sleep_mode"] is True and seen["enforce_eager"] is True
    assert seen["gpu_memory_utilization"] == 0.3 and seen["lora_rank"] == 8
    assert seen["extra"]["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert seen["stop_strings"] is False  # no stop strings: the engine skips its tokenizer
    Sampler.build(policy, RolloutConfig(stop_strings=("</action>",)), RewardConfig(), engine, EnvConfig(), EvalConfig(), with_pool=False)
    assert seen["stop_strings"] is True


def test_the_vllm_engine_scores_a_sequence_through_the_sampler_one_position_a_request(monkeypatch):
    """No prompt log-probs (vLLM 0.26 gives LoRA logits the wrong mapping there): request i is the prefix before
    position i with that token's log-prob asked for, never read from the prefix cache, with the served adapter."""
    import sys
    from types import ModuleType, SimpleNamespace

    from alfrl.engines import EngineError
    from alfrl.vllm_engine import VLLMEngine

    vllm = ModuleType("vllm")
    vllm.SamplingParams = SimpleNamespace
    inputs = ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: tuple(prompt_token_ids)
    for name, mod in (("vllm", vllm), ("vllm.inputs", inputs)):
        monkeypatch.setitem(sys.modules, name, mod)
    seen = []

    def generate(prompts, params, use_tqdm, lora_request):  # log p(token | prefix) = -(len(prefix) + token) / 100
        seen.append((prompts, params, lora_request))
        return [SimpleNamespace(request_id=str(i), outputs=[SimpleNamespace(logprobs=[
            {9: SimpleNamespace(logprob=-0.5), **{t: SimpleNamespace(logprob=-(len(p) + t) / 100) for t in q.logprob_token_ids}}])])
            for i, (p, q) in enumerate(zip(prompts, params))]

    engine = object.__new__(VLLMEngine)
    engine._lora = "served adapter"
    engine.llm = SimpleNamespace(generate=generate)
    assert engine.score([5, 3, 7, 2]) == [0.0, -0.04, -0.09, -0.05]
    ((prompts, params, lora),) = seen
    assert prompts == [(5,), (5, 3), (5, 3, 7)] and lora == "served adapter"
    assert all(p.max_tokens == 1 and p.temperature == 1.0 and p.skip_reading_prefix_cache for p in params)
    assert [p.logprob_token_ids for p in params] == [[3], [7], [2]] and not any(hasattr(p, "prompt_logprobs") for p in params)
    assert engine.score([5]) == [0.0]
    engine.llm = SimpleNamespace(generate=lambda prompts, params, use_tqdm, lora_request: [
        SimpleNamespace(request_id="0", outputs=[SimpleNamespace(logprobs=[{9: SimpleNamespace(logprob=-0.5)}])])])
    with pytest.raises(EngineError, match="no log-prob for probe token 3 .*logprob_token_ids"):
        engine.score([5, 3])
