"""Recipes: YAML files read by LightningCLI, validated before any model loads.

A recipe has the keys ``seed_everything``, ``trainer`` (Lightning's Trainer), ``model``
(``AlfrlPolicy``), ``data`` (``RolloutDataModule``), and the always-present callbacks
``weight_sync``, ``checkpoint`` and ``periodic_eval``. Values may use omegaconf interpolation
(``${trainer.default_root_dir}/checkpoints``), resolved after command-line overrides.

``AlfrlCLI.before_instantiate_classes`` collects every problem of the resolved configuration
(bad values, a group size below 2, clip ranges that exclude 1, a trajectory budget over the
model's context, missing data) and stops with one line per problem, naming the key to change.
"""

from __future__ import annotations

import sys

from jsonargparse import ActionConfigFile, Namespace, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from alfrl.advantages import AdvantageConfig
from alfrl.datamodule import EngineConfig, EnvConfig, RolloutDataModule
from alfrl.evaluation import EvalConfig
from alfrl.games import DataError, discover_games
from alfrl.policy import AlfrlPolicy
from alfrl.rewards import RewardConfig
from alfrl.rollout import RolloutConfig
from callbacks import Checkpointing, PeriodicEval, RolloutProgressBar, SamplerWeightSync

# recipes write ${trainer.default_root_dir}; resolved after overrides, relative to the recipe's root
set_parsing_settings(omegaconf_absolute_to_relative_paths=True)

DATA_CONFIGS = {
    "rollout": RolloutConfig,
    "reward": RewardConfig,
    "advantage": AdvantageConfig,
    "engine": EngineConfig,
    "env": EnvConfig,
    "eval": EvalConfig,
}

TRAINER_DEFAULTS = {
    "enable_checkpointing": False,  # alfrl's Checkpointing writes LoRA-only checkpoints instead
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
    "use_distributed_sampler": False,  # the DataModule shards games across ranks itself
    "log_every_n_steps": 1,
    "max_epochs": -1,
}


class RecipeError(SystemExit):
    """A recipe problem; exits with status 2 and a message that names the key and the fix."""

    def __init__(self, problems: list[str]):
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"alfrl: the recipe has {len(problems)} problem(s):\n{lines}")


class _Parser(LightningArgumentParser):
    def error(self, message: str, ex: Exception | None = None):  # type: ignore[override]
        if not self.exit_on_error:  # an inner parser: jsonargparse handles the exception itself
            return super().error(message, ex)
        first = " ".join(str(message).split())
        hint = "see the valid keys with `alfrl fit --help` or print a resolved recipe with `alfrl fit --config RECIPE --print_config`"
        raise SystemExit(f"alfrl: recipe error: {first}\n  ({hint})")


def _model_context(model_name: str, gguf_file: str | None) -> int | None:
    from transformers import AutoConfig

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    config = AutoConfig.from_pretrained(model_name, **kwargs)
    text = getattr(config, "text_config", None) or config
    return getattr(text, "max_position_embeddings", None)


def data_dict(data: Namespace | dict) -> dict:
    d = data.as_dict() if isinstance(data, Namespace) else dict(data)
    for key, cls in DATA_CONFIGS.items():
        value = d.get(key)
        if isinstance(value, dict):
            d[key] = cls(**value)
    return d


def recipe_problems(cfg: Namespace, check_data: bool = True, check_model: bool = True) -> list[str]:
    """Every problem of a resolved recipe (model, data and callbacks), one string each."""
    model = cfg.model.as_dict()
    problems = AlfrlPolicy.problems(model)
    try:
        data = data_dict(cfg.data)
    except TypeError as e:
        return problems + [f"data: {e}"]
    problems += RolloutDataModule.problems(data)
    rollout: RolloutConfig = data["rollout"]
    evalc: EvalConfig = data["eval"]
    engine: EngineConfig = data["engine"]
    budget = max(rollout.max_trajectory_tokens, evalc.max_trajectory_tokens)
    if engine.max_model_len is not None and engine.max_model_len < budget:
        problems.append(
            f"data.engine.max_model_len={engine.max_model_len} is below the trajectory budget {budget}: "
            "raise it or lower data.rollout.max_trajectory_tokens / data.eval.max_trajectory_tokens"
        )
    if check_model and model.get("model_name"):
        try:
            context = _model_context(model["model_name"], model.get("gguf_file"))
        except Exception as e:  # noqa: BLE001 - any loading problem is reported as a recipe problem
            problems.append(f"model.model_name={model['model_name']!r} could not be read ({type(e).__name__}: {str(e).splitlines()[0][:200]}): give a hub name or a local model folder")
        else:
            if context is not None and budget > context:
                problems.append(
                    f"data.rollout.max_trajectory_tokens / data.eval.max_trajectory_tokens ({budget}) exceed the model's context "
                    f"of {context} tokens: lower them to at most {context}"
                )
    if check_data:
        splits = [data.get("train_split", "train")] + list(evalc.splits)
        try:
            discover_games(data.get("data_dir"), sorted(set(splits)))
        except DataError as e:
            problems.append(f"data.data_dir: {e}")
    return problems


class AlfrlCLI(LightningCLI):
    """``alfrl fit``: LightningCLI over AlfrlPolicy and RolloutDataModule with alfrl's callbacks."""

    check_data = True

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("parser_kwargs", {})
        kwargs["parser_kwargs"].setdefault("parser_mode", "omegaconf+")
        kwargs.setdefault("trainer_defaults", dict(TRAINER_DEFAULTS))
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(AlfrlPolicy, RolloutDataModule, *args, **kwargs)

    def init_parser(self, **kwargs) -> LightningArgumentParser:
        kwargs.setdefault("dump_header", ["alfrl recipe (resolved)"])
        parser = _Parser(**kwargs)
        parser.add_argument("-c", "--config", action=ActionConfigFile, help="a recipe (YAML); later flags override it")
        return parser

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(SamplerWeightSync, "weight_sync")
        parser.add_lightning_class_args(Checkpointing, "checkpoint")
        parser.add_lightning_class_args(PeriodicEval, "periodic_eval")
        parser.add_lightning_class_args(RolloutProgressBar, "progress_bar")

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        if self.subcommand in (None, "fit"):
            problems = recipe_problems(cfg, check_data=self.check_data)
            if problems:
                raise RecipeError(problems)

    def _parse_ckpt_path(self) -> None:
        """Resolve ``--ckpt_path`` (a step folder, ``.../last`` or ``trainer.ckpt``).

        Unlike plain LightningCLI, the checkpoint's hyperparameters do not overwrite the recipe:
        the recipe (with its overrides) stays the one source of settings, and loading checks that
        the checkpoint's LoRA weights fit the model it describes.
        """
        if self.config.get("subcommand") != "fit" or not self.config.fit.get("ckpt_path"):
            return
        from callbacks.checkpointing import resolve_ckpt_path

        try:
            self.config.fit.ckpt_path = resolve_ckpt_path(self.config.fit.ckpt_path)
        except FileNotFoundError as e:
            raise RecipeError([f"--ckpt_path: {e}"]) from None


class _Parsed(Exception):
    def __init__(self, config: Namespace):
        self.config = config


class _ParseOnly(AlfrlCLI):
    def before_instantiate_classes(self) -> None:
        raise _Parsed(self.config)


def _with_argv(args: list[str], make):
    """LightningCLI warns when both sys.argv and args are given; show it only ``args``."""
    saved = sys.argv
    sys.argv = [saved[0], *args]
    try:
        return make()
    finally:
        sys.argv = saved


def parse_recipe(args: list[str]) -> Namespace:
    """The resolved configuration of a recipe plus overrides, without checks or instantiation."""
    try:
        _with_argv(list(args), lambda: _ParseOnly(run=False))
    except _Parsed as parsed:
        return parsed.config
    raise AssertionError("unreachable")


def load_recipe(args: list[str]) -> AlfrlCLI:
    """Parse and validate a recipe plus overrides, and build the model (not yet loaded) and DataModule."""
    return _with_argv(list(args) + ["--trainer.logger=false"], lambda: AlfrlCLI(run=False))


def main_fit(args: list[str]) -> None:
    _with_argv(["fit", *args], AlfrlCLI)


if __name__ == "__main__":  # pragma: no cover
    main_fit(sys.argv[1:])
