"""The weight sync and its checks on the tiny model: counts, the probe gap, and a skipped sync caught."""

import pytest
import torch

from alfrl.advantages import sample_of
from alfrl.chat import chat_format
from alfrl.engines import AdapterWeights, EngineError, HFEngine, SamplingRequest
from alfrl.policy import AlfrlPolicy
from alfrl.ppo import PPOConfig
from alfrl.policy import LoRAConfig
from alfrl.types import TokenSequence
from alfrl.sync import NonFiniteProbeError, WeightSync, WeightSyncError


@pytest.fixture()
def setup(tiny_model_dir):
    policy = AlfrlPolicy(model_name=tiny_model_dir, dtype="float32", lora=LoRAConfig(rank=8, alpha=16))
    policy.configure_model()
    tok = policy.load_tokenizer()
    fmt = chat_format(tok, "tool_call")
    probe = fmt.first_prompt_ids("Your task is to: look.") + fmt.encode("<tool_call>look</tool_call>") + [fmt.end_of_turn_id]
    engine = HFEngine(lambda: policy.model, tok.pad_token_id, separate=True)
    return policy, engine, probe, fmt


def _train(policy, seed: int, scale: float = 0.05) -> None:
    """Stand in for an update: move every LoRA B (the engine's copy does not see it until a sync)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * scale)
    policy.weight_version += 1


@pytest.mark.parametrize("mode", ["lora", "merged"])
def test_a_real_sync_is_counted_and_followed_and_a_skipped_one_is_caught(setup, mode):
    policy, engine, probe, _ = setup
    sync = WeightSync(engine, probe, mode=mode, tolerance=0.1, min_response=0.5)
    first = sync.sync(policy)
    n_modules = len(policy.adapter_weights().modules)
    assert n_modules == 14  # 2 layers x (q, k, v, o, gate, up, down)
    assert first["sync/taken"] == first["sync/expected"] == n_modules
    assert first["sync/probe_abs_logprob_diff"] < 1e-4
    assert 0 <= first["sync/gather_seconds"] <= first["sync/seconds"] and "sync/load_seconds" not in first
    _train(policy, 1)
    engine.push_seconds = {"write": 0.25, "load": 0.5}  # what the vLLM engine in a process of its own says of a push
    second = sync.sync(policy)
    assert (second["sync/write_seconds"], second["sync/load_seconds"]) == (0.25, 0.5)
    assert second["sync/trainer_change"] > 1e-3  # the update moved the probe
    assert second["sync/engine_response"] == pytest.approx(1.0, abs=1e-3)  # and the engine followed it
    _train(policy, 2, scale=0.005)
    with pytest.raises(WeightSyncError, match="did not reach the engine"):
        sync.sync(policy, push=False)  # the engine still serves the previous weights


def test_the_gap_alone_misses_a_small_skipped_update_the_response_does_not(setup):
    policy, engine, probe, _ = setup
    sync = WeightSync(engine, probe, tolerance=0.1, min_response=0.5)
    sync.sync(policy)
    _train(policy, 3, scale=0.001)  # a small update: the gap stays near bf16 noise (0.008 on the GPU)
    with pytest.raises(WeightSyncError, match="did not move at all"):
        sync.sync(policy, push=False)
    assert engine.score(probe) != policy.score(probe)
    gap = sum(abs(a - b) for a, b in zip(engine.score(probe), policy.score(probe))) / len(probe)
    assert gap < 0.01  # what the old check looked at: it would have passed



def test_the_canary_tries_a_skipped_sync_on_a_copy_and_leaves_the_real_sync_as_it_was(setup):
    policy, engine, probe, _ = setup
    sync = WeightSync(engine, probe, tolerance=0.1, min_response=0.5)
    sync.sync(policy)
    _train(policy, 5, scale=0.01)
    before = (sync.last_trainer, sync.cross, sync.norm)
    canary = sync.canary(policy)
    assert canary["sync/canary_caught"] == 1.0 and "did not reach the engine" in canary["sync/canary_message"]
    assert (sync.last_trainer, sync.cross, sync.norm) == before  # the real sync's state is untouched
    real = sync.sync(policy)  # and the real sync after it measures the whole update
    assert real["sync/engine_response"] == pytest.approx(1.0, abs=1e-3)
    assert real["sync/engine_response_running"] == pytest.approx(1.0, abs=1e-3)
    # an update that did not move the probe leaves nothing to catch: reported, not claimed
    _train(policy, 6, scale=0.0)
    quiet = sync.canary(policy)
    assert quiet["sync/canary_caught"] == 0.0 and quiet["sync/canary_trainer_change"] == 0.0

def test_an_engine_that_does_not_follow_the_trainer_is_caught_by_the_running_response(setup):
    policy, engine, probe, _ = setup
    sync = WeightSync(engine, probe, tolerance=1.0, min_response=0.1)
    sync.sync(policy)
    start = {k: v.clone() for k, v in policy.adapter_weights().tensors.items()}
    _train(policy, 4, scale=0.01)
    trained = policy.adapter_weights()
    backwards = {k: 2 * start[k] - v for k, v in trained.tensors.items()}  # the engine moves the other way
    sync.push = lambda p: (engine.load_adapter(AdapterWeights(backwards, trained.config, trained.version)), len(trained.modules), 0.0)
    with pytest.raises(WeightSyncError, match="followed only -"):
        sync.sync(policy)


def test_the_running_response_passes_a_partly_followed_sync(setup):
    policy, engine, probe, _ = setup
    sync = WeightSync(engine, probe, tolerance=1.0, min_response=0.1)
    sync.sync(policy)
    engine_state = {k: v.clone() for k, v in policy.adapter_weights().tensors.items()}
    for seed in (5, 6):  # the engine gets 30% of each update (as if the rest were rounded away)
        start = {k: v.clone() for k, v in policy.adapter_weights().tensors.items()}
        _train(policy, seed, scale=0.01)
        trained = policy.adapter_weights()
        engine_state = {k: engine_state[k] + 0.3 * (v - start[k]) for k, v in trained.tensors.items()}
        sync.push = lambda p, pushed=engine_state, trained=trained: (
            engine.load_adapter(AdapterWeights(pushed, trained.config, trained.version)), len(trained.modules), 0.0)
        metrics = sync.sync(policy)
        assert 0.2 < metrics["sync/engine_response"] < 0.4
        assert 0.2 < metrics["sync/engine_response_running"] < 0.4
        assert 0.2 < metrics["sync/engine_response_total"] < 0.4  # since the first sync: also about 0.3


def test_merged_weights_with_unknown_names_are_refused_with_the_count(setup):
    policy, engine, _, _ = setup
    with pytest.raises(EngineError, match="no weight for 1 pushed tensors"):
        engine.update_weights([("model.layers.0.no_such_proj.weight", torch.zeros(1))])


def test_sampler_and_trainer_log_probs_agree_at_the_sampling_temperature(tmp_path, tiny_tokenizer):
    from alfrl.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "random", seed=0, pretrain_steps=0)  # random weights: a flat distribution
    policy = AlfrlPolicy(model_name=str(model_dir), dtype="float32", lora=LoRAConfig(rank=8, alpha=16), ppo=PPOConfig(old_logprobs="recompute"))
    policy.configure_model()
    probe = chat_format(tiny_tokenizer, "tool_call").first_prompt_ids("Your task is to: look.")
    live = HFEngine(lambda: policy.model, policy.load_tokenizer().pad_token_id)
    (completions,) = live.generate([SamplingRequest(tuple(probe), 2, 0.7, 1.0, 12, (), seed=5)])
    samples = []
    for c in completions:
        seq = TokenSequence(tuple(probe) + c.token_ids, tuple([0.0] * len(probe)) + c.logprobs, ((0, len(probe), len(probe) + len(c.token_ids)),))
        samples.append(sample_of(seq, [0.0], 0, 0))
    for sample, c, old in zip(samples, completions, policy.old_logprobs(samples, temperature=0.7)):
        assert torch.allclose(old, torch.tensor(c.logprobs), atol=1e-4)
    at_one = policy.old_logprobs(samples, temperature=1.0)
    assert (at_one[0] - torch.tensor(completions[0].logprobs)).abs().mean() > 1e-3  # T = 1 would be the wrong distribution


def test_non_finite_log_probs_stop_the_sync_instead_of_passing_every_comparison(setup):
    policy, engine, probe, _ = setup
    sync = WeightSync(engine, probe, tolerance=0.1, min_response=0.5)
    sync.sync(policy)
    _train(policy, 7, scale=0.01)
    score = engine.score
    engine.score = lambda ids: score(ids)[:-1] + [float("nan")]
    with pytest.raises(NonFiniteProbeError, match="not finite"):
        sync.canary(policy)  # garbage is not a canary caught
    with pytest.raises(NonFiniteProbeError, match="not finite"):
        sync.sync(policy)
    # NaN right after the wake-up, before the push: the engine's own hint (vLLM's: its graphs and sleep mode) is appended
    engine.wake_up_nan_hint = "; try enforce_eager"
    with pytest.raises(NonFiniteProbeError, match="before the push's .* not finite: .*here\\); try enforce_eager$"):
        sync.sync(policy)
    engine.score = score
    trained = policy.score(probe)
    policy.score = lambda ids: trained[:-1] + [float("nan")]  # the trainer's NaN gets no engine hint
    with pytest.raises(NonFiniteProbeError, match="trainer's .* so this stops here\\)$"):
        sync.sync(policy)
    del policy.score  # the trainer's own scoring again
    # NaN only after the push: the error says whether the pushed weights were finite and what the trainer scored
    engine.wake_up_nan_hint = ""
    pushed = {"n": 0}
    push = engine.load_adapter

    def load_then_nan(adapter):
        pushed["n"] += 1
        return push(adapter)

    engine.load_adapter = load_then_nan
    engine.score = lambda ids: score(ids)[:-1] + [float("nan")] if pushed["n"] else score(ids)
    with pytest.raises(NonFiniteProbeError, match=r"engine's .* here\); all \d+ pushed lora tensors are finite; the trainer's probe: 0 non-finite$"):
        sync.sync(policy)
    engine.fault_hint = "; graphs and LoRA"  # the engine's note on its settings (vLLM's: CUDA graphs with LoRA served)
    pushed["n"] = 0
    with pytest.raises(NonFiniteProbeError, match=r"the trainer's probe: 0 non-finite; graphs and LoRA$"):
        sync.sync(policy)
    engine.fault_hint = ""
    param = next(p for n, p in policy.model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        param[0, 0] = float("inf")
    pushed["n"] = 0
    with pytest.raises(NonFiniteProbeError, match=r"1 of the \d+ pushed lora tensors have non-finite values"):
        sync.sync(policy)


def test_a_skipped_sync_under_the_noise_floor_is_still_caught_when_the_engine_did_not_move_at_all(setup):
    policy, engine, probe, _ = setup
    sync = WeightSync(engine, probe, tolerance=0.1, min_response=0.5)
    sync.sync(policy)
    sync.floor = 1.0  # a floor far above this update: the response is not checked, the exact-zero rule still is
    _train(policy, 8, scale=0.001)
    with pytest.raises(WeightSyncError, match="did not move at all"):
        sync.sync(policy, push=False)
    real = sync.sync(policy)
    assert "sync/engine_response_running" not in real and real["sync/engine_response"] == pytest.approx(1.0, abs=1e-3)


def test_the_engine_is_checked_after_a_rollout_against_its_last_sync(setup):
    """check_engine: nothing before the first sync; then the probe as right after the sync (drift 0, even with the trainer
    moved: no push); a NaN engine raises naming when."""
    policy, engine, probe, _ = setup
    sync = WeightSync(engine, probe, tolerance=0.1, min_response=0.5)
    assert sync.check_engine("after the rollout") == {}
    sync.sync(policy)
    _train(policy, 9)  # the trainer moves; the engine (a separate copy) must not
    checked = sync.check_engine("after the rollout")
    assert checked["engine/probe_drift"] == 0.0 and checked["engine/probe_seconds"] > 0
    score = engine.score
    engine.score = lambda ids: [x + 0.5 for x in score(ids)[:-1]] + [float("inf")]
    with pytest.raises(NonFiniteProbeError, match="after the rollout, 1 of the hf engine's"):
        sync.check_engine("after the rollout")
    engine.score = lambda ids: [x + 0.5 for x in score(ids)]
    assert sync.check_engine("after the rollout")["engine/probe_drift"] == pytest.approx(0.5)


def test_a_skipped_push_is_caught_even_when_the_probe_after_the_rollout_drifted(setup):
    """On the H200 the engine's probe right after a rollout differed from its score after the last sync with no push in
    between (engine/probe_drift up to 0.206, 2026-12-04 fits), while two scores at a sync came out bit-identical (the
    canary caught, 2026-12-02e). The sync scores its "before" itself, so a drifted after-rollout score cannot hide a push
    that never came."""
    policy, engine, probe, _ = setup
    sync = WeightSync(engine, probe, tolerance=0.1, min_response=0.5)
    sync.sync(policy)
    _train(policy, 13, scale=0.001)
    score = engine.score
    engine.score = lambda ids: [x + 1e-3 for x in score(ids)]  # the rollout's leftovers shift the engine's numbers
    assert sync.check_engine("after the rollout")["engine/probe_drift"] == pytest.approx(1e-3)
    engine.score = score  # idle again
    with pytest.raises(WeightSyncError, match="did not move at all"):
        sync.sync(policy, push=False)


def test_an_engine_that_fails_scoring_the_probe_says_when_and_what_is_known(setup):
    """A CUDA fault in the engine (vLLM on the H200: the first request, the sync's probe) becomes an EngineError naming
    the sync and the engine's hint, the original as its cause; the engine's own errors pass as they are."""
    policy, engine, probe, _ = setup
    sync = WeightSync(engine, probe, tolerance=0.1, min_response=0.5)
    score = engine.score

    def fault(ids):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported")

    engine.score, engine.fault_hint = fault, "; try enforce_eager"
    with pytest.raises(EngineError, match=r"^the hf engine failed scoring the sync's probe before pushing weight version 0 "
                       r"\(RuntimeError: CUDA error: an illegal memory access was encountered\); try enforce_eager$") as raised:
        sync.sync(policy)
    assert isinstance(raised.value.__cause__, RuntimeError)
    engine.score = score
    sync.sync(policy)
    engine.score = fault
    with pytest.raises(EngineError, match="failed scoring the sync's probe after the rollout"):
        sync.check_engine("after the rollout")

    def refused(ids):
        raise EngineError("vLLM scored 3 of 9 probe tokens")

    engine.score = refused
    with pytest.raises(EngineError, match="^vLLM scored 3 of 9 probe tokens$"):
        sync.sync(policy)
