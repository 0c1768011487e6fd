"""Supervised warm start: next-token loss on the assistant tokens of expert trajectories.

``alfrl sft --config recipes/sft_qwen15b.yaml`` (LightningCLI: same overrides, CSV / SwanLab
logging and checkpoint format as ``alfrl fit``). The expert trajectories come from ``alfrl expert``
(training games only, never the evaluation splits). Each sequence is cut into a training sample by
the same rule as RL (``advantages.sample_of``: only tokens the policy would have sampled are
trained), sequences are packed into rows without padding, and the loss is the mean negative
log-likelihood over every trained token of an optimizer step. A held-out share of the expert games
gives ``val/nll`` at every ``trainer.val_check_interval``. An RL run starts from the result with
``--model.init_adapter RUN/checkpoints/last``; ``alfrl eval --adapter`` evaluates it.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from alfrl.advantages import sample_of
from alfrl.policy import AlfrlPolicy
from alfrl.ppo import UpdateStart, clip_gradients, global_counts, gradient_sync, sum_in_order
from alfrl.types import Sample


@dataclass(frozen=True)
class SFTBatch:
    samples: list[Sample]


class _Stream(IterableDataset):
    def __init__(self, dm: ExpertDataModule, train: bool):
        self.dm, self.train = dm, train

    def __iter__(self):
        if self.train:
            while True:
                yield self.dm.next_batch()
        else:
            yield from self.dm.validation_batches()


def _identity(x):
    return x


class ExpertDataModule(L.LightningDataModule):
    """Token-packed batches of expert trajectories. Every argument is a recipe key under ``data:``."""

    def __init__(self, expert_file: str = "", limit: int | None = None, validation_fraction: float = 0.05,
                 tokens_per_step: int = 65536, seed: int = 42):
        """
        Args:
            expert_file: the JSONL written by ``alfrl expert`` (training games only).
            limit: use only the first N expert trajectories (sorted by game); null: all.
            validation_fraction: share of the trajectories held out for ``val/nll``.
            tokens_per_step: sequence tokens per optimizer step (a step takes whole trajectories).
            seed: seeds the split and the order (reshuffled every epoch).
        """
        super().__init__()
        self.expert_file, self.limit, self.validation_fraction = expert_file, limit, validation_fraction
        self.tokens_per_step, self.seed = tokens_per_step, seed
        self.train_samples: list[Sample] = []
        self.val_samples: list[Sample] = []
        self.cursor = 0
        self._order: list[int] = []

    @staticmethod
    def problems(args: dict, prefix: str = "data") -> list[str]:
        from pathlib import Path

        out = []
        path = args.get("expert_file") or ""
        if not path:
            out.append(f"{prefix}.expert_file is empty: write expert trajectories with `alfrl expert --config RECIPE --out FILE`")
        elif not Path(path).is_file():
            out.append(f"{prefix}.expert_file={path!r}: no such file: write it with `alfrl expert --config RECIPE --out {path}`")
        if not 0 <= args.get("validation_fraction", 0.05) < 1:
            out.append(f"{prefix}.validation_fraction={args.get('validation_fraction')} must be in [0, 1)")
        if args.get("tokens_per_step", 1) < 1:
            out.append(f"{prefix}.tokens_per_step={args.get('tokens_per_step')} must be >= 1")
        if args.get("limit") is not None and args["limit"] < 1:
            out.append(f"{prefix}.limit={args['limit']} must be >= 1 (or null for all)")
        return out

    def setup(self, stage: str) -> None:
        from alfrl.expert import read_expert

        trajectories = read_expert(self.expert_file, self.limit)
        if not trajectories:
            raise ValueError(f"{self.expert_file} holds no expert trajectories")
        splits = {t.split for t in trajectories}
        if splits & {"valid_seen", "valid_unseen"}:
            raise ValueError(f"{self.expert_file} holds evaluation games ({sorted(splits)}): the warm start uses training games only")
        games = sorted({t.game_id for t in trajectories})
        random.Random(self.seed).shuffle(games)
        held = set(games[: int(len(games) * self.validation_fraction)])
        rank, world = self._rank_world()
        for t in trajectories:
            samples = [sample_of(seq, [1.0] * len(t.turns), 0, t.index) for seq in t.sequences if seq.spans]
            (self.val_samples if t.game_id in held else self.train_samples).extend(samples)
        self.train_samples = self.train_samples[rank::world]
        self.val_samples = self.val_samples[rank::world]

    def _rank_world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])

    def next_batch(self) -> SFTBatch:
        """Whole trajectories in a seeded order (a new order every epoch) up to ``tokens_per_step`` tokens."""
        batch, used = [], 0
        while True:
            n = len(self.train_samples)
            epoch, pos = divmod(self.cursor, n)
            if pos == 0 or len(self._order) != n:
                self._order = list(range(n))
                random.Random(self.seed * 1009 + epoch).shuffle(self._order)
            s = self.train_samples[self._order[pos]]
            if batch and used + len(s) > self.tokens_per_step:
                return SFTBatch(batch)
            batch.append(s)
            used += len(s)
            self.cursor += 1

    def validation_batches(self):
        for start in range(0, len(self.val_samples), 16):
            yield SFTBatch(self.val_samples[start : start + 16])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Stream(self, True), batch_size=None, num_workers=0, collate_fn=_identity)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Stream(self, False), batch_size=None, num_workers=0, collate_fn=_identity)


class SFTPolicy(AlfrlPolicy):
    """The policy (same model, LoRA, optimizer and checkpoints) trained by next-token loss."""

    def transfer_batch_to_device(self, batch, device, dataloader_idx: int):
        return batch  # samples stay on the CPU; each packed row moves to the device when it is built

    def nll(self, samples: list[Sample]) -> tuple[torch.Tensor, int]:
        """Sum of -log p over the trained tokens of ``samples`` (with grad when enabled) and their count."""
        total, count = None, 0
        for mb in self.microbatches(samples, list(range(len(samples)))):
            lp = self.logprobs_of(mb)
            part = -lp.sum()
            total = part if total is None else total + part
            count += int(lp.numel())
        return (total if total is not None else torch.zeros((), device=self.device)), count

    def training_step(self, batch: SFTBatch, batch_idx: int):
        started = time.perf_counter()
        start = UpdateStart(self)  # as alfrl.ppo.ppo_update: prepared (train mode; the linear-attention kernel), memory marked
        optimizer = self.optimizers()
        n_tok = sum(s.trained_tokens for s in batch.samples)
        world = self.trainer.world_size
        _, global_tok = global_counts(self, 1, n_tok, world)
        losses = []  # read once after the rows (a read per row would wait for the GPU each time)
        rows = self.microbatches(batch.samples, list(range(len(batch.samples))))
        for r, mb in enumerate(rows):
            lp = self.logprobs_of(mb)
            loss = -lp.sum() / global_tok  # the mean over the step's trained tokens, over all ranks
            with gradient_sync(self, last=r == len(rows) - 1):
                self.manual_backward(loss)
            losses.append(loss.detach())
        loss_sum = sum_in_order(losses)
        grad_norm = clip_gradients(self)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - started
        tokens = sum(len(s) for s in batch.samples)
        speed = {f"sft/{k}": v for k, v in {**self.throughput(tokens, n_tok, seconds), **start.memory()}.items()}  # 6N, peak memory
        self.log_dict({"sft/loss": loss_sum * world, "sft/grad_norm": grad_norm, "sft/skipped_steps": float(self.skipped_steps), "sft/trained_tokens": float(n_tok),
                       "sft/sequence_tokens": float(tokens), "sft/seconds": seconds, "sft/tokens_per_second": tokens / max(seconds, 1e-9), **speed},
                      on_step=True, batch_size=1)
        self.log("sft/nll", loss_sum * world, on_step=True, prog_bar=True, batch_size=1)

    def on_validation_epoch_start(self) -> None:
        self._val = [0.0, 0]

    @torch.no_grad()
    def validation_step(self, batch: SFTBatch, batch_idx: int):
        total, count = self.nll(batch.samples)
        self._val[0] += float(total)
        self._val[1] += count

    def on_validation_epoch_end(self) -> None:
        values = torch.tensor(self._val, dtype=torch.float64, device=self.device)
        if self.trainer.world_size > 1:
            values = self.trainer.strategy.reduce(values, reduce_op="sum")
        nll = float(values[0] / max(float(values[1]), 1.0))
        self.log_dict({"val/nll": nll, "val/perplexity": math.exp(min(nll, 50.0))}, batch_size=1, rank_zero_only=False)
