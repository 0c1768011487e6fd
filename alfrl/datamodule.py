"""The DataModule: the training games, step by step, and the Sampler that plays them.

It builds the training game list (seeded shuffle, its fingerprint checked on resume), builds the ``Sampler`` (handed to
the LightningModule when training starts) and yields one ``StepGames`` per step from an IterableDataset (no DataLoader
workers): ``games_per_batch`` games taken cyclically, with everything the training step needs to play them and score
the result (group size, seed, reward and advantage settings). With several ranks each takes a disjoint share of the
step's games; a group never spans ranks, so advantages stay exact.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from alfrl.advantages import AdvantageConfig
from alfrl.evaluation import EvalConfig
from alfrl.games import DataError, Game, fingerprint, scan_games, shuffled
from alfrl.rewards import RewardConfig
from alfrl.rollout import RolloutConfig, RolloutStats
from alfrl.sampler import Sampler
from alfrl.envs import EnvConfig
from alfrl.sampler_config import EngineConfig
from alfrl.types import RolloutProgress, TrajectoryGroup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepGames:
    """One training step's games and how to play and score them (``RolloutDataModule.next_step``)."""

    step: int
    games: list[Game]
    group_size: int
    seed: int
    """The rollout's sampling seed (from ``data.seed`` and the step)."""
    next_games: list[Game]
    """The next step's games, reset while this one trains (``data.env.prefetch_resets``; else empty)."""
    advantage: AdvantageConfig
    reward: RewardConfig
    history_length: int
    temperature: float
    """The sampling temperature of the rollouts (the trainer scores at the same temperature)."""
    rollouts_file: str | None = None
    """Where this rank writes the step's trajectories (``data.save_rollouts``), else None."""
    progress: Callable[[RolloutProgress], None] | None = field(default=None, compare=False)


class _RolloutStream(IterableDataset):
    def __init__(self, dm: RolloutDataModule):
        self.dm = dm

    def __iter__(self):
        while True:
            yield self.dm.next_step()


def _identity(x):
    return x


class RolloutDataModule(L.LightningDataModule):
    """Rollout batches from ALFWorld. Every argument is a recipe key under ``data:``."""

    def __init__(
        self,
        data_dir: str | None = None,
        train_split: str = "train",
        games_per_batch: int = 8,
        group_size: int = 8,
        seed: int = 42,
        rollout: RolloutConfig = RolloutConfig(),
        reward: RewardConfig = RewardConfig(),
        advantage: AdvantageConfig = AdvantageConfig(),
        engine: EngineConfig = EngineConfig(),
        env: EnvConfig = EnvConfig(),
        eval: EvalConfig = EvalConfig(),
        save_rollouts: bool = False,
        accept_changed_games: bool = False,
    ):
        """
        Args:
            data_dir: folder holding json_2.1.1/ (default $ALFWORLD_DATA or ~/.cache/alfworld).
            train_split: split the training games come from.
            games_per_batch: games per step (over all ranks); each gives one group.
            group_size: K, trajectories per game (>= 2: advantages compare within a group).
            seed: seeds the game shuffle and the sampling.
            rollout: sampling, action format, context and episode limits.
            reward: reward kind, win reward, invalid penalty, gamma.
            advantage: estimator and its settings; dropping degenerate groups.
            engine: the sampler (hf or vllm) and its settings.
            env: environment worker pool.
            eval: the evaluation protocol (``alfrl eval`` and periodic evaluation).
            save_rollouts: write every step's trajectories (texts, rewards, no token ids) to
                ``<trainer.default_root_dir>/rollouts/step-NNNNNN-rankR.jsonl`` (update N, the one saved as checkpoint step-N).
            accept_changed_games: resume a checkpoint although the training game list differs from
                the one it was trained on (its fingerprint is stored in every checkpoint); by default
                such a resume stops, since the seeded order, and so the games played, would change.
        """
        super().__init__()
        self.data_dir = data_dir
        self.train_split = train_split
        self.games_per_batch = games_per_batch
        self.group_size = group_size
        self.seed = seed
        self.rollout = rollout
        self.reward = reward
        self.advantage = advantage
        self.engine_cfg = engine
        self.env_cfg = env
        self.eval_cfg = eval
        self.save_rollouts = save_rollouts
        self.accept_changed_games = accept_changed_games
        self.cursor = 0
        """How many training games have been taken so far (saved in checkpoints)."""
        self.step = 0
        self.sampler: Sampler | None = None
        self.train_games: list[Game] = []
        self.progress_listener: Callable[[RolloutProgress], None] | None = None

    # ------------------------------------------------------------ checks
    @staticmethod
    def problems(args: dict, prefix: str = "data") -> list[str]:
        out = []
        if args.get("games_per_batch", 1) < 1:
            out.append(f"{prefix}.games_per_batch={args.get('games_per_batch')} must be >= 1")
        if args.get("group_size", 2) < 2:
            out.append(f"{prefix}.group_size={args.get('group_size')} must be >= 2: advantages compare the K trajectories of a game")
        rollout = args.get("rollout")
        if isinstance(rollout, RolloutConfig):
            if rollout.temperature == 0:  # a negative one is RolloutConfig's own problem
                out.append(f"{prefix}.rollout.temperature={rollout.temperature}: training samples at a temperature > 0 "
                           "(the trainer scores softmax(logits / T)); greedy decoding is for data.eval")
            if rollout.top_p < 1:
                out.append(f"{prefix}.rollout.top_p={rollout.top_p}: training needs top_p 1 (the trainer scores the full "
                           "distribution at the sampling temperature, not a nucleus); top_p < 1 is for data.eval.top_p")
        for name in ("rollout", "reward", "advantage", "engine", "env", "eval"):
            cfg = args.get(name)
            if cfg is not None and hasattr(cfg, "problems"):
                out.extend(cfg.problems(f"{prefix}.{name}"))
        return out

    # ------------------------------------------------------------ wiring
    def connect(self, policy, with_pool: bool = True, deterministic: bool | None = None) -> Sampler:
        """The Sampler for ``policy`` (made once), its engine batch-invariant per ``deterministic`` (default
        ``data.rollout.deterministic``; ``alfrl eval`` passes ``data.eval.deterministic``). In a fit the first call comes
        at ``on_train_start`` (the weight sync), not in ``setup``: by then Lightning has put the policy's weights on the
        device, made the optimizer with its state (``configure_optimizers``) and restored a checkpoint, so the trainer's
        long-lived GPU tensors exist before the engine allocates anything (alfrl.guard says why)."""
        if self.sampler is None:
            self.sampler = Sampler.build(policy, self.rollout, self.reward, self.engine_cfg, self.env_cfg, self.eval_cfg,
                                         seed=self.seed, with_pool=with_pool,
                                         deterministic=self.rollout.deterministic if deterministic is None else deterministic)
        return self.sampler

    def setup(self, stage: str) -> None:
        scan = scan_games(self.data_dir, [self.train_split])
        if scan.warning():
            log.warning(scan.warning())
        self.train_games = shuffled(scan.games, self.seed)
        if self.reward.noise > 0:
            log.warning("data.reward.noise=%s: every trajectory's reward carries random noise (a pipeline check on weights that "
                        "never win, not a learning run)", self.reward.noise)
        bar = getattr(self.trainer, "progress_bar_callback", None)
        if bar is not None and hasattr(bar, "rollout_progress"):
            self.progress_listener = bar.rollout_progress

    def teardown(self, stage: str) -> None:
        self.close()

    def on_exception(self, exception: BaseException) -> None:
        """A run that failed (Lightning calls no teardown then): the environment workers stop now, not at the process's exit."""
        self.close()

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None

    def _rank_world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_RolloutStream(self), batch_size=None, num_workers=0, collate_fn=_identity)

    # ------------------------------------------------------------ state (checkpointed)
    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "step": self.step, "games": len(self.train_games), "games_fingerprint": fingerprint(self.train_games)}

    def load_state_dict(self, state: dict) -> None:
        saved, now = state.get("games_fingerprint"), fingerprint(self.train_games)
        if saved is not None and saved != now:
            message = (f"the checkpoint was trained on {state.get('games')} training games (fingerprint {saved}), this data has "
                       f"{len(self.train_games)} (fingerprint {now}): the resumed run would play different games")
            if not self.accept_changed_games:
                raise DataError(message + ". Restore the original games, or pass --data.accept_changed_games true to resume anyway")
            log.warning(message + " (accepted: data.accept_changed_games)")
        self.cursor = int(state["cursor"])
        self.step = int(state["step"])

    # ------------------------------------------------------------ batches
    def step_games(self, advance: bool = True) -> list[Game]:
        """This rank's share of the next ``games_per_batch`` training games (cyclic); advances the cursor unless told not to."""
        rank, world = self._rank_world()
        n = len(self.train_games)
        games = [self.train_games[(self.cursor + i) % n] for i in range(self.games_per_batch)]
        self.cursor += self.games_per_batch if advance else 0
        return games[rank::world]

    def next_step(self) -> StepGames:
        """This rank's games of the next step, and the settings to play and score them with."""
        games = self.step_games()
        rank, _ = self._rank_world()
        folder = Path(self.trainer.default_root_dir) / "rollouts" if self.save_rollouts else None
        plan = StepGames(step=self.step, games=games, group_size=self.group_size, seed=zlib.crc32(f"{self.seed}|step|{self.step}".encode()),
                         next_games=self.step_games(advance=False) if self.env_cfg.prefetch_resets else [],
                         advantage=self.advantage, reward=self.reward, history_length=self.rollout.history_length,
                         temperature=self.rollout.temperature,
                         rollouts_file=str(folder / f"step-{self.step + 1:06d}-rank{rank}.jsonl") if folder else None,  # update N: checkpoint step-N
                         progress=self.progress_listener)
        self.step += 1
        return plan

    # ------------------------------------------------------------ periodic evaluation
    def evaluate_in_memory(self, limit_per_split: int | None) -> tuple[list[dict], bool]:
        """The evaluation protocol on the first games of each split (with several ranks, sharded and gathered): every game's
        record, and whether the engine that played them was batch-invariant (the training engine's setting)."""
        from alfrl.evaluation import eval_games

        rank, world = self._rank_world()
        games = eval_games(self.data_dir, self.eval_cfg.splits, limit_per_split)[rank::world]
        sampler = self.connect(self.trainer.lightning_module)
        records = sampler.evaluate_records(games)
        if world > 1:
            gathered: list = [None] * world
            torch.distributed.all_gather_object(gathered, records)
            records = [r for part in gathered for r in part]
        return records, sampler.deterministic


SUMMED_METRICS = ("rollout/trajectories", "rollout/failed_groups", "rollout/degenerate_groups", "rollout/dropped_groups")
LOCAL_METRICS = ("rollout/seconds", "rollout/engine_busy_share", "rollout/half_ended_seconds", "rollout/completion_tokens_max",
                 "rollout/env_wait_seconds", "rollout/last_group_started_seconds", "rollout/tail_steps", "rollout/tail_step_ms",
                 "rollout/tail_core_step_ms", "rollout/tail_output_lag_ms", *(f"rollout/last_ended_{k}" for k in RolloutStats.LAST_ENDED))


def reduce_metrics(metrics: dict[str, float], groups: list[TrajectoryGroup], trainer) -> dict[str, float]:
    """A rank's rollout metrics made global over all ranks: counts summed, rates weighted by each rank's trajectories
    (rollout seconds, its tail and its longest trajectory stay this rank's)."""
    world = trainer.world_size if trainer is not None else 1
    if world <= 1:
        return metrics
    n = float(sum(len(g.trajectories) for g in groups))
    keys = sorted(k for k in metrics if k not in LOCAL_METRICS)
    summed = {k for k in keys if k in SUMMED_METRICS or k.startswith("tokens/")}
    values = torch.tensor([metrics[k] if k in summed else metrics[k] * n for k in keys] + [n], dtype=torch.float64)
    strategy = trainer.strategy
    values = strategy.reduce(values.to(strategy.root_device), reduce_op="sum").cpu().tolist()
    total = max(values[-1], 1.0)
    out = {k: v if k in summed else v / total for k, v in zip(keys, values[:-1])}
    out.update({k: metrics[k] for k in LOCAL_METRICS if k in metrics})
    return out


def write_rollouts(path: str, groups: list[TrajectoryGroup]) -> None:
    """The step's trajectories as JSONL records (``data.save_rollouts``)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rollout_records(groups)))


def rollout_records(groups: list[TrajectoryGroup]) -> list[dict]:
    """The JSONL records of ``data.save_rollouts``: each trajectory as an evaluation game record plus its group and index."""
    from alfrl.evaluation import game_record

    return [{**game_record(t), "type": "trajectory", "group": t.group_id, "index": t.index} for g in groups for t in g.trajectories]
