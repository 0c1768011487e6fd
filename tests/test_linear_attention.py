"""The trainer's Gated DeltaNet kernel: FLA's guarded backward is used only after it matched the PyTorch reference."""

import functools
import inspect
from types import SimpleNamespace

import pytest
import torch

from alfrl import linear_attention as la
from alfrl.policy import AlfrlPolicy
from alfrl.policy import LoRAConfig

SIZES = {"key_heads": 2, "value_heads": 4, "key_dim": 16, "value_dim": 16}


@pytest.fixture()
def modeling():
    """transformers' Qwen3.5 modeling module, its chunked rule restored after the test."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as py

    saved = getattr(py, la.FUNCTION)
    yield py
    setattr(py, la.FUNCTION, saved)


def reference_of(py):
    return inspect.unwrap(getattr(py, la.FUNCTION))


def backward_only_bug(reference):
    """The same forward, the key's gradient 1.5x: what a miscompiled backward kernel (#640) looks like."""
    @functools.wraps(reference)
    def wrong(query, key, value, **kw):
        key = key + (0.5 * key - (0.5 * key).detach())
        return reference(query, key, value, **kw)
    return wrong


def test_the_check_accepts_the_reference_in_bf16_and_catches_a_backward_that_is_wrong(modeling):
    ref = reference_of(modeling)
    errors = la.relative_errors(ref, ref, SIZES, torch.device("cpu"), tokens=100)
    assert set(errors) == {"output", "query", "key", "value", "g", "beta"}
    assert max(errors.values()) <= la.CHECK_TOLERANCE / 2  # bf16 inputs against float32
    wrong = la.relative_errors(backward_only_bug(ref), ref, SIZES, torch.device("cpu"), tokens=100)
    assert wrong["output"] <= la.CHECK_TOLERANCE / 2 and wrong["key"] > la.CHECK_TOLERANCE


def test_the_check_gives_q_and_k_at_the_value_heads_count_which_every_reference_takes(modeling):
    """transformers 5.17's reference needs q and k at the value heads' count (on the H200 it raised otherwise)."""
    ref = reference_of(modeling)
    shapes = []

    def equal_heads_only(query, key, value, **kw):
        shapes.append((query.shape[2], key.shape[2], value.shape[2]))
        assert query.shape[2] == key.shape[2] == value.shape[2], "a 5.17-style reference"
        return ref(query, key, value, **kw)

    errors = la.relative_errors(equal_heads_only, equal_heads_only, SIZES, torch.device("cpu"), tokens=64)
    assert shapes == [(4, 4, 4)] * 2 and max(errors.values()) <= la.CHECK_TOLERANCE / 2


def hopper_with_old_triton(monkeypatch):
    """FLA installed, its #640 guard refusing (Hopper, Triton 3.6); the check itself run on the CPU."""
    guard = SimpleNamespace(IS_NVIDIA_HOPPER=True, TRITON_ABOVE_3_4_0=True, TRITON_ABOVE_3_7_1=False)
    monkeypatch.setattr(la, "fla_installed", lambda: True)
    monkeypatch.setattr(la, "fla_guard", lambda: guard)
    real = la.relative_errors
    monkeypatch.setattr(la, "relative_errors", lambda fast, ref, sizes, device: real(fast, ref, sizes, torch.device("cpu"), tokens=100))
    return guard


def test_auto_lifts_the_guard_only_for_a_kernel_that_matched_the_reference(qwen35_small_dir, modeling, monkeypatch):
    from alfrl.models import load_causal_lm

    model = load_causal_lm(qwen35_small_dir, torch.float32, "sdpa")
    guard = hopper_with_old_triton(monkeypatch)
    wrapper = getattr(modeling, la.FUNCTION)
    choice = la.select(model, "auto", torch.device("cuda"))
    assert choice.kernel == "fla" and guard.TRITON_ABOVE_3_7_1 and choice.max_error <= la.CHECK_TOLERANCE
    assert getattr(modeling, la.FUNCTION) is wrapper  # transformers keeps calling its FLA wrapper

    guard.TRITON_ABOVE_3_7_1 = False
    setattr(modeling, la.FUNCTION, backward_only_bug(reference_of(modeling)))
    with pytest.raises(la.LinearAttentionKernelError, match="set model.linear_attention_kernel: auto"):
        la.select(model, "fla", torch.device("cuda"))
    assert not guard.TRITON_ABOVE_3_7_1  # the guard stays as FLA set it
    choice = la.select(model, "auto", torch.device("cuda"))
    assert choice.kernel == "torch" and "does not match" in choice.reason and choice.max_error > la.CHECK_TOLERANCE
    assert getattr(modeling, la.FUNCTION) is reference_of(modeling) and not hasattr(getattr(modeling, la.FUNCTION), "__wrapped__")


def test_without_fla_or_cuda_the_reference_and_fla_asked_for_is_an_error(qwen35_small_dir, modeling, tiny_model_dir):
    from alfrl.models import load_causal_lm

    model = load_causal_lm(qwen35_small_dir, torch.float32, "sdpa")
    with pytest.raises(la.LinearAttentionKernelError, match="fla, but .*: install flash-linear-attention"):
        la.select(model, "fla", torch.device("cpu"))
    choice = la.select(model, "auto", torch.device("cpu"))
    assert choice.kernel == "torch" and getattr(modeling, la.FUNCTION) is reference_of(modeling)
    assert la.select(load_causal_lm(tiny_model_dir, torch.float32, "sdpa"), "auto", torch.device("cpu")).kernel == "none"
    with pytest.raises(ValueError, match="choose one of auto, fla, torch"):
        la.select(model, "triton", torch.device("cpu"))


def test_the_policy_chooses_before_its_first_update_and_the_recipe_key_is_checked(qwen35_small_dir, modeling):
    policy = AlfrlPolicy(model_name=qwen35_small_dir, dtype="float32", lora=LoRAConfig(rank=4, alpha=8), linear_attention_kernel="torch")
    policy.configure_model()
    assert policy.linear_attention is None  # scoring alone never needs the choice
    policy.prepare_training()
    assert policy.linear_attention.kernel == "torch" and policy.model.training
    problems = AlfrlPolicy.problems({"model_name": qwen35_small_dir, "linear_attention_kernel": "triton"})
    assert problems == ["model.linear_attention_kernel='triton': choose one of auto, fla, torch"]
