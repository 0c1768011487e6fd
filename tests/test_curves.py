"""A run's curves from its CSV logs (alfrl.curves), as ``alfrl report --train-log`` writes them: a resumed run's rows
merged, joined logs with their own columns, the periodic evaluation per task type, and the starting adapter at update 0."""

import json

import pytest

from tests.helpers import HAND_MADE, alfrl_here


def test_training_curves_merge_a_resumed_run(tmp_path):
    """Rows of both CSV versions, the resumed run's row winning for a step logged twice; the PNG is drawn."""
    from alfrl.report import main as report_main
    from alfrl.curves import log_records, training_rows

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
    assert "In all: 54.25 s of steps = 0.015 h of wall clock over 2 updates" in report  # beside other runs' GPU-hours
    assert (out / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="no metrics.csv"):
        training_rows(log_records([str(tmp_path / "report")]))


def test_one_file_holding_two_processes_logs_with_their_own_columns(tmp_path):
    """A resumed run's CSVs joined into one file (a lease ships them so): the second header's column order holds for
    the rows after it."""
    from alfrl.curves import eval_rows, log_records, training_outputs, training_rows

    first = "step,rollout/reward_mean,rollout/success_rate,eval/success_rate\n0,0.1,0.25,\n1,0.2,0.5,0.3\n"
    second = ("eval/success_rate,rollout/success_rate,step,rollout/reward_mean,rollout/repeated_turns_mean\n"
              ",0.75,2,0.4,1.5\n0.6,0.5,3,0.3,0.25\n")  # a later process logs the loops too
    path = tmp_path / "joined.metrics.csv"
    path.write_text(first + second)
    rows = training_rows(log_records([str(path)]))
    assert [(r["step"], r["reward"], r["success"]) for r in rows] == [(0, 0.1, 0.25), (1, 0.2, 0.5), (2, 0.4, 0.75), (3, 0.3, 0.5)]
    assert [r["repeated_turns"] for r in rows] == [None, None, 1.5, 0.25]
    assert [p.name for p in training_outputs(rows, tmp_path)] == ["training.csv", "training_curves.png"]  # a loops panel, gaps before
    assert [(r["update"], r["success_rate"]) for r in eval_rows(log_records([str(path)]))] == [(2, 0.3), (4, 0.6)]


def test_the_periodic_evaluation_is_drawn_per_task_type_against_updates(tmp_path):
    """eval/ columns on the update's row (as Lightning's CSVLogger merges them): update = step + 1, a resumed run's
    evaluation wins, the table and the curves written; a run that never evaluated gets neither."""
    from alfrl.curves import eval_rows, log_records
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


def test_a_runs_curves_alone_need_no_evaluation_files(tmp_path, capfd):
    # what a user watching a run asks: its training curves and periodic evaluations, before any alfrl eval
    v0 = tmp_path / "run" / "csv" / "version_0"
    v0.mkdir(parents=True)
    (v0 / "metrics.csv").write_text("rollout/reward_mean,rollout/success_rate,rollout/invalid_actions_mean,step,eval/success_rate,"
                                    "eval/task/pick_and_place_simple/success_rate\n0.1,0.25,2.0,0,,\n,,,9,0.5,0.75\n0.3,0.5,1.0,9,,\n")
    out = alfrl_here(capfd, "report", "--train-log", str(tmp_path / "run"), "--out", str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["eval_curves.csv", "eval_curves.png", "report.md",
                                                                  "training.csv", "training_curves.png"]
    text = (tmp_path / "r" / "report.md").read_text()
    assert "## Periodic evaluation (1 evaluation" in text and "| 10 | 50.00% | 75.00% |" in text
    for argv, said in [((), "give alfrl eval output files to compare, or --train-log RUN_DIR"),
                       (("--train-log", str(tmp_path / "run"), "--html"), "--html shows evaluated games")]:
        out = alfrl_here(capfd, "report", *argv, "--out", str(tmp_path / "r2"))
        assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr


def test_the_periodic_curves_begin_with_the_starting_adapter_on_the_same_games(tmp_path, capsys):
    """--start: update 0 is the starting adapter's evaluation cut to the games the periodic evaluation played (read from
    the run's evals/ folder): a 4-game evaluation, of which the periodic one played 3; a start that lacks one of those
    games, or no periodic games to find, is one line."""
    from alfrl.report import main as report_main

    run = tmp_path / "run"
    (run / "csv" / "version_0").mkdir(parents=True)
    (run / "csv" / "version_0" / "metrics.csv").write_text(
        "step,eval/success_rate,eval/valid_seen/success_rate,eval/task/pick_and_place_simple/success_rate\n9,1.0,1.0,1.0\n")
    (run / "evals").mkdir()
    periodic = [dict(r, won=True) for r in HAND_MADE[:3]]  # valid_seen a, b, c
    (run / "evals" / "update-000010.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [{"type": "header", "config": {}}, *periodic]))
    start = tmp_path / "start.jsonl"
    start.write_text("".join(json.dumps(r) + "\n" for r in [{"type": "header", "config": {}}, *HAND_MADE]))  # a won, b lost, c won, d lost
    out = tmp_path / "r"
    assert report_main(["--train-log", str(run), "--start", str(start), "--out", str(out)]) == 0
    lines = (out / "eval_curves.csv").read_text().splitlines()
    assert lines[0] == "update,success_rate,valid_seen,task/pick_and_place_simple,task/look_at_obj_in_light"
    assert lines[1] == "0,0.6666666666666666,0.6666666666666666,0.5,1.0"  # 2 of the 3 periodic games; d (unseen) left out
    assert lines[2].startswith("10,1.0,1.0,1.0")
    assert "| 0 (start) | 66.67% | 66.67% |" in (out / "report.md").read_text()
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps(r) + "\n" for r in [{"type": "header", "config": {}}, *HAND_MADE[:2]]))
    capsys.readouterr()
    assert report_main(["--train-log", str(run), "--start", str(short), "--out", str(out)]) == 2
    assert f"{short} lacks 1 of the 3 games of the periodic evaluation" in capsys.readouterr().err
    assert report_main(["--train-log", str(run / "csv" / "version_0" / "metrics.csv"), "--start", str(start), "--out", str(out)]) == 2
    assert "give --train-log RUN_DIR (with its evals/ folder) or --evals" in capsys.readouterr().err
    assert report_main(["--train-log", str(run / "csv" / "version_0" / "metrics.csv"), "--start", str(start), "--evals",
                        str(run / "evals" / "update-000010.jsonl"), "--out", str(out)]) == 0
