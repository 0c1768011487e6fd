"""The update's benchmark (``sampler_bench --phases update``): PPO updates on the same samples, one per variant of the
packed-row size, gradient checkpointing, the LoRA's float32 matmul precision, the adapter's dtype, compiled layers and
SDPA's kernels: seconds, peak memory, MFU (6N, and 8N with the gradient-checkpoint recompute), the sampler-trainer gap;
``profile_tables`` for torch.profiler runs (this one's and the engine steps' in sampler_bench)."""

from __future__ import annotations

import dataclasses
import time
import traceback

import torch

from alfrl.models import parameter_counts, peak_bf16_tflops, update_flops
from alfrl.ppo import ppo_update

DENSE_BF16_TFLOPS = peak_bf16_tflops("NVIDIA H200")  # NVIDIA's dense bf16 figure (alfrl.models.PEAK_BF16_TFLOPS): 989


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def model_flops(policy) -> tuple[float, float]:
    """(N body parameters, output-layer parameters): the body runs on every token, the output layer on trained ones."""
    return parameter_counts(policy.model)


UPDATE_VARIANTS = (  # (name, attention, micro-batch tokens, gradient checkpointing, float32 matmul precision, adapter dtype,
    # compiled layers), the same samples
    ("varlen_rows4096_bf16", "sdpa_varlen", 4096, False, "highest", "bfloat16", False),  # the H100 learning recipes (rl_qwen15b_grpo / gigpo)
    ("varlen_rows16384", "sdpa_varlen", 16384, False, "highest", "float32", False),  # the 1.5B recipes since 2026-12-01
    ("varlen_rows16384_tf32", "sdpa_varlen", 16384, False, "high", "float32", False),  # the LoRA's float32 matmuls on TF32
    ("varlen_rows16384_bf16", "sdpa_varlen", 16384, False, "highest", "bfloat16", False),  # the adapter in bf16 (autocast)
    ("varlen_rows16384_bf16_compiled", "sdpa_varlen", 16384, False, "highest", "bfloat16", True),  # + MLP and norms compiled
    ("varlen_rows32768_bf16_compiled", "sdpa_varlen", 32768, False, "highest", "bfloat16", True),  # longer rows (no float32 copies)
    # the attention block compiled too (rotary, its LoRA's scale-and-add; graph breaks at the per-sequence split)
    ("varlen_rows32768_bf16_compiled_attention", "sdpa_varlen", 32768, False, "highest", "bfloat16", "with_attention"),
    # SDPA's cuDNN kernels first (the update's FlashAttention-2 forward and backward were 31% of its kernel time)
    ("varlen_rows32768_bf16_compiled_cudnn", "sdpa_varlen+cudnn", 32768, False, "highest", "bfloat16", True),
    # checkpointing in effect since 2026-12-01 (before, nothing was recomputed): its cost, and the longer rows it allows
    ("varlen_rows32768_bf16_compiled_checkpointed", "sdpa_varlen", 32768, True, "highest", "bfloat16", True),
)
PROFILED_VARIANT = "varlen_rows16384_bf16_compiled"


def _set_attention(policy, name: str) -> None:
    """transformers' attention by name; ``NAME+cudnn``: that one, its SDPA calls under ``_sdpa_backends``."""
    from alfrl.attention import register
    from alfrl.logprobs import causal_lm_of

    register()
    causal_lm_of(policy.model).set_attn_implementation(name.split("+")[0])


def _sdpa_backends(attn: str):
    """SDPA's cuDNN kernels first for a ``+cudnn`` variant (PyTorch falls back in order where cuDNN cannot run a call)."""
    from contextlib import nullcontext

    if not attn.endswith("+cudnn"):
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


def _set_checkpointing(policy, on: bool) -> None:
    from alfrl.logprobs import causal_lm_of
    from alfrl.models import set_gradient_checkpointing

    set_gradient_checkpointing(causal_lm_of(policy.model), on)


def _apply_variant(policy, attn: str, rows: int, ckpt: bool, precision: str, adapter_dtype: str, compiled) -> None:
    """One UPDATE_VARIANTS entry's settings on the policy (the precision and the adapter's dtype take effect in the update);
    ``compiled``: False, True (model.compile_layers) or "with_attention" (the attention block too)."""
    from alfrl.logprobs import causal_lm_of
    from alfrl.models import COMPILED_PARTS, compile_layers

    _set_attention(policy, attn)
    _set_checkpointing(policy, ckpt)
    policy.hparams.float32_matmul_precision = precision
    policy.hparams.adapter_dtype = adapter_dtype
    lm = causal_lm_of(policy.model)
    compile_layers(lm, on=bool(compiled), parts=COMPILED_PARTS)
    compile_layers(lm, on=compiled == "with_attention", parts=("self_attn",))
    policy.hparams.ppo = dataclasses.replace(policy.ppo, microbatch_tokens=rows)


def update_phase(policy, samples, temperature: float, variants=UPDATE_VARIANTS, profile_path: str | None = None, on_run=None,
                 profile_variant: str = PROFILED_VARIANT) -> dict:
    """One warm-up update, then one PPO update per variant (attention, row size, checkpointing) on the same samples,
    the sampler's log-probs as old ones (the recipes'); and the first row's log-probs under sdpa and sdpa_varlen.
    ``on_run(figures so far)`` after each run (a caller saves them: a run cut short keeps what finished)."""
    body, head = model_flops(policy)
    out = {"samples": len(samples), "sequence_tokens": sum(len(s) for s in samples), "trained_tokens": sum(s.trained_tokens for s in samples),
           "body_parameters": body, "output_layer_parameters": head, "runs": []}
    tokens, trained = out["sequence_tokens"], out["trained_tokens"]
    ppo0, attn0 = policy.ppo, policy.hparams.attn_implementation
    ckpt0 = bool(policy.hparams.gradient_checkpointing)
    precision0 = policy.hparams.get("float32_matmul_precision", "highest")
    adapter0, compiled0 = policy.hparams.get("adapter_dtype", "float32"), bool(policy.hparams.get("compile_layers", False))
    policy.hparams.ppo = dataclasses.replace(ppo0, old_logprobs="sampler")
    try:  # the same packed row scored both ways: the new attention must give the old one's log-probs
        _set_checkpointing(policy, False)
        policy.hparams.ppo = dataclasses.replace(policy.ppo, microbatch_tokens=16384)
        row = max(policy.microbatches(samples, list(range(len(samples)))), key=lambda mb: len(mb.members))
        with torch.no_grad():
            scored = {}
            for attn in ("sdpa", "sdpa_varlen"):
                _set_attention(policy, attn)
                scored[attn] = policy.logprobs_of(row, temperature).float()
        out["varlen_check"] = {"row_sequences": len(row.members), "row_tokens": int(row.input_ids.shape[1]),
                               "max_abs_logprob_diff": float((scored["sdpa"] - scored["sdpa_varlen"]).abs().max()),
                               "mean_abs_logprob_diff": float((scored["sdpa"] - scored["sdpa_varlen"]).abs().mean())}
        del scored, row
    except Exception:  # noqa: BLE001 - recorded; the timings still run
        out["varlen_check"] = {"error": traceback.format_exc(limit=4)}
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-6, betas=(0.9, 0.95))
    # a variant that compiles (or the first) runs once untimed before: its first update includes Inductor's compilation
    runs, compiled_before = [], None
    for name, *settings in variants:
        if compiled_before is None or settings[-1] != compiled_before:
            runs.append((f"{name}: warm-up", settings))
        runs.append((name, settings))
        compiled_before = settings[-1]
    for name, settings in runs:
        attn, rows, ckpt, precision, adapter_dtype, compiled = settings
        run = {"variant": name, "attention": attn, "microbatch_tokens": rows, "gradient_checkpointing": ckpt,
               "float32_matmul_precision": precision, "adapter_dtype": adapter_dtype, "compiled_layers": compiled}
        try:
            _apply_variant(policy, *settings)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                torch.cuda.synchronize()
            with _sdpa_backends(attn):
                stats, seconds = timed(lambda: ppo_update(policy, optimizer, samples, temperature))
            train_flops = update_flops(body, head, tokens, trained)
            recompute = update_flops(body, head, tokens, trained, recompute=ckpt) - train_flops  # checkpointed layers: forward twice
            run.update({"seconds": seconds, "update_seconds": stats["update_seconds"], "peak_memory_gib": stats["peak_memory_gib"],
                        "rows": len(policy.microbatches(samples, list(range(len(samples))))),
                        "mfu_6n": train_flops / seconds / (DENSE_BF16_TFLOPS * 1e12),
                        "mfu_6n_plus_recompute": (train_flops + recompute) / seconds / (DENSE_BF16_TFLOPS * 1e12),
                        "tokens_per_second": tokens / seconds,
                        # the trainer against the sampler on the trained tokens, before this update's optimizer step
                        "sampler_trainer_abs_logprob_diff": stats["sampler_trainer_abs_logprob_diff"]})
        except Exception:  # noqa: BLE001 - an out-of-memory variant is a figure too
            run["error"] = traceback.format_exc(limit=4)
        out["runs"].append(run)
        if on_run is not None:
            on_run(out)
    if profile_path:  # one variant once more under torch.profiler: where an update's time goes
        try:
            from torch.profiler import ProfilerActivity, profile

            name, *settings = next((v for v in variants if v[0] == profile_variant), variants[0])
            _apply_variant(policy, *settings)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=activities) as prof:
                _, seconds = timed(lambda: ppo_update(policy, optimizer, samples, temperature))
            out["profile"] = {"variant": name, "seconds": seconds, **profile_tables(prof, seconds, profile_path, f"update ({name})")}
        except Exception:  # noqa: BLE001 - recorded; the other figures stand
            out["profile"] = {"error": traceback.format_exc(limit=4)}
        if torch.cuda.is_available():  # and once under CUDA's sync debug mode: the update's reads of the device, counted
            out["profile"]["synchronizing_calls"] = count_synchronizing_calls(lambda: ppo_update(policy, optimizer, samples, temperature))
    _apply_variant(policy, attn0 or "sdpa", ppo0.microbatch_tokens, ckpt0, precision0, adapter0, compiled0)
    policy.hparams.ppo = ppo0
    return out


def count_synchronizing_calls(fn) -> dict:
    """``fn()`` under ``torch.cuda.set_sync_debug_mode("warn")``: how many calls waited for the GPU (each drains its
    queue), and the five most frequent of their messages."""
    import collections
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    said = [str(w.message).splitlines()[0][:120] for w in caught if "synchroniz" in str(w.message)]
    return {"count": len(said), "most_frequent": collections.Counter(said).most_common(5)}


def profile_tables(prof, wall: float, path: str, what: str, mode: str = "w") -> dict:
    """Kernel and operator tables of a finished torch.profiler run into ``path``; its device time and busy share: the
    kernels' own time (events on the device; an operator's row repeats its kernels' time, so operators are not summed:
    before 2026-12-07f they were, and the update's busy share of 2026-12-02f read 1.43 where its kernels were 0.71)."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA)
    with open(path, mode) as f:
        f.write(f"{what}: wall {wall:.3f} s, device kernels {device_us / 1e6:.3f} s\n\n")
        for key in ("self_device_time_total", "self_cpu_time_total", "cpu_time_total"):
            try:
                f.write(f"== sorted by {key}\n" + events.table(sort_by=key, row_limit=35) + "\n")
            except Exception as e:  # noqa: BLE001 - a key this torch does not know
                f.write(f"== {key}: {e}\n")
    return {"device_kernel_seconds": device_us / 1e6, "device_busy_share": device_us / 1e6 / wall}
