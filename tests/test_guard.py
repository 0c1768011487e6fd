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
