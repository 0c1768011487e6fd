"""Game discovery with the reference filters, data preparation and `alfrl data`."""

import json
import tarfile

import pytest

from alfrl import games
from alfrl.games import DataError, discover_games, shuffled
from tests.helpers import alfrl_here


def _write_game(root, split, task_folder, trial, solvable=True):
    d = root / "json_2.1.1" / split / task_folder / trial
    d.mkdir(parents=True)
    (d / "game.tw-pddl").write_text(json.dumps({"solvable": solvable, "walkthrough": ["look"]}))


def test_filters_and_ids_on_games_written_here(tmp_path):
    _write_game(tmp_path, "train", "pick_and_place_simple-Mug-None-Desk-1", "trial_b")
    _write_game(tmp_path, "train", "pick_and_place_simple-Mug-None-Desk-1", "trial_a")
    _write_game(tmp_path, "train", "look_at_obj_in_light-Book-None-DeskLamp-2", "trial_c", solvable=False)
    _write_game(tmp_path, "train", "pick_and_place_with_movable_recep-Pen-Bowl-Desk-3", "trial_d")
    _write_game(tmp_path, "train", "pick_clean_then_place_in_recep-AppleSliced-None-Fridge-4", "trial_e")
    _write_game(tmp_path, "train", "pick_cool_then_place_in_recep-Apple-None-Fridge-5", "trial_f")
    _write_game(tmp_path, "train", "unknown_task-Apple-None-Fridge-6", "trial_g")
    found = discover_games(tmp_path, ["train"])
    assert [g.id for g in found] == [
        "train:pick_and_place_simple-Mug-None-Desk-1/trial_a",
        "train:pick_and_place_simple-Mug-None-Desk-1/trial_b",
        "train:pick_cool_then_place_in_recep-Apple-None-Fridge-5/trial_f",
    ]
    assert [g.task_type for g in found] == ["pick_and_place_simple", "pick_and_place_simple", "pick_cool_then_place_in_recep"]


def test_seeded_shuffle_is_reproducible_and_does_not_touch_global_random(tmp_path):
    import random

    for i in range(6):
        _write_game(tmp_path, "train", f"pick_and_place_simple-Mug-None-Desk-{i}", "t")
    found = discover_games(tmp_path, ["train"])
    state = random.getstate()
    assert shuffled(found, 3) == shuffled(found, 3) != shuffled(found, 4)
    assert random.getstate() == state


def test_missing_data_says_how_to_prepare(tmp_path):
    with pytest.raises(DataError, match="alfrl data prepare --data-dir"):
        discover_games(tmp_path / "nothing", ["valid_seen"])
    (tmp_path / "json_2.1.1" / "valid_seen").mkdir(parents=True)
    with pytest.raises(DataError, match="no ALFWorld games in"):
        discover_games(tmp_path, ["valid_seen"])


def test_counts_on_the_full_data(data_dir):
    summary = games.summarize(discover_games(data_dir, ["train", "valid_seen", "valid_unseen"]))
    assert summary["splits"] == {"train": 3553, "valid_seen": 140, "valid_unseen": 134}
    assert set(summary["task_types"]["valid_unseen"]) == set(games.TASK_TYPES)


def test_prepare_from_an_archive(tmp_path):
    src = tmp_path / "src"
    _write_game(src, "valid_seen", "pick_and_place_simple-Mug-None-Desk-1", "trial_a")
    archive = tmp_path / "json.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(src / "json_2.1.1", arcname="json_2.1.1")
    target = games.prepare_from_archive(tmp_path / "data", archive)
    assert target.is_dir() and len(discover_games(tmp_path / "data", ["valid_seen"])) == 1
    with pytest.raises(DataError, match="--archive"):
        games.prepare_from_archive(tmp_path / "other", tmp_path / "missing.tar.xz")


def test_download_runs_the_script_beside_the_interpreter_when_the_venv_is_not_on_path(tmp_path, monkeypatch):
    # `make data` after `make setup`: alfworld-download sits in .venv/bin, which the user's PATH does not hold
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    script = bin_dir / "alfworld-download"
    script.write_text('#!/bin/sh\necho "$@" > "$ALFWORLD_DATA/called"\n')
    script.chmod(0o755)
    monkeypatch.setattr(games.sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    target = games.prepare_by_download(tmp_path / "data")
    assert target == tmp_path / "data" / "json_2.1.1"
    assert (tmp_path / "data" / "called").read_text().split() == ["--data-dir", str(tmp_path / "data")]
    script.unlink()
    with pytest.raises(DataError, match="alfworld-download is neither beside .* nor on PATH: install the project"):
        games.prepare_by_download(tmp_path / "data")


def test_data_summary_command(data_dir, capfd):
    out = alfrl_here(capfd, "data", "summary", "--data-dir", data_dir, "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["splits"]["train"] == 3553 and summary["splits"]["valid_seen"] == 140 and summary["splits"]["valid_unseen"] == 134


def test_data_summary_on_an_empty_folder_fails_clearly(tmp_path, capfd):
    out = alfrl_here(capfd, "data", "summary", "--data-dir", str(tmp_path))
    assert out.returncode == 2
    assert "alfrl data prepare" in out.stderr and "Traceback" not in out.stderr
