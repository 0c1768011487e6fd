"""Which kernel computes the trainer's Gated DeltaNet layers (Qwen3.5's linear attention): ``model.linear_attention_kernel``.

transformers runs the chunked gated delta rule with flash-linear-attention (FLA) when that package is installed,
else with its PyTorch reference (correct, more than an order of magnitude slower). FLA 0.6 refuses the *gated
backward* on Hopper GPUs with Triton >= 3.4 and < 3.7.1 (fla-org/flash-linear-attention#640: a miscompile at one
block width). The GPU image's torch 2.11 ships Triton 3.6.0, so on an H200 the first update of a Qwen3.5 run
stopped there with FLA's RuntimeError, after the engine's start and a rollout (2026-12-02, raw-results-2026-12-06:bench/README.md).

- ``auto``: FLA where it runs as it is. Where its guard refuses, FLA's gated forward and backward are first
  compared with the PyTorch reference on this GPU at the model's head sizes (one sequence of a few chunks): FLA is
  used, its guard lifted, if every output and gradient agrees within ``CHECK_TOLERANCE``; otherwise the reference.
  Without FLA, or off CUDA, the reference.
- ``fla``: as ``auto``, but where FLA cannot be used (missing, off CUDA, or the check failed) it stops with an error.
- ``torch``: the PyTorch reference always.

The choice is made once, before the first update (the forward-only scoring never reaches the guarded kernel), and
applies to the whole process: transformers looks the function up in its modeling module at each call.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass

import torch

KERNELS = ("auto", "fla", "torch")
CHECK_TOLERANCE = 0.1
"""Largest relative L2 error (||fast - reference|| / ||reference||) of the output and of each input's gradient.
The reference itself from bf16 inputs against float32 ones: 0.004 (CPU, the Qwen3.5-4B head sizes); the
miscompile reported in #640: max error 14.7 in dk where the correct kernels stay under 0.02. Not yet run against
FLA on a GPU (2026-12-02)."""
FUNCTION = "torch_chunk_gated_delta_rule"
"""The name transformers' Qwen3.5 / Qwen3-Next modeling modules call the chunked rule by (its FLA-or-torch wrapper)."""
GUARD_MODULE = "fla.ops.common.chunk_o"


class LinearAttentionKernelError(RuntimeError):
    """``model.linear_attention_kernel: fla`` where FLA cannot be used."""


@dataclass(frozen=True)
class Choice:
    kernel: str
    """``fla`` or ``torch`` (``none`` for a model without linear attention)."""
    reason: str
    max_error: float | None = None
    """The check's largest relative error, where it ran."""


def modeling_modules(model: torch.nn.Module) -> list:
    """The Python modules whose layers in ``model`` call ``FUNCTION`` (one per model family)."""
    found = {}
    for module in model.modules():
        py = sys.modules.get(type(module).__module__)
        if py is not None and callable(getattr(py, FUNCTION, None)):
            found[py.__name__] = py
    return list(found.values())


def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def fla_guard():
    """FLA's module holding the #640 guard, or None where FLA is not installed or has no such guard."""
    if not fla_installed():
        return None
    try:
        mod = importlib.import_module(GUARD_MODULE)
    except Exception:  # an FLA that cannot be imported here is FLA transformers does not use either
        return None
    return mod if all(hasattr(mod, a) for a in ("IS_NVIDIA_HOPPER", "TRITON_ABOVE_3_4_0", "TRITON_ABOVE_3_7_1")) else None


def guard_refuses(guard) -> bool:
    return bool(guard is not None and guard.IS_NVIDIA_HOPPER and guard.TRITON_ABOVE_3_4_0 and not guard.TRITON_ABOVE_3_7_1)


def use_reference(modules: list) -> None:
    """Make each modeling module call the PyTorch reference (what its FLA-or-torch wrapper wraps)."""
    for py in modules:
        setattr(py, FUNCTION, inspect.unwrap(getattr(py, FUNCTION)))


def head_sizes(config) -> dict[str, int]:
    """The linear-attention head counts and sizes of a (text) config."""
    from alfrl.models import text_config_of

    c = text_config_of(config)
    return {"key_heads": c.linear_num_key_heads, "value_heads": c.linear_num_value_heads,
            "key_dim": c.linear_key_head_dim, "value_dim": c.linear_value_head_dim}


def relative_errors(fast, reference, sizes: dict[str, int], device, tokens: int = 320, seed: int = 0) -> dict[str, float]:
    """Relative L2 errors of ``fast`` against ``reference`` (both with transformers' signature): the output and the
    gradients of q, k, v, g and beta, for one sequence of ``tokens`` random bf16 inputs shaped like the model's layer
    (``fast`` gets bf16 leaves, the reference their float32 copies)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hk, hv, dk, dv = sizes["key_heads"], sizes["value_heads"], sizes["key_dim"], sizes["value_dim"]

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    # q and k repeated to the value heads, which every transformers version's reference takes: on the H200
    # (2026-12-02) the check with Qwen3.5-4B's 16 key and 32 value heads raised in transformers 5.17's reference
    # (a size mismatch, 16 against 32) after FLA had run, and the slower reference was used; 5.24's repeats them itself.
    query, key = (rand(1, tokens, hk, dk).repeat_interleave(hv // hk, dim=2) for _ in range(2))
    inputs = {"query": query, "key": key, "value": rand(1, tokens, hv, dv),
              "g": -torch.nn.functional.softplus(rand(1, tokens, hv)) * 0.5, "beta": torch.sigmoid(rand(1, tokens, hv))}
    grad_out = rand(1, tokens, hv, dv)

    def run(fn, dtype):
        leaves = {k: v.to(device=device, dtype=torch.float32 if k == "g" else dtype).requires_grad_(True)  # g is float32 in the model too
                  for k, v in inputs.items()}
        out, _ = fn(leaves["query"], leaves["key"], leaves["value"], g=leaves["g"], beta=leaves["beta"],
                    initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
        out.float().backward(grad_out.to(device=device))
        return {"output": out.detach().float().cpu(), **{k: v.grad.float().cpu() for k, v in leaves.items()}}

    got, want = run(fast, torch.bfloat16), run(reference, torch.float32)
    return {k: float((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-12)) for k in want}


def select(model: torch.nn.Module, kernel: str, device: torch.device) -> Choice:
    """Choose (and install) the kernel of ``model``'s linear-attention layers for training; see the module's doc."""
    if kernel not in KERNELS:
        raise ValueError(f"model.linear_attention_kernel={kernel!r}: choose one of {', '.join(KERNELS)}")
    modules = modeling_modules(model)
    if not modules:
        return Choice("none", "no linear-attention layers")
    if kernel == "torch":
        use_reference(modules)
        return Choice("torch", "model.linear_attention_kernel: torch")
    if not fla_installed() or device.type != "cuda":
        why = "flash-linear-attention is not installed" if not fla_installed() else f"the model is on {device.type}, FLA needs CUDA"
        if kernel == "fla":
            raise LinearAttentionKernelError(f"model.linear_attention_kernel: fla, but {why}: install flash-linear-attention "
                                             "on a CUDA machine, or set model.linear_attention_kernel: auto (the PyTorch reference)")
        use_reference(modules)
        return Choice("torch", why)
    guard = fla_guard()
    if not guard_refuses(guard):
        return Choice("fla", "flash-linear-attention")
    # Hopper + Triton in [3.4, 3.7.1): FLA refuses its gated backward; check it here before lifting the guard
    guard.TRITON_ABOVE_3_7_1 = True
    fast = getattr(modules[0], FUNCTION)
    try:
        errors = relative_errors(fast, inspect.unwrap(fast), head_sizes(model.config), device)
    except Exception as e:  # a kernel that fails to run is a failed check
        errors = {f"the check raised {type(e).__name__}: {e}": float("inf")}
    worst_name, worst = max(errors.items(), key=lambda kv: kv[1])
    if worst <= CHECK_TOLERANCE:
        return Choice("fla", f"flash-linear-attention, its Triton guard (#640) lifted: gated forward and backward match the "
                              f"PyTorch reference on this GPU (largest relative error {worst:.3g}, in {worst_name})", worst)
    guard.TRITON_ABOVE_3_7_1 = False
    message = (f"flash-linear-attention's gated backward does not match the PyTorch reference on this GPU (relative error "
               f"{worst:.3g} in {worst_name}, tolerance {CHECK_TOLERANCE})")
    if kernel == "fla":
        raise LinearAttentionKernelError(f"model.linear_attention_kernel: fla, but {message}: install Triton >= 3.7.1, or set "
                                         "model.linear_attention_kernel: auto (the PyTorch reference, slower)")
    use_reference(modules)
    return Choice("torch", message + ": the PyTorch reference is used (correct, slower)", worst)
