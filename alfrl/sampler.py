"""The Sampler: everything that plays ALFWorld with the policy, behind one small interface.

It owns the sampling engine (HF or vLLM), the environment worker pool, the chat format, the rollout
runner, the weight sync with its probe, and evaluation:

    sampler = Sampler.build(policy, rollout, reward, engine, env, eval)
    result = sampler.rollout(games, group_size, seed)      # grouped trajectories, token counters, timings
    probe = sampler.probe(next_games, group_size)          # the engine's drift over the rollout; it sleeps; next resets start
    metrics = sampler.sync(policy)                         # new weights in, counted and probed
    summary = sampler.evaluate(games, out="results.jsonl", config={...})
    sampler.close()

The LightningModule's training step makes those calls in that order; ``alfrl eval``, ``alfrl rollout`` and the
benchmarks use the same calls. Its settings: ``alfrl.sampler_config.EngineConfig`` and ``alfrl.envs.EnvConfig``.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


from alfrl import protocol
from alfrl.chat import ChatFormat, chat_format
from alfrl.engines import Engine, EngineCounters, HFEngine
from alfrl.envs import EnvConfig, EnvGroup, EnvPool, PrefetchedResets
from alfrl.evaluation import EvalConfig, game_record, run_eval
from alfrl.games import Game
from alfrl.rewards import RewardConfig
from alfrl.rollout import RolloutConfig, RolloutRunner, RolloutStats, rollout_metrics
from alfrl.sampler_config import EngineConfig
from alfrl.sync import WeightSync
from alfrl.types import RolloutProgress, TrajectoryGroup

log = logging.getLogger("alfrl")

@dataclass(frozen=True)
class RolloutResult:
    """What one rollout played and what it cost."""

    groups: list[TrajectoryGroup]
    counters: EngineCounters
    """Prompt / cached prompt / generated tokens of this rollout."""
    stats: RolloutStats

    def metrics(self) -> dict[str, float]:
        """This rollout's ``rollout/`` and ``tokens/`` metrics (this rank's; its samples' own: ``AdvantageResult.metrics``)."""
        stats = self.stats
        metrics = rollout_metrics(self.groups)
        metrics["rollout/seconds"] = stats.seconds
        metrics["tokens/prompt"] = float(self.counters.prompt_tokens)
        metrics["tokens/cached_prompt"] = float(self.counters.cached_prompt_tokens)
        metrics["tokens/generated"] = float(self.counters.generated_tokens)
        metrics["rollout/engine_busy_share"] = stats.engine_seconds / max(stats.seconds, 1e-9)
        metrics["rollout/engine_steps"] = float(stats.engine_steps)
        metrics["rollout/engine_step_ms"] = 1000 * stats.engine_seconds / max(stats.engine_steps, 1)
        metrics["rollout/submit_seconds"] = stats.submit_seconds
        metrics["rollout/env_wait_seconds"] = stats.env_wait_seconds
        if stats.group_start_seconds:  # the start-up: every group's environments reset, its first request ready
            metrics["rollout/last_group_started_seconds"] = max(stats.group_start_seconds)
        if stats.trajectory_end_seconds:  # half the trajectories had ended by then; the rest is the tail
            metrics["rollout/half_ended_seconds"] = statistics.median(stats.trajectory_end_seconds)
            # the last trajectory's life (the rollout's critical path): generating, stepping, waiting here
            metrics.update({f"rollout/last_ended_{k}": v for k, v in stats.last_ended.items()})
        if stats.tail_engine_steps:  # the engine's steps after that, with the batch emptying: the tail's step time
            metrics.update(stats.tail_figures())
            metrics.update(stats.tail_output_figures())  # vLLM: its core's step there, and how late this process took it
        return metrics


class Sampler:
    """Plays trajectories with the policy; see the module docstring."""

    def __init__(self, engine: Engine, pool: EnvPool | None, fmt: ChatFormat, rollout: RolloutConfig, reward: RewardConfig,
                 evaluation: EvalConfig, engine_cfg: EngineConfig):
        self.engine = engine
        self.pool = pool
        self.fmt = fmt
        self.rollout_cfg = rollout
        self.reward = reward
        self.eval_cfg = evaluation
        self.engine_cfg = engine_cfg
        self._sync: WeightSync | None = None
        self._prefetch: PrefetchedResets | None = None

    @classmethod
    def build(cls, policy, rollout: RolloutConfig, reward: RewardConfig, engine: EngineConfig, env: EnvConfig,
              evaluation: EvalConfig, seed: int = 0, with_pool: bool = True, deterministic: bool = False) -> Sampler:
        """The engine for ``policy`` (its tokenizer, its weights), a worker pool and the chat format; ``deterministic``:
        an engine whose requests do not depend on each other (vLLM's batch-invariant mode; the hf engine always is)."""
        tokenizer = policy.load_tokenizer()
        fmt = chat_format(tokenizer, rollout.action_format, rollout.enable_thinking)
        if engine.kind == "hf":
            policy.configure_model()
            sampling: Engine = HFEngine(lambda: policy.model, tokenizer.pad_token_id, engine.max_batch_rows, separate=engine.separate_weights)
        else:
            from alfrl.models import hf_folder_for
            from alfrl.vllm_engine import VLLMEngine

            path = hf_folder_for(policy.hparams.model_name, policy.hparams.gguf_file)
            rank = int(os.environ.get("LOCAL_RANK", "0"))
            sampling = VLLMEngine(
                path,
                gpu_memory_utilization=engine.gpu_memory_utilization,
                max_model_len=engine.max_model_len or max(rollout.max_trajectory_tokens, evaluation.max_trajectory_tokens),
                enable_sleep_mode=engine.sleep_mode,
                enforce_eager=engine.enforce_eager,
                enable_prefix_caching=engine.prefix_caching,
                dtype="bfloat16",
                seed=seed + rank,
                lora_rank=policy.lora.rank if engine.weight_sync == "lora" else None,
                extra=engine.vllm_extra(path),
                stop_strings=bool(rollout.stop_strings),  # evaluation's rollouts take the training ones' stop strings
                separate_process=engine.separate_process,
                batch_invariant=deterministic,
            )
        pool = env.make_pool() if with_pool else None
        return cls(sampling, pool, fmt, rollout, reward, evaluation, engine)

    # ------------------------------------------------------------ rollouts
    def runner(self, cfg: RolloutConfig | None = None) -> RolloutRunner:
        return RolloutRunner(self.engine, self.pool, self.fmt, cfg or self.rollout_cfg, self.reward)

    def rollout(self, games: list[Game], group_size: int, seed: int,
                progress: Callable[[RolloutProgress], None] | None = None) -> RolloutResult:
        """Play ``group_size`` trajectories of each game with the current weights (the engine awake)."""
        self.engine.wake_up()
        before = self.engine.counters()
        runner = self.runner()
        groups = runner.run(games, group_size, seed, progress, prepared=self._take_prefetch(games, group_size))
        failed = [g for g in groups if g.failed is not None]
        if failed:
            log.warning("%d of %d groups could not be played and are left out (%s)", len(failed), len(groups), failed[0].failed)
        return RolloutResult(groups, self.engine.counters().minus(before), runner.stats)

    def probe(self, next_games: list[Game] = (), group_size: int = 0) -> dict[str, float]:
        """After a rollout: the engine scores the sync's probe as right after the last sync (``engine/probe_drift``: the
        same weights must give the same log-probs), then sleeps (sleep mode: its memory to the trainer), then the resets of
        ``next_games`` start in the workers (the next rollout's, while this step trains)."""
        metrics = self._sync.check_engine("after the rollout") if self._sync is not None else {}
        slept = time.perf_counter()
        self.engine.sleep()
        freed = getattr(self.engine, "sleep_freed_gib", None)  # None: the engine does not sleep
        if freed is not None:
            metrics["engine/sleep_seconds"] = time.perf_counter() - slept
            metrics["engine/sleep_freed_gib"] = freed
        if next_games:
            self.prefetch(list(next_games), group_size)
        return metrics

    def prefetch(self, games: list[Game], group_size: int) -> None:
        """Submit the resets of ``games``' groups now; ``rollout`` plays them if it gets the same games and group size
        (anything else drops them first). Not with ``max_live_games`` below the games: those start one by one."""
        self.drop_prefetch()
        if self.pool is None or not games or 0 < self.rollout_cfg.max_live_games < len(games):
            return
        groups = [EnvGroup.create(self.pool, game, group_size) for game in games]
        p = PrefetchedResets(tuple(g.id for g in games), group_size, groups, [self.pool.submit(g.reset_ops()) for g in groups])
        p.collector = threading.Thread(target=self._collect, args=(self.pool, p), name="alfrl-prefetch", daemon=True)
        p.collector.start()
        self._prefetch = p

    def prefetch_counts(self) -> tuple[int, int] | None:
        """A pending prefetch's resets back so far, of how many; None where none is pending (never submitted, taken by a
        rollout, dropped, or not possible with ``max_live_games`` below the games)."""
        return None if self._prefetch is None else self._prefetch.counts()

    @staticmethod
    def _collect(pool: EnvPool, p: PrefetchedResets) -> None:
        """Until the next rollout (or a drop) stops it: the pool sends each worker its next op only when polled, so this
        thread polls it, keeping every worker resetting, and keeps what comes back. Nothing else uses the pool meanwhile."""
        while not p.stop.is_set() and pool.busy:
            p.early.update(pool.poll(0.05))

    def _take_prefetch(self, games: list[Game], group_size: int) -> PrefetchedResets | None:
        p = self._prefetch
        if p is not None and p.matches(games, group_size):
            p.stop_collecting()
            self._prefetch = None
            return p
        self.drop_prefetch()
        return None

    def drop_prefetch(self) -> None:
        """Collect a prefetch's resets (no other rollout may find their results in the pool) and release its environments."""
        p, self._prefetch = self._prefetch, None
        if p is None:
            return
        p.stop_collecting()
        if self.pool is None:
            return
        pending = {t for tickets in p.tickets for t in tickets} - set(p.early)
        while pending:  # each reset ends, or fails at the pool's reset_timeout
            pending -= {t for t, _ in self.pool.poll(1.0)}
        for group in p.groups:
            group.close()

    # ------------------------------------------------------------ weights
    def probe_ids(self) -> list[int]:
        """A fixed sequence (opening prompt + a well-formed answer) to check engine and trainer agree."""
        prompt = self.fmt.first_prompt_ids("Your task is to: put a clean mug in the coffeemachine.\n\nStep 1 of 50.\nObservation: You are in the middle of a room.")
        answer = self.fmt.encode(protocol.format_action("go to countertop 1", self.rollout_cfg.action_format, "The mug is probably on a countertop. "))
        return prompt + answer + [self.fmt.end_of_turn_id]

    def weight_sync(self, check: bool = True) -> WeightSync:
        """The sync of this engine (made once: it remembers the trainer's probe log-probs between syncs)."""
        if self._sync is None:
            cfg = self.engine_cfg
            self._sync = WeightSync(self.engine, self.probe_ids(), cfg.weight_sync, cfg.sync_check_tolerance, cfg.sync_min_response, check)
        return self._sync

    def sync(self, policy, check: bool = True, push: bool = True, canary: bool = False) -> dict[str, float]:
        """Push ``policy``'s weights into the engine and check they arrived (``sync/`` metrics, ``sync/total_seconds``).
        ``canary``: first a sync that skips the push, and whether the checks caught it (``sync/canary_caught``)."""
        started = time.perf_counter()
        metrics: dict[str, float] = {}
        if canary and check:
            found = self.weight_sync(check).canary(policy)
            log.warning("weight-sync canary after update %d: a sync that skipped the push was %s (%s)", policy.weight_version,
                        "caught" if found["sync/canary_caught"] else "NOT caught", found.get("sync/canary_message", ""))
            metrics.update({k: v for k, v in found.items() if isinstance(v, float)})
        metrics = {**self.weight_sync(check).sync(policy, push=push), **metrics}
        metrics["sync/total_seconds"] = time.perf_counter() - started  # the engine's wake-up, the canary, push and checks
        return metrics

    # ------------------------------------------------------------ evaluation
    def evaluate_records(self, games: list[Game], cfg: EvalConfig | None = None) -> list[dict]:
        """One trajectory per game under the evaluation protocol, as JSONL records (in game order)."""
        cfg = cfg or self.eval_cfg
        self.drop_prefetch()
        self.engine.wake_up()
        runner = self.runner(cfg.rollout_config(self.rollout_cfg))
        records = []
        for i in range(0, len(games), cfg.games_per_chunk):
            for group in runner.run(games[i : i + cfg.games_per_chunk], 1, cfg.seed):
                records.extend(game_record(t) for t in group.trajectories)
        return records

    def evaluate(self, games: list[Game], out: str | Path, config: dict, cfg: EvalConfig | None = None, overwrite: bool = False,
                 on_game: Callable[[int, int], None] | None = None) -> dict:
        """The evaluation protocol on ``games`` into the resumable result file ``out``; returns the summary."""
        cfg = cfg or self.eval_cfg
        self.drop_prefetch()
        self.engine.wake_up()
        before = self.engine.counters()
        start = time.perf_counter()
        spent: dict = {}
        summary = run_eval(self.runner(cfg.rollout_config(self.rollout_cfg)), games, cfg, out, config, overwrite, on_game, spent)
        summary["seconds"] = time.perf_counter() - start
        c = self.engine.counters().minus(before)
        summary["time"] = {**spent, "prompt_tokens": c.prompt_tokens, "cached_prompt_tokens": c.cached_prompt_tokens,
                           "generated_tokens": c.generated_tokens}  # where this process's time went (not part of the results)
        return summary

    @property
    def deterministic(self) -> bool:
        """Whether this Sampler's rollouts and evaluations reproduce to the bit (its engine is batch-invariant)."""
        return bool(self.engine.batch_invariant)

    def close(self) -> None:
        p, self._prefetch = self._prefetch, None
        if p is not None:  # its environments end with the pool's workers
            p.stop_collecting()
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self.engine.close()
