"""The update of finished groups during the rollout (alfrl.update.GroupUpdate) is the update after it."""

from types import SimpleNamespace

import pytest
import torch

from alfrl.advantages import sample_of
from alfrl.policy import AlfrlPolicy
from alfrl.ppo import LoRAConfig, OptimizerConfig, PPOConfig
from alfrl.types import TokenSequence
from alfrl.update import GroupUpdate


@pytest.fixture(scope="module")
def random_model_dir(tmp_path_factory):
    from alfrl.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("random") / "model", seed=0, pretrain_steps=0))


def _groups(n_groups=3, k=4, seed=5):
    """Groups of k samples of several lengths and turns, advantages of both signs, sampler log-probs off the trainer's."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(n_groups):
        samples = []
        for t in range(k):
            n = int(torch.randint(12, 40, (1,), generator=gen))
            ids = torch.randint(0, 1000, (n,), generator=gen).tolist()
            cut = n // 2
            spans = ((0, 5, cut), (1, cut + 3, n))
            logprobs = tuple(float(-torch.rand(1, generator=gen)) * 3 if i > 0 else 0.0 for i in range(n))
            seq = TokenSequence(tuple(ids), logprobs, spans)
            samples.append(sample_of(seq, [float(t - 1.5), 0.5 * (g - 1)], g, t))
        groups.append(samples)
    return groups


def _policy(model_dir, compiled=False, **ppo):
    policy = AlfrlPolicy(model_name=model_dir, dtype="float32", lora=LoRAConfig(rank=4, alpha=8), optim=OptimizerConfig(grad_clip_norm=0.0),
                         ppo=PPOConfig(microbatch_tokens=64, **ppo), compile_layers=compiled, compile_attention=compiled,
                         attn_implementation="sdpa_varlen" if compiled else "sdpa")
    torch.manual_seed(0)  # the same LoRA A in every policy
    policy.configure_model()
    for name, p in policy.model.named_parameters():  # B != 0, so A gets gradients too
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    return policy


def _lora(policy):
    return {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("aggregation,old,threaded,compiled", [("token_mean", "sampler", False, False), ("token_sum", "recompute", False, False),
                                                               ("seq_mean", "sampler", True, False), ("token_mean", "recompute", True, False),
                                                               ("token_mean", "sampler", True, True)])
def test_groups_fed_one_by_one_give_the_update_of_the_whole_batch(random_model_dir, aggregation, old, threaded, compiled):
    # compiled: model.compile_layers + compile_attention, first compiled in the worker thread ("during" runs first)
    groups = _groups()
    batch = [s for g in groups for s in g]
    stats = {}
    weights = {}
    for mode in ("during", "after"):
        policy = _policy(random_model_dir, compiled=compiled, loss_aggregation=aggregation, old_logprobs=old)
        sgd = torch.optim.SGD(policy.trainable_parameters(), lr=0.5)  # a step proportional to the gradient: its scale is checked
        if mode == "after":
            stats[mode] = policy.update(batch, optimizer=sgd)
        else:
            early = GroupUpdate(policy, 1.0, threaded=threaded)
            for g in reversed(groups):  # in the order the groups finish, not the batch's
                early.add(g)
            early.add([])  # a dropped group
            stats[mode] = early.finish(batch, sgd.step)
            assert all(p.grad is None for p in policy.trainable_parameters())
        assert any(m._compiled_call_impl is not None for m in policy.model.modules()) == compiled
        weights[mode] = _lora(policy)
    before = _lora(_policy(random_model_dir))
    assert any(not torch.equal(before[n], weights["after"][n]) for n in before), "the update changed nothing: the test would prove nothing"
    for n in before:
        torch.testing.assert_close(weights["during"][n], weights["after"][n], rtol=1e-5, atol=1e-7, msg=n)
    for key in ("loss", "grad_norm", "clip_fraction", "approx_kl", "ratio_mean", "trained_tokens", "samples",
                "sampler_minus_trainer_logprob", "sequence_tokens"):
        assert stats["during"][key] == pytest.approx(stats["after"][key], rel=1e-5, abs=1e-9), key
    assert stats["during"]["groups_during_rollout"] == 3.0
    assert stats["during"]["update_during_rollout_seconds"] > 0
    assert stats["during"]["model_tflops"] > 0


def test_the_trained_groups_must_be_the_batch(random_model_dir):
    groups = _groups()
    policy = _policy(random_model_dir)
    early = GroupUpdate(policy, 1.0, threaded=False)
    early.add(groups[0])
    early.add(groups[1])
    with pytest.raises(AssertionError, match=r"trained during the rollout \(8 samples\) are not the batch's \(12 samples\)"):
        early.finish([s for g in groups for s in g], lambda: None)


def test_a_failure_in_the_worker_stops_the_rollout_at_the_next_group_and_the_gradients_are_dropped(random_model_dir):
    groups = _groups()
    bad = sample_of(TokenSequence((5, 6, 10**7, 8), (0.0, -1.0, -1.0, -1.0), ((0, 1, 4),)), [1.0], 9, 0)  # an id past the vocabulary
    policy = _policy(random_model_dir)
    early = GroupUpdate(policy, 1.0, threaded=True)
    early.add(groups[0])
    early.add([bad])
    early.thread.join(timeout=60)  # the worker stopped at the bad group
    with pytest.raises(RuntimeError, match="the update of finished groups failed"):
        early.add(groups[1])
    early.abort()
    assert all(p.grad is None for p in policy.trainable_parameters())


def test_more_than_one_optimizer_step_is_refused_with_the_fix(random_model_dir):
    assert any("update_during_rollout=true needs one optimizer step per rollout, not epochs=2 x minibatches=1: set both to 1"
               in m for m in PPOConfig(update_during_rollout=True, epochs=2).problems())
    assert PPOConfig(update_during_rollout=True).problems() == []
    policy = _policy(random_model_dir, minibatches=2)
    with pytest.raises(ValueError, match="epochs 1, minibatches 1"):
        GroupUpdate(policy, 1.0, threaded=False)



def test_the_step_replay_trains_each_group_when_its_last_trajectory_ends_and_serially_the_same_samples(random_model_dir, tmp_path):
    """bench/step_replay.py on a stand-in engine (one token a step): beside the replay, a group goes to the update when its
    last trajectory's last turn ends, while the other group still plays; serially, after the replay. Both train the same
    samples (the same LoRA after the optimizer step, from the same start); the saved turns keep the sampler's log-probs."""
    from tests.helpers import OneTokenCore, load_bench

    rc, sr = load_bench("replay_ceiling"), load_bench("step_replay")

    def trajectory(seed, turn_tokens):  # one full-history sequence: a 4-token prompt before each turn of that many tokens
        gen = torch.Generator().manual_seed(seed)
        ids, spans, pos = [], [], 0
        for turn, n in enumerate(turn_tokens):
            ids += torch.randint(0, 1000, (4 + n,), generator=gen).tolist()
            spans.append((turn, pos + 4, pos + 4 + n))
            pos += 4 + n
        logprobs = tuple(-0.5 - (i % 7) / 10 if i else 0.0 for i in range(len(ids)))
        return TokenSequence(tuple(ids), logprobs, tuple(spans))

    seqs = [trajectory(1, [2, 3]), trajectory(2, [3, 2]), trajectory(3, [6, 8]), trajectory(4, [5, 9])]  # group 0 ends first
    rc.save_turns([SimpleNamespace(sequences=(s,)) for s in seqs], str(tmp_path / "turns.json.gz"))
    trajectories = rc.load_turns(str(tmp_path / "turns.json.gz"))
    assert [t.sequences for t in trajectories] == [(s,) for s in seqs]  # log-probs too

    results, loras = {}, {}
    for mode in ("beside", "serial"):
        policy = _policy(random_model_dir)
        optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-3)
        run = lambda **hooks: rc.replay(OneTokenCore(), trajectories, make_params=lambda n: n, **hooks)  # noqa: E731
        synced = []
        results[mode] = sr.play_step(run, policy, trajectories, 2, 1.0, optimizer, mode, sync=lambda: synced.append(1) or {"taken": 4},
                                     threaded=False)
        loras[mode] = _lora(policy)
        assert synced == [1] and results[mode]["sync/taken"] == 4
    beside, serial = results["beside"], results["serial"]
    assert beside["groups_handed"] == [(0, 2), (1, 0)]  # group 0 trained while group 1's two trajectories still played
    assert serial["groups_handed"] == [(0, 0), (1, 0)]
    assert beside["engine_steps"] == serial["engine_steps"] == 14  # the longest trajectories' 14 tokens, one a step
    assert beside["samples"] == serial["samples"] == 4 and beside["update/samples"] == serial["update/samples"] == 4.0
    # half of the 4 ended (group 0, after its 5 tokens) before steps 6..14
    assert beside["tail_steps"] == serial["tail_steps"] == 9 and beside["update/groups_during_rollout"] == 2.0
    for name in loras["beside"]:
        torch.testing.assert_close(loras["beside"][name], loras["serial"][name])
    assert sr.tail_figures([(0.001, 0), (0.002, 1), (0.004, 2), (0.006, 3)], 4) == {"tail_steps": 2, "tail_step_ms": 5.0}
    with pytest.raises(ValueError, match="step mode 'after': choose one of beside, serial"):
        sr.play_step(run, policy, trajectories, 2, 1.0, optimizer, "after")


def test_the_step_phase_plays_on_the_hf_engine_through_its_submit_and_step(random_model_dir):
    """sampler_bench's step phase in a CPU dry run: the replay through the hf engine's submit / step (lengths asked, not
    forced), every mode's figures, the trained samples all of them."""
    from alfrl.evaluation import EvalConfig
    from alfrl.rewards import RewardConfig
    from alfrl.rollout import RolloutConfig
    from alfrl.envs import EnvConfig
    from alfrl.sampler import Sampler
    from alfrl.sampler_config import EngineConfig
    from tests.helpers import load_bench

    sr = load_bench("step_replay")
    policy = _policy(random_model_dir)
    sampler = Sampler.build(policy, RolloutConfig(), RewardConfig(), EngineConfig(), EnvConfig(), EvalConfig(), with_pool=False)
    groups = _groups(n_groups=2, k=2)
    trajectories = [SimpleNamespace(sequences=(TokenSequence(tuple(s.token_ids_T.tolist()), (0.0,) * len(s), ((0, 5, 9), (1, 12, 14))),))
                    for g in groups for s in g]
    out = sr.step_phase(sampler, policy, trajectories, 2, 1.0, ("beside", "serial"))
    assert [r["mode"] for r in out["runs"]] == ["beside", "serial"] and out["trajectories"] == 4 and out["warm_up_seconds"] > 0
    first = sr.first_turns(trajectories, 1)  # the warm-up's replay: each trajectory cut after its first turn
    assert [t.sequences[0].spans for t in first] == [((0, 5, 9),)] * 4 and len(first[0].sequences[0].token_ids) == 9
    assert first[0].sequences[0].sampler_logprobs == trajectories[0].sequences[0].sampler_logprobs[:9]
    for run in out["runs"]:
        assert run["turns"] == 8 and run["update/samples"] == 4.0 and [g for g, _ in run["groups_handed"]] == [0, 1]
        assert run["step_seconds"] >= run["replay_seconds"] > 0
