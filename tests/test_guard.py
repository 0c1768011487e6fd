"""alfrl.guard: the trainer's parameters and optimizer state must come out of a rollout and a sync as an update left them."""

import pytest
import torch

from alfrl.engines import EngineError
from alfrl.guard import MemoryGuard, TrainerMemoryError, fingerprint


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].weight.requires_grad_(False)  # a frozen base weight is watched too
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def test_an_untouched_trainer_passes_and_its_fingerprint_names_every_tensor():
    model, opt = _trained()
    names, bits = fingerprint(model, opt)
    assert names[:4] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert "exp_avg_sq of 1.weight" in names and "step of 0.bias" in names and len(bits) == len(names)
    guard = MemoryGuard()
    guard.check(model, opt, "nothing")  # nothing taken yet: nothing to compare
    guard.take(model, opt)
    model(torch.randn(5, 4))  # a forward reads, writes nothing of the trainer
    guard.check(model, opt, "a forward")


@pytest.mark.parametrize("write, name, where", [
    (lambda m, o: m[0].weight.data.view(-1)[3].add_(1e-3), "0.weight", "0 of 12 non-finite"),  # a frozen base weight
    (lambda m, o: m[1].bias.data.fill_(float("nan")), "1.bias", "2 of 2 non-finite"),
    (lambda m, o: o.state[m[1].weight]["exp_avg_sq"].view(-1)[0].mul_(-1.0), "exp_avg_sq of 1.weight", "0 of 6 non-finite"),  # NaN next step
])
def test_a_write_into_the_trainers_memory_stops_with_the_tensor_named(write, name, where):
    model, opt = _trained()
    guard = MemoryGuard()
    guard.take(model, opt)
    write(model, opt)
    with pytest.raises(TrainerMemoryError, match=r"1 of the trainer's 13 .* during the rollout, which computes none") as e:
        guard.check(model, opt, "the rollout")
    assert isinstance(e.value, EngineError)  # a run it stops ends with it as the last line (alfrl.recipe.report_stop)
    assert f"(first: {name} ({where}, cpu at 0x" in str(e.value)


def test_an_update_in_between_is_not_a_write_once_taken_again():
    model, opt = _trained()
    guard = MemoryGuard()
    guard.take(model, opt)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    guard.take(model, opt)
    guard.check(model, opt, "the rollout")


def test_the_guard_counts_the_time_it_takes():
    model, opt = _trained()
    guard = MemoryGuard()
    guard.take(model, opt)
    after_take = guard.seconds
    guard.check(model, opt, "the rollout")
    assert 0 < after_take < guard.seconds


def test_optimizer_state_made_up_front_changes_nothing_and_the_next_step_is_the_first():
    from alfrl.guard import allocate_optimizer_state

    def model_and_opt():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        model[0].weight.requires_grad_(False)
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)

    fresh, fresh_opt = model_and_opt()
    early, early_opt = model_and_opt()
    before = [p.detach().clone() for p in early.parameters()]
    assert allocate_optimizer_state(early_opt) == 3 and not fresh_opt.state
    assert all(torch.equal(a, b) for a, b in zip(before, early.parameters()))  # bit-identical weights
    assert all(p.grad is None for p in early.parameters()) and early_opt.param_groups[0]["lr"] == 1e-2
    assert sorted(early_opt.state[early[1].weight]) == ["exp_avg", "exp_avg_sq", "step"]
    assert allocate_optimizer_state(early_opt) == 0  # made once
    for _ in range(2):  # the same two updates: bit-identical weights and state
        x = torch.randn(5, 4)
        for model, opt in ((fresh, fresh_opt), (early, early_opt)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), early.parameters()))
    for a, b in zip(fresh_opt.state.values(), early_opt.state.values()):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_fit_starts_the_engine_after_the_trainers_weights_and_optimizer_state(tmp_path, tiny_model_dir, data_dir, monkeypatch):
    """On the H200 the graph fits' rollouts wrote into AdamW state made after the engine started (alfrl.guard). The
    engine now starts when every trainable parameter already has its optimizer state."""
    import logging
    from pathlib import Path

    from alfrl.cli import main
    from alfrl.sampler import Sampler

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    monkeypatch.setattr(logging, "raiseExceptions", False)  # Lightning's handlers hold an earlier test's captured stderr
    seen = []
    build = Sampler.build.__func__

    def recording_build(cls, policy, *args, **kwargs):
        optimizers = policy.trainer.optimizers if policy._trainer is not None else []
        params = [p for p in policy.parameters() if p.requires_grad]
        seen.append((sum(bool(optimizers and optimizers[0].state.get(p)) for p in params), len(params)))
        return build(cls, policy, *args, **kwargs)

    monkeypatch.setattr(Sampler, "build", classmethod(recording_build))
    args = ["fit", "--config", "recipes/tiny.yaml", "--model.model_name", tiny_model_dir, "--trainer.logger", "false",
            "--trainer.max_steps", "1", "--data.rollout.max_episode_steps", "3", "--checkpoint.save_every", "0",
            "--trainer.default_root_dir", str(tmp_path / "run")]
    assert main(args) == 0
    assert len(seen) == 1 and seen[0][1] > 0 and seen[0][0] == seen[0][1], seen

