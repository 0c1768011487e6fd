"""Evaluation: exact summaries, resumable output, the walkthrough wins, the tiny model end to end, reports."""

import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from alfrl.chat import chat_format
from alfrl.envs import EnvPool
from alfrl.evaluation import EvalConfig, EvalError, eval_games, read_results, run_eval, summarize
from alfrl.rewards import RewardConfig
from alfrl.rollout import RolloutConfig, RolloutRunner
from tests.conftest import one_game_per_task
from tests.helpers import EMPTY_SAFETENSORS, WalkthroughEngine, alfrl_here

REPO = Path(__file__).resolve().parent.parent


def _turn(valid, admissible):
    return {"valid_format": valid, "admissible": admissible}


HAND_MADE = [
    {"type": "game", "game_id": "valid_seen:a", "split": "valid_seen", "task_type": "pick_and_place_simple", "won": True, "steps": 2,
     "invalid_actions": 0, "stop_reason": "won", "reward": 1.0, "turns": [_turn(True, True), _turn(True, True)]},
    {"type": "game", "game_id": "valid_seen:b", "split": "valid_seen", "task_type": "pick_and_place_simple", "won": False, "steps": 4,
     "invalid_actions": 2, "stop_reason": "max_steps", "reward": -0.2, "turns": [_turn(False, False), _turn(True, False), _turn(True, True), _turn(True, True)]},
    {"type": "game", "game_id": "valid_seen:c", "split": "valid_seen", "task_type": "look_at_obj_in_light", "won": True, "steps": 3,
     "invalid_actions": 1, "stop_reason": "won", "reward": 0.9, "turns": [_turn(True, False), _turn(True, True), _turn(True, True)]},
    {"type": "game", "game_id": "valid_unseen:d", "split": "valid_unseen", "task_type": "look_at_obj_in_light", "won": False, "steps": 1,
     "invalid_actions": 1, "stop_reason": "trajectory_too_long", "reward": -0.1, "turns": [_turn(False, False)]},
]


def test_summary_of_a_hand_made_file_is_exact(tmp_path):
    path = tmp_path / "hand.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in HAND_MADE))
    _, games, s = read_results(path)
    assert len(games) == 4
    seen, unseen, overall = s["splits"]["valid_seen"], s["splits"]["valid_unseen"], s["overall"]
    assert (seen["games"], seen["wins"]) == (3, 2) and seen["success_rate"] == 2 / 3
    assert seen["mean_reward"] == pytest.approx((1.0 - 0.2 + 0.9) / 3) and seen["mean_steps"] == 3.0 and seen["mean_invalid_actions"] == 1.0
    assert seen["valid_format_rate"] == 8 / 9 and seen["admissible_rate"] == 6 / 9
    assert (unseen["games"], unseen["wins"], unseen["success_rate"], unseen["valid_format_rate"]) == (1, 0, 0.0, 0.0)
    # overall is game-weighted: 2 wins of 4 games, not the mean of the split rates
    assert overall["success_rate"] == 0.5 and overall["mean_steps"] == 2.5 and overall["admissible_rate"] == 6 / 10
    assert s["task_types"]["valid_seen"]["pick_and_place_simple"] == {"games": 2, "wins": 1, "success_rate": 0.5}
    assert s["task_types"]["valid_seen"]["look_at_obj_in_light"]["success_rate"] == 1.0
    assert s["task_types"]["valid_unseen"]["look_at_obj_in_light"] == {"games": 1, "wins": 0, "success_rate": 0.0}


def test_the_walkthrough_policy_wins_every_game_of_a_sample(valid_games, tiny_tokenizer, tmp_path):
    sample = one_game_per_task(valid_games, "valid_seen") + one_game_per_task(valid_games, "valid_unseen")
    fmt = chat_format(tiny_tokenizer, "tool_call")
    cfg = EvalConfig(games_per_chunk=1)
    with EnvPool(num_workers=2) as pool:
        runner = RolloutRunner(WalkthroughEngine(fmt, sample), pool, fmt, cfg.rollout_config(RolloutConfig()), RewardConfig())
        summary = run_eval(runner, sample, cfg, tmp_path / "walk.jsonl", {"policy": "walkthrough"})
    assert summary["overall"]["games"] == 12 and summary["overall"]["success_rate"] == 1.0
    assert summary["overall"]["valid_format_rate"] == 1.0 and summary["overall"]["admissible_rate"] == 1.0
    for split in ("valid_seen", "valid_unseen"):
        assert len(summary["task_types"][split]) == 6
        assert all(v["success_rate"] == 1.0 for v in summary["task_types"][split].values())


@pytest.fixture(scope="module")
def tiny_runner(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alfrl.engines import HFEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    fmt = chat_format(tok, "tool_call")
    cfg = EvalConfig(max_episode_steps=4, max_trajectory_tokens=5000, max_assistant_tokens=40, games_per_chunk=2, temperature=1.0)
    with EnvPool(num_workers=2) as pool:
        yield RolloutRunner(HFEngine(model, tok.pad_token_id), pool, fmt, cfg.rollout_config(RolloutConfig()), RewardConfig()), cfg


def test_an_interrupted_eval_keeps_every_finished_game_and_resumes_to_the_same_summary(valid_games, tiny_runner, tmp_path):
    runner, cfg = tiny_runner
    games = valid_games[:2] + valid_games[-2:]
    config = {"model": "tiny"}
    on_disk = []  # each game's record is on disk when on_game is called
    whole = run_eval(runner, games, cfg, tmp_path / "whole.jsonl", config,
                     on_game=lambda done, total: on_disk.append((done, total, len(read_results(tmp_path / "whole.jsonl")[1]))))
    assert on_disk == [(1, 4, 1), (2, 4, 2), (3, 4, 3), (4, 4, 4)]
    spent = {}
    run_eval(runner, games, cfg, tmp_path / "timed.jsonl", config, spent=spent)
    assert spent["requests"] >= 4 and spent["engine_seconds"] > 0 and spent["env_wait_seconds"] >= 0  # where the time went
    assert spent["engine_steps"] >= 1 and spent["submit_seconds"] > 0
    header, records, _ = read_results(tmp_path / "whole.jsonl")
    assert [r["game_id"] for r in records] == [g.id for g in games]  # rewritten in the games' order at the end
    # an evaluation cut after its first finished game (as the end of a machine loan would cut it)
    lines = (tmp_path / "whole.jsonl").read_text().splitlines()
    first = next(line for line in lines[1:] if json.loads(line)["game_id"] == games[2].id)
    (tmp_path / "parts.jsonl").write_text(lines[0] + "\n" + first + "\n" + first[: len(first) // 2])  # and a torn line
    played = []
    resumed = run_eval(runner, games, cfg, tmp_path / "parts.jsonl", config, on_game=lambda d, t: played.append(d))
    assert played == [2, 3, 4]  # only the three other games were played
    assert resumed == whole
    # a finished file re-run plays nothing and gives the same summary
    assert run_eval(runner, games, cfg, tmp_path / "parts.jsonl", config, on_game=lambda d, t: played.append(d)) == whole
    assert played == [2, 3, 4]
    # a different configuration is refused unless --overwrite
    changed = {**config, "model": "other"} if isinstance(config, dict) else {"model": "other"}
    with pytest.raises(EvalError, match="--overwrite") as refused:
        run_eval(runner, games, cfg, tmp_path / "parts.jsonl", changed)
    assert "model: " in str(refused.value) and "-> 'other'" in str(refused.value) and len(str(refused.value)) < 400  # the key, not the dict
    assert run_eval(runner, games[:2], cfg, tmp_path / "parts.jsonl", {"model": "other"}, overwrite=True)["overall"]["games"] == 2


def test_the_cpu_engine_plays_the_same_records_twice_and_the_files_say_it_was_deterministic(valid_games, tiny_runner, tmp_path):
    """data.eval.deterministic: the hf engine generates each request on its own under the request's seed, so two runs of the
    same games at temperature 1 (every turn sampled) write the same records, token counts included, whatever the
    environments' timing; the header and the summary record that the engine was batch-invariant."""
    runner, cfg = tiny_runner
    games = [valid_games[0], valid_games[-1], valid_games[1]]
    config = {"model": "tiny", "deterministic": runner.engine.batch_invariant}
    first = run_eval(runner, games, cfg, tmp_path / "a.jsonl", config)
    second = run_eval(runner, games, cfg, tmp_path / "b.jsonl", config)
    (ha, ga, sa), (_, gb, sb) = read_results(tmp_path / "a.jsonl"), read_results(tmp_path / "b.jsonl")
    assert ga == gb and first == second == sa == sb
    assert sum(t["completion_tokens"] for r in ga for t in r["turns"]) > 0 and all("prompt_tokens" in t for r in ga for t in r["turns"])
    assert ha["config"]["deterministic"] is True and sa["deterministic"] is True
    assert summarize(ga)["deterministic"] is None  # a summary made without the header does not claim it


def test_a_limited_evaluation_covers_every_task_type_of_each_split_with_the_same_games_every_time(data_dir):
    games = eval_games(data_dir, ("valid_seen", "valid_unseen"), 6)
    assert [g.split for g in games] == ["valid_seen"] * 6 + ["valid_unseen"] * 6
    for split in ("valid_seen", "valid_unseen"):
        mine = [g for g in games if g.split == split]
        assert len({g.task_type for g in mine}) == 6  # one of each of the six task types
        assert [g.id for g in mine] == sorted(g.id for g in mine)
        everything = [g for g in eval_games(data_dir, (split,), None) if g.task_type in {m.task_type for m in mine}]
        first_of_type = {}
        for g in everything:
            first_of_type.setdefault(g.task_type, g.id)
        assert {g.id for g in mine} == set(first_of_type.values())  # each type's first game in sorted order
    assert [g.id for g in eval_games(data_dir, ("valid_seen",), 20)] == [g.id for g in eval_games(data_dir, ("valid_seen",), 20)]
    twenty = eval_games(data_dir, ("valid_seen",), 20)
    counts = Counter(g.task_type for g in twenty)
    assert max(counts.values()) - min(counts.values()) <= 1, counts  # the first 20 sorted would be 13 of one type
    assert len(eval_games(data_dir, ("valid_seen", "valid_unseen"), None)) == 274
    assert len(eval_games(data_dir, ("valid_seen",), 1000)) == 140


def test_make_eval_runs_the_tiny_model_and_report_compares_runs(tmp_path, data_dir, tiny_model_dir, capfd, monkeypatch):
    env = dict(os.environ, ALFWORLD_DATA=data_dir)
    outputs = []
    for name, extra in (("base", ""), ("greedy", "--data.eval.temperature 0")):
        out = tmp_path / f"{name}.jsonl"
        args = f"--model.model_name {tiny_model_dir} {extra}"
        if name == "base":  # the documented command, a process of its own
            proc = subprocess.run(["make", "eval", "RECIPE=recipes/tiny.yaml", "LIMIT=2", f"OUT={out}", f"ARGS={args}", f"DATA_DIR={data_dir}",
                                   f"TINY_MODEL={tiny_model_dir}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        else:  # what it runs, in this process (a process start costs ~9 s of imports)
            monkeypatch.setenv("ALFWORLD_DATA", data_dir)
            proc = alfrl_here(capfd, "eval", "--config", "recipes/tiny.yaml", "--limit-per-split", "2", "--out", str(out), *args.split())
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "success per task type" in proc.stdout and "in engine steps" in proc.stdout and " ms each)" in proc.stdout  # where the time went
        header, games, summary = read_results(out)
        assert header["config"]["model_name"] == tiny_model_dir and len(games) == 4
        assert header["config"]["deterministic"] is True and summary["deterministic"] is True  # data.eval.deterministic, as played
        assert "deterministic" in proc.stderr
        assert json.loads(out.with_suffix(".summary.json").read_text()) == summary
        assert json.loads(out.read_text().splitlines()[-1])["type"] == "summary"
        outputs.append(str(out))
    report = tmp_path / "report"
    proc = subprocess.run(["alfrl" if False else str(REPO / ".venv/bin/alfrl") if (REPO / ".venv/bin/alfrl").exists() else "alfrl",
                           "report", *outputs, "--names", "base", "greedy", "--out", str(report)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    table = (report / "report.md").read_text()
    assert "| base |" in table and "| greedy |" in table and "pick_and_place_simple" in table
    assert table.count("% | yes |") == 2 and "Warning" not in table and "warning" not in proc.stderr  # both deterministic
    for png in ("success_by_split.png", "success_by_task.png", "invalid_actions.png"):
        data = (report / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_report_of_hand_made_runs(tmp_path):
    from alfrl.report import markdown

    base = summarize(HAND_MADE)
    better = summarize([dict(r, won=True) for r in HAND_MADE])
    table = markdown([("base", base), ("trained", better)])
    assert "| base | 66.67% | 0.00% | 50.00% | 2/4 |" in table
    assert "| trained | 100.00% (+33.33) | 100.00% (+100.00) | 100.00% (+50.00) | 4/4 |" in table
    assert "| look_at_obj_in_light | 50.00% | 100.00% (+50.00) |" in table
    assert table.count("% | not recorded |") == 2 and "Warning" not in table


def test_report_of_runs_on_different_games_compares_the_games_all_of_them_played(tmp_path, capfd):
    """A 274-game evaluation beside a 60-game periodic one: the tables are over the common games, and say so; runs
    with no game in common are one line."""
    def write(name, records):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in [{"type": "header", "config": {}}, *records]))
        return str(path)

    full = write("full", HAND_MADE)  # 2 wins of 4
    part = write("part", [dict(r, won=True) for r in HAND_MADE[1:3]])  # b and c, both won
    out = tmp_path / "report"
    proc = alfrl_here(capfd, "report", full, part, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    table = (out / "report.md").read_text()
    line = "The runs played different games (full 4, part 2): every table and chart below is over the 2 games all of them played."
    assert line in table and line in proc.stderr
    assert "| full | 50.00% | - | 50.00% | 1/2 |" in table and "| part | 100.00% (+50.00) | - | 100.00% (+50.00) | 2/2 |" in table
    other = write("other", [dict(HAND_MADE[0], game_id="valid_seen:z")])
    proc = alfrl_here(capfd, "report", full, other, "--out", str(tmp_path / "r2"))
    assert proc.returncode != 0 and "no game was played by every run (full 4, other 1 games)" in proc.stderr


def test_report_compares_a_run_known_by_its_summary_alone_unpaired(tmp_path, capfd):
    """A run whose records are gone (only its .summary.json): in the tables, left out of the pairing, compared by
    Newcombe's interval; a summary cannot be the baseline, and a file that is not a summary is one line."""
    from alfrl.stats import unpaired_comparison

    full = tmp_path / "new.jsonl"
    full.write_text("".join(json.dumps(r) + "\n" for r in [{"type": "header", "config": {}}, *HAND_MADE]))  # 2 wins of 4
    old = tmp_path / "old.summary.json"
    old.write_text(json.dumps(summarize([dict(r, won=False) for r in HAND_MADE[:3]] + [dict(HAND_MADE[3], won=True)])))
    out = tmp_path / "report"
    proc = alfrl_here(capfd, "report", str(full), str(old), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    table = (out / "report.md").read_text()
    assert "| old | " in table and "## Paired comparison" not in table
    c = unpaired_comparison(1, 4, 2, 4)
    assert "## Unpaired comparison against old (its summary only: no game-by-game pairing)" in table
    assert (f"| new | all | 4 | 25.00% -> 50.00% | +25.00 pts | [{100 * c['ci_low']:+.2f}, {100 * c['ci_high']:+.2f}] pts | "
            "not shown |") in table
    for args, error in (([str(old), str(full)], "is the baseline and must hold the games"),
                        ([str(full), str(tmp_path / "new.jsonl")], None)):
        proc = alfrl_here(capfd, "report", *args, "--out", str(tmp_path / "r2"))
        assert (proc.returncode != 0 and error in proc.stderr) if error else proc.returncode == 0
    bad = tmp_path / "bad.summary.json"
    bad.write_text(json.dumps({"overall": {"games": 4}}))
    proc = alfrl_here(capfd, "report", str(full), str(bad), "--out", str(tmp_path / "r3"))
    assert proc.returncode != 0 and "is not an `alfrl eval` summary" in proc.stderr and "give the .summary.json" in proc.stderr


def test_report_warns_when_it_pairs_a_deterministic_evaluation_with_one_that_was_not(tmp_path, capfd):
    """Two runs of one adapter on a non-deterministic engine differed by 3 points: a paired difference against such a run
    is not the adapters' alone; the report says so in report.md and on stderr, and says nothing when both are exact."""
    def write(name, deterministic, won):
        records = [dict(r, won=won) for r in HAND_MADE]
        header = {"type": "header", "config": {"model": name, **({} if deterministic is None else {"deterministic": deterministic})}}
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in [header, *records]))
        return str(path)

    exact, noisy, old = write("exact", True, True), write("noisy", False, False), write("old", None, True)
    for files, warned in (([exact, noisy], ["noisy was not"]), ([old, exact], ["old was not"]), ([exact, write("exact2", True, False)], [])):
        out = tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}"
        proc = alfrl_here(capfd, "report", *files, "--out", str(out))  # in this process: 3 process starts are ~27 s of imports
        assert proc.returncode == 0, proc.stderr
        table = (out / "report.md").read_text()
        for text in warned:
            assert text in table and "**Warning:**" in table and "alfrl report: warning:" in proc.stderr and text in proc.stderr
        if not warned:
            assert "Warning" not in table and "warning" not in proc.stderr


def test_report_training_curves_merge_a_resumed_run(tmp_path):
    """Rows of both CSV versions, the resumed run's row winning for a step logged twice; the PNG is drawn."""
    from alfrl.report import main as report_main
    from alfrl.report import log_records, training_rows

    header = ("epoch,rollout/invalid_actions_mean,rollout/reward_mean,rollout/success_rate,rollout/trajectories,step,train/loss,"
              "rollout/seconds,train/update_seconds,sync/total_seconds,step/seconds\n")
    v0 = tmp_path / "run" / "csv" / "version_0"
    v1 = tmp_path / "run" / "csv" / "version_1"
    v0.mkdir(parents=True)
    v1.mkdir(parents=True)
    (v0 / "metrics.csv").write_text(header + "0,3.0,-0.3,0.0,64,0,,20.0,6.0,0.5,\n0,,,,,0,0.5,,,,\n0,2.0,-0.1,0.125,64,1,,,,,\n")
    (v1 / "metrics.csv").write_text(header + "0,1.5,0.05,0.25,64,1,,30.0,1.0,0.5,32.0\n0,1.0,0.2,0.375,64,2,,16.0,5.0,0.5,22.25\n")
    rows = training_rows(log_records([str(tmp_path / "run")]))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["reward"] for r in rows] == [-0.3, 0.05, 0.2]
    assert [r["success"] for r in rows] == [0.0, 0.25, 0.375]
    assert [r["invalid_actions"] for r in rows] == [3.0, 1.5, 1.0]
    assert [r["seconds_step"] for r in rows] == [26.5, 31.5, 21.5]  # rollout + the update after it + sync
    assert [r["seconds_wall"] for r in rows] == [None, 32.0, 22.25]  # the wall clock, where logged (since 2026-12-04)
    assert [r["seconds_other"] for r in rows] == [None, 0.5, 0.75]  # and what the three parts leave out

    result = tmp_path / "result.jsonl"
    header_rec = {"type": "header", "config": {}, "config_hash": "x", "games": ["g"]}
    game = {"type": "game", "game_id": "g", "split": "valid_seen", "task_type": "pick_and_place_simple", "won": True,
            "steps": 3, "invalid_actions": 0, "reward": 1.0, "stop_reason": "won", "turns": []}
    from alfrl.evaluation import summarize

    lines = [header_rec, game, summarize([game])]
    result.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "report"
    assert report_main([str(result), "--out", str(out), "--train-log", str(tmp_path / "run")]) == 0
    assert (out / "training.csv").read_text().splitlines()[0].startswith("step,reward,success,invalid_actions")
    assert len((out / "training.csv").read_text().splitlines()) == 4
    report = (out / "report.md").read_text()
    assert "## Training steps (3 updates, seconds)" in report and "| step, its three parts | 26.50 | 21.50 | 31.50 | 79.50 | 3 |" in report
    assert "| step, wall clock | 27.12 | 22.25 | 32.00 | 54.25 | 2 |" in report  # the total over the updates that logged it
    assert "| between the parts (wall clock - parts) | 0.62 | 0.50 | 0.75 | 1.25 | 2 |" in report
    assert "| update after the rollout | 4.00 | 1.00 | 6.00 | 12.00 | 3 |" in report
    assert (out / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="no metrics.csv"):
        training_rows(log_records([str(tmp_path / "report")]))


def test_report_reads_one_file_holding_two_processes_logs_with_their_own_columns(tmp_path):
    """A resumed run's CSVs joined into one file (a lease ships them so): the second header's column order holds for
    the rows after it."""
    from alfrl.report import eval_rows, log_records, training_rows

    first = "step,rollout/reward_mean,rollout/success_rate,eval/success_rate\n0,0.1,0.25,\n1,0.2,0.5,0.3\n"
    second = "eval/success_rate,rollout/success_rate,step,rollout/reward_mean\n,0.75,2,0.4\n0.6,0.5,3,0.3\n"
    path = tmp_path / "joined.metrics.csv"
    path.write_text(first + second)
    rows = training_rows(log_records([str(path)]))
    assert [(r["step"], r["reward"], r["success"]) for r in rows] == [(0, 0.1, 0.25), (1, 0.2, 0.5), (2, 0.4, 0.75), (3, 0.3, 0.5)]
    assert [(r["update"], r["success_rate"]) for r in eval_rows(log_records([str(path)]))] == [(2, 0.3), (4, 0.6)]


def test_report_html_games_spread_over_task_types_among_the_games_every_run_played():
    from alfrl.report import spread_games

    def run(ids):
        return [{"game_id": i, "task_type": i.split("/")[0]} for i in ids]

    before = run(["a/1", "a/2", "a/3", "b/1", "b/2", "c/1", "c/9"])
    after = run(["a/1", "a/2", "a/3", "b/1", "b/2", "c/1"])  # c/9 not played by both: never chosen
    assert spread_games([("w", before), ("r", after)], 4) == {"a/1", "b/1", "c/1", "a/2"}
    assert spread_games([("w", before), ("r", after)], 50) == {g["game_id"] for g in after}
    with pytest.raises(SystemExit, match="--html-games 0"):
        spread_games([("w", before)], 0)


def test_report_draws_the_periodic_evaluation_per_task_type_against_updates(tmp_path):
    """eval/ columns on the update's row (as Lightning's CSVLogger merges them): update = step + 1, a resumed run's
    evaluation wins, the table and the curves written; a run that never evaluated gets neither."""
    from alfrl.report import eval_rows, log_records
    from alfrl.report import main as report_main

    header = ("step,rollout/reward_mean,eval/success_rate,eval/valid_seen/success_rate,eval/valid_unseen/success_rate,"
              "eval/task/pick_and_place_simple/success_rate,eval/task/pick_two_obj_and_place/success_rate,eval/wins\n")
    for version, body in ((0, "9,0.1,0.25,0.5,0.0,1.0,0.0,5\n10,0.2,,,,,,\n19,0.3,0.3,0.4,0.2,1.0,0.0,6\n"),
                          (1, "19,0.3,0.45,0.5,0.4,1.0,0.5,9\n")):
        folder = tmp_path / "run" / "csv" / f"version_{version}"
        folder.mkdir(parents=True)
        (folder / "metrics.csv").write_text(header + body)
    rows = eval_rows(log_records([str(tmp_path / "run")]))
    assert [r["update"] for r in rows] == [10, 20]
    assert rows[1] == {"update": 20, "success_rate": 0.45, "valid_seen": 0.5, "valid_unseen": 0.4,
                       "task/pick_and_place_simple": 1.0, "task/pick_two_obj_and_place": 0.5}
    result = tmp_path / "result.jsonl"
    from alfrl.evaluation import summarize

    game = {"type": "game", "game_id": "g", "split": "valid_seen", "task_type": "pick_and_place_simple", "won": True,
            "steps": 3, "invalid_actions": 0, "reward": 1.0, "stop_reason": "won", "turns": []}
    result.write_text("".join(json.dumps(x) + "\n" for x in [{"type": "header", "config": {}, "games": ["g"]}, game, summarize([game])]))
    out = tmp_path / "report"
    assert report_main([str(result), "--out", str(out), "--train-log", str(tmp_path / "run")]) == 0
    report = (out / "report.md").read_text()
    assert "## Periodic evaluation (2 evaluations" in report
    assert "| 20 | 45.00% | 50.00% | 40.00% | 100.00% | 50.00% |" in report
    assert (out / "eval_curves.csv").read_text().splitlines()[0] == \
        "update,success_rate,valid_seen,valid_unseen,task/pick_and_place_simple,task/pick_two_obj_and_place"
    assert (out / "eval_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "metrics.csv").write_text("step,rollout/reward_mean\n0,0.1\n")
    assert eval_rows(log_records([str(tmp_path / "plain")])) == []


def test_identical_games_finds_each_games_first_different_turn():
    """alfrl report's "games played identically": every turn's text, action and token counts, and the same stop."""
    from alfrl.report import identical_games

    def game(gid, texts, won=False, stop="max_steps"):
        turns = [{"completion_text": t, "action": t, "prompt_tokens": 10 * i, "completion_tokens": len(t), "finish_reason": "stop",
                  "observation": "ok"} for i, t in enumerate(texts)]
        return {"game_id": gid, "won": won, "stop_reason": stop, "turns": turns}

    a = [game("g1", ["go", "take"]), game("g2", ["go", "open"]), game("g3", ["look"]), game("g4", ["go"], won=True, stop="won"),
         game("only-a", ["x"])]
    b = [game("g1", ["go", "take"]), game("g2", ["go", "close"]), game("g3", ["look", "look"]), game("g4", ["go"]),
         game("only-b", ["x"])]
    b[0]["turns"][1] = dict(b[0]["turns"][1])  # equal content in another object: still identical
    same = identical_games(a, b)
    assert same["games"] == 4 and same["identical"] == 1 and same["outcome_changed"] == 1
    assert same["first_difference"] == {"g1": None, "g2": 1, "g3": 1, "g4": 1}
    b[0]["turns"][0] = dict(b[0]["turns"][0], completion_tokens=3)  # one token more in the same text: a different play
    assert identical_games(a, b)["first_difference"]["g1"] == 0


def test_an_adapter_given_to_eval_replaces_the_warm_start_the_recipe_names(monkeypatch, tmp_path):
    """`alfrl eval --config recipes/rl_qwen15b_from_sft.yaml --adapter RUN/checkpoints/last` on a machine without the
    recipe's warm start (runs/sft_qwen15b/...) stopped with a recipe error (H100, 2026-12-06): the evaluated adapter is
    the model's whole adapter, so the recipe's init_adapter is dropped before the recipe is checked."""
    from alfrl import evaluate_cli, recipe

    seen = []

    def stop(argv):
        seen.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(recipe, "load_recipe", stop)
    for argv in (["--config", "recipes/rl_qwen15b_from_sft.yaml", "--adapter", str(tmp_path), "--out", "x.jsonl"],
                 ["--config", "recipes/rl_qwen15b_from_sft.yaml", "--out", "x.jsonl"]):
        with pytest.raises(SystemExit):
            evaluate_cli.main(argv)
    assert seen[0][-2:] == ["--model.init_adapter", "null"] and "--model.init_adapter" not in seen[1]


def test_an_evaluation_file_whose_tail_is_not_utf8_keeps_every_whole_game(tmp_path):
    """A file cut inside a multi-byte character (or with garbage after it) stopped the rerun with a UnicodeDecodeError
    traceback and recovered nothing; the whole records before the torn tail are kept, as for a cut line."""
    header = {"type": "header", "config": {"model": "x"}}
    lines = [json.dumps(header)] + [json.dumps(r) for r in HAND_MADE[:2]]
    path = tmp_path / "torn.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + '{"type": "game", "task": "caf\u00e9'.encode()[:-1] + b"\xff\xfe\n")
    got_header, games, summary = read_results(path)
    assert got_header == header and [g["game_id"] for g in games] == ["valid_seen:a", "valid_seen:b"]
    assert summary["overall"]["games"] == 2


def test_report_reads_gzipped_records_as_results_folders_keep_them(tmp_path, capfd):
    """results/*/X.jsonl.gz (the records a results folder keeps compressed) is read as X.jsonl, named X; a cut or
    corrupt .gz is one line."""
    import gzip

    records = [{"type": "header", "config": {}}, *HAND_MADE]
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in records))
    packed = tmp_path / "packed.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_results(packed)[1:] == read_results(plain)[1:]
    out = tmp_path / "report"
    proc = alfrl_here(capfd, "report", str(plain), str(packed), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "| packed | " in (out / "report.md").read_text()
    for name, data in (("cut", packed.read_bytes()[:-12]), ("corrupt", b"not gzip at all")):
        bad = tmp_path / f"{name}.jsonl.gz"
        bad.write_bytes(data)
        with pytest.raises(EvalError, match="cannot be read .*is it an `alfrl eval` output"):
            read_results(bad)


def test_a_missing_adapter_is_one_line_before_any_model_loads(capfd):
    from alfrl.cli import main

    assert main(["eval", "--config", "recipes/tiny.yaml", "--out", "x.jsonl.gz"]) == 2  # appended plain lines under a .gz name
    assert capfd.readouterr().err.strip().splitlines() == [
        "alfrl eval: --out x.jsonl.gz: alfrl eval writes plain JSONL (resumable): give a .jsonl name and gzip the file "
        "afterwards (alfrl report reads .jsonl.gz)"]

    assert main(["eval", "--config", "recipes/tiny.yaml", "--adapter", "/no/such/path", "--out", "x.jsonl"]) == 2
    err = capfd.readouterr().err
    assert err.strip().splitlines() == ["alfrl eval: --adapter /no/such/path: no such file or folder: give a checkpoint folder "
                                        "(runs/NAME/checkpoints/last), its adapter/ folder or its trainer.ckpt"]


@pytest.mark.parametrize("problem,shown", [("rank", "has r=4 but model.lora.rank=8"), ("truncated", "is damaged: its header is cut short")])
def test_an_adapter_of_other_lora_settings_or_damaged_is_one_line_before_any_model_loads(capsys, tmp_path, tiny_model_dir, problem, shown):
    """Issue "Nothing lost, nothing injected": the rank mismatch loaded the model before its error; a truncated adapter was
    a SafetensorError traceback."""
    from alfrl.cli import main

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4 if problem == "rank" else 8, "lora_alpha": 16}))
    (adapter / "adapter_model.safetensors").write_bytes(EMPTY_SAFETENSORS[: 3 if problem == "truncated" else None])
    code = main(["eval", "--config", "recipes/tiny.yaml", "--model.model_name", tiny_model_dir, "--adapter", str(adapter),
                 "--out", str(tmp_path / "x.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and shown in err and len([x for x in err.splitlines() if "alfrl eval:" in x]) == 1, err[-2000:]
    # in this process an exception would have failed the test before here: no traceback to look for
    assert "Loading weights" not in err and not (tmp_path / "x.jsonl").exists()


def test_the_summary_reader_checks_the_keys_a_summary_block_has():
    from alfrl.evaluation import SUMMARY_BLOCK_KEYS, _block

    assert tuple(_block(HAND_MADE)) == SUMMARY_BLOCK_KEYS
