"""Every N steps, evaluate the current policy on a subset of the evaluation games, log it and keep its records."""

from __future__ import annotations

from pathlib import Path

import lightning as L

from alfrl.evaluation import game_repeats, results_header, summarize, task_type_wins, write_results
from alfrl.types import STOP_REASONS


class PeriodicEval(L.Callback):
    """Runs the evaluation protocol of ``data.eval`` on ``limit_per_split`` games of each split (the same
    games every time, spread over the task types) and logs success overall, per split and per task type. Every game's
    record goes to ``<default_root_dir>/evals/update-NNNNNN.jsonl`` in ``alfrl eval``'s format, so that ``alfrl report``
    pairs it with any evaluation on the games both played (the warm start's, an earlier update's)."""

    def __init__(self, every_n_steps: int = 0, limit_per_split: int | None = 10):
        """
        Args:
            every_n_steps: evaluate after every N training steps (0 turns it off).
            limit_per_split: games per split, spread over its task types; null for all of them.
        """
        if every_n_steps < 0:
            raise ValueError(f"periodic_eval.every_n_steps={every_n_steps} must be >= 0 (0 turns it off)")
        self.every_n_steps = every_n_steps
        self.limit_per_split = limit_per_split
        self.last: dict | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self.every_n_steps or trainer.global_step % self.every_n_steps:
            return
        records, deterministic = trainer.datamodule.evaluate_in_memory(self.limit_per_split)
        summary = summarize(records, deterministic)
        self.last = summary
        if trainer.is_global_zero:
            config = {"source": "periodic_eval", "update": trainer.global_step, "limit_per_split": self.limit_per_split,
                      "model_name": pl_module.hparams.model_name, "deterministic": deterministic}
            write_results(Path(trainer.default_root_dir) / "evals" / f"update-{trainer.global_step:06d}.jsonl",
                          results_header(config, [r["game_id"] for r in records]), records, summary)
        metrics = {f"eval/{k}": float(v) for k, v in summary["overall"].items()}
        for split, block in summary["splits"].items():
            metrics[f"eval/{split}/success_rate"] = float(block["success_rate"])
        for task, (wins, games) in task_type_wins(summary).items():  # all splits pooled: a collapsing task type shows early
            metrics[f"eval/task/{task}/success_rate"] = wins / games
        repeats = [(game_repeats(r) or (0, 0))[0] for r in records]  # this engine's records: every turn has its state_key
        metrics["eval/repeated_turns_mean"] = sum(repeats) / max(len(repeats), 1)  # loops a game, as rollout/repeated_turns_mean
        for reason in STOP_REASONS:  # how the games ended, as rollout/stop/*: won, out of steps, out of tokens, ...
            metrics[f"eval/stop/{reason}"] = sum(r.get("stop_reason") == reason for r in records) / max(len(records), 1)
        pl_module.log_dict(metrics, on_step=True, batch_size=1, rank_zero_only=False)
