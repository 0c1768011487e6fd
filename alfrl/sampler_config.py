"""The Sampler's settings: the engine (``data.engine``) and the environment worker pool (``data.env``), each a frozen
dataclass with a default, a type and a check (``problems``) for every knob; ``alfrl.sampler`` builds from them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from alfrl.envs import EnvPool
from alfrl.mps import PRIORITIES as MPS_PRIORITIES
from alfrl.sync import SYNC_MODES

ENGINE_KINDS = ("hf", "vllm")
CUDAGRAPH_MODES = ("none", "piecewise", "full", "full_decode_only", "full_and_piecewise")


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
    21% of the time (bench/README.md). Larger values capture more graphs at engine start."""
    cudagraph_mode: str | None = None
    """vLLM: which engine steps are replayed as CUDA graphs (``compilation_config.cudagraph_mode``): ``piecewise``
    (around attention), ``full`` (whole steps), ``full_decode_only``, ``full_and_piecewise`` or ``none``; null: vLLM's
    (full_and_piecewise where the attention backend allows). A diagnostic knob: on the H200 (2026-12-02) the random
    Qwen3.5-4B scored NaN after a wake-up with vLLM's default graphs and not in eager mode (bench/README.md)."""
    torch_compile: bool | None = None
    """vLLM: compile the model with torch.compile (``compilation_config.mode``); null: vLLM's (on unless
    ``enforce_eager``). Off with ``cudagraph_mode: full_decode_only`` replays whole decode steps as CUDA graphs of
    the uncompiled model; on with ``cudagraph_mode: none`` compiles without graphs: the two tell a fault of the
    compiled code from one of the graphs (Qwen3.5 on the H200, 2026-12-02: NaN or a fault with both, clean with neither)."""
    cudagraph_specialize_lora: bool | None = None
    """vLLM: capture separate CUDA graphs for steps with and without LoRA adapters
    (``compilation_config.cudagraph_specialize_lora``); null: vLLM's (on). A diagnostic knob for the 1.5B recipe's
    fault with graphs and LoRA served (README fault table)."""
    async_scheduling: bool | None = None
    """vLLM: schedule the next engine step while the last one's outputs are copied back (``async_scheduling``); null:
    vLLM's (on). A diagnostic knob: on the H200 (2026-12-02) the 1.5B recipe's fits with CUDA graphs failed with it
    off as with it on (an illegal memory access on the engine's first request; bench/leases/2026-12-02h.md)."""
    high_priority_stream: bool = False
    """vLLM: run the engine (and the trainer's own work in that thread) on a CUDA stream of the highest priority, so that its
    kernels are scheduled first when the update of finished groups (``model.ppo.update_during_rollout``) shares the GPU
    from its worker's default-priority stream: beside that worker the engine's steps took 1.28-1.37x longer on the H200
    (bench/leases/2026-12-03f.md). Run on the H200 since: no faster (the engine's steps beside the worker as slow as on its default stream;
    mean step 39.29 s against 35.15 s, 6 + 6 updates, not paired; bench/leases/2026-12-03g.md), so off in every recipe."""
    separate_process: bool = False
    """vLLM: its engine core (scheduler, model runner, CUDA graphs) in a process of its own, which steps the GPU while this
    process handles environments, outputs and the update (in this process both share one Python thread's time and the GIL:
    on the H200 a rollout spent 11-23% of its time outside engine steps, and its steps ran 1.20x longer beside the update
    of finished groups; bench/leases/2026-12-03g.md). The adapter reaches it as a peft folder (in /dev/shm) through
    vLLM's ``add_lora``. Needs ``weight_sync: lora`` and no ``sleep_mode`` or ``high_priority_stream``. On the H200 its rollouts
    generated 1.28x / 1.18x more tokens a second than in-process (20.05 / 24.96 s against 25.22 / 29.24 s, not pairs), the
    same turns replayed by the engine alone 1.13x slower (bench/leases/2026-12-03h.md); its first fit's steps 27.640 s on
    average against 33.658 s (4 + 4 updates, not pairs; 2026-12-04a), so on in the 1.5B RL recipes."""
    core_cpu_threads: int | None = None
    """vLLM with ``separate_process``: torch's CPU threads in the engine core's process (``OMP_NUM_THREADS`` and torch's
    setting while it is spawned; this process keeps its own). null: torch's default, one per CPU. The core's CPU work is
    small (each pushed adapter read, pinned and scaled on the CPU) but every parallel op waits for all of its threads, and
    while the environment workers reset (``data.env.prefetch_resets``, one worker per CPU) some of them wait for a CPU:
    every adapter load over 0.5 s on the H200 came then (0.585-3.257 s, else 0.047-0.196 s; bench/leases/2026-12-04i.md).
    vLLM itself sets 1 in the workers of its multiprocess executor "to avoid unnecessary CPU contention". On the 2-core
    development machine, adapter-shaped work beside the resets took 4.28-5.26x its idle time (median) at 2 threads and
    1.25-1.42x at 1, as fast idle, the resets no slower (bench/README.md, the workers' niceness). Not yet run on a GPU:
    every recipe leaves it at null."""
    trainer_sm_percentage: int | None = None
    """Under a CUDA MPS daemon, the share (1-100) of the GPU's SMs this process's kernels (the update) may use, set by
    ``alfrl fit`` once the recipe is read, before CUDA starts (the SMs it got are printed when the engine has started); the
    engine core (``separate_process``) is spawned with all of them, so its small steps at the end of a rollout find SMs
    free beside the update of finished groups (alfrl/mps.py). null: no limit. On the H200 (bench/leases/2026-12-04c.md)
    50 gave 66 of 132 SMs: shorter tail steps, a slower update, steps no faster; off in every recipe."""
    trainer_mps_priority: str = "normal"
    """Under a CUDA MPS daemon, the priority of this process's GPU work: ``below_normal`` has MPS schedule it after the
    engine core's (``CUDA_MPS_CLIENT_PRIORITY``; the core, ``separate_process``, is spawned at ``normal``), as the
    high-priority stream did inside one process. Set like ``trainer_sm_percentage``. On the H200 the tail steps were as
    without it (bench/leases/2026-12-04c.md); off in every recipe."""
    lora_kernel_configs: str | None = None
    """vLLM: a folder of LoRA kernel launch configs tuned on this GPU for this model and rank (``bench/lora_tune.py --out``
    writes ``<GPU>_SHRINK.json`` and ``<GPU>_EXPAND_TRUE.json``); the engine reads it as ``VLLM_TUNED_CONFIG_FOLDER``. On
    the H200, the 1.5B model's LoRA kernels took 786.7 us a decode step at 1 row against 1,296.4 us with vLLM's defaults,
    770.4-795.1 against 1,075.8-1,128.8 us at 2-16 rows (each kernel alone; bench/leases/2026-12-04e.md). null: vLLM's defaults."""
    speculative_ngram_tokens: int = 0
    """vLLM: n-gram speculative decoding (prompt lookup, on the GPU): up to this many tokens per step proposed from the
    sequence's own history where its last ``speculative_ngram_min``..``speculative_ngram_max`` tokens occurred before,
    then verified by the policy in the same step; vLLM's rejection sampler keeps what is sampled distributed as without
    speculation and the log-probs are the policy's. Meant for the trajectories that decode nearly alone at the end of a
    rollout and repeat their history; with the LoRA served it made the engine-only ceiling 2.19x slower on the H200 (vLLM
    then runs its V1 model runner; bench/leases/2026-12-03d.md) and the rollouts 31.43 / 37.32 s against 27.20 / 31.00 s
    (fewer engine steps, each ~26 ms; bench/leases/2026-12-03e.md). 0: off."""
    speculative_ngram_min: int = 2
    """vLLM: the shortest trailing n-gram looked up (vLLM's ``prompt_lookup_min``)."""
    speculative_ngram_max: int = 5
    """vLLM: the longest trailing n-gram looked up (vLLM's ``prompt_lookup_max``)."""
    prefix_caching: bool = True
    """vLLM: reuse the KV cache of prompt prefixes seen before (every turn's history; Qwen3.5's linear-attention
    layers in vLLM's experimental "align" mode). Off, every turn computes its whole history again."""
    language_model_only: bool | None = None
    """vLLM: start a vision-language checkpoint without its vision encoder (prompts are token ids);
    null: on exactly for vision-language checkpoints (Qwen3.5)."""
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
    A skipped sync gives 0; bf16 LoRA weights in vLLM gave 0.37 on a small first update (bench/README.md)."""

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
        if self.torch_compile and self.enforce_eager:
            out.append(f"{prefix}.torch_compile=true contradicts {prefix}.enforce_eager=true (eager turns torch.compile off): "
                       "set one of them")
        if self.torch_compile is False and self.cudagraph_mode in ("piecewise", "full_and_piecewise"):
            out.append(f"{prefix}.cudagraph_mode={self.cudagraph_mode!r} needs torch.compile (its pieces are the compiled graph's): "
                       f"with {prefix}.torch_compile=false use full_decode_only, full or none")
        if self.speculative_ngram_tokens < 0:
            out.append(f"{prefix}.speculative_ngram_tokens={self.speculative_ngram_tokens} must be >= 0 (0: no speculative decoding)")
        if self.speculative_ngram_tokens and self.kind != "vllm":
            out.append(f"{prefix}.speculative_ngram_tokens={self.speculative_ngram_tokens} needs {prefix}.kind: vllm "
                       "(the hf engine does not speculate): set it to 0")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            out.append(f"{prefix}.speculative_ngram_min={self.speculative_ngram_min} and speculative_ngram_max="
                       f"{self.speculative_ngram_max} must satisfy 1 <= min <= max")
        if self.high_priority_stream and self.kind != "vllm":
            out.append(f"{prefix}.high_priority_stream=true needs {prefix}.kind: vllm (the hf engine runs no stream of its own): set it to false")
        needs = [need for need, unmet in (("kind: vllm", self.kind != "vllm"), ("weight_sync: lora", self.weight_sync != "lora"),
                                          ("sleep_mode: false", self.sleep_mode), ("high_priority_stream: false", self.high_priority_stream))
                 if unmet]
        if self.separate_process and needs:
            out.append(f"{prefix}.separate_process=true needs {', '.join(f'{prefix}.{n}' for n in needs)} (the engine's model, memory "
                       "and streams are in its own process): change those, or set it to false")
        if self.core_cpu_threads is not None and not (self.core_cpu_threads >= 1 and self.kind == "vllm" and self.separate_process):
            out.append(f"{prefix}.core_cpu_threads={self.core_cpu_threads} must be >= 1 and needs {prefix}.kind: vllm with "
                       f"{prefix}.separate_process: true (in one process they would be the trainer's threads): fix it, or set it to null")
        if self.trainer_sm_percentage is not None and not (1 <= self.trainer_sm_percentage <= 100 and self.separate_process):
            out.append(f"{prefix}.trainer_sm_percentage={self.trainer_sm_percentage} must be in 1..100 and needs {prefix}."
                       "separate_process: true (in one process the engine would share the limit): fix it, or set it to null")
        if self.trainer_mps_priority not in MPS_PRIORITIES or (self.trainer_mps_priority != "normal" and not self.separate_process):
            out.append(f"{prefix}.trainer_mps_priority={self.trainer_mps_priority!r} must be one of {', '.join(MPS_PRIORITIES)}, and "
                       f"below_normal needs {prefix}.separate_process: true (in one process the engine would share it): fix it")
        if self.lora_kernel_configs is not None:
            folder = Path(self.lora_kernel_configs)
            missing = [p for p in ("*_SHRINK.json", "*_EXPAND_TRUE.json") if not any(folder.glob(p))]
            if self.kind != "vllm" or self.weight_sync != "lora" or missing:
                out.append(f"{prefix}.lora_kernel_configs={self.lora_kernel_configs!r} needs {prefix}.kind: vllm, {prefix}.weight_sync: "
                           f"lora and a folder with {' and '.join(missing) or 'its files'} (`python bench/lora_tune.py --out` writes "
                           "them): fix it, or set it to null")
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
        if self.torch_compile is False:
            extra.setdefault("compilation_config", {})["mode"] = 0  # vLLM's CompilationMode.NONE
        if self.cudagraph_specialize_lora is not None:
            extra.setdefault("compilation_config", {})["cudagraph_specialize_lora"] = self.cudagraph_specialize_lora
        if self.async_scheduling is not None:
            extra["async_scheduling"] = self.async_scheduling
        if self.speculative_ngram_tokens:
            # the lookup on the GPU (vLLM's ``ngram_gpu``): it keeps async scheduling on, and the CPU one needs numba
            extra["speculative_config"] = {"method": "ngram_gpu",
                                           "num_speculative_tokens": self.speculative_ngram_tokens,
                                           "prompt_lookup_min": self.speculative_ngram_min,
                                           "prompt_lookup_max": self.speculative_ngram_max}
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


@dataclass(frozen=True)
class EnvConfig:
    """The environment worker pool."""

    num_workers: int | None = None
    """Worker processes; default the CPU count."""
    step_timeout: float = 60.0
    """Seconds before a step counts as hung (the worker is restarted, that trajectory ends with env_error)."""
    reset_timeout: float = 180.0
    prefetch_resets: bool = False
    """Reset the next training step's environments as soon as a rollout ends (the workers are idle while the update and
    the sync run), so the next rollout's groups start without waiting for their resets (``Sampler.prefetch``). On the H200
    (16 workers) every group then started within 0.011 s and half of the trajectories had ended at 6.75-8.00 s against
    10.97-13.47 s (not pairs; bench/leases/2026-12-04b.md), so it is on in the 1.5B RL recipes; on the 2-core development
    machine the resets slowed the CPU update more than they saved."""
    nice: int = 0
    """Added to the workers' CPU niceness (0-19): above 0 they yield the CPU to the trainer and vLLM's engine core (every adapter
    push over 1 s on the H200 came while prefetched resets ran: bench/leases/2026-12-04g.md; one fit at 10, undecided: 2026-12-04h)."""

    def problems(self, prefix: str = "data.env") -> list[str]:
        out = []
        if self.num_workers is not None and self.num_workers < 1:
            out.append(f"{prefix}.num_workers={self.num_workers} must be >= 1 (or null for the CPU count)")
        if self.step_timeout <= 0 or self.reset_timeout <= 0:
            out.append(f"{prefix}.step_timeout / reset_timeout must be > 0")
        if not 0 <= self.nice <= 19:
            out.append(f"{prefix}.nice={self.nice} must be 0-19 (0: the workers at the trainer's own CPU priority)")
        return out

    def make_pool(self) -> EnvPool:
        return EnvPool(self.num_workers, self.step_timeout, self.reset_timeout, nice=self.nice)
