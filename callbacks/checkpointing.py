"""Atomic checkpoints every ``save_every`` steps, at the end, and when the run is stopped by SIGTERM.

Each checkpoint is a folder ``<dirpath>/step-000020/`` holding:

- ``adapter/``: the LoRA adapter in peft format (``adapter_config.json`` + ``adapter_model.safetensors``),
- ``trainer.ckpt``: the Lightning checkpoint: LoRA weights, optimizer, step, loops, the game cursor
  (DataModule state) and the RNG states,
- ``merged/`` (with ``save_merged``): base + LoRA as a Hugging Face folder for vLLM or evaluation,
- ``checksums.json``: the size and sha256 of ``trainer.ckpt`` and the adapter's weights, checked before a resume or
  an evaluation reads them (a damaged file is one line naming the newest intact checkpoint).

A SIGTERM (``kill``, a scheduler's preemption, ``bench/lease.sh stop``) lets the update in flight finish (Lightning's
signal handling), then that update is saved before the process exits, so a stopped run loses no update and resumes from
where it stopped.

It is written under a temporary name and renamed into place (a step saved again swaps folders by renames), so a
crash never leaves a half checkpoint; ``<dirpath>/last`` names the newest one. Resume with ``--ckpt_path <dir>/last`` (or a
step folder, or its ``trainer.ckpt``).

Only the newest ``keep_resume_states`` checkpoints keep ``trainer.ckpt`` (the optimizer state makes it
two thirds of a checkpoint: 0.4 of 0.6 GB for the 1.5B recipe); older ones keep their adapter, which
``alfrl eval --adapter`` and ``model.init_adapter`` read. A full disk stops the run with one line that
says what to change, and leaves no partial folder behind.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch

from alfrl.checkpoints import CKPT_FILE, CheckpointSpaceError, save_adapter, save_merged_model, write_checksums


class Checkpointing(L.Callback):
    """Save every ``save_every`` steps and at the end of training."""

    def __init__(self, dirpath: str | None = None, save_every: int = 20, save_merged: bool = False, keep_resume_states: int = 2):
        """
        Args:
            dirpath: folder for checkpoints (default ``<trainer.default_root_dir>/checkpoints``).
            save_every: save after every N steps (0: only at the end).
            save_merged: also write base + LoRA as a Hugging Face folder.
            keep_resume_states: how many of the newest checkpoints keep ``trainer.ckpt`` (what
                ``--ckpt_path`` resumes from: optimizer, loops, data cursor, RNG); older ones keep only
                their adapter (0: every checkpoint keeps everything).
        """
        if save_every < 0:
            raise ValueError(f"checkpoint.save_every={save_every} must be >= 0 (0 saves only at the end)")
        if keep_resume_states < 0:
            raise ValueError(f"checkpoint.keep_resume_states={keep_resume_states} must be >= 0 (0 keeps every one)")
        self.dirpath = dirpath
        self.save_every = save_every
        self.save_merged = save_merged
        self.keep_resume_states = keep_resume_states
        self.last_saved_step = -1

    def folder(self, trainer: L.Trainer) -> Path:
        return Path(self.dirpath) if self.dirpath else Path(trainer.default_root_dir) / "checkpoints"

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.save_every and trainer.global_step % self.save_every == 0:
            started = time.perf_counter()
            self.save(trainer, pl_module)
            pl_module.log("checkpoint/seconds", time.perf_counter() - started, on_step=True, batch_size=1)

    def unsaved(self, trainer: L.Trainer) -> bool:
        """An update has ended since the last save."""
        return trainer.global_step > 0 and trainer.global_step != self.last_saved_step

    def on_train_end(self, trainer: L.Trainer, pl_module) -> None:
        if self.unsaved(trainer):
            self.save(trainer, pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module, exception: BaseException) -> None:
        """A SIGTERM stops the run between two updates (Lightning raises ``SIGTERMException`` once the update in flight has
        ended): the last one is saved. Other exceptions may come mid-update, where the state is not one to resume from."""
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exception, SIGTERMException) and self.unsaved(trainer):
            final = self.save(trainer, pl_module)
            if trainer.is_global_zero:
                print(f"stopped by SIGTERM after update {trainer.global_step}: saved {final}; go on with --ckpt_path "
                      f"{self.folder(trainer) / 'last'}", flush=True)

    def save(self, trainer: L.Trainer, policy) -> Path:
        step = trainer.global_step
        root = self.folder(trainer)
        final = root / f"step-{step:06d}"
        tmp = root / f".step-{step:06d}.partial"
        if trainer.is_global_zero:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        trainer.strategy.barrier("alfrl_checkpoint_start")
        try:
            trainer.save_checkpoint(tmp / CKPT_FILE, weights_only=False)  # every rank takes part; rank 0 writes; the full state
            if trainer.is_global_zero:
                save_adapter(policy.model, tmp / "adapter")
                if self.save_merged:
                    save_merged_model(policy, tmp / "merged")
                write_checksums(tmp)  # what a resume, `alfrl eval --adapter` and model.init_adapter check the files against
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointSpaceError(errno.ENOSPC, f"checkpoint of step {step}: no space left on the disk of {root} "
                                       f"(the newest, {self._last_name(root)}, is intact): free space there, or keep fewer "
                                       f"resume states (checkpoint.keep_resume_states, now {self.keep_resume_states}), or save "
                                       f"less often (checkpoint.save_every, now {self.save_every})") from None
        if trainer.is_global_zero:
            # a step saved again (a run resumed from an earlier step) swaps folders by renames only: the old one aside, the
            # new one in, then the old one deleted; a kill between the renames leaves the old one aside, and
            # ``alfrl.checkpoints`` puts it back when `last` names a step that is missing
            aside = root / f".{final.name}.old"
            shutil.rmtree(aside, ignore_errors=True)
            if final.exists():
                os.replace(final, aside)
            os.replace(tmp, final)
            (root / "last.tmp").write_text(final.name)
            os.replace(root / "last.tmp", root / "last")
            shutil.rmtree(aside, ignore_errors=True)
            self.prune(root, keep=final)
        trainer.strategy.barrier("alfrl_checkpoint_end")
        self.last_saved_step = step
        return final

    def prune(self, root: Path, keep: Path) -> list[Path]:
        """Delete ``trainer.ckpt`` from every step folder but the newest ``keep_resume_states`` (and ``keep``,
        the one just written); returns the files deleted."""
        if not self.keep_resume_states:
            return []
        steps = sorted(p for p in root.glob("step-*") if p.is_dir() and (p / CKPT_FILE).is_file())
        old = [p / CKPT_FILE for p in steps[:-self.keep_resume_states] if p != keep]
        for f in old:
            f.unlink()
        return old

    @staticmethod
    def _last_name(root: Path) -> str:
        last = root / "last"
        return last.read_text().strip() if last.is_file() else "none yet"

    # RNG states travel inside trainer.ckpt, so a resumed run samples what the uninterrupted one would
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module, checkpoint: dict) -> None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        checkpoint["alfrl_rng"] = {  # plain types and tensors only: Lightning loads with weights_only=True
            "python": random.getstate(),
            "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module, checkpoint: dict) -> None:
        rng = checkpoint.get("alfrl_rng")
        if rng is None:
            return
        random.setstate(rng["python"])
        name, keys, pos, has_gauss, gauss = rng["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
