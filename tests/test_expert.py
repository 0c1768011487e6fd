"""Expert plans (alfrl.expert): each training game's walkthrough replayed through the recipe's protocol; only wins written,
the rest counted; a replay resumed plays nothing twice."""

import json
from pathlib import Path

import pytest

from alfrl.envs import EnvPool
from alfrl.expert import ExpertEngine, read_expert, replay
from alfrl.games import DataError
from alfrl.rewards import RewardConfig
from alfrl.rollout import RolloutRunner
from tests.helpers import EXPERT_CFG as CFG


def test_expert_replay_writes_only_wins_and_counts_the_rest(expert):
    games, fmt, out, result = expert
    trajectories = read_expert(out)
    assert result["written"] == len(trajectories) >= 6 and result["written"] + result["skipped"] == len(games)
    assert all(t.won and t.stop_reason == "won" and t.invalid_actions == 0 for t in trajectories)
    for t in trajectories:
        plan = next(g for g in games if g.id == t.game_id).walkthrough()
        assert [turn.action for turn in t.turns] == plan[: t.steps]  # the game's own walkthrough, turn by turn
        assert all(turn.completion_text.startswith("<think>") and "</think><action>" in turn.completion_text for turn in t.turns)
        (seq,) = t.sequences
        assert len(seq.token_ids) == len(seq.sampler_logprobs) and seq.spans[-1][2] == len(seq.token_ids)
    skipped = json.loads(Path(str(out) + ".skipped.json").read_text())
    assert set(skipped) == {g.id for g in games} - {t.game_id for t in trajectories}
    assert all(reason == "max_steps" for reason in skipped.values())  # plans longer than the recipe's 8 steps


def test_expert_replay_resumes_without_playing_again(expert):
    games, fmt, out, result = expert
    before = out.read_text()
    played = []

    class Counting(RolloutRunner):
        def run(self, games, *args, **kwargs):
            played.extend(games)
            return super().run(games, *args, **kwargs)

    with EnvPool(num_workers=1) as pool:
        again = replay(lambda engine: Counting(engine, pool, fmt, CFG, RewardConfig()), fmt, games, CFG.max_episode_steps, out)
    assert played == [] and out.read_text() == before and again["written"] == result["written"]


def test_expert_replay_plays_one_game_at_a_time_when_seeds_collide(expert, tmp_path, monkeypatch):
    # request seeds are 31-bit hashes: over all 3,553 training games some collide (seen: `alfrl expert`
    # on every game refused to start). Here every game's turn t gets the same seed, so any two collide.
    import alfrl.expert
    import alfrl.rollout

    games, fmt, out, _ = expert
    coarse = lambda seed, game_id, index, turn: (index + 2) * 1000 + turn  # noqa: E731
    monkeypatch.setattr(alfrl.rollout, "request_seed", coarse)
    monkeypatch.setattr(alfrl.expert, "request_seed", coarse)
    runs = []

    class Counting(RolloutRunner):
        def run(self, games, *args, **kwargs):
            runs.append(len(games))
            return super().run(games, *args, **kwargs)

    with EnvPool(num_workers=2) as pool:
        result = replay(lambda engine: Counting(engine, pool, fmt, CFG, RewardConfig()), fmt, games[:3], CFG.max_episode_steps, tmp_path / "e.jsonl")
    assert runs == [1, 1, 1]
    assert [t.game_id for t in read_expert(tmp_path / "e.jsonl")] == [t.game_id for t in read_expert(out) if t.game_id in {g.id for g in games[:3]}]
    assert result["written"] + result["skipped"] == 3


def test_expert_engine_requests_are_found_by_seed(expert):
    games, fmt, _, _ = expert
    engine = ExpertEngine(fmt, games, 8)
    assert len(engine.by_seed) == 2 * len(games) * 9  # every game, turn and index: no two requests share a seed


def test_a_damaged_expert_file_is_one_error_naming_its_line(expert, tmp_path):
    _, _, out, _ = expert
    lines = Path(out).read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"  # an interrupted `alfrl expert`: its last line written in part
    cut.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])
    assert len(read_expert(cut, limit=2)) == 2  # the whole lines before it still read
    with pytest.raises(DataError, match=r"cut.jsonl: line 3 \(the file's last line, cut short\) is not an expert trajectory .*alfrl expert"):
        read_expert(cut)
    other = tmp_path / "other.jsonl"
    other.write_text("root:x:0:0:root:/root:/bin/bash\n")
    with pytest.raises(DataError, match=r"other.jsonl: line 1 is not an expert trajectory \(JSONDecodeError"):
        read_expert(other)
    fields = tmp_path / "fields.jsonl"
    fields.write_text(lines[0] + json.dumps({"game_id": "x"}) + "\n")
    with pytest.raises(DataError, match=r"fields.jsonl: line 2 is not an expert trajectory \(KeyError"):
        read_expert(fields)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(DataError, match=r"binary.jsonl: line 1 is not an expert trajectory"):
        read_expert(binary)
    skipped = tmp_path / "s.jsonl.skipped.json"  # the list of games whose plan did not win, damaged
    skipped.write_text("{\"train:a\": ")
    with pytest.raises(DataError, match=r"s.jsonl.skipped.json is damaged .*delete it and run again"):
        replay(lambda engine: None, expert[1], [], 8, tmp_path / "s.jsonl")
