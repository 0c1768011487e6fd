"""The LightningModule: a causal LM with a LoRA adapter, trained with PPO-clip on the rollouts of its Sampler.

``training_step`` reads top to bottom, one phase a line:

1. rollout: the Sampler (handed over when training starts) plays this step's games with the current weights;
2. probe: the engine scores the weight sync's probe again (its drift over the rollout), then sleeps;
3. samples: ``make_samples`` scores each group (advantages) and cuts per-token tensors, already shifted;
4. update: ``alfrl.ppo.ppo_update``, PPO-clip over packed micro-batches, AdamW on the LoRA;
5. sync: the new adapter goes to the engine, counted and probed;
6. metrics: the rollout's (global over ranks), the probe's, the update's and the sync's, and the step's wall clock.

``trainer.max_steps`` counts these rollout+update steps (one Lightning step each, however many
PPO epochs and minibatches). The module also loads the model (peft LoRA, GGUF, kernels) and scores sequences.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import lightning as L
import torch

from alfrl.guard import MemoryGuard, allocate_optimizer_state
from alfrl.linear_attention import KERNELS
from alfrl.logprobs import causal_lm_of, predicted_logprobs, sequence_logprobs
from alfrl.advantages import make_samples
from alfrl.datamodule import reduce_metrics, write_rollouts
from alfrl.ppo import MicroBatch, PPOConfig, collate, pack_microbatches, ppo_update
from alfrl.types import Sample

DTYPES = ("auto", "bfloat16", "float16", "float32")
MATMUL_PRECISIONS = ("highest", "high", "medium")
ADAPTER_DTYPES = ("float32", "bfloat16")
log = logging.getLogger("alfrl")


@dataclass(frozen=True)
class LoRAConfig:
    """The adapter trained on the frozen base model."""

    rank: int = 32
    """LoRA rank r of every adapted layer."""
    alpha: int = 64
    """Scaling = alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input, in [0, 1)."""
    target_modules: str | list[str] = "all-linear"
    """``all-linear`` (every linear layer but the output layer, of every layer kind) or module names."""

    def problems(self, prefix: str = "model.lora") -> list[str]:
        out = []
        if self.rank < 1:
            out.append(f"{prefix}.rank={self.rank} must be >= 1")
        if self.alpha <= 0:
            out.append(f"{prefix}.alpha={self.alpha} must be > 0")
        if not 0 <= self.dropout < 1:
            out.append(f"{prefix}.dropout={self.dropout} must be in [0, 1)")
        if not self.target_modules:
            out.append(f"{prefix}.target_modules is empty: all-linear or a list of module names")
        return out


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW on the LoRA weights."""

    lr: float = 1e-6
    """AdamW learning rate (constant; the reference's 1e-6)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's two moment decays, each in [0, 1)."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay on the LoRA weights."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    grad_clip_norm: float = 1.0
    """Clip the LoRA gradient norm to this (0 = no clipping)."""

    def problems(self, prefix: str = "model.optim") -> list[str]:
        out = []
        if self.lr <= 0:
            out.append(f"{prefix}.lr={self.lr}: the learning rate must be > 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            out.append(f"{prefix}.betas={list(self.betas)}: two numbers in [0, 1), e.g. [0.9, 0.95]")
        if self.weight_decay < 0:
            out.append(f"{prefix}.weight_decay={self.weight_decay} must be >= 0")
        if self.eps <= 0:
            out.append(f"{prefix}.eps={self.eps} must be > 0")
        if self.grad_clip_norm < 0:
            out.append(f"{prefix}.grad_clip_norm={self.grad_clip_norm} must be >= 0 (0 turns clipping off)")
        return out


def lora_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if "lora_" in k}


class AlfrlPolicy(L.LightningModule):
    """LoRA policy + PPO-clip. Every argument is a recipe key under ``model:``."""

    def __init__(
        self,
        model_name: str,
        gguf_file: str | None = None,
        dtype: str = "auto",
        attn_implementation: str | None = "sdpa",
        gradient_checkpointing: bool = False,
        linear_attention_kernel: str = "auto",
        float32_matmul_precision: str = "highest",
        adapter_dtype: str = "float32",
        compile_layers: bool = False,
        init_adapter: str | None = None,
        lora: LoRAConfig = LoRAConfig(),
        optim: OptimizerConfig = OptimizerConfig(),
        ppo: PPOConfig = PPOConfig(),
        seed: int = 42,
    ):
        """
        Args:
            model_name: Hugging Face hub name or local folder of the base model (a vision-language
                checkpoint such as Qwen3.5's loads its text stack).
            gguf_file: a GGUF file inside ``model_name`` to load (dequantized) instead of safetensors.
            dtype: ``auto`` = bfloat16 on GPU, float32 on CPU.
            attn_implementation: passed to transformers (``sdpa``, ``flash_attention_2``, ``eager``), or
                ``sdpa_varlen`` (alfrl.attention): SDPA on each sequence of a packed row instead of a T x T mask.
            gradient_checkpointing: recompute activations in backward (long trajectories on big models); the
                update runs the model in train mode, without which transformers recomputes nothing.
            linear_attention_kernel: what computes Gated DeltaNet layers (Qwen3.5) in training: ``auto``,
                ``fla`` or ``torch`` (alfrl.linear_attention: flash-linear-attention refuses its gated backward
                on Hopper with Triton < 3.7.1 unless checked against the PyTorch reference first).
            float32_matmul_precision: torch's, set before each update: the LoRA weights are float32, so peft runs the
                adapter's matmuls in float32 beside the bf16 base; ``high`` lets them use TF32 tensor cores
                (10-bit mantissa, still finer than the bf16 base), ``medium`` bf16, ``highest`` keeps full float32. Process-wide.
            adapter_dtype: what the adapter's matmuls run in when the trainer scores tokens (update, old log-probs,
                probe): ``float32`` (peft's way: the bf16 activations cast to float32 beside the bf16 base) or
                ``bfloat16`` (under bf16 autocast, the activations as they are; vLLM serves the adapter in bf16 too).
                The LoRA weights, their gradients and AdamW's state stay float32 either way. ``bfloat16`` needs a
                bf16 model (``dtype: bfloat16``, or ``auto`` on a GPU).
            compile_layers: torch.compile each decoder layer's MLP and norms for training (alfrl.models.compile_layers:
                fused elementwise work, dynamic shapes; the first update compiles). Attention stays eager.
            init_adapter: start from this LoRA adapter (a checkpoint folder, its adapter/ or trainer.ckpt,
                e.g. an ``alfrl sft`` run's); null starts from B = 0.
            lora: the adapter (rank, alpha, dropout, target modules).
            optim: AdamW (lr, betas, weight decay, eps, gradient clipping).
            ppo: the PPO-clip update (clip range, dual clip, aggregation, epochs, minibatches, old log-probs).
            seed: seeds the minibatch shuffling.
        """
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.strict_loading = False  # checkpoints hold the LoRA weights only
        self.model: torch.nn.Module | None = None
        self.packable = True
        """Whether several sequences may share a row (False for models with linear-attention layers)."""
        self.weight_version = 0
        """How many updates the weights have seen (logged by the weight sync)."""
        self.skipped_steps = 0
        """Optimizer steps skipped for a non-finite gradient (logged)."""
        self.guard = MemoryGuard()
        """Parameters and optimizer state must come out of each rollout and sync as the last update left them (with an
        engine whose ``guard_trainer_memory`` says it could change them)."""
        self._lora_layers: list[torch.nn.Module] | None = None
        self._flop_counts: tuple[float, float] | None = None  # (body, output layer) parameters, for the update's flops
        self.linear_attention = None
        """The kernel chosen for linear-attention layers (alfrl.linear_attention.Choice), before the first update."""
        self.sampler = None
        """The Sampler (alfrl.sampler) that plays the training games, handed over at the start of training (``attach``)."""
        self.sync_check, self.canary_at_step = True, 0
        self.compiled: tuple[int, tuple[str, ...]] | None = None
        """(modules, parts) that model.compile_layers compiles on their first call (told at the first update)."""

    @property
    def lora(self) -> LoRAConfig:
        return _as(LoRAConfig, self.hparams.lora)

    @property
    def optim(self) -> OptimizerConfig:
        return _as(OptimizerConfig, self.hparams.optim)

    @property
    def ppo(self) -> PPOConfig:
        return _as(PPOConfig, self.hparams.ppo)

    # ------------------------------------------------------------ checks
    @staticmethod
    def problems(args: dict, prefix: str = "model") -> list[str]:
        """Every problem with these init arguments, each naming the recipe key and the fix."""
        out = []
        if not args.get("model_name"):
            out.append(f"{prefix}.model_name is empty: set a hub name or a local model folder")
        for key, default, allowed in (("dtype", "auto", DTYPES), ("float32_matmul_precision", "highest", MATMUL_PRECISIONS),
                                      ("linear_attention_kernel", "auto", KERNELS), ("adapter_dtype", "float32", ADAPTER_DTYPES)):
            if args.get(key, default) not in allowed:
                out.append(f"{prefix}.{key}={args.get(key)!r}: choose one of {', '.join(allowed)}")
        if args.get("adapter_dtype") == "bfloat16" and args.get("dtype", "auto") in ("float16", "float32"):
            out.append(f"{prefix}.adapter_dtype=bfloat16 needs a bf16 model, and {prefix}.dtype is {args.get('dtype')}: "
                       f"set {prefix}.dtype to bfloat16 (or auto on a GPU), or {prefix}.adapter_dtype to float32")
        for key, cls in (("lora", LoRAConfig), ("optim", OptimizerConfig), ("ppo", PPOConfig)):
            try:
                out.extend(_as(cls, args.get(key, cls())).problems(f"{prefix}.{key}"))
            except TypeError as e:
                out.append(f"{prefix}.{key}: {e}")
        return out

    # ------------------------------------------------------------ model
    def torch_dtype(self) -> torch.dtype:
        name = self.hparams.dtype
        if name == "auto":
            return torch.bfloat16 if torch.cuda.is_available() else torch.float32
        return getattr(torch, name)

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        kwargs = {"gguf_file": self.hparams.gguf_file} if self.hparams.gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(self.hparams.model_name, **kwargs)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def configure_model(self) -> None:
        """Load the base model, add the LoRA adapter (and ``init_adapter``'s weights); once."""
        if self.model is not None:
            return
        from peft import LoraConfig, get_peft_model

        from alfrl.models import COMPILED_PARTS, compile_layers, has_linear_attention, load_causal_lm, set_gradient_checkpointing

        hp, lora = self.hparams, self.lora
        base = load_causal_lm(hp.model_name, self.torch_dtype(), hp.attn_implementation, hp.gguf_file)
        if hp.gradient_checkpointing:
            set_gradient_checkpointing(base, True)
        base.config.use_cache = False
        self.packable = not has_linear_attention(base.config)
        config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules,
                            bias="none", task_type="CAUSAL_LM")
        self.model = get_peft_model(base, config)
        if hp.get("compile_layers", False):
            self.compiled = (compile_layers(base), COMPILED_PARTS)  # compiled on their first call: told at the first update
        if hp.init_adapter:
            self.load_adapter(hp.init_adapter)

    def prepare_training(self) -> None:
        """Before each update: train mode (from_pretrained leaves the base model in eval mode, Lightning keeps
        submodules' modes, and transformers recomputes nothing for gradient checkpointing in eval mode); before the
        first, the linear-attention kernel (alfrl.linear_attention); the float32 matmul precision (the adapter's)."""
        self.model.train()
        torch.set_float32_matmul_precision(self.hparams.get("float32_matmul_precision", "highest"))
        if self.linear_attention is None:
            from alfrl.linear_attention import select

            self.linear_attention = select(self.model, self.hparams.get("linear_attention_kernel", "auto"), self.device)
            if self.linear_attention.kernel != "none":
                log.warning("linear-attention layers: %s (%s)", self.linear_attention.kernel, self.linear_attention.reason)
            if self.compiled:
                log.warning("model.compile_layers: %d modules (%s) compile in this first update: expect it to "
                            "take about a minute longer (57.65 s more on an H200 for the 1.5B model, raw-results-2026-12-06:bench/leases/2026-12-04f.md)",
                            self.compiled[0], ", ".join(self.compiled[1]))

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def configure_optimizers(self):
        o = self.optim
        optimizer = torch.optim.AdamW(self.trainable_parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, eps=o.eps)
        allocate_optimizer_state(optimizer)  # now, before the engine starts (alfrl.guard)
        return optimizer

    def merged_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, base + LoRA delta) for every weight the adapter changes, one at a time."""
        from peft.tuners.lora import LoraLayer

        dtype = self.torch_dtype()
        for name, module in causal_lm_of(self.model).named_modules():
            if isinstance(module, LoraLayer) and "default" in module.lora_A:
                base = module.get_base_layer()
                delta = module.get_delta_weight("default")
                yield f"{name}.weight", (base.weight.float() + delta.float()).to(dtype)

    def adapter_weights(self):
        """The LoRA adapter in memory, as peft would save it (for a sampler that serves it unmerged)."""
        from peft import get_peft_model_state_dict

        from alfrl.engines import AdapterWeights

        config = self.model.peft_config["default"].to_dict()
        return AdapterWeights(dict(get_peft_model_state_dict(self.model)), config, self.weight_version)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return lora_state_dict(self.model)

    def load_adapter(self, path: str) -> str:
        """Load LoRA weights from a checkpoint folder, its ``adapter/`` folder or its ``trainer.ckpt``.

        Returns the file that was read. The adapter's rank and alpha must match this model's.
        """
        from alfrl.checkpoints import load_adapter_into

        self.configure_model()
        return load_adapter_into(self.model, path, self.lora.rank, self.lora.alpha)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if "lora_" in k}
        checkpoint["weight_version"] = self.weight_version

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        expected = {f"model.{k}" for k in self.model.state_dict() if "lora_" in k} if self.model is not None else set()
        got = set(checkpoint["state_dict"])
        if expected and got != expected:
            missing, unexpected = sorted(expected - got)[:3], sorted(got - expected)[:3]
            raise RuntimeError(
                f"the checkpoint's LoRA weights do not match this model (missing {missing}, unexpected {unexpected}): "
                "resume with the same model.model_name and LoRA settings the run was started with"
            )
        self.weight_version = checkpoint.get("weight_version", 0)

    # ------------------------------------------------------------ log-probs
    def throughput(self, sequence_tokens: int, trained_tokens: int, seconds: float, passes: int = 1,
                   scored: bool = False) -> dict[str, float]:
        """A training pass's model TFLOP/s (6N, ``alfrl.models.update_flops``: the body on every sequence token, the output
        layer on the trained ones) and ``mfu``, over the GPU's dense bf16 peak where it is known."""
        from alfrl.models import parameter_counts, peak_bf16_tflops, update_flops

        self._flop_counts = self._flop_counts or parameter_counts(self.model)
        flops = update_flops(*self._flop_counts, sequence_tokens, trained_tokens, passes,
                             bool(self.hparams.gradient_checkpointing), scored)
        out = {"model_tflops": flops / max(seconds, 1e-9) / 1e12}
        peak = peak_bf16_tflops(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        return {**out, "mfu": out["model_tflops"] / peak} if peak else out

    def microbatches(self, samples: list[Sample], idx: list[int]) -> list[MicroBatch]:
        rows = pack_microbatches([len(samples[i]) for i in idx], self.ppo.microbatch_tokens, pack=self.packable)
        return [collate(samples, [idx[j] for j in row], self.device) for row in rows]

    def scoring(self):
        """The context of every forward that scores tokens (``model.adapter_dtype``): with ``bfloat16``, bf16 autocast and
        peft's cast of the activations to the adapter's float32 turned off, so the adapter's matmuls run on bf16 tensor
        cores from its float32 weights; with ``float32``, peft's default."""
        bf16 = self.hparams.get("adapter_dtype", "float32") == "bfloat16"
        if bf16 and self.torch_dtype() != torch.bfloat16:
            raise ValueError(f"model.adapter_dtype=bfloat16 needs a bf16 model and this one is {self.torch_dtype()}: "
                             "set model.dtype to bfloat16 (or auto on a GPU), or model.adapter_dtype to float32")
        if self._lora_layers is None:
            from peft.tuners.tuners_utils import BaseTunerLayer

            self._lora_layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        for layer in self._lora_layers:
            layer.cast_input_dtype_enabled = not bf16
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if bf16 else nullcontext()

    def logprobs_of(self, mb: MicroBatch, temperature: float = 1.0) -> torch.Tensor:
        """(N,) the trainer's log-probs of the micro-batch's trained tokens at ``temperature``."""
        with self.scoring():
            return predicted_logprobs(self.model, mb.input_ids, mb.predict_mask, mb.position_ids, None, self.ppo.logprob_chunk_size,
                                      temperature, row_index=(mb.predict_index, mb.targets))

    @torch.no_grad()
    def score(self, sequence: list[int]) -> list[float]:
        """Log-prob of every token of ``sequence`` under the current weights (first token: 0.0)."""
        was_training = self.model.training
        self.model.eval()
        try:
            ids = torch.tensor([sequence], device=self.device)
            with self.scoring():
                return [0.0] + sequence_logprobs(self.model, ids, torch.ones_like(ids), self.ppo.logprob_chunk_size)[0].tolist()
        finally:
            self.model.train(was_training)

    @torch.no_grad()
    def old_logprobs(self, samples: list[Sample], temperature: float = 1.0) -> list[torch.Tensor]:
        """Per sample, the log-probs of its trained tokens before the update (float32, on device)."""
        if self.ppo.old_logprobs == "sampler":
            return [s.sampler_logprobs_T[s.loss_mask_T].to(self.device) for s in samples]
        was_training = self.model.training
        self.model.eval()
        try:
            out: list[torch.Tensor | None] = [None] * len(samples)
            for mb in self.microbatches(samples, list(range(len(samples)))):
                for i, piece in zip(mb.members, torch.split(self.logprobs_of(mb, temperature), mb.tokens_per_sequence)):
                    out[i] = piece.float()
            return out  # type: ignore[return-value]
        finally:
            self.model.train(was_training)

    # ------------------------------------------------------------ training
    def attach(self, sampler, sync_check: bool = True, canary_at_step: int = 0) -> None:
        """The Sampler this policy trains with, handed over when training starts (``SamplerWeightSync``), and the weight
        sync's settings (``weight_sync.check``, ``weight_sync.canary_at_step``)."""
        self.sampler, self.sync_check, self.canary_at_step = sampler, sync_check, canary_at_step

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        """Each update's log row holds only what that update logged. Lightning keeps a step metric in every later row
        until the epoch ends (here: the whole run), so a value logged at one update only (the canary, a checkpoint's
        seconds, a periodic evaluation) came back in every row after it: its logged values are cleared first."""
        results = getattr(self.trainer, "_results", None)
        if results is not None:
            results.reset()

    def transfer_batch_to_device(self, batch, device, dataloader_idx: int):
        return batch  # a step's games and settings: nothing for the device (the samples move row by row in the update)

    def training_step(self, dataloader_iter):
        """One update, its phases in order. The step's games are taken from Lightning's iterator only now, after update t-1
        and its sync (Lightning fetches a batch before its step otherwise; it goes by this parameter's name)."""
        started = time.perf_counter()
        step, _, _ = next(dataloader_iter)  # StepGames: this rank's games and how to score them (RolloutDataModule)
        optimizer = self.optimizers()
        guarded = self.sampler.engine.guard_trainer_memory  # an engine that can write into this process's memory (alfrl.guard)
        if guarded and self.guard.taken is None:
            self.guard.take(self.model, optimizer.optimizer)
        rollout = self.sampler.rollout(step.games, step.group_size, step.seed, step.progress)  # 1 rollout
        probe = self.sampler.probe(step.next_games, step.group_size)  # 2 probe: the engine's drift; it sleeps
        if guarded:
            self.guard.check(self.model, optimizer.optimizer, "the rollout and the weight sync since the last update")
        samples = make_samples(rollout.groups, step.advantage, step.reward, step.history_length)  # 3 samples
        update = ppo_update(self, optimizer, samples.samples, step.temperature)  # 4 update
        if guarded:
            self.guard.take(self.model, optimizer.optimizer)
            update["memory_guard_seconds"] = self.guard.seconds
        self.weight_version += 1
        sync = self.sampler.sync(self, self.sync_check, canary=self.global_step == self.canary_at_step)  # 5 sync
        rollout_metrics = reduce_metrics({**rollout.metrics(), **samples.metrics()}, rollout.groups, self.trainer)  # 6 metrics
        metrics = {**rollout_metrics, **probe, **{f"train/{k}": v for k, v in update.items()}, **sync,
                   "step/seconds": time.perf_counter() - started}
        if step.rollouts_file:
            write_rollouts(step.rollouts_file, rollout.groups)
        shown = ("train/loss", "rollout/success_rate", "rollout/reward_mean")
        self.log_dict({k: v for k, v in metrics.items() if k not in shown}, on_step=True, batch_size=1)
        self.log_dict({k: metrics[k] for k in shown if k in metrics}, on_step=True, prog_bar=True, batch_size=1)


def _as(cls, value):
    """A settings dataclass from itself, a dict (jsonargparse / checkpoints) or a Namespace."""
    if isinstance(value, cls):
        return value
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, dict):
        return cls(**value)
    raise TypeError(f"expected {cls.__name__} settings, got {value!r}")
