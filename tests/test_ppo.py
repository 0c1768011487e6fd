"""The PPO update (alfrl.ppo): packed rows, one update's direction, the sampler's log-probs as old ones, train mode and
gradient checkpointing, a non-finite gradient skipped."""

import math

import pytest
import torch

from alfrl.models import parameter_counts
from alfrl.policy import AlfrlPolicy, LoRAConfig
from alfrl.ppo import PPOConfig, collate, pack_microbatches, ppo_update
from tests.helpers import tail_sample

LORA8 = LoRAConfig(rank=8, alpha=16)


def test_pack_microbatches_respects_the_budget_without_padding():
    lengths = [100, 5000, 300, 12000, 200, 600]
    rows = pack_microbatches(lengths, 1000)
    assert sorted(i for b in rows for i in b) == list(range(6))
    for b in rows:
        assert len(b) == 1 or sum(lengths[i] for i in b) <= 1000  # the row's tokens, not count x longest
    assert [0, 4, 2] in rows and [3] in rows  # short ones share a row; a 12K-token trajectory is a row of its own
    assert pack_microbatches(lengths, 1000, pack=False) == [[0], [4], [2], [5], [1], [3]]


def test_sequences_packed_in_one_row_score_as_if_alone(policy):
    # no padding: three sequences share a row, position ids restart, attention stays inside each
    torch.manual_seed(3)
    samples = [tail_sample(torch.randint(0, 1000, (n,)).tolist(), n // 2, 1.0, traj=k) for k, n in enumerate((17, 30, 9))]
    row = collate(samples, [0, 1, 2], "cpu")
    assert row.input_ids.shape == (1, 56) and row.position_ids[0, 17].item() == 0 and row.position_ids[0, 47].item() == 0
    packed = policy.logprobs_of(row)
    alone = torch.cat([policy.logprobs_of(collate(samples, [i], "cpu")) for i in range(3)])
    assert packed.shape == alone.shape == (sum(s.trained_tokens for s in samples),)
    assert torch.allclose(packed, alone, atol=1e-5)


def test_one_update_raises_positive_and_lowers_negative_advantage_tokens(random_model_dir):
    # as in a group: the same prompts, answered with different tokens, one answer rewarded, one not
    policy = AlfrlPolicy(model_name=random_model_dir, dtype="float32", lora=LORA8, ppo=PPOConfig(old_logprobs="recompute"))
    policy.configure_model()
    torch.manual_seed(2)
    samples = []
    for k in range(3):
        prompt = torch.randint(0, 1000, (20,)).tolist()
        samples.append(tail_sample(prompt + [100 + k], 20, +1.0, traj=2 * k))
        samples.append(tail_sample(prompt + [300 + k], 20, -1.0, traj=2 * k + 1))
    before = [float(lp.sum()) for lp in policy.old_logprobs(samples)]
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-4)
    stats = ppo_update(policy, optimizer, samples)
    after = [float(lp.sum()) for lp in policy.old_logprobs(samples)]
    for i, sample in enumerate(samples):
        if sample.advantages_T[-2] > 0:
            assert after[i] > before[i], f"positive sample {i}: {before[i]:.4f} -> {after[i]:.4f}"
        else:
            assert after[i] < before[i], f"negative sample {i}: {before[i]:.4f} -> {after[i]:.4f}"
    assert stats["trained_tokens"] == 6
    assert stats["clip_fraction"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)  # first epoch: ratio 1
    assert stats["grad_norm"] > 0
    # 6N over the update and 2N for the trainer's old log-probs (old_logprobs: recompute), per second of both; no MFU
    # on a device without a known peak
    body, head = parameter_counts(policy.model)
    seconds = stats["old_logprob_seconds"] + stats["update_seconds"]
    assert stats["model_tflops"] * seconds * 1e12 == pytest.approx(8 * (body * 6 * 21 + head * 6), rel=1e-3)
    assert "mfu" not in stats


def test_sampler_old_logprobs_make_the_clip_bound_the_sampler_trainer_mismatch(random_model_dir):
    # the seed's convention: PPO's old log-probs are the rollout's. Here the "sampler" put every token
    # 0.5 nats below the trainer, so the first ratio is e^0.5 = 1.65, outside [0.8, 1.2]: positive
    # advantages are clipped (no gradient), negative ones train (and the dual clip 3 does not bind).
    policy = AlfrlPolicy(model_name=random_model_dir, dtype="float32", lora=LORA8)
    assert policy.ppo.old_logprobs == "sampler"
    policy.configure_model()
    torch.manual_seed(2)
    prompt = torch.randint(0, 1000, (20,)).tolist()
    probe = [tail_sample(prompt + [100 + k], 20, 1.0) for k in range(2)]
    trainer_lp = [float(policy.logprobs_of(collate(probe, [k], "cpu"))[0]) for k in range(2)]
    samples = [tail_sample(prompt + [100 + k], 20, adv, traj=k, sampler_logprob=lp - 0.5)
               for k, (adv, lp) in enumerate(zip((1.0, -1.0), trainer_lp))]
    stats = ppo_update(policy, torch.optim.AdamW(policy.trainable_parameters(), lr=1e-4), samples)
    assert stats["ratio_mean"] == pytest.approx(math.exp(0.5), rel=1e-4)
    assert stats["clip_fraction"] == 0.5 and stats["dual_clip_fraction"] == 0.0
    assert stats["sampler_minus_trainer_logprob"] == pytest.approx(-0.5, abs=1e-5)  # measured before the optimizer step


@pytest.mark.parametrize("checkpointing", [True, False])
def test_an_update_trains_in_train_mode_and_gradient_checkpointing_recomputes(random_model_dir, checkpointing):
    # from_pretrained leaves the base model in eval mode and Lightning keeps submodules' modes: before the fix the
    # decoder layers never saw training=True, so gradient_checkpointing: true recomputed nothing
    policy = AlfrlPolicy(model_name=random_model_dir, dtype="float32", lora=LORA8, gradient_checkpointing=checkpointing)
    policy.configure_model()
    layer = policy.model.get_base_model().model.layers[0]
    assert not layer.training  # as transformers hands it over
    calls, forward = [], layer.mlp.forward
    layer.mlp.forward = lambda *a, **k: calls.append(layer.training) or forward(*a, **k)
    torch.manual_seed(2)
    samples = [tail_sample(torch.randint(0, 1000, (24,)).tolist(), 12, 1.0 - 2 * k, traj=k) for k in range(2)]
    ppo_update(policy, torch.optim.AdamW(policy.trainable_parameters(), lr=1e-4), samples)
    assert calls and all(calls)  # every forward of the update ran in train mode
    rows = len(policy.microbatches(samples, [0, 1]))
    assert len(calls) == rows * (2 if checkpointing else 1)  # checkpointed: the backward ran each layer again


def test_a_non_finite_gradient_skips_the_step_instead_of_poisoning_the_weights(random_model_dir):
    # the H200 warm start of 2026-12-01 went NaN at step 18 and stayed NaN: a NaN gradient is now dropped
    policy = AlfrlPolicy(model_name=random_model_dir, dtype="float32", lora=LORA8)
    policy.configure_model()
    torch.manual_seed(4)
    good = tail_sample(torch.randint(0, 1000, (12,)).tolist(), 6, 1.0)
    bad = tail_sample(torch.randint(0, 1000, (12,)).tolist(), 6, 1.0)
    bad.advantages_T[bad.loss_mask_T] = float("nan")
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-2)
    before = policy.adapter_state()
    stats = ppo_update(policy, optimizer, [good, bad])
    after = policy.adapter_state()
    assert stats["skipped_steps"] == 1.0 and math.isnan(stats["grad_norm"])
    assert all(torch.equal(before[k], after[k]) for k in before)  # no step, no NaN
    stats = ppo_update(policy, optimizer, [good])  # the next finite step trains as usual
    assert stats["skipped_steps"] == 1.0 and math.isfinite(stats["grad_norm"])
    assert all(torch.isfinite(v).all() for v in policy.adapter_state().values())
    assert any(not torch.equal(before[k], v) for k, v in policy.adapter_state().items())


def test_a_packed_row_is_scored_without_reading_the_device_back(policy, monkeypatch):
    # each read of a GPU tensor on the host (a boolean mask's selection, .tolist(), float()) waits for every kernel queued
    # before it: collate finds the row's sequence lengths, trained positions and targets on the CPU instead
    from alfrl.attention import register
    from alfrl.logprobs import causal_lm_of, predicted_logprobs

    register()
    causal_lm_of(policy.model).set_attn_implementation("sdpa_varlen")
    torch.manual_seed(3)
    samples = [tail_sample(torch.randint(0, 1000, (n,)).tolist(), n // 2, 1.0, traj=k) for k, n in enumerate((17, 30, 9))]
    row = collate(samples, [0, 1, 2], "cpu")
    assert row.position_ids._alfrl_segments == (17, 30, 9)
    assert torch.equal(row.predict_index, torch.nonzero(row.predict_mask[0]).flatten())
    assert torch.equal(row.targets, torch.roll(row.input_ids, -1, dims=1)[row.predict_mask])
    with torch.no_grad():
        by_mask = predicted_logprobs(policy.model, row.input_ids, row.predict_mask, row.position_ids, None, 7)
    monkeypatch.setattr(torch, "nonzero", lambda *a, **k: pytest.fail("the row's scoring looked for its positions on the device"))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda *a, **k: pytest.fail("the row's scoring read a tensor back"))
    with torch.no_grad():
        scored = policy.logprobs_of(row)
    assert torch.equal(scored, by_mask)
    with pytest.raises(ValueError, match="the last position of a row has no next token"):
        bad = tail_sample(list(range(10)), 5, 1.0)
        bad.loss_mask_T[-1] = True
        collate([bad], [0], "cpu")
