"""The vLLM engine: a vLLM ``LLM`` on token prompts, with prefix caching; its engine core in the trainer's process, or
in one of its own (``separate_process``: the adapter then goes to it as a peft folder; a core that died is one EngineError).

Requests are submitted and stepped (``submit`` / ``step``) so the rollout keeps the engine busy without a round barrier;
``generate`` waits for a batch. The trained LoRA adapter is served unmerged from memory (``load_adapter``, the default
sync) or merged weights are loaded (``update_weights``); both count what vLLM took. Vision-language checkpoints (Qwen3.5)
start with ``language_model_only`` and the trainer's text-stack names (``model.layers.*``) are renamed to the
checkpoint's (``model.language_model.layers.*``) before vLLM maps them to its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable

import torch

from alfrl.engines import AdapterWeights, Completion, EngineCounters, EngineError, SamplingRequest

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
KEPT_TAG = "weights"
"""The tag of vLLM's sleep-mode allocations that level-1 sleep copies to the CPU and back (the rest is dropped)."""

log = logging.getLogger("alfrl")


def keep_across_sleep(allocations: dict, kv_ranges: list[tuple[int, int]]) -> int:
    """Tag every sleep-mode allocation that holds no KV-cache page as kept by level-1 sleep; returns the bytes so kept.

    ``allocations`` is vLLM's ``CuMemAllocator.pointer_to_data`` (address -> data with ``.tag`` and ``.handle``,
    the handle's second item its size), ``kv_ranges`` the (address, bytes) of the KV cache's storages. Level-1
    sleep keeps only the allocations tagged ``weights``; everything vLLM allocated while building its KV cache
    is tagged ``kv_cache`` and comes back at wake-up as whatever the memory then holds: beside the cache, the
    attention metadata and, for a model whose cache blocks are not vLLM's default size (Qwen3.5: 272 tokens), the
    persistent input batch. Suspected (from vLLM 0.26's source) of the NaN probes after a wake-up of the random
    Qwen3.5-4B on the H200 (2026-12-02), they were then shown not to be its cause (``bench/sleep_probe.py``; the next
    fit scored NaN with them kept). Kept, they come back as they were; a segment holding a cache page is never kept.
    """
    kept = 0
    for address, data in allocations.items():
        size = data.handle[1]
        if data.tag == KEPT_TAG or any(address < start + n and start < address + size for start, n in kv_ranges):
            continue
        data.tag = KEPT_TAG
        kept += size
    return kept


def _graphs(enforce_eager: bool, extra: dict) -> bool:
    """Whether an engine with these settings replays CUDA graphs."""
    return not enforce_eager and str(extra.get("compilation_config", {}).get("cudagraph_mode", "")).upper() != "NONE"


def fault_hint(lora: bool, enforce_eager: bool, extra: dict) -> str:
    """What to add when the engine fails scoring the sync's probe (``WeightSync``), for an engine with these settings:
    with CUDA graphs and LoRA served, what the H200 showed (empty otherwise)."""
    if not (lora and _graphs(enforce_eager, extra)):
        return ""
    return ("; seen with vLLM 0.26's CUDA graphs and LoRA served on the H200 (docs/faults.md: 15 of 15 fits of the 1.5B "
            "recipe failed while the engine started before the trainer's memory; one clean since it starts after), where "
            "data.engine.enforce_eager: true or cudagraph_mode: none has run clean")


def wake_up_nan_hint(sleep_mode: bool, enforce_eager: bool, extra: dict) -> str:
    """What to add to a probe scored non-finite right after a wake-up, for an engine with these settings: with sleep mode
    and CUDA graphs, what the H200 showed (empty otherwise: nothing is known to break a setting without them)."""
    if not (sleep_mode and _graphs(enforce_eager, extra)):
        return ""
    return ("; the probe right after a wake-up: seen with vLLM 0.26's CUDA graphs and sleep mode on Qwen3.5-structure "
            "checkpoints (raw-results-2026-12-06:bench/README.md, 2026-12-02; piecewise graphs and prefix caching off did not help), where only "
            "data.engine.enforce_eager: true has run clean")


def set_batch_invariance(on: bool) -> None:
    """vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT``) for the engines this process starts: its own engine core and
    the ones it spawns, which inherit the environment. vLLM reads the switch when its modules load (the LoRA kernels keep it
    from their import on) and, in the process that runs the engine core, replaces torch's softmax, log-softmax, mean and bmm
    on the GPU and turns off split-k matmuls: in the trainer's process (``separate_process: false``) the update runs on them
    too. So a process keeps the mode its first engine had; asking for the other one later is an ``EngineError``."""
    import sys

    lora_utils = sys.modules.get("vllm.lora.ops.triton_ops.utils")
    if lora_utils is not None and bool(getattr(lora_utils, "is_batch_invariant", False)) != on:
        raise EngineError(f"vLLM was loaded in this process with its batch-invariant mode {'off' if on else 'on'}; an engine "
                          f"{'with' if on else 'without'} it cannot start beside that: run it in a process of its own "
                          "(data.eval.deterministic / data.rollout.deterministic name the mode)")
    os.environ["VLLM_BATCH_INVARIANT"] = "1" if on else "0"


def scored_token(out, token: int) -> float:
    """The log-prob of ``token`` in a one-token request's output that asked for it (``logprob_token_ids``)."""
    steps = out.outputs[0].logprobs or []
    if not steps or token not in steps[0]:
        raise EngineError(f"vLLM returned no log-prob for probe token {token} (request {out.request_id}): "
                          "this vLLM does not honour SamplingParams.logprob_token_ids; install vllm>=0.26")
    return float(steps[0][token].logprob)


class VLLMEngine:
    """A vLLM ``LLM`` on token prompts, with prefix caching.

    ``model_path`` is a Hugging Face folder (or hub name) with the base weights. With ``lora_rank`` set, the engine
    serves LoRA adapters of that rank (``load_adapter``, the default sync); else the trainer pushes merged weights
    (``update_weights``). ``sleep()`` / ``wake_up()`` release and take back its GPU memory (``enable_sleep_mode``).
    ``extra`` goes to ``vllm.LLM`` as is (e.g. ``language_model_only``). With ``stop_strings`` it loads the folder's
    tokenizer and stops a request on its stop strings as it samples; without, it generates on to a stop token or the
    limit and the rollout cuts the completion (the 1.5B model writes imagined observations after its action: on the
    H200, 2026-12-02, a rollout's engine generated 74,332 tokens of which the trajectories kept 53,253).
    With ``separate_process`` vLLM's engine core (scheduler, model runner, CUDA graphs) runs in a process vLLM spawns
    (``VLLM_ENABLE_V1_MULTIPROCESSING=1``) and steps the GPU while this one handles environments, outputs and the
    update; ``submit`` / ``step`` / ``score`` are unchanged, the adapter goes as a peft folder (``AdapterWeights.write_folder``)
    through vLLM's ``add_lora``; merged pushes and sleep mode reach into its model and memory and are refused.
    """

    name = "vllm"
    shares_policy = False

    def __init__(
        self,
        model_path: str,
        gpu_memory_utilization: float = 0.4,
        max_model_len: int = 16384,
        enable_sleep_mode: bool = False,
        enforce_eager: bool = False,
        dtype: str = "bfloat16",
        seed: int = 0,
        enable_prefix_caching: bool = True,
        lora_rank: int | None = None,
        extra: dict | None = None,
        stop_strings: bool = False,
        separate_process: bool = False,
        batch_invariant: bool = False,
    ):
        if separate_process and enable_sleep_mode:
            raise EngineError("a vLLM engine in a separate process takes no sleep mode (it acts on this process's GPU memory): "
                              "set data.engine.separate_process: false or data.engine.sleep_mode: false")
        self.separate_process = separate_process
        self.guard_trainer_memory = not separate_process  # a core in this process allocates in the trainer's CUDA context
        # the engine core in this process (0), or in one vLLM spawns (1; spawned, never forked: this process has CUDA and threads)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if separate_process else "0"
        if separate_process:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        self._adapter_root: str | None = None  # separate_process: the folder (in /dev/shm if any) of the pushed adapters
        set_batch_invariance(batch_invariant)
        self.batch_invariant = batch_invariant
        try:
            import vllm
        except ImportError as e:
            raise EngineError(
                f"the vllm engine needs vLLM ({e}); install it with `pip install -e '.[vllm]'` on a CUDA machine, "
                "or set data.engine.kind: hf in the recipe"
            ) from None
        if not torch.cuda.is_available():
            raise EngineError("the vllm engine needs a CUDA GPU and none is visible here; set data.engine.kind: hf to run on CPU")
        self._vllm = vllm
        import importlib

        envs = importlib.import_module("vllm.envs")
        if bool(envs.VLLM_BATCH_INVARIANT) != batch_invariant:  # read once a service started: a second engine keeps the first's
            raise EngineError(f"vLLM in this process reads its batch-invariant mode as {bool(envs.VLLM_BATCH_INVARIANT)}, this "
                              f"engine asks for {batch_invariant}: start it in a process of its own")
        self.sleep_mode = enable_sleep_mode
        self._asleep = False
        self._lora = None  # the LoRARequest every request carries once an adapter is loaded
        self._lora_model = None
        self._next_lora_id = 1
        self.push_seconds: dict[str, float] = {}
        """The last adapter push's phases (separate_process): write (the tensors copied off the GPU into the peft folder),
        load (``add_lora``), swap (the previous adapter removed, the prefix cache reset)."""
        self._submitted = 0
        self.sleep_freed_gib: float | None = None  # GPU memory the last sleep handed back (weights offloaded, KV cache dropped)
        self._kept_bytes = 0
        self.lora_enabled = lora_rank is not None
        kwargs = dict(extra or {})
        self.wake_up_nan_hint = wake_up_nan_hint(enable_sleep_mode, enforce_eager, kwargs)
        """Appended to a non-finite probe right after a wake-up (``WeightSync``): what broke this before and what ran."""
        self.fault_hint = fault_hint(self.lora_enabled, enforce_eager, kwargs)
        """Appended when the engine fails scoring the sync's probe (``WeightSync``): what broke this before and what ran."""
        self.vision_language = bool(kwargs.get("language_model_only"))  # trainer names get the checkpoint's text-stack prefix
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # one engine per rank inside the trainer's process group (each rank samples its own games)
            kwargs["distributed_executor_backend"] = "external_launcher"
            os.environ.setdefault("RANK", str(dist.get_rank()))
            os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
            os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device()))
        if lora_rank is not None:
            fitting = [r for r in VLLM_LORA_RANKS if r >= lora_rank]
            if not fitting:
                raise EngineError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}; model.lora_rank={lora_rank}: "
                                  "lower it or set data.engine.weight_sync: merged")
            kwargs.update(enable_lora=True, max_lora_rank=fitting[0], max_loras=1, max_cpu_loras=2)
        self.stop_strings = stop_strings  # requests stop on their stop strings in the engine (its tokenizer loaded)
        self.llm = vllm.LLM(
            model=model_path,
            skip_tokenizer_init=not stop_strings,
            enable_prefix_caching=enable_prefix_caching,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_sleep_mode=enable_sleep_mode,
            enforce_eager=enforce_eager,
            dtype=dtype,
            seed=seed,
            disable_log_stats=False,
            logprobs_mode="processed_logprobs",  # log-probs of the distribution sampled from (temperature applied)
            **kwargs,
        )
        self.last_output_times: tuple[float, float] | None = None
        clock_outputs(self.llm.llm_engine.engine_core, self)

    def checkpoint_name(self, name: str) -> str:
        """The trainer's parameter or adapter-tensor name as the checkpoint spells it (what vLLM's
        loaders map): a vision-language checkpoint keeps its text stack under ``model.language_model``."""
        if not self.vision_language:
            return name
        for prefix in ("base_model.model.model.", "model."):
            if name.startswith(prefix):
                return prefix + "language_model." + name[len(prefix):]
        return name

    def _runner(self):
        if self.separate_process:
            raise EngineError("the vLLM engine runs in a separate process (data.engine.separate_process: true): its model and "
                              "memory are not reachable from here; set it to false for merged-weight syncs or sleep mode")
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def sampling_params(self, r: SamplingRequest):
        from vllm import SamplingParams

        # stop strings: the text is detokenized as it is sampled, and a request stops after the token that completes one
        # (its token ids and log-probs end there; the rollout's own cut then finds the same token)
        stops = dict(stop=list(r.stop_strings), include_stop_str_in_output=True) if r.stop_strings and self.stop_strings else {}
        return SamplingParams(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            max_tokens=r.max_new_tokens,
            stop_token_ids=list(r.stop_token_ids),
            seed=r.seed,
            logprobs=0,
            detokenize=bool(stops),
            **stops,
            # a fresh object for each request, never reused: vLLM may copy it shallowly instead of deep-copying it for
            # every request (0.126 s of cProfile's 4.1 s window for 222 requests in the 274-game evaluation, 2026-12-02)
            skip_clone=True,
        )

    @staticmethod
    def completions_of(out) -> list[Completion]:
        """A vLLM RequestOutput's completions, in index order, with one log-prob per token."""
        completions = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            ids = list(c.token_ids)
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise EngineError(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} log-probs for {len(ids)} tokens")
            lps = tuple(float(step[tok].logprob) for tok, step in zip(ids, c.logprobs))
            completions.append(Completion(tuple(ids), lps, "length" if c.finish_reason == "length" else "stop"))
        return completions

    def generate(self, requests: list[SamplingRequest]) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        params = [self.sampling_params(r) for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora)
        return [self.completions_of(out) for out in outputs]

    def submit(self, requests: list[SamplingRequest]) -> list[str]:
        """Queue requests in the running engine (vLLM schedules them with those already running).

        The ids are ours: vLLM adds a random suffix to the ids it is given internally but reports
        outputs under the given (external) id, which ``step`` returns.
        """
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        ids = []
        for r in requests:
            params = self.sampling_params(r)
            params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, when all its n are done
            rid = f"alfrl-{self._submitted}"
            self._submitted += 1
            with self._core_alive():
                self.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=list(r.prompt_ids)), params, lora_request=self._lora)
            ids.append(rid)
        return ids

    def step(self) -> list[tuple[str, list[Completion]]]:
        """One engine iteration (a prefill / decode step over every running request)."""
        with self._core_alive():
            outputs = self.llm.llm_engine.step()
        return [(out.request_id, self.completions_of(out)) for out in outputs if out.finished]

    @contextlib.contextmanager
    def _core_alive(self):
        """vLLM's EngineDeadError (its engine core's process died) as one line that says what to do."""
        try:
            yield
        except Exception as e:
            if type(e).__name__ == "EngineDeadError":  # vllm.v1.engine.exceptions' (by name: no vLLM import on this path)
                raise EngineError("vLLM's engine core process died (its own log above says why, e.g. CUDA out of memory): resume "
                                  "from the last checkpoint (--ckpt_path); if it recurs, set data.engine.separate_process: false") from e
            raise

    @property
    def busy(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    def score(self, token_ids: list[int]) -> list[float]:
        """Teacher-forced log-probs through the sampler, the path rollouts take: one request per position (the
        prefix before it, one token, ``logprob_token_ids`` naming the token there), all in one batch.

        Not ``prompt_logprobs``: in vLLM 0.26 the LoRA logits of prompt log-probs use a mapping of one row per
        request for rows of one per prompt token (vllm-project/vllm#51594, #53842: wrong logits, "CUDA memory
        access errors"). On the H200 this scoring ran in four fits (raw-results-2026-12-06:bench/leases/2026-12-02i.md): gaps 0.032-0.040,
        as prompt log-probs gave; the graph fits' fault (the trainer's weights NaN) came with either scoring."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(token_ids[:i])) for i in range(1, len(token_ids))]
        # never from the prefix cache: scoring the same weights twice must give the same numbers (sync's response check)
        params = [SamplingParams(max_tokens=1, temperature=1.0, seed=0, detokenize=False, logprob_token_ids=[token_ids[i]],
                                 skip_reading_prefix_cache=True) for i in range(1, len(token_ids))]
        outs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora) if prompts else []
        return [0.0] + [scored_token(out, tok) for out, tok in zip(outs, token_ids[1:])]

    def load_adapter(self, adapter: AdapterWeights) -> int:
        """Register ``adapter`` in vLLM's LoRA manager (in memory) and serve it from the next request.

        Counts the adapted modules vLLM's LoRA layers take (packed ones such as qkv_proj take q, k and
        v) and raises unless every module of the adapter is served.
        """
        if not self.lora_enabled:
            raise EngineError("this vLLM engine was started without LoRA support: start it with lora_rank, or sync merged weights")
        if self.separate_process:
            return self._load_adapter_folder(adapter)
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        workers = self._runner().lora_manager
        manager = workers._adapter_manager
        helper = PEFTHelper.from_dict({**adapter.plain_config, "vllm_max_position_embeddings": workers.max_position_embeddings})
        helper.validate_legal(workers.lora_config)
        mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
        lora_id = self._next_lora_id
        self._next_lora_id += 1
        lora = LoRAModel.from_lora_tensors(
            lora_id,
            {self.checkpoint_name(k): v.detach() for k, v in adapter.tensors.items()},
            helper,
            device="cuda",
            dtype=workers.lora_config.lora_dtype,
            model_vocab_size=workers.vocab_size,
            weights_mapper=mapper.get_unstacked_mapper() if mapper is not None else None,
            skip_prefixes=getattr(manager.model, "lora_skip_prefixes", None),
        )
        served = {sub for name in manager.modules for sub in manager.packed_modules.get(name, [name]) if sub in lora.loras}
        missing = sorted(set(lora.loras) - served)
        if missing or len(lora.loras) != len(adapter.modules):
            raise EngineError(
                f"vLLM serves LoRA on {len(served)} of the adapter's {len(adapter.modules)} modules (not on {missing[:3]}): "
                "use lora_target_modules that vLLM supports for this model, or data.engine.weight_sync: merged"
            )
        self._register(lora, f"alfrl-v{adapter.version}-{lora_id}")
        return len(served)

    def _load_adapter_folder(self, adapter: AdapterWeights) -> int:
        """separate_process: ``adapter`` as a peft folder, loaded by the engine's process through vLLM's ``add_lora`` (its
        loader refuses a module it cannot serve), served from the next request; the adapter served before and its folder are removed."""
        import atexit
        import shutil
        import tempfile

        from vllm.lora.request import LoRARequest

        if self._adapter_root is None:  # in memory where there is /dev/shm; removed at close, or at this process's exit
            self._adapter_root = tempfile.mkdtemp(prefix="alfrl-adapters-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            atexit.register(shutil.rmtree, self._adapter_root, True)
        lora_id = self._next_lora_id
        self._next_lora_id += 1
        name = f"alfrl-v{adapter.version}-{lora_id}"
        dtype = getattr(getattr(getattr(self.llm.llm_engine, "vllm_config", None), "lora_config", None), "lora_dtype", None)
        dtype = dtype if isinstance(dtype, torch.dtype) else None  # what vLLM's loader casts the tensors to
        clock = [time.perf_counter()]
        folder = adapter.write_folder(os.path.join(self._adapter_root, name), self.checkpoint_name, dtype)
        clock.append(time.perf_counter())
        request = LoRARequest(name, lora_id, lora_path=folder)
        try:
            with self._core_alive():
                loaded, why = self.llm.llm_engine.add_lora(request), "add_lora returned False"
                clock.append(time.perf_counter())
        except EngineError:  # a dead core, said as such by _core_alive
            shutil.rmtree(folder, ignore_errors=True)
            raise
        except Exception as e:  # noqa: BLE001 - vLLM's loader raises ValueError
            loaded, why = False, " ".join(f"{type(e).__name__}: {e}".split())[:400]
        if not loaded:
            shutil.rmtree(folder, ignore_errors=True)
            raise EngineError(f"vLLM's engine process did not load the pushed adapter ({why}): use lora_target_modules vLLM "
                              "serves for this model, or data.engine.separate_process: false")
        previous, self._lora = self._lora, request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(os.path.join(self._adapter_root, previous.lora_name), ignore_errors=True)
        self.llm.reset_prefix_cache()
        clock.append(time.perf_counter())
        self.push_seconds = dict(zip(("write", "load", "swap"), (b - a for a, b in zip(clock, clock[1:]))))
        return len(adapter.modules)

    def _register(self, lora, name: str) -> None:
        """Serve ``lora`` (a vLLM LoRAModel) from the next request on, in place of the adapter served so far."""
        from vllm.lora.request import LoRARequest

        manager = self._runner().lora_manager._adapter_manager
        if self._lora is not None:
            manager.remove_adapter(self._lora.lora_int_id)
        manager.add_adapter(lora)
        manager.activate_adapter(lora.id)
        self._lora = LoRARequest(name, lora.id, lora_path="in-memory")
        self._lora_model = lora
        self.llm.reset_prefix_cache()

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load merged weights one tensor at a time; every one must be taken (``load_weights`` names it)."""
        model = self._runner().model
        loaded, missed = 0, []
        for name, tensor in named_tensors:
            if model.load_weights(iter([(self.checkpoint_name(name), tensor)])):
                loaded += 1
            else:
                missed.append(name)
        if missed:
            raise EngineError(f"vLLM took {loaded} of the {loaded + len(missed)} pushed weights (not {missed[:3]}): "
                              "the parameter names do not match the model")
        self.llm.reset_prefix_cache()
        return loaded

    def counters(self) -> EngineCounters:
        return counters_from_metrics(self.llm.get_metrics())

    def sleep(self) -> None:
        if self.sleep_mode and not self._asleep:
            from vllm.device_allocator.cumem import CuMemAllocator

            kept = keep_across_sleep(CuMemAllocator.get_instance().pointer_to_data, self._kv_cache_ranges())
            if kept:  # retagged once: later sleeps find them kept already
                self._kept_bytes += kept
                log.info("vLLM sleep: %.1f MiB of engine buffers allocated beside the KV cache are backed up with the weights",
                         self._kept_bytes / 2**20)
            free = torch.cuda.mem_get_info()[0]
            self.llm.sleep(level=1)
            self._asleep = True
            self.sleep_freed_gib = (torch.cuda.mem_get_info()[0] - free) / 2**30

    def wake_up(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
            self._zero_kv_cache()
            if self._lora_model is not None:
                # the adapter served before the sleep, registered again under a new id as a push does (tensors shared), which
                # resets the prefix cache; not the fix of the random Qwen3.5-4B's NaN after a wake-up (H200, 2026-12-02c)
                lora_id = self._next_lora_id
                self._next_lora_id += 1
                self._register(self._lora_model.clone(lora_id), f"{self._lora.lora_name}-woken-{lora_id}")

    def _kv_cache_storages(self) -> list:
        """The distinct storages of the runner's KV cache tensors (a linear-attention layer's states are views of one)."""
        seen, storages = set(), []

        def walk(x) -> None:
            if isinstance(x, torch.Tensor):
                storage = x.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    storages.append(storage)
            elif isinstance(x, (list, tuple)):
                for y in x:
                    walk(y)

        walk(getattr(self._runner(), "kv_caches", []))
        return storages

    def _kv_cache_ranges(self) -> list[tuple[int, int]]:
        return [(s.data_ptr(), s.nbytes()) for s in self._kv_cache_storages()]

    @torch.no_grad()
    def _zero_kv_cache(self) -> int:
        """Zero the KV cache (and the linear-attention state kept with it) after a wake-up; returns the bytes zeroed.

        vLLM allocates the cache zeroed at start and, waking from sleep level 1, maps fresh memory back without zeroing
        it (vLLM 0.26 zeroes it only for fp8 caches): a zeroed cache is the state the engine started in (on the H200,
        2026-12-02, it alone did not stop the random Qwen3.5-4B's NaN probe after a wake-up).
        """
        total = 0
        for storage in self._kv_cache_storages():
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).zero_()
            total += storage.nbytes()
        return total

    def close(self) -> None:
        """A separate engine process is shut down (otherwise vLLM does it at this process's exit); pushed adapters removed."""
        if self.separate_process:
            self.llm.llm_engine.engine_core.shutdown()
        if self._adapter_root is not None:
            import shutil

            shutil.rmtree(self._adapter_root, ignore_errors=True)
            self._adapter_root = None


def clock_outputs(core, engine) -> None:
    """After each ``core.get_output()`` (vLLM's engine-core client) ``engine.last_output_times`` holds when the core made
    those outputs (their ``timestamp``: ``time.monotonic()``, one clock for every process of the machine) and when this
    process took them: the rollout's tail shows from them whether it waited on the core or on this process."""
    get_output = core.get_output

    def get_output_clocked(*args, **kwargs):
        out = get_output(*args, **kwargs)
        engine.last_output_times = (float(out.timestamp), time.monotonic())
        return out

    core.get_output = get_output_clocked


def counters_from_metrics(metrics: Iterable) -> EngineCounters:
    """Token counters from vLLM's ``LLM.get_metrics()``.

    Cached prompt tokens come from ``vllm:prompt_tokens_cached``. vLLM 0.26's ``vllm:prefix_cache_hits``
    is not a token count: in an 8 x 8 rollout it read 31,920 against 16.47 M prompt tokens while
    ``vllm:prompt_tokens_cached`` read 15.98 M (H200, 2026-12-02; docs/performance.md); it is only the fallback for
    versions without the token counter.
    """
    values: dict[str, float] = {}
    for metric in metrics:
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            values[metric.name] = values.get(metric.name, 0) + value
    cached = values.get("vllm:prompt_tokens_cached", values.get("vllm:prefix_cache_hits", 0))
    return EngineCounters(
        prompt_tokens=int(values.get("vllm:prompt_tokens", 0)),
        cached_prompt_tokens=int(cached),
        generated_tokens=int(values.get("vllm:generation_tokens", 0)),
    )
