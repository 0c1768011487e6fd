"""Sampling engines: token ids in, token ids and their log-probabilities out.

One small interface (``Engine``), two real implementations:

- ``HFEngine`` runs transformers ``generate`` on the live policy module (CPU or GPU), batched with left
  padding; it needs no weight copy, the policy *is* its model.
- ``VLLMEngine`` (``alfrl.vllm_engine``) runs a vLLM ``LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; with
  ``data.engine.separate_process`` vLLM's engine core runs in a process of its own) on token prompts with prefix caching;
  ``update_weights`` loads new weights into the running model.

The engine never sees text. The log-probability of a sampled token is that of the distribution it
was drawn from: softmax(logits / T) at the request's temperature T (vLLM's ``processed_logprobs``),
which is what the trainer computes with the same T. ``score`` gives teacher-forced log-probs at T = 1.

Weights reach a sampler that holds its own copy in one of two ways (``data.engine.weight_sync``):

- ``lora`` (the default): the trainer's LoRA adapter itself, unmerged, in memory (vLLM's LoRA support;
  no file is written; an engine in its own process reads it from a peft folder in /dev/shm). The sampler then runs exactly the trainer's computation: base + (alpha/r) B A.
- ``merged``: base + (alpha/r) B A merged into every adapted weight, cast to the model dtype. Faster to
  decode, but in bf16 most of a small update is rounded away (W is on the bf16 grid, dW is below half
  a step of it): the sampler then plays a policy the trainer never had.

Both return how many adapted modules / tensors the sampler really took, and raise when that is not
all of them.
"""

from __future__ import annotations

import copy
import json
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import torch


class EngineError(RuntimeError):
    """An engine cannot run here; the message says why and what to do."""


@dataclass(frozen=True)
class SamplingRequest:
    """One prompt to sample ``n`` completions from."""

    prompt_ids: tuple[int, ...]
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    """Text that ends the completion: an engine that can stop on it does (vLLM started with ``stop_strings``), the
    others generate on; the rollout cuts every completion after the token that completes one either way."""


@dataclass(frozen=True)
class Completion:
    """One sampled completion."""

    token_ids: tuple[int, ...]
    """Sampled ids, the final stop token included when the completion stopped."""
    logprobs: tuple[float, ...]
    """The sampler's log-probability of each sampled id (same length as ``token_ids``)."""
    finish_reason: str
    """``stop`` (a stop token was sampled) or ``length`` (cut by ``max_new_tokens``)."""


@dataclass
class EngineCounters:
    """Token counts since the engine started (differences give per-batch figures)."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0

    def minus(self, earlier: EngineCounters) -> EngineCounters:
        return EngineCounters(
            self.prompt_tokens - earlier.prompt_tokens,
            self.cached_prompt_tokens - earlier.cached_prompt_tokens,
            self.generated_tokens - earlier.generated_tokens,
        )


@dataclass(frozen=True)
class AdapterWeights:
    """A LoRA adapter as peft saves it, held in memory."""

    tensors: dict[str, torch.Tensor]
    """peft's names (``base_model.model.<module>.lora_A.weight`` / ``lora_B``) -> tensors."""
    config: dict
    """peft's adapter config (``r``, ``lora_alpha``, ``target_modules``, ``use_rslora`` ...)."""
    version: int
    """The policy's weight version (number of updates)."""

    @property
    def plain_config(self) -> dict:
        """``config`` with its sets as sorted lists (``target_modules``): what JSON and vLLM's ``PEFTHelper`` take."""
        return {k: (sorted(v) if isinstance(v, set) else v) for k, v in self.config.items()}

    @property
    def modules(self) -> list[str]:
        """The adapted modules' names, e.g. ``model.layers.0.self_attn.q_proj``."""
        names = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in self.tensors}
        return sorted(names)

    def write_folder(self, folder: str, name: Callable[[str], str] = lambda n: n, dtype: torch.dtype | None = None) -> str:
        """This adapter as peft saves one (``adapter_config.json``, ``adapter_model.safetensors``) in ``folder``, tensor
        names through ``name``: what vLLM's ``add_lora`` loads in an engine of its own process. ``dtype``: cast on their
        device to what vLLM's loader casts them to anyway (its ``lora_dtype``): the same values, half the bytes of float32."""
        import os

        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(self.plain_config, f, default=str)
        save_file({name(k): v.detach().to(dtype or v.dtype).to("cpu", copy=True).contiguous() for k, v in self.tensors.items()},
                  os.path.join(folder, "adapter_model.safetensors"))
        return folder


class Engine(Protocol):
    name: str
    shares_policy: bool
    """True when the engine samples from the trainer's own module (nothing to sync)."""
    guard_trainer_memory: bool
    """True when the engine holds GPU memory through an allocator of its own in the trainer's process (vLLM in-process),
    where a write into the trainer's memory was seen: the training step then checks its memory across the rollout and the
    sync (``alfrl.guard``). An engine in a process of its own, or one on torch's allocator, cannot write there."""
    last_output_times: tuple[float, float] | None
    """After ``step``: when the engine made what it returned and when this process took it (``time.monotonic()``); None
    where both are one moment (an engine in this process's own loop)."""
    push_seconds: Mapping[str, float]
    """The last adapter push's phases in seconds where the engine times them (a vLLM core in its own process: write, load,
    swap; logged as ``sync/<phase>_seconds``), else empty."""
    batch_invariant: bool
    """True when a request's completions and log-probs do not depend on which other requests the engine ran beside it
    (so the same seeds give the same trajectories to the bit, however the turns interleave)."""

    def generate(self, requests: list[SamplingRequest]) -> list[list[Completion]]:
        """``n`` completions per request, in request order (waits for all of them)."""

    def submit(self, requests: list[SamplingRequest]) -> list[str]:
        """Queue requests without waiting; one id per request. Their completions come from ``step``."""

    def step(self) -> list[tuple[str, list[Completion]]]:
        """Advance generation a little; (id, completions) of every request that finished meanwhile."""

    @property
    def busy(self) -> bool:
        """Whether submitted requests are still unfinished."""

    def score(self, token_ids: list[int]) -> list[float]:
        """Teacher-forced log-prob (temperature 1) of every token given the ones before (first: 0.0)."""

    def load_adapter(self, adapter: AdapterWeights) -> int:
        """Serve ``adapter`` (unmerged) from now on; returns the number of adapted modules served."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load merged weights (Hugging Face names); returns the number of tensors loaded."""

    def counters(self) -> EngineCounters: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...


class InProcessEngine:
    """Defaults for engines that sample in the trainer's own memory: nothing to sync, sleep or close;
    ``submit`` / ``step`` on top of ``generate`` (a step generates every queued request)."""

    shares_policy = True
    guard_trainer_memory = False
    last_output_times = None
    push_seconds: Mapping[str, float] = MappingProxyType({})
    batch_invariant = True
    """Each request is generated on its own (``generate`` takes them one at a time), so none depends on another."""

    def __init__(self):
        self._queue: list[tuple[str, SamplingRequest]] = []
        self._submitted = 0

    def submit(self, requests: list[SamplingRequest]) -> list[str]:
        ids = []
        for r in requests:
            ids.append(str(self._submitted))
            self._queue.append((ids[-1], r))
            self._submitted += 1
        return ids

    def step(self) -> list[tuple[str, list[Completion]]]:
        batch, self._queue = self._queue, []
        outs = self.generate([r for _, r in batch]) if batch else []
        return [(rid, o) for (rid, _), o in zip(batch, outs)]

    @property
    def busy(self) -> bool:
        return bool(self._queue)

    def score(self, token_ids: list[int]) -> list[float]:
        raise EngineError(f"the {self.name} engine cannot score sequences")

    def load_adapter(self, adapter: AdapterWeights) -> int:
        """Nothing to copy: the engine samples from the policy module itself, so it serves every module."""
        return len(adapter.modules)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Nothing to copy: the engine samples from the policy module itself."""
        return sum(1 for _ in named_tensors)

    def counters(self) -> EngineCounters:
        return EngineCounters(**vars(getattr(self, "_counters", EngineCounters())))

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass




def _cut(token_ids: list[int], logprobs: list[float], stop_ids: tuple[int, ...], limit: int) -> Completion:
    """Cut a generated row at its first stop token (kept) or at ``limit`` tokens."""
    for i, tok in enumerate(token_ids[:limit]):
        if tok in stop_ids:
            return Completion(tuple(token_ids[: i + 1]), tuple(logprobs[: i + 1]), "stop")
    return Completion(tuple(token_ids[:limit]), tuple(logprobs[:limit]), "length")


class HFEngine(InProcessEngine):
    """transformers ``generate`` on the live policy module, or on a copy of it.

    ``model`` is the module itself or a callable returning it (the LightningModule's policy, so
    samples always come from the current weights). Each request's ``n`` rows are generated together
    (at most ``max_batch_rows`` at a time) under the request's own seed, so a request's samples do
    not depend on which other requests were pending: the rollout is reproducible however its turns
    interleave.

    With ``separate=True`` the engine samples from its own copy of the (peft) model, taken at the
    first call, and sees new weights only through ``load_adapter`` / ``update_weights``, like vLLM:
    the CPU tests use it to check the weight sync and its probe.
    """

    name = "hf"

    def __init__(self, model: torch.nn.Module | Callable[[], torch.nn.Module], pad_token_id: int, max_batch_rows: int = 64,
                 separate: bool = False):
        super().__init__()
        self._model = model
        self.pad_token_id = pad_token_id
        self.max_batch_rows = max_batch_rows
        self.separate = separate
        self.shares_policy = not separate
        self._copy: torch.nn.Module | None = None
        self._merged = False
        """Separate copy only: True after ``update_weights`` (merged base weights, the adapter off)."""
        self._counters = EngineCounters()

    @property
    def model(self) -> torch.nn.Module:
        live = self._model if isinstance(self._model, torch.nn.Module) else self._model()
        if not self.separate:
            return live
        if self._copy is None:
            self._copy = copy.deepcopy(live)
        return self._copy

    def _adapter_off(self):
        from contextlib import nullcontext

        return self.model.disable_adapter() if self._merged and hasattr(self.model, "disable_adapter") else nullcontext()

    def load_adapter(self, adapter: AdapterWeights) -> int:
        if not self.separate:
            return super().load_adapter(adapter)
        from peft import set_peft_model_state_dict

        model = self.model
        with torch.no_grad():
            result = set_peft_model_state_dict(model, {k: v.detach().clone() for k, v in adapter.tensors.items()})
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise EngineError(f"the hf engine's copy has no module for {len(unexpected)} adapter tensors, e.g. {unexpected[:2]}")
        self._merged = False
        return len(adapter.modules)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        if not self.separate:
            return super().update_weights(named_tensors)
        model = self.model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        loaded, missing = 0, []
        for name, tensor in named_tensors:
            try:
                module = base.get_submodule(name.removesuffix(".weight"))
            except AttributeError:
                missing.append(name)
                continue
            target = module.get_base_layer() if hasattr(module, "get_base_layer") else module
            target.weight.copy_(tensor)
            loaded += 1
        if missing:
            raise EngineError(f"the hf engine's copy has no weight for {len(missing)} pushed tensors, e.g. {missing[:2]}")
        self._merged = True
        return loaded

    @torch.no_grad()
    def score(self, token_ids: list[int]) -> list[float]:
        from alfrl.logprobs import sequence_logprobs

        model = self.model
        was_training = model.training
        model.eval()
        try:
            with self._adapter_off():
                ids = torch.tensor([list(token_ids)], device=model.device)
                return [0.0] + sequence_logprobs(model, ids, torch.ones_like(ids))[0].tolist()
        finally:
            model.train(was_training)

    def generate(self, requests: list[SamplingRequest]) -> list[list[Completion]]:
        out: list[list[Completion]] = []
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []), self._adapter_off():
                for r in requests:
                    torch.manual_seed(r.seed if r.seed is not None else zlib.crc32(bytes(str(r.prompt_ids[-8:]), "utf8")))
                    completions: list[Completion] = []
                    for start in range(0, r.n, self.max_batch_rows):
                        completions += self._generate_rows([r] * min(self.max_batch_rows, r.n - start), model)
                    out.append(completions)
        finally:
            model.train(was_training)
        return out

    @torch.no_grad()
    def _generate_rows(self, rows: list[SamplingRequest], model: torch.nn.Module) -> list[Completion]:
        first = rows[0]
        for r in rows:
            if (r.temperature, r.top_p, r.stop_token_ids) != (first.temperature, first.top_p, first.stop_token_ids):
                raise EngineError("HFEngine batches requests with one temperature, top_p and stop ids per call")
        device = model.device
        width = max(len(r.prompt_ids) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):  # left padding
            input_ids[b, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            attention[b, width - len(r.prompt_ids) :] = 1
        max_new = max(r.max_new_tokens for r in rows)
        sampling = dict(do_sample=True, temperature=first.temperature, top_p=first.top_p, top_k=0) if first.temperature > 0 else dict(do_sample=False)
        generated = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            max_new_tokens=max_new,
            min_new_tokens=0,
            eos_token_id=list(first.stop_token_ids),
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
            use_cache=True,
            **sampling,
        )
        new_ids = generated.sequences[:, width:]  # (B, T)
        logits = torch.stack(generated.logits, dim=1).float()  # (B, T, V), raw (before temperature / top-p)
        if first.temperature > 0:
            logits = logits / first.temperature  # the distribution the tokens were drawn from (as vLLM's processed log-probs)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new_ids.unsqueeze(-1)).squeeze(-1)
        completions = []
        for b, r in enumerate(rows):
            c = _cut(new_ids[b].tolist(), logprobs[b].tolist(), r.stop_token_ids, r.max_new_tokens)
            completions.append(c)
            self._counters.prompt_tokens += len(r.prompt_ids)
            self._counters.generated_tokens += len(c.token_ids)
        return completions
