"""The trainer's memory, checked across the work that computes none of it: the rollout and the weight sync.

A colocated vLLM engine runs in the trainer's process and CUDA context. On the H200 (raw-results-2026-12-06:bench/leases/2026-12-02i.md)
every 1.5B fit with vLLM's CUDA graphs and the LoRA adapter served ended with 3-4 of the trainer's own LoRA tensors
NaN after its second update, while the update's gradients were finite (a non-finite gradient skips the optimizer
step) and the same fits eager, or compiled without graphs, ran clean. Something wrote into the trainer's memory.

``MemoryGuard`` takes a fingerprint of every parameter and optimizer-state tensor (the float64 sum of each, its bits)
after an update and compares it before the next: the rollout, the sync and evaluation in between change none of them.
A difference stops the run at once, naming the tensors, instead of an update later as a NaN. A change that leaves
every sum bit-identical escapes it. About 1,500 small sums for the 1.5B model: 0.09-0.11 s a fit's first step on the
H200 (raw-results-2026-12-06:bench/leases/2026-12-03a.md); a take and a check on the step's path cost 0.165-0.380 s per update in the 2026-12-04
fits (g, h, i: ``train/memory_guard_seconds``, the sum so far).

The training step guards only with an engine whose ``guard_trainer_memory`` is true: vLLM's engine core in this process
(``data.engine.separate_process: false``). A core in a process of its own (the 1.5B recipes' since 2026-12-04, the fits
above) has a CUDA context of its own and cannot write into this one's memory; the hf engine allocates through torch's
own allocator, as the trainer does.

There the guard stopped the graph fits after the second rollout: the rollout and the sync had changed 6 of the
optimizer's state tensors (finite values, one contiguous stretch of memory). AdamW made that state at its first step,
after the engine had started, so it sat in memory the engine's allocator had held and given back. Hence the order a
fit keeps: the trainer's long-lived GPU tensors, its weights and (``allocate_optimizer_state``) its optimizer state,
exist before the engine starts (``RolloutDataModule.connect``, first called at ``on_train_start``), so no block the
engine used and freed can hold them.
"""

from __future__ import annotations

import time

import torch

from alfrl.engines import EngineError


class TrainerMemoryError(EngineError):
    """A trainer tensor changed while nothing of the trainer ran."""


def _tensors(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[list[str], list[torch.Tensor]]:
    names, tensors = [], []
    name_of = {}
    for name, p in module.named_parameters():
        names.append(name)
        tensors.append(p)
        name_of[id(p)] = name
    if optimizer is not None:
        for p, state in optimizer.state.items():
            for key, value in state.items():
                if torch.is_tensor(value):
                    names.append(f"{key} of {name_of.get(id(p), 'an optimizer parameter')}")
                    tensors.append(value)
    return names, tensors


def _sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bits of each tensor's float64 sum. The sums stay on their tensors' devices until one copy per device
    (AdamW keeps its step counts on the CPU)."""
    sums = torch.zeros(len(tensors), dtype=torch.float64)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    with torch.no_grad():
        for idx in by_device.values():
            sums[idx] = torch.stack([tensors[i].detach().sum(dtype=torch.float64) for i in idx]).cpu()
    return sums.view(torch.int64)


def fingerprint(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple[list[str], torch.Tensor]:
    """(names, the bits of each tensor's float64 sum) of every parameter and optimizer-state tensor."""
    names, tensors = _tensors(module, optimizer)
    return names, _sums(tensors)


def describe(t: torch.Tensor) -> str:
    """Where a tensor lives and how much of it is not finite: for a changed tensor, where the write landed."""
    bad = int((~torch.isfinite(t.detach())).sum()) if t.is_floating_point() else 0
    return f"{bad} of {t.numel()} non-finite, {t.device} at {t.data_ptr():#x}, {t.numel() * t.element_size()} bytes"


@torch.no_grad()
def allocate_optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    """Make the optimizer's state for every trainable parameter now, as its first step would (AdamW: zeros, step 0),
    instead of at that step. Done by the optimizer's own code: one step at learning rate 0 on zero gradients, which
    leaves every parameter bit-identical, then the step counts set back to 0; the next real step is the first (tested
    against a fresh optimizer). Returns how many parameters got state."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad and not optimizer.state.get(p)]
    if not params:
        return 0
    lrs = [g["lr"] for g in optimizer.param_groups]
    grads = [p.grad for p in params]
    try:
        for g in optimizer.param_groups:
            g["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for p, grad in zip(params, grads):
            p.grad = grad
    for p in params:
        state = optimizer.state[p]
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0
    return len(params)


class MemoryGuard:
    """``take`` after the trainer changed its tensors; ``check(what)`` raises if anything changed them since.
    ``seconds``: the time both took so far (logged by the trainer as ``train/memory_guard_seconds``)."""

    def __init__(self):
        self.taken: tuple[list[str], torch.Tensor] | None = None
        self.seconds = 0.0

    def take(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        started = time.perf_counter()
        self.taken = fingerprint(module, optimizer)
        self.seconds += time.perf_counter() - started

    def check(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, what: str) -> None:
        if self.taken is None:
            return
        started = time.perf_counter()
        names, bits = self.taken
        now_names, tensors = _tensors(module, optimizer)
        if now_names != names:
            return  # another set of tensors (an optimizer without its state made up front): nothing to compare
        changed = [i for i, (a, b) in enumerate(zip(bits.tolist(), _sums(tensors).tolist())) if a != b]
        self.seconds += time.perf_counter() - started
        if changed:
            first = ", ".join(f"{names[i]} ({describe(tensors[i])})" for i in changed[:3])
            raise TrainerMemoryError(
                f"{len(changed)} of the trainer's {len(names)} parameter and optimizer-state tensors changed during {what}, "
                f"which computes none of them (first: {first}): something in this process wrote into the "
                "trainer's memory; seen with vLLM's CUDA graphs and the LoRA adapter served (docs/faults.md), where "
                "data.engine.enforce_eager: true has run clean")
