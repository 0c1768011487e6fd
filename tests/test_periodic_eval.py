"""The periodic evaluation callback logs success overall, per split and per task type (splits pooled), and loops a game."""

import itertools
from types import SimpleNamespace

import pytest

from alfrl.evaluation import read_results, summarize
from callbacks.periodic_eval import PeriodicEval

_IDS = itertools.count()


def _record(split, task, won):
    return {"type": "game", "game_id": f"{split}/{task}/{next(_IDS)}", "split": split, "task_type": task, "won": won, "reward": float(won), "steps": 3,
            "invalid_actions": 0, "stop_reason": "won" if won else "max_steps", "turns": [{"valid_format": True, "admissible": True}]}


class _Module:
    def __init__(self):
        self.logged = {}
        self.hparams = SimpleNamespace(model_name="tiny")

    def log_dict(self, metrics, **kwargs):
        self.logged.update(metrics)


def test_success_per_task_type_pools_the_splits_and_runs_only_every_n_steps_and_its_records_are_kept(tmp_path):
    records = [_record("valid_seen", "pick_two_obj_and_place", True), _record("valid_seen", "pick_two_obj_and_place", False),
               _record("valid_unseen", "pick_two_obj_and_place", False), _record("valid_unseen", "look_at_obj_in_light", True)]
    # the second game takes an apple, puts it back and takes it again from where it first took it: one loop in 4 games
    records[1]["turns"] = [dict(records[1]["turns"][0], state_key=state, action=action)
                           for state, action in (("s0", "take apple 1"), ("s1", "put apple 1"), ("s0", "take apple 1"))]
    asked = []
    datamodule = SimpleNamespace(evaluate_in_memory=lambda limit: asked.append(limit) or (records, False))
    cb, module = PeriodicEval(every_n_steps=2, limit_per_split=6), _Module()
    trainer = SimpleNamespace(global_step=1, datamodule=datamodule, is_global_zero=True, default_root_dir=str(tmp_path))
    cb.on_train_batch_end(trainer, module, None, None, 0)
    assert asked == [] and module.logged == {} and not (tmp_path / "evals").exists()
    trainer.global_step = 2
    cb.on_train_batch_end(trainer, module, None, None, 0)
    assert asked == [6]
    # the records, in alfrl eval's format: alfrl report reads them and knows the engine was not batch-invariant
    header, games, summary = read_results(tmp_path / "evals" / "update-000002.jsonl")
    assert header["config"]["source"] == "periodic_eval" and header["config"]["update"] == 2 and header["config"]["model_name"] == "tiny"
    assert [g["game_id"] for g in games] == [r["game_id"] for r in records] == header["games"]
    assert summary == summarize(records, False) and summary["deterministic"] is False
    assert module.logged["eval/task/pick_two_obj_and_place/success_rate"] == pytest.approx(1 / 3)
    assert module.logged["eval/task/look_at_obj_in_light/success_rate"] == 1.0
    assert module.logged["eval/valid_seen/success_rate"] == 0.5
    assert module.logged["eval/success_rate"] == 0.5
    assert module.logged["eval/repeated_turns_mean"] == 0.25
    assert module.logged["eval/stop/won"] == 0.5 and module.logged["eval/stop/max_steps"] == 0.5  # as _record wrote them
