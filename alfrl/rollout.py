"""Grouped multi-turn rollouts: K trajectories per game, played without a round barrier.

For a batch of games, each game gets a group of K environments that start from the identical state (checked). The first
turn of a group is one request with n=K on the shared prompt; after that each trajectory asks for its next turn the moment
its environment step returns.

``schedule: async`` (the default) keeps the engine and the environment workers busy together: a trajectory's next request
is submitted as soon as its environment answered, environment steps of some trajectories run while others generate, and a
group starts generating as soon as its own resets are done. No turn waits for the slowest completion or environment.
``schedule: rounds`` is the old barrier (every live trajectory generates, then every environment steps, then the next
round); it gives the same trajectories for the same seeds wherever sampling is deterministic (every request carries its
own seed), and stays for comparison.

A trajectory ends with one of ``STOP_REASONS``. An environment that fails ends only its own
trajectory (``env_error``); a group whose environments do not start identically is recorded as
failed and left out of training, and the batch goes on.
"""

from __future__ import annotations

import hashlib
import logging
import statistics
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from alfrl import protocol
from alfrl.chat import ChatFormat
from alfrl.context import CONTEXT_MODES, LiveTrajectory, make_context
from alfrl.engines import Completion, Engine, SamplingRequest
from alfrl.envs import EnvFailure, EnvGroup, EnvOp, EnvPool, EnvState, GroupStartMismatch, PrefetchedResets, check_same_start
from alfrl.games import Game
from alfrl.rewards import RewardConfig, episode_reward, reward_noise, step_rewards
from alfrl.types import STOP_REASONS, RolloutProgress, Trajectory, TrajectoryGroup, Turn, repeated_turns

log = logging.getLogger(__name__)

SCHEDULES = ("async", "rounds")



@dataclass
class RolloutStats:
    """Where a rollout's time went (seconds), for benchmarks and logs."""

    seconds: float = 0.0
    engine_seconds: float = 0.0
    """Inside engine steps (the GPU's share of the rollout, for vLLM; with its core in a process of its own, waiting for its outputs)."""
    env_wait_seconds: float = 0.0  # blocked waiting for environments with nothing to generate
    submit_seconds: float = 0.0  # handing requests to the engine (for vLLM: its input processing and prefix-cache hashing)
    requests: int = 0
    trajectory_end_seconds: list[float] = field(default_factory=list)  # when each ended (after the start), in that order
    group_start_seconds: list[float] = field(default_factory=list)
    """When each group's first request was ready (its environments reset and checked): the start-up's length, the last one."""
    engine_steps: int = 0
    """Calls of ``engine.step()``: engine_seconds / engine_steps is the time of one (more calls than model forwards may run)."""
    tail_engine_seconds: float = 0.0  # the engine steps (and their seconds) once half of the trajectories had ended
    tail_engine_steps: int = 0
    tail_output_times: list[tuple[float, float]] = field(default_factory=list)
    """The tail's steps' ``Engine.last_output_times`` (vLLM: when its core made the outputs, when this process took them)."""
    LAST_ENDED: ClassVar[tuple[str, ...]] = ("start", "generate", "environment", "local", "turns", "tokens")
    last_ended: dict[str, float] = field(default_factory=dict)
    """The trajectory that ended last (the rollout's critical path), its life split in seconds: ``start`` (its group's
    resets and check, to its first request), ``generate`` (request to completion: queued in the engine, prefill, decode,
    outputs taken), ``environment`` (its steps), ``local`` (a turn done to the next request submitted, and to its end);
    with its ``turns`` and sampled ``tokens``."""

    def engine_step(self, seconds: float, tail: bool, output_times: tuple[float, float] | None) -> None:
        """One ``engine.step()`` call of ``seconds``; ``tail``: half of the trajectories had ended before it."""
        self.engine_seconds += seconds
        self.engine_steps += 1
        if tail:
            self.tail_engine_seconds += seconds
            self.tail_engine_steps += 1
            if output_times is not None:
                self.tail_output_times.append(output_times)

    def tail_figures(self) -> dict[str, float]:
        """``rollout/tail_steps`` and ``rollout/tail_step_ms`` (their mean time), empty without a tail."""
        if not self.tail_engine_steps:
            return {}
        return {"rollout/tail_steps": float(self.tail_engine_steps),
                "rollout/tail_step_ms": 1000 * self.tail_engine_seconds / self.tail_engine_steps}

    def tail_output_figures(self) -> dict[str, float]:
        """Whether the tail waited on the engine or on this process (empty without output times; milliseconds, medians):
        ``rollout/tail_core_step_ms``, between the core's consecutive outputs (its step while busy: the turns' gaps are few);
        ``rollout/tail_output_lag_ms``, from the core making outputs to this process taking them (queued behind its other work)."""
        made = [m for m, _ in self.tail_output_times]
        gaps = [b - a for a, b in zip(made, made[1:]) if b > a]
        if not gaps:
            return {}
        return {"rollout/tail_core_step_ms": 1000 * statistics.median(gaps),
                "rollout/tail_output_lag_ms": 1000 * statistics.median(r - m for m, r in self.tail_output_times)}

@dataclass(frozen=True)
class RolloutConfig:
    """How trajectories are sampled and when they end."""

    action_format: str = "tool_call"
    """``tool_call`` (the reference) or ``action_tag`` (plain ``<think>/<action>`` text)."""
    context: str = "full"
    """``full``: the whole history, token-in/token-out. ``window``: each step rendered afresh (stepwise)."""
    history_length: int = 2
    """With ``context: window``, how many past observations and actions the prompt shows."""
    enable_thinking: bool | None = None
    """Passed to the chat template when set (Qwen3: False skips the reasoning block)."""
    temperature: float = 1.0
    """Sampling temperature of the training rollouts (1.0: the policy's own distribution, which PPO's ratio assumes)."""
    top_p: float = 1.0
    """Nucleus sampling of the training rollouts (1.0: off)."""
    max_episode_steps: int = 50
    """Environment steps before a trajectory ends unfinished (not won)."""
    max_trajectory_tokens: int = 12000
    """Tokens of one trajectory at most (prompt, completions, observations): a completion gets what is left, and the
    trajectory ends when its next prompt reaches it."""
    max_assistant_tokens: int = 2048
    """Tokens one completion (one turn) may sample."""
    stop_strings: tuple[str, ...] = ()
    """End a completion right after the first of these texts (e.g. ``</action>`` for models that keep writing imagined
    observations after their action): it keeps the sampled tokens up to the one that completes the text."""
    schedule: str = "async"
    """``async``: a trajectory's next turn goes out when its environment answered; ``rounds``: the old barrier runner."""
    max_live_games: int = 0
    """At most this many games played at once (0: all): the next game starts when one ends, so the engine's KV cache holds
    the live trajectories instead of thrashing (an evaluation of 274 games)."""
    deterministic: bool = False
    """``alfrl fit`` starts its engine batch-invariant: a rollout's completions and log-probs do not depend on which other
    requests shared an engine step (vLLM: ``VLLM_BATCH_INVARIANT=1``; the hf engine always is). Its periodic evaluations
    play on the same engine. ``alfrl eval`` follows ``data.eval.deterministic`` instead."""

    def problems(self, prefix: str = "data.rollout") -> list[str]:
        out = []
        if self.action_format not in protocol.ACTION_FORMATS:
            out.append(f"{prefix}.action_format={self.action_format!r} is not one of {', '.join(protocol.ACTION_FORMATS)}")
        if self.context not in CONTEXT_MODES:
            out.append(f"{prefix}.context={self.context!r} is not one of {', '.join(CONTEXT_MODES)}")
        if self.context == "window" and self.action_format != "action_tag":
            out.append(f"{prefix}.context=window renders <think>/<action> prompts: set {prefix}.action_format=action_tag")
        if self.schedule not in SCHEDULES:
            out.append(f"{prefix}.schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.history_length < 0:
            out.append(f"{prefix}.history_length={self.history_length} must be >= 0")
        if self.temperature < 0:
            out.append(f"{prefix}.temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            out.append(f"{prefix}.top_p={self.top_p} must be in (0, 1]")
        for name in ("max_episode_steps", "max_trajectory_tokens", "max_assistant_tokens"):
            if getattr(self, name) < 1:
                out.append(f"{prefix}.{name}={getattr(self, name)} must be >= 1")
        if self.max_live_games < 0:
            out.append(f"{prefix}.max_live_games={self.max_live_games} must be >= 0 (0: every game at once)")
        return out


def _state_key(state: EnvState) -> str:
    return hashlib.sha1((state.observation + "\x00" + "\x00".join(state.admissible)).encode()).hexdigest()[:16]


def cut_at_stop_strings(c: Completion, stop_strings: tuple[str, ...], fmt: ChatFormat) -> Completion:
    """``c`` cut after the token that completes the first stop string (``c`` itself if none occurs)."""
    if not stop_strings:
        return c
    ids = list(c.token_ids)
    text = fmt.completion_text(ids)
    if not any(s in text for s in stop_strings):
        return c
    lo, hi = 1, len(ids)  # the smallest k whose decoded prefix contains a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        prefix = fmt.tokenizer.decode(ids[:mid], skip_special_tokens=False)
        if any(s in prefix for s in stop_strings):
            hi = mid
        else:
            lo = mid + 1
    # a stop string completed by the very last token (even of a completion cut at the length limit)
    # is a stop: the completion ended exactly where sampling would have stopped
    return Completion(tuple(ids[:lo]), tuple(c.logprobs[:lo]), "stop")


def request_seed(seed: int, game_id: str, index: int, turn: int) -> int:
    """A per-request seed that depends only on the run seed, the game, the trajectory and the turn."""
    return zlib.crc32(f"{seed}|{game_id}|{index}|{turn}".encode()) & 0x7FFFFFFF


class RolloutRunner:
    """Plays groups of games with an engine over an environment pool."""

    def __init__(self, engine: Engine, pool: EnvPool, fmt: ChatFormat, cfg: RolloutConfig, reward: RewardConfig):
        self.engine = engine
        self.pool = pool
        self.fmt = fmt
        self.cfg = cfg
        self.reward = reward
        self.context = make_context(cfg.context, fmt, cfg.history_length)
        self.stats = RolloutStats()
        self.trace: list[tuple[str, int, int, int]] | None = None
        """Set to a list to record events (kind, group, trajectory, turn): ``request`` (a turn was
        submitted), ``completion`` (it came back), ``env`` (its environment answered), ``end`` (the trajectory ended)."""

    def run(
        self,
        games: list[Game],
        group_size: int,
        seed: int,
        progress: Callable[[RolloutProgress], None] | None = None,
        on_group: Callable[[int, TrajectoryGroup], None] | None = None,
        prepared: PrefetchedResets | None = None,
    ) -> list[TrajectoryGroup]:
        """Play ``group_size`` trajectories of each game; one TrajectoryGroup per game, in order.
        ``on_group`` gets each game's index and group as soon as its last trajectory ended (evaluation writes it then).
        ``prepared``: these games' groups with their resets submitted
        ahead of the rollout and the results of those already back (``Sampler.prefetch``)."""
        groups = prepared.groups if prepared else [EnvGroup.create(self.pool, game, group_size) for game in games]
        self.stats = RolloutStats()
        start = time.perf_counter()
        try:
            play = _Play(self, groups, seed, progress, on_group, started=start, prepared=prepared)
            play.run()
        finally:
            for group in groups:
                group.close()
        self.stats.seconds = time.perf_counter() - start
        return [play.finished_group(gi) for gi in range(len(groups))]

    # ---------------------------------------------------------------- one turn
    def request(self, t: LiveTrajectory, game_id: str, seed: int, n: int) -> SamplingRequest:
        budget = min(self.cfg.max_assistant_tokens, self.cfg.max_trajectory_tokens - len(t.prompt_ids))
        return SamplingRequest(
            prompt_ids=tuple(t.prompt_ids),
            n=n,
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            max_new_tokens=budget,
            stop_token_ids=self.fmt.stop_token_ids,
            seed=request_seed(seed, game_id, t.index if n == 1 else -1, len(t.turns)),
            stop_strings=self.cfg.stop_strings,
        )

    def parse(self, c: Completion) -> tuple[Completion, protocol.ParsedAction]:
        c = cut_at_stop_strings(c, self.cfg.stop_strings, self.fmt)
        if c.finish_reason == "length":
            return c, protocol.ParsedAction(None, "cut off by the token limit")
        return c, protocol.parse_completion(self.fmt.completion_text(list(c.token_ids)), self.cfg.action_format)

    def advance(self, t: LiveTrajectory, c: Completion, parsed: protocol.ParsedAction, result: EnvState | EnvFailure | None) -> None:
        """Record one turn of ``t`` and decide whether it goes on (``t.stop_reason`` stays None)."""
        cfg = self.cfg
        before = t.state
        text = self.fmt.completion_text(list(c.token_ids))
        admissible = parsed.valid and parsed.action in before.admissible
        step_no = len(t.turns) + 1
        if isinstance(result, EnvFailure):
            status, observation, state = protocol.STATUS_ENDED, f"environment error: {result.reason}", before
            t.stop_reason = "env_error"
        else:
            state = result if result is not None else before
            observation = state.observation if result is not None else protocol.NOTHING_HAPPENS
            if not parsed.valid:
                status = protocol.STATUS_INVALID_FORMAT
            elif not admissible:
                status = protocol.STATUS_NOT_ADMISSIBLE
            else:
                status = protocol.STATUS_EXECUTED
            if state.won:
                status, t.stop_reason, t.won_at = protocol.STATUS_WON, "won", len(t.turns)
            elif state.done:
                status, t.stop_reason = protocol.STATUS_ENDED, "env_done"
            elif step_no >= cfg.max_episode_steps:
                status, t.stop_reason = protocol.STATUS_ENDED, "max_steps"
        invalid = protocol.stepwise_invalid(text) if self.reward.kind == "stepwise" else not admissible
        t.turns.append(
            Turn(
                completion_text=text,
                action=parsed.action,
                valid_format=parsed.valid,
                format_error=parsed.error,
                admissible=admissible,
                invalid=invalid,
                status=status,
                observation=observation,
                observation_before=before.observation,
                state_key=_state_key(before),
                prompt_tokens=len(t.prompt_ids),
                completion_tokens=len(c.token_ids),
                finish_reason=c.finish_reason,
            )
        )
        t.history.append((before.observation, parsed.action if parsed.valid else "(no valid action)"))
        self.context.record_completion(t, c, len(t.turns) - 1)
        t.state = state if result is not None else EnvState(protocol.NOTHING_HAPPENS, before.admissible, before.won, before.done)
        if t.stop_reason is not None:
            return
        feedback = protocol.Feedback(
            status=status,
            observation=observation,
            actions=state.shown_actions,
            next_step=step_no + 1,
            max_steps=cfg.max_episode_steps,
            detail=parsed.error if not parsed.valid else (parsed.action or ""),
        )
        next_prompt = self.context.next_prompt(t, feedback)
        if len(next_prompt) >= cfg.max_trajectory_tokens:
            t.stop_reason = "trajectory_too_long"
            return
        self.context.accept_prompt(t, next_prompt)

    def _finish(self, group: EnvGroup, lives: list[LiveTrajectory], failed: str | None, seed: int) -> TrajectoryGroup:
        trajectories = []
        for t in lives:
            invalid = [turn.invalid for turn in t.turns]
            won = t.won_at is not None
            steps = step_rewards(t.won_at, invalid, self.reward)
            noise = reward_noise(self.reward, seed, group.game.id, t.index) if steps else 0.0
            if noise:
                steps[-1] += noise
            trajectories.append(
                Trajectory(
                    game_id=group.game.id,
                    split=group.game.split,
                    task_type=group.game.task_type,
                    group_id=t.group,
                    index=t.index,
                    task=t.task,
                    turns=tuple(t.turns),
                    won=won,
                    invalid_actions=sum(invalid),
                    stop_reason=t.stop_reason or "env_error",
                    reward=episode_reward(won, sum(invalid), self.reward) + noise,
                    step_rewards=tuple(steps),
                    sequences=self.context.sequences(t),
                )
            )
        return TrajectoryGroup(game=group.game, trajectories=tuple(trajectories), failed=failed)


class _Play:
    """The event loop of one rollout: engine completions and environment results as they come."""

    POLL_SECONDS = 0.05

    def __init__(self, runner: RolloutRunner, groups: list[EnvGroup], seed: int, progress, on_group=None, *, started: float,
                 prepared: PrefetchedResets | None = None):
        self.r = runner
        self.resets, self.early = (prepared.tickets, prepared.early) if prepared else ([], {})  # resets submitted before it
        self.on_group = on_group
        self.finished: dict[int, TrajectoryGroup] = {}
        self.groups = groups
        self.seed = seed
        self.progress = progress
        self.rounds = runner.cfg.schedule == "rounds"
        self.lives: dict[int, list[LiveTrajectory]] = {}
        self.failures: dict[int, str] = {}
        self.starts: dict[int, dict[int, EnvState | EnvFailure]] = {gi: {} for gi in range(len(groups))}
        self.reset_owner: dict[int, tuple[int, int]] = {}
        self.step_owner: dict[int, tuple[LiveTrajectory, Completion, protocol.ParsedAction]] = {}
        self.request_owner: dict[str, list[LiveTrajectory]] = {}
        self.ready: list[tuple[LiveTrajectory, int]] = []  # to be submitted, with their request's n (K on a group's first turn)
        self.held: list[tuple[LiveTrajectory, Completion, protocol.ParsedAction]] = []  # rounds: waiting for the round's end
        self.turns = 0
        self.total = sum(len(g) for g in groups)
        self.last_report = 0.0
        self.window = runner.cfg.max_live_games or len(groups)
        self.next_group = 0  # groups before it were started (``max_live_games``: the next starts when one ends)
        self.live_groups = 0
        self.started = started
        """The rollout's start (``time.perf_counter()``, the run's clock): trajectory end times count from it."""
        self.last_event: dict[tuple[int, int], float] = {}  # per trajectory: when its last event came
        self.phases: dict[tuple[int, int], dict[str, float]] = {}  # per trajectory: its seconds in each phase so far

    CLOSES = {"completion": "generate", "env": "environment"}  # the phase an event ends; a first request ends "start", others "local"

    def event(self, kind: str, t: LiveTrajectory, turn: int) -> None:
        if self.r.trace is not None:
            self.r.trace.append((kind, t.group, t.index, turn))
        key, now = (t.group, t.index), time.perf_counter()
        phase = "start" if kind == "request" and turn == 0 else self.CLOSES.get(kind, "local")
        phases = self.phases.setdefault(key, dict.fromkeys(("start", "generate", "environment", "local"), 0.0))
        phases[phase] += now - self.last_event.get(key, self.started)
        self.last_event[key] = now

    def live_count(self) -> int:
        return sum(t.live for lives in self.lives.values() for t in lives) + sum(
            len(self.groups[gi]) for gi in range(len(self.groups)) if gi not in self.lives and gi not in self.failures)

    def report(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.progress and (force or now - self.last_report > 0.5):
            self.last_report = now
            self.progress(RolloutProgress(self.turns, self.live_count(), self.total))

    def run(self) -> None:
        r = self.r
        self.start_groups()
        for ticket, result in sorted(self.early.items()):  # prefetched resets already back
            self.on_reset(ticket, result)
        self.report(force=True)
        while self.reset_owner or self.step_owner or self.request_owner or self.ready or self.held:
            self.submit_ready()
            if r.engine.busy:
                started = time.perf_counter()
                finished = r.engine.step()
                spent = time.perf_counter() - started
                # the tail: once half of the trajectories ended
                r.stats.engine_step(spent, 2 * len(r.stats.trajectory_end_seconds) >= self.total, r.engine.last_output_times)
                for request_id, completions in finished:
                    self.on_completions(self.request_owner.pop(request_id), completions)
            if self.rounds and self.held and not r.engine.busy:
                held, self.held = self.held, []
                self.step_environments(held)
            waiting = not r.engine.busy and not self.ready and not self.held
            started = time.perf_counter()
            results = r.pool.poll(self.POLL_SECONDS if waiting else 0.0)
            if waiting:
                r.stats.env_wait_seconds += time.perf_counter() - started
            for ticket, result in results:
                if ticket in self.reset_owner:
                    self.on_reset(ticket, result)
                else:
                    t, c, parsed = self.step_owner.pop(ticket)
                    self.event("env", t, len(t.turns))
                    self.after_turn(t, c, parsed, result)
            self.report()
        self.report(force=True)
        assert self.next_group == len(self.groups), "the rollout ended with games never started"

    def finished_group(self, gi: int) -> TrajectoryGroup:
        if gi not in self.finished:
            self.finished[gi] = self.r._finish(self.groups[gi], self.lives.get(gi, []), self.failures.get(gi), self.seed)
        return self.finished[gi]

    def start_groups(self) -> None:
        """Reset the environments of the next groups while fewer than ``window`` are playing."""
        while self.next_group < len(self.groups) and self.live_groups < self.window:
            gi = self.next_group
            self.next_group += 1
            self.live_groups += 1
            tickets = self.resets[gi] if gi < len(self.resets) else self.r.pool.submit(self.groups[gi].reset_ops())
            for k, ticket in enumerate(tickets):
                self.reset_owner[ticket] = (gi, k)

    def group_ended(self, gi: int) -> None:
        """Called once per group, when it failed to start or its last trajectory ended."""
        self.live_groups -= 1
        if self.on_group is not None:
            self.on_group(gi, self.finished_group(gi))
        self.start_groups()

    # -- events
    def on_reset(self, ticket: int, result: EnvState | EnvFailure) -> None:
        gi, k = self.reset_owner.pop(ticket)
        self.starts[gi][k] = result
        group = self.groups[gi]
        if len(self.starts[gi]) < len(group):
            return
        start = [self.starts[gi][k] for k in range(len(group))]
        try:
            check_same_start(group.game.id, start)
        except GroupStartMismatch as e:
            log.warning("skipping a group: %s", e)
            self.failures[gi] = str(e)
            self.group_ended(gi)
            return
        task, observation = protocol.split_first_observation(start[0].observation)
        first = EnvState(observation, start[0].admissible, start[0].won, start[0].done)  # banner and task line split off
        prompt = self.r.context.first_prompt(task, first, self.r.cfg.max_episode_steps)
        lives = [LiveTrajectory(gi, k, env_id, task, first, list(prompt), token_ids=list(prompt), logprobs=[0.0] * len(prompt))
                 for k, env_id in enumerate(group.env_ids)]
        self.lives[gi] = lives
        self.ready.append((lives[0], len(lives)))  # one request with n = K on the shared first prompt
        self.r.stats.group_start_seconds.append(time.perf_counter() - self.started)

    def submit_ready(self) -> None:
        if not self.ready:
            return
        if self.rounds and (self.reset_owner or self.step_owner or self.request_owner or self.held):
            return  # the barrier: a round starts when every environment and every generation is done
        batch, self.ready = self.ready, []
        requests = [self.r.request(t, self.groups[t.group].game.id, self.seed, n) for t, n in batch]
        started = time.perf_counter()
        request_ids = self.r.engine.submit(requests)
        self.r.stats.submit_seconds += time.perf_counter() - started
        for (t, n), request_id in zip(batch, request_ids):
            owners = self.lives[t.group] if n > 1 else [t]
            self.request_owner[request_id] = owners
            for o in owners:
                self.event("request", o, len(o.turns))
        self.r.stats.requests += len(requests)

    def on_completions(self, owners: list[LiveTrajectory], completions: list[Completion]) -> None:
        if len(completions) != len(owners):
            raise RuntimeError(f"engine returned {len(completions)} completions for {len(owners)} trajectories")
        planned = []
        for t, c in zip(owners, completions):
            self.event("completion", t, len(t.turns))
            c, parsed = self.r.parse(c)
            planned.append((t, c, parsed))
        if self.rounds:
            self.held.extend(planned)
        else:
            self.step_environments(planned)

    def step_environments(self, planned: list[tuple[LiveTrajectory, Completion, protocol.ParsedAction]]) -> None:
        stepping = [(t, c, p) for t, c, p in planned if p.valid]
        tickets = self.r.pool.submit([EnvOp(t.env_id, "step", p.action) for t, _, p in stepping])
        for ticket, item in zip(tickets, stepping):
            self.step_owner[ticket] = item
        for t, c, p in planned:
            if not p.valid:  # nothing to step: "Nothing happens."
                self.after_turn(t, c, p, None)

    def after_turn(self, t: LiveTrajectory, c: Completion, parsed: protocol.ParsedAction, result) -> None:
        self.r.advance(t, c, parsed, result)
        self.turns += 1
        if t.live:
            self.ready.append((t, 1))
            return
        self.r.stats.trajectory_end_seconds.append(time.perf_counter() - self.started)
        self.event("end", t, len(t.turns))
        self.r.stats.last_ended = {**self.phases[(t.group, t.index)], "turns": float(len(t.turns)),
                                   "tokens": float(sum(u.completion_tokens for u in t.turns))}
        if not any(o.live for o in self.lives[t.group]):
            self.group_ended(t.group)


def completion_tokens(t: Trajectory) -> int:
    """The tokens the policy sampled in a trajectory (its turns' completions, as kept)."""
    return sum(turn.completion_tokens for turn in t.turns)


def rollout_metrics(groups: list[TrajectoryGroup], prefix: str = "rollout/") -> dict[str, float]:
    """Reward, success, invalid actions, steps and stop reasons over all trajectories."""
    trajs = [t for g in groups for t in g.trajectories]
    n = max(len(trajs), 1)
    tokens = [completion_tokens(t) for t in trajs]
    turns = [u for t in trajs for u in t.turns]
    metrics = {
        "reward_mean": sum(t.reward for t in trajs) / n,
        "success_rate": sum(t.won for t in trajs) / n,
        "invalid_actions_mean": sum(t.invalid_actions for t in trajs) / n,
        # turns a trajectory that repeat an action from a state it already took it in (loops; alfrl.types.repeated_turns)
        "repeated_turns_mean": sum(repeated_turns((u.state_key, u.action) for u in t.turns)[0] for t in trajs) / n,
        "steps_mean": sum(t.steps for t in trajs) / n,
        # sampled tokens per trajectory: the longest sets how long an asynchronous rollout takes
        "completion_tokens_mean": sum(tokens) / n,
        "completion_tokens_max": float(max(tokens, default=0)),
        # turns cut off by a token limit (invalid) and the longest well-formed one: what a lower max_assistant_tokens would cost
        "turns_cut_off": sum(u.finish_reason == "length" for u in turns) / max(len(turns), 1),
        "valid_turn_tokens_max": float(max((u.completion_tokens for u in turns if u.valid_format), default=0)),
        "trajectories": float(len(trajs)),
        "failed_groups": float(sum(g.failed is not None for g in groups)),
    }
    for reason in STOP_REASONS:
        metrics[f"stop/{reason}"] = sum(t.stop_reason == reason for t in trajs) / n
    return {prefix + k: v for k, v in metrics.items()}
