"""TextWorld environments in worker processes: a pool, and groups of K envs that share a start.

TextWorld's parsers are module-level singletons and not thread-safe, so every environment lives in
a worker process. Workers are fresh interpreters (``python -c``), never forks: forking after torch
or vLLM started threads can hang, and ``multiprocessing``'s spawn would re-run the user's script.
A worker hosts several environments and runs one command at a time; the pool keeps at most one
command in flight per worker, so a step that hangs past ``step_timeout`` is caught. When a worker
hangs or dies, the environment whose command was running is marked failed (its trajectory ends with
``env_error``); the worker is restarted and every other environment it hosted is rebuilt by
replaying its actions, which is exact because the games are deterministic. A worker found dead
while idle (killed between commands) is replaced the same way before any command is sent to it,
so no environment is lost.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection as mpc
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

from alfrl.games import Game

log = logging.getLogger(__name__)

HIDDEN_ACTIONS = ("help",)
"""Legal commands never listed to the model."""


def canonical_action(action: str) -> str:
    """Lower case, single spaces, no surrounding white space."""
    return " ".join(action.lower().split())


@dataclass(frozen=True)
class EnvState:
    """What an environment reports after a reset or a step."""

    observation: str
    """TextWorld's feedback text, unchanged."""
    admissible: tuple[str, ...]
    """Every legal command in canonical form, sorted (``help`` included)."""
    won: bool
    done: bool

    @property
    def shown_actions(self) -> tuple[str, ...]:
        """The admissible commands shown to the model (``help`` hidden)."""
        return tuple(a for a in self.admissible if a not in HIDDEN_ACTIONS)


@dataclass(frozen=True)
class EnvFailure:
    """An environment that hung, crashed or raised; its trajectory ends with ``env_error``."""

    reason: str


class GroupStartMismatch(RuntimeError):
    """The K environments of a group did not start from the identical state."""


# ---------------------------------------------------------------- worker process


def _state_of(game_state, done: bool) -> tuple:
    admissible = tuple(sorted({canonical_action(a) for a in game_state["admissible_commands"] or ()}))
    won = bool(game_state["won"])
    return (game_state.feedback, admissible, won, bool(done) or won)


class PlannerLibraries:
    """The planner library copies of one worker's environments, reused.

    fast_downward gives every environment its own copy of ``libdownward.so`` (the planner keeps its task in globals):
    copied into a temporary folder that is deleted at once while the copy stays loaded, so each copy's 33 MB of disk
    stay held until the worker exits. A fit's 64 environments a step held 2.1 GB more every step, and ``alfrl expert``
    over the 3,553 training games filled a 64 GB disk (H100, 2026-12-06: 281 games failed with ENOSPC). Here the copies
    of closed environments go back to a free list and new environments take them (each new planner state loads its own
    task into its copy first), so a worker holds as many copies as it ever had environments open at once.
    """

    def __init__(self):
        import fast_downward

        self._load = fast_downward.load_lib
        self.free: list = []
        self.owned: dict[int, list] = {}
        self._taking: list | None = None
        fast_downward.load_lib = self.take

    def take(self):
        lib = self.free.pop() if self.free else self._load()
        if self._taking is not None:
            self._taking.append(lib)
        return lib

    @contextlib.contextmanager
    def taken_by(self, env_id: int):
        """The copies handed out inside belong to ``env_id`` (an environment that failed to start gives them back)."""
        self._taking = taken = []
        try:
            yield
        except BaseException:
            self.free.extend(taken)
            raise
        finally:
            self._taking = None
        self.owned[env_id] = taken

    def release(self, env_id: int) -> None:
        """``env_id``'s copies back to the free list (its environment closed or replaced)."""
        self.free.extend(self.owned.pop(env_id, []))


def _worker_main(fd: int, fast_reset: bool = True, fast_step: bool = True) -> None:
    """Serve environment commands on the socket ``fd`` until the parent closes it."""
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

    if fast_reset:
        from alfrl.fast_reset import enable_fast_reset

        enable_fast_reset()
    if fast_step:
        from alfrl.fast_step import enable_fast_step

        enable_fast_step()

    libraries = PlannerLibraries()
    conn = mpc.Connection(fd)
    infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
    envs: dict[int, object] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, KeyboardInterrupt):
            break
        op, env_id, arg = msg
        if op == "shutdown":
            break
        try:
            if op == "reset":
                old = envs.pop(env_id, None)
                if old is not None:
                    old.close()
                libraries.release(env_id)
                with libraries.taken_by(env_id):
                    env = textworld.start(arg, infos, wrappers=[AlfredDemangler(), AlfredInfos])
                envs[env_id] = env
                conn.send(("ok", _state_of(env.reset(), False)))
            elif op == "step":
                game_state, _score, done = envs[env_id].step(arg)
                conn.send(("ok", _state_of(game_state, done)))
            elif op == "close":
                env = envs.pop(env_id, None)
                if env is not None:
                    env.close()
                libraries.release(env_id)
                conn.send(("ok", None))
            elif op == "ping":
                conn.send(("ok", os.getpid()))
            else:
                conn.send(("error", f"unknown op {op!r}"))
        except Exception:  # reported to the parent; the worker keeps serving its other envs
            conn.send(("error", traceback.format_exc(limit=4)))


# ---------------------------------------------------------------- pool


@dataclass
class _Env:
    path: str
    worker: int
    actions: list[str] = field(default_factory=list)
    """Actions applied since the last reset (replayed when the worker is restarted)."""
    started: bool = False
    """Whether the environment was reset (an environment never reset needs no replay)."""
    failed: str | None = None


@dataclass
class _Worker:
    process: subprocess.Popen
    conn: mpc.Connection

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace: float) -> None:
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.conn.close()


@dataclass(frozen=True)
class EnvOp:
    """One command for the pool: reset an env, or step it with an action."""

    env_id: int
    kind: str  # "reset" | "step"
    action: str | None = None


class EnvPool:
    """Worker processes that host TextWorld environments.

    ``num_workers`` defaults to the CPU count. Use as a context manager, or call ``close()``:
    closing stops every worker, so no child process outlives the pool.
    """

    def __init__(self, num_workers: int | None = None, step_timeout: float = 60.0, reset_timeout: float = 180.0,
                 fast_reset: bool = True, fast_step: bool = True):
        self.num_workers = num_workers or os.cpu_count() or 1
        self.fast_reset = fast_reset
        """Workers translate each game once per reset instead of four times (``alfrl.fast_reset``)."""
        self.fast_step = fast_step
        """Workers parse TextWorld's text grammar once per string and copy its contexts shallow (``alfrl.fast_step``)."""
        self.step_timeout = step_timeout
        self.reset_timeout = reset_timeout
        self._workers: list[_Worker] = [self._start_worker() for _ in range(self.num_workers)]
        self._envs: dict[int, _Env] = {}
        self._next_id = 0
        self._next_ticket = 0
        self._ops: dict[int, EnvOp] = {}
        """Submitted ops whose result was not yet returned, by ticket."""
        self._queues: dict[int, deque[int]] = {}
        """Tickets waiting for their worker, per worker."""
        self._inflight: dict[int, tuple[int, float]] = {}
        """Per busy worker: (ticket, deadline)."""
        self._results: dict[int, EnvState | EnvFailure] = {}
        self.restarts = 0
        """How many workers were restarted after a hang or crash."""

    # -- lifecycle
    def _start_worker(self) -> _Worker:
        parent, child = socket.socketpair()
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from alfrl.envs import _worker_main; "
             "_worker_main(int(sys.argv[1]), sys.argv[2] == '1', sys.argv[3] == '1')",
             str(child.fileno()), "1" if self.fast_reset else "0", "1" if self.fast_step else "0"],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
            env=env,
        )
        child.close()
        return _Worker(process, mpc.Connection(parent.detach()))

    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def worker_pid_of(self, env_id: int) -> int:
        return self._workers[self._envs[env_id].worker].process.pid

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(("shutdown", 0, None))
            except (OSError, BrokenPipeError):
                pass
        for w in self._workers:
            w.stop(grace=5)
        self._workers = []
        self._envs.clear()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_workers", None):
            self.close()

    # -- environments
    def create(self, path: str) -> int:
        """Register an environment for a game file on the least-loaded worker; it starts at ``reset``."""
        load = [0] * self.num_workers
        for env in self._envs.values():
            load[env.worker] += 1
        worker = min(range(self.num_workers), key=lambda i: load[i])
        env_id = self._next_id
        self._next_id += 1
        self._envs[env_id] = _Env(path=path, worker=worker)
        return env_id

    def release(self, env_ids: list[int]) -> None:
        """Close environments in their workers and forget them."""
        ops_by_worker: dict[int, list[int]] = {}
        for env_id in env_ids:
            env = self._envs.pop(env_id, None)
            if env is not None and env.failed is None:
                ops_by_worker.setdefault(env.worker, []).append(env_id)
        for worker, ids in ops_by_worker.items():
            w = self._workers[worker]
            for env_id in ids:
                try:
                    w.conn.send(("close", env_id, None))
                    if w.conn.poll(self.step_timeout):
                        w.conn.recv()
                except (OSError, EOFError):
                    break

    # -- running commands
    def submit(self, ops: list[EnvOp]) -> list[int]:
        """Queue ``ops`` (run in order per environment, concurrently across workers); one ticket per op.

        Results come back from ``poll`` (or ``run``) under their tickets.
        """
        tickets = []
        for op in ops:
            ticket = self._next_ticket
            self._next_ticket += 1
            self._ops[ticket] = op
            env = self._envs[op.env_id]
            if env.failed is not None:
                self._results[ticket] = EnvFailure(env.failed)
            else:
                self._queues.setdefault(env.worker, deque()).append(ticket)
            tickets.append(ticket)
        self._dispatch()
        return tickets

    @property
    def busy(self) -> bool:
        """Whether some submitted op has not finished yet."""
        return bool(self._queues or self._inflight)

    def poll(self, timeout: float = 0.0) -> list[tuple[int, EnvState | EnvFailure]]:
        """(ticket, result) of every finished op not yet returned; waits up to ``timeout`` seconds for one."""
        self._dispatch()
        if not self._results and self._inflight:
            self._wait(timeout)
        out = sorted(self._results.items())
        self._results = {}
        for ticket, _ in out:
            del self._ops[ticket]
        return out

    def run(self, ops: list[EnvOp]) -> list[EnvState | EnvFailure]:
        """Run ``ops`` and wait for them; one result per op, in op order."""
        tickets = self.submit(ops)
        wanted = set(tickets)
        while not wanted <= set(self._results):
            self._wait(3600.0)
        results = [self._results.pop(t) for t in tickets]
        for t in tickets:
            del self._ops[t]
        return results

    def _dispatch(self) -> None:
        """Send the next queued op to every idle worker (replacing a worker found dead first)."""
        for worker in list(self._queues):
            queue = self._queues[worker]
            while queue and worker not in self._inflight:
                ticket = queue.popleft()
                op = self._ops[ticket]
                env = self._envs[op.env_id]
                if env.failed is None and not self._workers[worker].alive():  # died while idle: replace it first
                    self._restart(worker, "environment worker died while idle")
                if env.failed is not None:
                    self._results[ticket] = EnvFailure(env.failed)
                    continue
                timeout = self.reset_timeout if op.kind == "reset" else self.step_timeout
                try:
                    self._workers[worker].conn.send((op.kind, op.env_id, env.path if op.kind == "reset" else op.action))
                    self._inflight[worker] = (ticket, time.monotonic() + timeout)
                except (OSError, BrokenPipeError):
                    self._inflight[worker] = (ticket, 0.0)  # dead: handled as a failure by _wait
            if not queue:
                del self._queues[worker]

    def _wait(self, timeout: float) -> None:
        """Collect the replies that arrive within ``timeout`` (and the ops whose deadline passed)."""
        if not self._inflight:
            return
        now = time.monotonic()
        wait_for = max(0.0, min([timeout] + [deadline - now for _, deadline in self._inflight.values()]))
        by_conn = {self._workers[w].conn: w for w in self._inflight}
        for conn in mpc.wait(list(by_conn), timeout=wait_for):
            worker = by_conn[conn]
            ticket, _ = self._inflight.pop(worker)
            op = self._ops[ticket]
            try:
                status, payload = conn.recv()
            except (EOFError, OSError):
                self._results[ticket] = self._fail_and_restart(worker, op.env_id, "environment worker died")
                continue
            if status == "ok":
                self._results[ticket] = self._record(op, payload)
            else:
                self._envs[op.env_id].failed = f"environment raised: {payload.strip().splitlines()[-1]}"
                self._results[ticket] = EnvFailure(self._envs[op.env_id].failed)  # type: ignore[arg-type]
        now = time.monotonic()
        for worker, (ticket, deadline) in list(self._inflight.items()):
            if deadline <= now:
                del self._inflight[worker]
                op = self._ops[ticket]
                alive = self._workers[worker].alive()
                reason = f"{op.kind} timed out after {self.reset_timeout if op.kind == 'reset' else self.step_timeout:.0f}s" if alive else "environment worker died"
                self._results[ticket] = self._fail_and_restart(worker, op.env_id, reason)
        self._dispatch()

    def _record(self, op: EnvOp, payload: tuple) -> EnvState:
        env = self._envs[op.env_id]
        if op.kind == "reset":
            env.actions = []
            env.started = True
        else:
            env.actions.append(op.action)  # type: ignore[arg-type]
        observation, admissible, won, done = payload
        return EnvState(observation=observation, admissible=admissible, won=won, done=done)

    def _fail_and_restart(self, worker: int, env_id: int, reason: str) -> EnvFailure:
        """Mark ``env_id`` failed, restart ``worker`` and rebuild its other environments by replay."""
        self._envs[env_id].failed = reason
        self._restart(worker, reason)
        return EnvFailure(reason)

    def _restart(self, worker: int, reason: str) -> None:
        """Replace ``worker`` and rebuild every started, unfailed environment it hosted by replay."""
        old = self._workers[worker]
        old.process.kill()
        old.stop(grace=10)
        self._workers[worker] = self._start_worker()
        self.restarts += 1
        log.warning("restarted environment worker %d (%s)", worker, reason)
        conn = self._workers[worker].conn
        for other_id, env in self._envs.items():
            if env.worker != worker or env.failed is not None or not env.started:
                continue
            if not self._replay(conn, other_id, env):
                env.failed = f"could not rebuild after a worker restart ({reason})"

    def _replay(self, conn: mpc.Connection, env_id: int, env: _Env) -> bool:
        commands = [("reset", env.path)] + [("step", a) for a in env.actions]
        for kind, arg in commands:
            try:
                conn.send((kind, env_id, arg))
                if not conn.poll(self.reset_timeout if kind == "reset" else self.step_timeout):
                    return False
                status, _ = conn.recv()
            except (OSError, EOFError):
                return False
            if status != "ok":
                return False
        return True


# ---------------------------------------------------------------- groups


def check_same_start(game_id: str, states: list[EnvState | EnvFailure]) -> None:
    """Raise GroupStartMismatch unless every state equals the first (observation and actions)."""
    first = states[0]
    for i, state in enumerate(states):
        if isinstance(state, EnvFailure):
            raise GroupStartMismatch(f"game {game_id}: environment {i} of the group failed to start: {state.reason}")
        if state != first:
            what = "observation" if state.observation != first.observation else "admissible actions"  # type: ignore[union-attr]
            raise GroupStartMismatch(
                f"game {game_id}: environment {i} of the group started with a different {what} than environment 0; "
                "the K environments of a group must start from the identical state"
            )


class EnvGroup:
    """K independent environments of one game that must start from the identical state."""

    def __init__(self, pool: EnvPool, game: Game, env_ids: list[int]):
        self.pool = pool
        self.game = game
        self.env_ids = list(env_ids)

    @classmethod
    def create(cls, pool: EnvPool, game: Game, size: int) -> EnvGroup:
        return cls(pool, game, [pool.create(game.path) for _ in range(size)])

    def __len__(self) -> int:
        return len(self.env_ids)

    def reset_ops(self) -> list[EnvOp]:
        return [EnvOp(env_id, "reset") for env_id in self.env_ids]

    def reset(self) -> list[EnvState]:
        states = self.pool.run(self.reset_ops())
        check_same_start(self.game.id, states)
        return states  # type: ignore[return-value]

    def step(self, actions: list[str | None]) -> list[EnvState | EnvFailure | None]:
        """Step env i with ``actions[i]``; None leaves env i untouched and gives None."""
        ops = [EnvOp(env_id, "step", a) for env_id, a in zip(self.env_ids, actions) if a is not None]
        results = iter(self.pool.run(ops))
        return [next(results) if a is not None else None for a in actions]

    def close(self) -> None:
        self.pool.release(self.env_ids)


@dataclass
class PrefetchedResets:
    """A rollout's group resets submitted ahead of it (``Sampler.prefetch``), with the results already back."""

    game_ids: tuple[str, ...]
    group_size: int
    groups: list[EnvGroup]
    tickets: list[list[int]]
    """Each group's reset tickets."""
    early: dict[int, EnvState | EnvFailure] = field(default_factory=dict)
    """The results collected so far, by ticket (by ``collector``, a thread that keeps polling the pool)."""
    stop: threading.Event = field(default_factory=threading.Event)
    collector: threading.Thread | None = None

    def matches(self, games: list[Game], group_size: int) -> bool:
        return self.game_ids == tuple(g.id for g in games) and self.group_size == group_size

    def counts(self) -> tuple[int, int]:
        """How many of the resets are back so far, of how many."""
        return len(self.early), sum(len(t) for t in self.tickets)

    def stop_collecting(self) -> None:
        if self.collector is not None:
            self.stop.set()
            self.collector.join()
            self.collector = None


@dataclass(frozen=True)
class EnvConfig:
    """The environment worker pool."""

    num_workers: int | None = None
    """Worker processes; default the CPU count."""
    step_timeout: float = 60.0
    """Seconds before a step counts as hung (the worker is restarted, that trajectory ends with env_error)."""
    reset_timeout: float = 180.0
    """Seconds before a reset counts as hung (the worker is restarted, that group is left out of the step)."""
    prefetch_resets: bool = False
    """Reset the next training step's environments as soon as a rollout ends (the workers are idle while the update and
    the sync run), so the next rollout's groups start without waiting for their resets (``Sampler.prefetch``). On the H200
    (16 workers) every group then started within 0.011 s and half of the trajectories had ended at 6.75-8.00 s against
    10.97-13.47 s (not pairs; raw-results-2026-12-06:bench/leases/2026-12-04b.md), so it is on in the 1.5B RL recipes; on the 2-core development
    machine the resets slowed the CPU update more than they saved."""

    def problems(self, prefix: str = "data.env") -> list[str]:
        out = []
        if self.num_workers is not None and self.num_workers < 1:
            out.append(f"{prefix}.num_workers={self.num_workers} must be >= 1 (or null for the CPU count)")
        if self.step_timeout <= 0 or self.reset_timeout <= 0:
            out.append(f"{prefix}.step_timeout / reset_timeout must be > 0")
        return out

    def make_pool(self) -> EnvPool:
        return EnvPool(self.num_workers, self.step_timeout, self.reset_timeout)
