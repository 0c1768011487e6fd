"""alfrl report (alfrl.report): runs side by side, paired and unpaired, the determinism warning, the games the HTML page
shows, gzipped records, how the games ended (a run's curves: test_curves.py)."""

import json

import pytest

from alfrl.evaluation import EvalError, read_results, summarize
from tests.helpers import HAND_MADE, alfrl_here


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


def test_a_game_record_without_the_fields_of_a_summary_is_one_line_naming_it(tmp_path, capfd):
    path = tmp_path / "other.jsonl"  # JSON lines typed "game", but not alfrl eval's
    path.write_text(json.dumps(HAND_MADE[0]) + "\n" + json.dumps({"type": "game", "game_id": "x", "won": "yes"}) + "\n")
    with pytest.raises(EvalError, match=r"other.jsonl: line 2 is a game record without split, task_type, won, reward, steps, "
                                         r"invalid_actions, turns \(or not of its type\)"):
        read_results(path)
    path.write_text(json.dumps(dict(HAND_MADE[0], turns=[{"valid_format": True}])) + "\n")
    with pytest.raises(EvalError, match="line 1 is a game record without turns"):
        read_results(path)
    out = alfrl_here(capfd, "report", str(path), "--out", str(tmp_path / "r"))
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert [ln for ln in out.stderr.splitlines() if ln.startswith("alfrl report:")] == [
        f"alfrl report: {path}: line 1 is a game record without turns (or not of its type): is it an `alfrl eval` output?"]


def test_report_says_how_games_ended_and_counts_loops_as_the_same_action_in_the_same_state():
    """Stop reasons per run, what the lost games spent, and repeated turns: an action taken again in the same state is a
    loop, the same action in another state is not; records without ``state_key`` (written before it) show '-'."""
    from alfrl.evaluation import game_repeats
    from alfrl.report import endings_markdown

    def turn(state, action):
        return {"valid_format": True, "admissible": True, "state_key": state, "action": action}

    # take, put, take again from the same state (a loop), put from another state (not one), take from the first state again
    looping = [turn("s0", "take apple 1"), turn("s1", "put apple 1 in fridge 1"), turn("s0", "take apple 1"),
               turn("s2", "put apple 1 in fridge 1"), turn("s0", "take apple 1"), {"valid_format": False, "admissible": False, "action": None}]
    assert game_repeats({"turns": looping}) == (2, 5)
    assert game_repeats({"turns": [{"valid_format": True, "admissible": True, "action": "look"}]}) is None
    assert game_repeats({"turns": [turn(["not", "a", "key"], "look")]}) is None and game_repeats({"turns": [turn("s0", {"a": 1})]}) is None
    keyed = [dict(g, turns=looping) if g["game_id"] == "valid_seen:b" else dict(g, turns=[turn(f"{g['game_id']}{i}", "look") for i in range(g["steps"])])
             for g in HAND_MADE]
    table = endings_markdown([("old", {}, HAND_MADE), ("new", {}, keyed), ("summary only", {}, None)])
    assert "| run | games | won | env_done | max_steps | trajectory_too_long | env_error |" in table
    assert "| old | 4 | 2 | 0 | 1 | 1 | 0 | 2.50 | 1.50 | - |" in table  # lost b (4 steps, 2 invalid) and d (1, 1)
    assert "| new | 4 | 2 | 0 | 1 | 1 | 0 | 2.50 | 1.50 | 18.18% |" in table  # 2 repeats of 11 turns with an action
    assert "| pick_and_place_simple | - | 28.57% |" in table and "| look_at_obj_in_light | - | 0.00% |" in table
    assert "summary only" not in table
    assert endings_markdown([("summary only", {}, None)]) == ""


def test_the_learning_runs_committed_records_read_as_its_readme_says():
    """results/rl_qwen15b_grpo/README.md, "How the games are lost", recomputed from the records in git: the third warm
    start's 274 games and GiGPO's update 20 on the periodic evaluation's 60 (a changed count or loop rule shows here)."""
    from pathlib import Path

    from alfrl.report import common_games, endings_markdown, load_runs

    results = Path(__file__).resolve().parents[1] / "results" / "rl_qwen15b_grpo"
    runs = load_runs([str(results / "warmstart3_det_a.jsonl.gz"), str(results / "gigpo_ws3_update20_eval60.jsonl.gz")], ["ws", "u20"])
    assert "| ws | 274 | 117 | 0 | 38 | 119 | 0 | 40.87 | 10.76 | 51.40% |" in endings_markdown(runs[:1])
    cut, _ = common_games(runs)
    table = endings_markdown(cut)
    assert "| ws | 60 | 27 | 0 | 11 | 22 | 0 |" in table and "51.14% |" in table
    assert "| u20 | 60 | 42 | 0 | 3 | 15 | 0 | 40.61 | 3.72 | 6.55% |" in table
