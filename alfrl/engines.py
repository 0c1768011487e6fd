"""Sampling engines: token ids in, token ids and their log-probabilities out.

One small interface (``Engine``), two real implementations:

- ``HFEngine`` runs transformers ``generate`` on the live policy module (CPU or GPU), batched with left
  padding; it needs no weight copy, the policy *is* its model.
- ``VLLMEngine`` runs a vLLM ``LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on token
  prompts with prefix caching; ``update_weights`` loads new weights into the running model.

The engine never sees text. Log-probabilities are those of the raw model distribution (temperature
1, before top-p), which is what the trainer recomputes.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
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


class Engine(Protocol):
    name: str

    def generate(self, requests: list[SamplingRequest]) -> list[list[Completion]]:
        """``n`` completions per request, in request order."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights (Hugging Face parameter names) into the sampler."""

    def counters(self) -> EngineCounters: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...


class InProcessEngine:
    """Defaults for engines that sample in the trainer's own memory: nothing to sync, sleep or close."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to copy: the engine samples from the policy module itself."""

    def counters(self) -> EngineCounters:
        return EngineCounters(**vars(getattr(self, "_counters", EngineCounters())))

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass


def _batch_seed(requests: list[SamplingRequest]) -> int:
    seeds = ",".join(str(r.seed) for r in requests)
    return zlib.crc32(seeds.encode())


def _cut(token_ids: list[int], logprobs: list[float], stop_ids: tuple[int, ...], limit: int) -> Completion:
    """Cut a generated row at its first stop token (kept) or at ``limit`` tokens."""
    for i, tok in enumerate(token_ids[:limit]):
        if tok in stop_ids:
            return Completion(tuple(token_ids[: i + 1]), tuple(logprobs[: i + 1]), "stop")
    return Completion(tuple(token_ids[:limit]), tuple(logprobs[:limit]), "length")


class HFEngine(InProcessEngine):
    """transformers ``generate`` on the live policy module.

    ``model`` is the module itself or a callable returning it (the LightningModule's policy, so
    samples always come from the current weights). Rows of all requests are generated together in
    batches of at most ``max_batch_rows``. Seeding is per call: the requests' seeds together give
    the batch seed, so the same batch gives the same samples.
    """

    name = "hf"

    def __init__(self, model: torch.nn.Module | Callable[[], torch.nn.Module], pad_token_id: int, max_batch_rows: int = 64):
        self._model = model
        self.pad_token_id = pad_token_id
        self.max_batch_rows = max_batch_rows
        self._counters = EngineCounters()

    @property
    def model(self) -> torch.nn.Module:
        return self._model if isinstance(self._model, torch.nn.Module) else self._model()

    def generate(self, requests: list[SamplingRequest]) -> list[list[Completion]]:
        rows = [(i, r) for i, r in enumerate(requests) for _ in range(r.n)]
        out: list[list[Completion]] = [[] for _ in requests]
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
                torch.manual_seed(_batch_seed(requests))
                for start in range(0, len(rows), self.max_batch_rows):
                    chunk = rows[start : start + self.max_batch_rows]
                    for (i, _), completion in zip(chunk, self._generate_rows([r for _, r in chunk], model)):
                        out[i].append(completion)
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
        logits = torch.stack(generated.logits, dim=1)  # (B, T, V), raw (before temperature / top-p)
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, new_ids.unsqueeze(-1)).squeeze(-1)
        completions = []
        for b, r in enumerate(rows):
            c = _cut(new_ids[b].tolist(), logprobs[b].tolist(), r.stop_token_ids, r.max_new_tokens)
            completions.append(c)
            self._counters.prompt_tokens += len(r.prompt_ids)
            self._counters.generated_tokens += len(c.token_ids)
        return completions


def counters_from_metrics(metrics: Iterable) -> EngineCounters:
    """Token counters from vLLM's ``LLM.get_metrics()``.

    Cached prompt tokens come from ``vllm:prompt_tokens_cached``. vLLM 0.26's ``vllm:prefix_cache_hits``
    is not a token count: in an 8 x 8 rollout it read 31,920 against 16.47 M prompt tokens while
    ``vllm:prompt_tokens_cached`` read 15.98 M (bench/README.md); it is only the fallback for
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


class VLLMEngine:
    """A vLLM ``LLM`` in the trainer's own process, on token prompts, with prefix caching.

    ``model_path`` is a Hugging Face folder (or hub name) with the base weights; after that the
    trainer pushes merged weights with ``update_weights``. ``sleep()`` releases the engine's GPU
    memory while the trainer trains (``enable_sleep_mode``); ``wake_up()`` takes it back.
    """

    name = "vllm"

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
    ):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs in this process
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
        self.sleep_mode = enable_sleep_mode
        self._asleep = False
        extra = {}
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # one engine per rank inside the trainer's process group (each rank samples its own games)
            extra["distributed_executor_backend"] = "external_launcher"
            os.environ.setdefault("RANK", str(dist.get_rank()))
            os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
            os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device()))
        self.llm = vllm.LLM(
            model=model_path,
            skip_tokenizer_init=True,
            enable_prefix_caching=enable_prefix_caching,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_sleep_mode=enable_sleep_mode,
            enforce_eager=enforce_eager,
            dtype=dtype,
            seed=seed,
            disable_log_stats=False,
            **extra,
        )

    def _model(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model

    def generate(self, requests: list[SamplingRequest]) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        params = [
            SamplingParams(
                n=r.n,
                temperature=r.temperature,
                top_p=r.top_p,
                max_tokens=r.max_new_tokens,
                stop_token_ids=list(r.stop_token_ids),
                seed=r.seed,
                logprobs=0,
                detokenize=False,
            )
            for r in requests
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        result = []
        for out in outputs:
            completions = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                if c.logprobs is None or len(c.logprobs) != len(ids):
                    raise EngineError(f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} log-probs for {len(ids)} tokens")
                lps = tuple(float(step[tok].logprob) for tok, step in zip(ids, c.logprobs))
                completions.append(Completion(tuple(ids), lps, "length" if c.finish_reason == "length" else "stop"))
            result.append(completions)
        return result

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        loaded = self._model().load_weights(iter(named_tensors))
        if loaded is not None and len(loaded) == 0:
            raise EngineError("vLLM loaded none of the pushed weights: the parameter names do not match the model")
        self.llm.reset_prefix_cache()

    def counters(self) -> EngineCounters:
        return counters_from_metrics(self.llm.get_metrics())

    def sleep(self) -> None:
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        pass
