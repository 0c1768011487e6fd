"""`alfrl play`: the expert walkthrough through the model's exact prompts, ending with the win."""

import io

import pytest

from alfrl.play import play
from tests.helpers import alfrl_here

GAME = "valid_unseen:pick_heat_then_place_in_recep"


def test_play_walkthrough_command_reports_the_win(data_dir, valid_games, capfd):
    game = next(g for g in valid_games if g.id.startswith(GAME))
    out = alfrl_here(capfd, "play", game.id, "--walkthrough", "--data-dir", data_dir)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "<|im_start|>system" in text and "alfworld_step" in text  # the template the model sees, tools included
    assert text.count("<tool_call>") >= len(game.walkthrough())
    assert "[task completed]" in text and "stop reason won, won True" in text


def test_a_person_plays_by_typing_actions(data_dir, valid_games):
    game = next(g for g in valid_games if g.id.startswith(GAME))
    typed = iter(["fly away"] + game.walkthrough())
    buf = io.StringIO()
    traj = play(game.id, data_dir, action_format="action_tag", out=buf, read=lambda: next(typed))
    assert traj.won and traj.invalid_actions == 1
    assert "Status: action not admissible ('fly away' is not one of the available actions)." in buf.getvalue()


@pytest.mark.parametrize("ending", ["quit", "eof"])
def test_quit_or_ctrl_d_ends_the_game_without_a_traceback(data_dir, valid_games, ending):
    game = next(g for g in valid_games if g.id.startswith(GAME))
    typed = iter(["look"])

    def read() -> str:
        try:
            return next(typed)
        except StopIteration:
            if ending == "eof":
                raise EOFError from None
            return "quit"

    buf = io.StringIO()
    assert play(game.id, data_dir, action_format="action_tag", out=buf, read=read) is None
    assert buf.getvalue().rstrip().endswith(f"game {game.id}: quit")
