"""The sampling engine's settings (``data.engine``): a frozen dataclass with a default, a type and a check (``problems``)
for every knob; ``alfrl.sampler`` builds the engine from them (the worker pool's, ``data.env``, are ``alfrl.envs.EnvConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alfrl.sync import SYNC_MODES

ENGINE_KINDS = ("hf", "vllm")
CUDAGRAPH_MODES = ("none", "piecewise", "full", "full_decode_only", "full_and_piecewise")
VLLM_ARGS_SET_BY_ALFRL = {
    "model": "model.model_name", "gpu_memory_utilization": "data.engine.gpu_memory_utilization",
    "max_model_len": "data.engine.max_model_len", "enable_sleep_mode": "data.engine.sleep_mode",
    "enforce_eager": "data.engine.enforce_eager", "enable_prefix_caching": "data.engine.prefix_caching", "dtype": "model.dtype",
    "seed": "data.seed", "enable_lora": "data.engine.weight_sync", "max_lora_rank": "model.lora.rank",
    "skip_tokenizer_init": "data.rollout.stop_strings", "kv_cache_memory_bytes": "data.engine.kv_cache_gib",
    "max_num_seqs": "data.engine.max_num_seqs", "max_num_batched_tokens": "data.engine.max_num_batched_tokens",
    "language_model_only": "data.engine.language_model_only", "logprobs_mode": "(fixed: the sampled distribution's log-probs)",
}
"""``vllm.LLM`` arguments that recipe keys set, and the key to use instead of ``data.engine.vllm_args``."""


@dataclass(frozen=True)
class EngineConfig:
    """Which sampler plays the rollouts and how it is set up."""

    kind: str = "hf"
    """``hf`` (transformers generate on the live policy, CPU or GPU) or ``vllm`` (GPU)."""
    gpu_memory_utilization: float = 0.4
    """vLLM: share of GPU memory for weights and KV cache (the rest is the trainer's)."""
    max_model_len: int | None = None
    """vLLM: context length; default the larger of the rollout's and the evaluation's trajectory budget."""
    sleep_mode: bool = False
    """vLLM: release the engine's memory while training, take it back for rollouts."""
    enforce_eager: bool = False
    """vLLM: skip torch.compile and CUDA graphs (faster start, slower decoding)."""
    kv_cache_gib: float | None = None
    """vLLM: a fixed KV cache size in GiB instead of the one vLLM infers by profiling within
    ``gpu_memory_utilization``. Set it when engines start beside other GPU processes: memory those
    allocate during the profile counts against this engine (an evaluation started beside training got
    a KV cache too small for its games and thrashed, 2026-12-01)."""
    max_num_seqs: int | None = None
    """vLLM: sequences decoded together (default vLLM's)."""
    max_num_batched_tokens: int | None = None
    """vLLM: tokens per engine step (default vLLM's)."""
    cudagraph_max_tokens: int | None = None
    """vLLM: the largest engine step (in tokens) replayed as a CUDA graph (``compilation_config.
    max_cudagraph_capture_size``; null: vLLM's, min(2 x max_num_seqs, 512)). A larger step runs op by op, and
    with LoRA served each of its ~112 LoRA kernels costs ~0.2-0.4 ms of Python: in the 274-game evaluation on
    the H200 (2026-12-01, ~150 games live, ~580 tokens a step) most steps were over 512 and the GPU was busy
    21% of the time (raw-results-2026-12-06:bench/README.md). Larger values capture more graphs at engine start."""
    cudagraph_mode: str | None = None
    """vLLM: which engine steps are replayed as CUDA graphs (``compilation_config.cudagraph_mode``): ``piecewise``
    (around attention), ``full`` (whole steps), ``full_decode_only``, ``full_and_piecewise`` or ``none``; null: vLLM's
    (full_and_piecewise where the attention backend allows). A diagnostic knob: on the H200 (2026-12-02) the random
    Qwen3.5-4B scored NaN after a wake-up with vLLM's default graphs and not in eager mode (raw-results-2026-12-06:bench/README.md)."""
    separate_process: bool = False
    """vLLM: its engine core (scheduler, model runner, CUDA graphs) in a process of its own, which steps the GPU while this
    process handles environments, outputs and the update (in this process both share one Python thread's time and the GIL:
    on the H200 a rollout spent 11-23% of its time outside engine steps, and its steps ran 1.20x longer beside the update
    of finished groups; raw-results-2026-12-06:bench/leases/2026-12-03g.md). The adapter reaches it as a peft folder (in /dev/shm) through
    vLLM's ``add_lora``. Needs ``weight_sync: lora`` and no ``sleep_mode``. On the H200 its rollouts
    generated 1.28x / 1.18x more tokens a second than in-process (20.05 / 24.96 s against 25.22 / 29.24 s, not pairs), the
    same turns replayed by the engine alone 1.13x slower (raw-results-2026-12-06:bench/leases/2026-12-03h.md); its first fit's steps 27.640 s on
    average against 33.658 s (4 + 4 updates, not pairs; 2026-12-04a), so on in the 1.5B RL recipes."""
    prefix_caching: bool = True
    """vLLM: reuse the KV cache of prompt prefixes seen before (every turn's history; Qwen3.5's linear-attention
    layers in vLLM's experimental "align" mode). Off, every turn computes its whole history again."""
    language_model_only: bool | None = None
    """vLLM: start a vision-language checkpoint without its vision encoder (prompts are token ids);
    null: on exactly for vision-language checkpoints (Qwen3.5)."""
    vllm_args: dict | None = None
    """vLLM: more keyword arguments for ``vllm.LLM``, passed as given after the ones the keys above make (e.g.
    ``{async_scheduling: false, compilation_config: {cudagraph_specialize_lora: false}}``; a ``compilation_config`` is
    merged into the one ``cudagraph_mode`` and ``cudagraph_max_tokens`` make). For what no key here covers; the arguments
    alfrl sets itself are refused."""
    gdn_prefill_backend: str | None = None
    """vLLM: the Gated DeltaNet prefill kernel of Qwen3.5's linear-attention layers (``triton`` or
    ``flashinfer``); null: FlashInfer's where its kernel for this GPU is installed, else triton (the
    offline kit lacks FlashInfer's Hopper kernel, and vLLM would pick it anyway and fail at the first prefill)."""
    max_batch_rows: int = 64
    """hf: rows per generate call."""
    separate_weights: bool = False
    """hf: sample from a copy of the policy that gets weights only through the sync, as vLLM does."""
    weight_sync: str = "lora"
    """``lora``: serve the trained adapter unmerged (exactly the trainer's weights); ``merged``: push
    base + LoRA in the model dtype (faster decoding; bf16 rounds most of a small update away)."""
    sync_check_tolerance: float = 0.1
    """After each weight sync, the mean |engine - trainer| log-prob of a probe sequence must stay below this."""
    sync_min_response: float = 0.1
    """After each sync, the engine's probe log-probs must follow at least this share of the trainer's
    change since the last sync (checked when the change is above numerical noise; 0 turns it off).
    A skipped sync gives 0; bf16 LoRA weights in vLLM gave 0.37 on a small first update (raw-results-2026-12-06:bench/README.md)."""

    def problems(self, prefix: str = "data.engine") -> list[str]:
        out = []
        if self.kind not in ENGINE_KINDS:
            out.append(f"{prefix}.kind={self.kind!r} is not one of {', '.join(ENGINE_KINDS)}")
        if self.weight_sync not in SYNC_MODES:
            out.append(f"{prefix}.weight_sync={self.weight_sync!r} is not one of {', '.join(SYNC_MODES)}")
        if self.sync_check_tolerance <= 0:
            out.append(f"{prefix}.sync_check_tolerance={self.sync_check_tolerance} must be > 0")
        if not 0 <= self.sync_min_response <= 1:
            out.append(f"{prefix}.sync_min_response={self.sync_min_response} must be in [0, 1] (0 turns the response check off)")
        if not 0 < self.gpu_memory_utilization < 1:
            out.append(f"{prefix}.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1)")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            out.append(f"{prefix}.kv_cache_gib={self.kv_cache_gib} must be > 0 (or null: inferred from gpu_memory_utilization)")
        for name in ("max_num_seqs", "max_num_batched_tokens", "cudagraph_max_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                out.append(f"{prefix}.{name}={getattr(self, name)} must be >= 1 (or null for vLLM's default)")
        if self.cudagraph_mode is not None and self.cudagraph_mode not in CUDAGRAPH_MODES:
            out.append(f"{prefix}.cudagraph_mode={self.cudagraph_mode!r} is not one of {', '.join(CUDAGRAPH_MODES)} (or null for vLLM's)")
        needs = [need for need, unmet in (("kind: vllm", self.kind != "vllm"), ("weight_sync: lora", self.weight_sync != "lora"),
                                          ("sleep_mode: false", self.sleep_mode)) if unmet]
        if self.separate_process and needs:
            out.append(f"{prefix}.separate_process=true needs {', '.join(f'{prefix}.{n}' for n in needs)} (the engine's model and "
                       "memory are in its own process): change those, or set it to false")
        if self.vllm_args is not None:
            if not isinstance(self.vllm_args, dict):
                out.append(f"{prefix}.vllm_args must be a mapping of vllm.LLM arguments (or null), not {type(self.vllm_args).__name__}")
            else:
                taken = sorted(set(self.vllm_args) & set(VLLM_ARGS_SET_BY_ALFRL))
                if taken:
                    out.append(f"{prefix}.vllm_args sets {', '.join(taken)}, which alfrl sets itself: use "
                               + ", ".join(f"{VLLM_ARGS_SET_BY_ALFRL[k]}" for k in taken) + " instead")
                if "compilation_config" in self.vllm_args and not isinstance(self.vllm_args["compilation_config"], dict):
                    out.append(f"{prefix}.vllm_args.compilation_config must be a mapping (vLLM's CompilationConfig fields)")
        if self.gdn_prefill_backend not in (None, "triton", "flashinfer"):
            out.append(f"{prefix}.gdn_prefill_backend={self.gdn_prefill_backend!r} is not one of triton, flashinfer (or null)")
        if self.max_batch_rows < 1:
            out.append(f"{prefix}.max_batch_rows={self.max_batch_rows} must be >= 1")
        return out

    def vllm_extra(self, model_path: str) -> dict:
        """The ``vllm.LLM`` arguments these settings add for ``model_path``."""
        from alfrl.models import has_linear_attention, is_vision_language, read_config

        extra: dict = {}
        if self.kv_cache_gib is not None:
            extra["kv_cache_memory_bytes"] = int(self.kv_cache_gib * 2**30)
        if self.max_num_seqs is not None:
            extra["max_num_seqs"] = self.max_num_seqs
        if self.max_num_batched_tokens is not None:
            extra["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.cudagraph_max_tokens is not None:
            extra.setdefault("compilation_config", {})["max_cudagraph_capture_size"] = self.cudagraph_max_tokens
        if self.cudagraph_mode is not None:
            extra.setdefault("compilation_config", {})["cudagraph_mode"] = self.cudagraph_mode.upper()
        for key, value in (self.vllm_args or {}).items():
            if key == "compilation_config":
                extra.setdefault("compilation_config", {}).update(value)
            else:
                extra[key] = value
        config = read_config(model_path)
        vl = is_vision_language(config)
        if self.language_model_only if self.language_model_only is not None else vl:
            extra["language_model_only"] = True
        backend = self.gdn_prefill_backend
        if backend is None and config is not None and has_linear_attention(config):
            backend = auto_gdn_prefill_backend()
        if backend is not None:
            extra["additional_config"] = {"gdn_prefill_backend": backend}
        return extra


def auto_gdn_prefill_backend() -> str:
    """``flashinfer`` when FlashInfer's Gated DeltaNet prefill kernel for this GPU can be imported, else ``triton``.

    vLLM 0.26 picks FlashInfer on every Hopper GPU without checking that its CuTe-DSL kernel is
    installed; without it the first prefill fails ("SM90 GDN prefill DSL kernel is unavailable").
    """
    try:
        major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 0
        from flashinfer import gdn_kernels

        kernel = {9: "chunk_gated_delta_rule_sm90", 10: "chunk_gated_delta_rule_sm100", 12: "chunk_gated_delta_rule_sm120"}.get(major)
        return "flashinfer" if kernel and getattr(gdn_kernels, kernel, None) is not None else "triton"
    except Exception:  # noqa: BLE001 - FlashInfer missing or broken: the triton kernel always works
        return "triton"
