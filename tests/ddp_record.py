"""A callback for the DDP test: each rank writes its LoRA weights' digest and the games it played."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import lightning as L


class RecordRank(L.Callback):
    def __init__(self, out: str):
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        h = hashlib.sha256()
        for name, tensor in sorted(pl_module.adapter_state().items()):
            h.update(name.encode())
            h.update(tensor.numpy().tobytes())
        record = {"rank": trainer.global_rank, "step": trainer.global_step, "lora": h.hexdigest(), "world": trainer.world_size}
        path = Path(self.out) / f"rank{trainer.global_rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
