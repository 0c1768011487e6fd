"""``alfrl play``: a person (or the expert walkthrough) plays one game through the model's protocol.

The game runs through the same RolloutRunner, chat template and token machinery as training; the
"engine" here is the console: it prints every new piece of the prompt exactly as the model would
receive it (decoded from the prompt's token ids) and turns the typed action into a well-formed
completion. With ``--walkthrough`` the expert actions are typed for you.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from alfrl import protocol
from alfrl.chat import ChatFormat, chat_format
from alfrl.engines import Completion, InProcessEngine, SamplingRequest
from alfrl.envs import EnvPool
from alfrl.games import DataError, find_game
from alfrl.rewards import RewardConfig
from alfrl.rollout import RolloutConfig, RolloutRunner
from alfrl.types import Trajectory


class ConsoleEngine(InProcessEngine):
    """Shows each prompt's new tokens as text and answers with an action from ``next_action``."""

    name = "console"

    def __init__(self, fmt: ChatFormat, next_action: Callable[[], str], out=None):
        super().__init__()
        self.fmt = fmt
        self.next_action = next_action
        self.out = out if out is not None else sys.stdout  # the stdout of the moment (a redirected one too), not the import's
        self.shown = 0
        self.last_prompt: list[int] = []

    def generate(self, requests: list[SamplingRequest]) -> list[list[Completion]]:
        results = []
        for r in requests:
            prompt = list(r.prompt_ids)
            new = prompt[self.shown :] if prompt[: self.shown] == self.last_prompt[: self.shown] else prompt
            self.out.write(self.fmt.tokenizer.decode(new, skip_special_tokens=False))
            self.out.flush()
            action = self.next_action()
            text = protocol.format_action(action, self.fmt.action_format)
            ids = self.fmt.encode(text) + [self.fmt.end_of_turn_id]
            self.out.write(text + self.fmt.end_of_turn_text)
            self.shown = len(prompt) + len(ids)
            self.last_prompt = prompt + ids
            results.append([Completion(tuple(ids), tuple([0.0] * len(ids)), "stop") for _ in range(r.n)])
        return results


QUIT = ("quit", "exit")


class Quit(Exception):
    """The person ended the game (``quit``, ``exit`` or Ctrl-D)."""


def _tokenizer(model: str | None):
    if model:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)
    from alfrl.tiny import build_tokenizer

    return build_tokenizer()


def play(
    game: str,
    data_dir: str | None = None,
    walkthrough: bool = False,
    action_format: str = "tool_call",
    context: str = "full",
    max_steps: int = 50,
    model: str | None = None,
    out=None,
    read: Callable[[], str] | None = None,
) -> Trajectory | None:
    """Play ``game``, printing to ``out`` (default: the stdout of the call); returns its trajectory after printing the
    outcome, or None when the person quit."""
    out = out if out is not None else sys.stdout
    g = find_game(data_dir, game)
    try:
        walkthrough_actions = g.walkthrough()
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"game file {g.path} cannot be read ({type(e).__name__}: {e}): unpack the games again "
                        "with `alfrl data prepare`") from None
    fmt = chat_format(_tokenizer(model), action_format)
    if walkthrough:
        actions = iter(walkthrough_actions)

        def next_action() -> str:
            try:
                return next(actions)
            except StopIteration:
                return "look"
    else:
        reader = read or (lambda: input("\n> "))
        out.write("(type an action; `quit` or Ctrl-D ends the game)\n")

        def next_action() -> str:
            try:
                typed = reader().strip()
            except EOFError:
                raise Quit from None
            if typed.lower() in QUIT:
                raise Quit
            return typed or "look"

    cfg = RolloutConfig(action_format=action_format, context=context, max_episode_steps=max_steps, max_trajectory_tokens=10**9, max_assistant_tokens=512)
    with EnvPool(num_workers=1) as pool:
        runner = RolloutRunner(ConsoleEngine(fmt, next_action, out), pool, fmt, cfg, RewardConfig())
        try:
            (group,) = runner.run([g], group_size=1, seed=0)
        except Quit:
            out.write(f"\n\ngame {g.id}: quit\n")
            return None
    if group.failed is not None:
        raise DataError(f"game {g.id} could not be played: {group.failed}")
    traj = group.trajectories[0]
    last = traj.turns[-1] if traj.turns else None
    out.write("\n\n")
    if last is not None:
        out.write(f"[{last.status}] {last.observation}\n")
    out.write(f"game {g.id}: stop reason {traj.stop_reason}, won {traj.won}, {traj.steps} steps, "
              f"{traj.invalid_actions} invalid actions, reward {traj.reward:.2f}\n")
    return traj
