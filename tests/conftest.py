"""Shared fixtures: the real ALFWorld games and the tiny model.

The games come from $ALFWORLD_DATA (``make test`` prepares it from $ALFWORLD_ARCHIVE). Tests that
need them fail with a clear message when they are missing, except outside CI where they skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from alfrl.games import DATA_SUBDIR, discover_games, prepare_from_archive, resolve_data_dir, shuffled

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def data_dir() -> str:
    root = resolve_data_dir(None)
    if not (root / DATA_SUBDIR / "valid_seen").is_dir() and os.environ.get("ALFWORLD_ARCHIVE"):
        prepare_from_archive(root, os.environ["ALFWORLD_ARCHIVE"])
    if not (root / DATA_SUBDIR / "valid_seen").is_dir():
        message = f"no ALFWorld games in {root}: run `make data ARCHIVE=...` or set ALFWORLD_DATA"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return str(root)


@pytest.fixture(scope="session")
def valid_games(data_dir):
    return discover_games(data_dir, ["valid_seen", "valid_unseen"])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The tiny model folder: $ALFRL_TINY_MODEL (written by `make test`) or written here once."""
    given = os.environ.get("ALFRL_TINY_MODEL")
    if given and (Path(given) / "config.json").is_file():
        return given
    from alfrl.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0))


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> str:
    """The tiny architecture with random weights (no pretraining): embeddings nearly orthogonal."""
    from alfrl.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("random") / "model", seed=0, pretrain_steps=0))


@pytest.fixture()
def policy(tiny_model_dir):
    """The tiny model with a LoRA r8 whose B is non-zero (the adapter takes part in every score), rows of 256 tokens,
    log-probs in chunks of 7: test_policy.py and test_ppo.py."""
    import torch

    from alfrl.policy import AlfrlPolicy, LoRAConfig, OptimizerConfig
    from alfrl.ppo import PPOConfig

    p = AlfrlPolicy(model_name=tiny_model_dir, dtype="float32", lora=LoRAConfig(rank=8, alpha=16), optim=OptimizerConfig(lr=5e-3),
                    ppo=PPOConfig(microbatch_tokens=256, logprob_chunk_size=7))
    p.configure_model()
    torch.manual_seed(0)
    for name, param in p.model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.02)
    return p


@pytest.fixture(scope="session")
def qwen35_small_dir(tmp_path_factory) -> str:
    """A random-weight checkpoint of Qwen3.5's structure (vision-language, Gated DeltaNet + full attention), small."""
    from alfrl.shapes import write_random_model

    out, _ = write_random_model("qwen3.5-small", tmp_path_factory.mktemp("q35") / "model")
    return str(out)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def one_game_per_task(games, split):
    seen = {}
    for g in games:
        if g.split == split and g.task_type not in seen:
            seen[g.task_type] = g
    return [seen[t] for t in sorted(seen)]


@pytest.fixture(scope="module")
def expert(data_dir, tiny_tokenizer, tmp_path_factory):
    """10 training games' expert plans replayed through the action_tag protocol (8 steps) into a file, with the tiny
    tokenizer: (games, chat format, the file, the replay's result)."""
    from alfrl.chat import chat_format
    from alfrl.envs import EnvPool
    from alfrl.expert import replay
    from alfrl.rewards import RewardConfig
    from alfrl.rollout import RolloutRunner
    from tests.helpers import EXPERT_CFG

    games = sorted(shuffled(discover_games(data_dir, ["train"]), 7)[:10], key=lambda g: g.id)
    fmt = chat_format(tiny_tokenizer, "action_tag")
    out = tmp_path_factory.mktemp("expert") / "expert.jsonl"
    with EnvPool(num_workers=2) as pool:
        result = replay(lambda engine: RolloutRunner(engine, pool, fmt, EXPERT_CFG, RewardConfig()), fmt, games,
                        EXPERT_CFG.max_episode_steps, out, chunk=4)
    return games, fmt, out, result
