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
import warnings
from pathlib import Path

from jsonargparse import ActionConfigFile, Namespace, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from alfrl.advantages import AdvantageConfig
from alfrl.datamodule import RolloutDataModule
from alfrl.evaluation import EvalConfig
from alfrl.games import SPLITS, DataError, discover_games
from alfrl.policy import AlfrlPolicy
from alfrl.rewards import RewardConfig
from alfrl.rollout import RolloutConfig
from alfrl.envs import EnvConfig
from alfrl.sampler_config import EngineConfig
from alfrl.sft import ExpertDataModule, SFTPolicy
from callbacks import Checkpointing, PeriodicEval, RolloutProgressBar, SamplerWeightSync

# recipes write ${trainer.default_root_dir}; resolved after overrides, relative to the recipe's root
set_parsing_settings(omegaconf_absolute_to_relative_paths=True, docstring_parse_attribute_docstrings=True)

# library warnings every fit printed, each understood and not the user's to act on
KNOWN_WARNINGS = (
    r"Found `dataloader_iter` argument in the `training_step`",  # the training step reads one StepGames per update on purpose
    r"You are using the `dataloader_iter` step flavor",
    r"Found \d+ module\(s\) in eval mode at the start of training",  # the frozen base model's dropout-free layers
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # Lightning's own call into torch
    r"`is_gradient_checkpointing` is deprecated",  # peft's call into transformers
)
for _message in KNOWN_WARNINGS:
    warnings.filterwarnings("ignore", message=_message)

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


EXIT_RECIPE = 2
"""Exit status of every recipe or data problem (``alfrl fit``, ``eval``, ``rollout``, ``sft``)."""
EXIT_STOPPED = 1
"""Exit status of a run an engine or a weight sync stopped (``EngineError``, ``WeightSyncError``)."""


def report_stop(exc: BaseException, name: str) -> int | None:
    """For a run stopped by an alfrl error (an engine's, a weight sync's) found in ``exc`` or in what it was raised
    during or from: print everything (traceback and chain), then that error as the last line; returns EXIT_STOPPED.
    None for anything else (the caller raises it). On a GPU broken by a CUDA fault Lightning's teardown raises a second
    CUDA error, which Python would print last, after the one that says what happened."""
    import traceback

    from alfrl.engines import EngineError
    from alfrl.sync import WeightSyncError

    seen, cause = set(), exc
    while cause is not None and id(cause) not in seen and not isinstance(cause, (EngineError, WeightSyncError)):
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if not isinstance(cause, (EngineError, WeightSyncError)):
        return None
    traceback.print_exception(exc)
    print(f"alfrl {name}: stopped: {cause}", file=sys.stderr)
    return EXIT_STOPPED


_HINT = "see the valid keys with `alfrl fit --help` or print a resolved recipe with `alfrl fit --config RECIPE --print_config`"


class RecipeError(Exception):
    """A recipe problem: the message names the key and the fix; the commands exit with status 2."""

    def __init__(self, problems: list[str] | str):
        if isinstance(problems, str):
            super().__init__(f"alfrl: recipe error: {problems}")
        else:
            lines = "\n".join(f"  - {p}" for p in problems)
            super().__init__(f"alfrl: the recipe has {len(problems)} problem(s):\n{lines}")


class _Parser(LightningArgumentParser):
    def error(self, message: str, ex: Exception | None = None):  # type: ignore[override]
        if not self.exit_on_error:  # an inner parser: jsonargparse handles the exception itself
            return super().error(message, ex)
        first = " ".join(str(message).split())
        raise RecipeError(f"{first}\n  ({_HINT})")


def check_recipe_files(args: list[str]) -> None:
    """Every ``--config FILE`` exists and holds a YAML mapping (an empty file used to say only "Unexpected config:")."""
    import yaml

    for flag, value in zip(args, args[1:]):
        if flag not in ("--config", "-c") or value.lstrip().startswith("{"):
            continue
        path = Path(value)
        if path.is_dir():
            raise RecipeError(f"--config {value} is a folder: give one recipe file in it, e.g. {path / 'tiny.yaml'}")
        if not path.is_file():
            raise RecipeError(f"--config {value}: no such recipe file (the recipes are in recipes/, e.g. recipes/tiny.yaml)")
        try:
            content = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise RecipeError(f"--config {value} is not valid YAML ({' '.join(str(e).split())[:200]})") from None
        if content is None:
            raise RecipeError(f"--config {value} is empty: start from a recipe in recipes/ (e.g. recipes/tiny.yaml)")
        if not isinstance(content, dict):
            raise RecipeError(f"--config {value} is not a mapping of keys (model:, data:, trainer: ...): see recipes/tiny.yaml")
        for key, section in _groups(content):
            if section is not None and not isinstance(section, dict):
                kind = type(section).__name__
                raise RecipeError(f"{key} in --config {value} is {'an' if kind[0] in 'aeiou' else 'a'} {kind} ({str(section)[:60]}): it must be a "
                                  f"mapping of keys, as in recipes/tiny.yaml ({key}:, then its keys indented under it)")
        for key, class_path in _class_paths(content):
            problem = _import_problem(class_path)
            if problem:
                raise RecipeError(
                    f"{key} in --config {value}: {class_path} cannot be imported ({problem}); install its package (e.g. "
                    f"`pip install swanlab`) or drop it from a copy of the recipe (an override cannot replace a class that does not import)"
                )


RECIPE_GROUPS = {  # the sections of a recipe and the groups inside them whose value is a mapping of keys
    "trainer": (), "checkpoint": (), "weight_sync": (), "periodic_eval": (), "progress_bar": (),
    "model": ("lora", "optim", "ppo"), "data": tuple(DATA_CONFIGS),
}


def _groups(content: dict) -> list[tuple[str, object]]:
    """(key, value) of every recipe section and group present in a recipe file's ``content``."""
    out = []
    for section, inner in RECIPE_GROUPS.items():
        if section in content:
            out.append((section, content[section]))
            if isinstance(content[section], dict):
                out += [(f"{section}.{g}", content[section][g]) for g in inner if g in content[section]]
    return out


def _class_paths(tree, key: str = "") -> list[tuple[str, str]]:
    """(key, class_path) of every ``class_path:`` in a recipe (loggers, callbacks)."""
    out = []
    if isinstance(tree, dict):
        if isinstance(tree.get("class_path"), str):
            out.append((key, tree["class_path"]))
        for k, v in tree.items():
            out.extend(_class_paths(v, f"{key}.{k}" if key else str(k)))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out.extend(_class_paths(v, f"{key}[{i}]"))
    return out


def _import_problem(class_path: str) -> str | None:
    """Why ``class_path`` (``module.Class``; a bare name is Lightning's to resolve) does not import, or None."""
    import importlib

    module, _, name = class_path.rpartition(".")
    if not module:
        return None
    try:
        getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        return " ".join(str(e).split())
    return None


def run_cli(make, args: list[str]):
    """Run ``make`` (which parses ``args``) turning recipe, interpolation and data problems into RecipeError."""
    from omegaconf.errors import OmegaConfBaseException

    check_recipe_files(args)
    try:
        return _with_argv(list(args), make)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        where = f" in {str(key).removeprefix('fit.')}" if key else ""
        msg = str(e).splitlines()[0]
        raise RecipeError(f"broken interpolation{where}: {msg} (an interpolation is ${{section.key}}, e.g. ${{trainer.default_root_dir}})") from None


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


def _setting(model: dict, group: str, key: str, default):
    """``model.<group>.<key>`` of a parsed recipe (a dict or a dataclass), or ``default``."""
    value = model.get(group)
    if value is None:
        return default
    return value.get(key, default) if isinstance(value, dict) else getattr(value, key, default)


def _looks_local(name: str) -> bool:
    """A folder path rather than a hub name (``org/name``)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).expanduser().exists()


def _model_problems(model: dict) -> tuple[list[str], int | None]:
    """(problems, context length): the model folder exists, its config has the LoRA target modules (read
    without loading weights) and the adapter to start from (``init_adapter``) is there."""
    out = []
    if model.get("init_adapter"):
        from alfrl.checkpoints import check_adapter

        try:
            check_adapter(model["init_adapter"], _setting(model, "lora", "rank", None), _setting(model, "lora", "alpha", None))
        except FileNotFoundError as e:
            out.append(f"model.init_adapter={model['init_adapter']!r}: {e} (`alfrl sft` writes one), or null to start from a fresh LoRA")
        except ValueError as e:  # damaged, or other LoRA settings
            out.append(f"model.init_adapter={model['init_adapter']!r}: {e}")
    name = model["model_name"]
    if _looks_local(name) and not Path(name).expanduser().is_dir():
        hint = "run `make tiny-model` to write the tiny model there" if "tiny" in name else "give an existing folder or a hub name such as Qwen/Qwen3.5-4B"
        return out + [f"model.model_name={name!r}: no model folder there: {hint}"], None
    try:
        context = _model_context(name, model.get("gguf_file"))
    except Exception as e:  # noqa: BLE001 - any loading problem is reported as a recipe problem
        return out + [f"model.model_name={name!r} could not be read ({type(e).__name__}: {str(e).splitlines()[0][:200]}): give a hub name or a local model folder"], None
    targets = _setting(model, "lora", "target_modules", "all-linear")
    if targets != "all-linear" and not model.get("gguf_file"):
        try:
            from alfrl.models import linear_module_names

            names = linear_module_names(name)
        except Exception:  # noqa: BLE001 - a config transformers cannot build: the load reports it later
            names = None
        if names is not None:
            unknown = [t for t in ([targets] if isinstance(targets, str) else targets) if t not in names]
            if unknown:
                out.append(f"model.lora.target_modules has {unknown}, which the model does not have: choose from {sorted(names)} or all-linear")
    return out, context


def _checkpoint_problems(cfg: Namespace) -> list[str]:
    keep = cfg.checkpoint.keep_resume_states
    return [f"checkpoint.keep_resume_states={keep} must be >= 0 (0 keeps every checkpoint's trainer.ckpt)"] if keep < 0 else []


def _logger_problems(loggers) -> list[str]:
    """A SwanLab logger in online mode that could log in only by asking at a terminal, where there is none (a batch job):
    SwanLab would stop the run with a traceback after the model loaded."""
    import os

    out = []
    for i, logger in enumerate(loggers if isinstance(loggers, list) else [loggers]):
        item = logger.as_dict() if hasattr(logger, "as_dict") else logger
        if not isinstance(item, dict) or "SwanLabLogger" not in str(item.get("class_path", "")):
            continue
        mode = (item.get("init_args") or {}).get("mode") or os.environ.get("SWANLAB_MODE") or "online"
        if mode == "online" and not _has_terminal() and not _swanlab_key_known():
            out.append(f"trainer.logger[{i}]: SwanLab logs online, but no API key is saved (`swanlab login`) or set "
                       "(SWANLAB_API_KEY) and there is no terminal to ask for one: log in first, or set that logger's mode "
                       "to local (a dashboard on this machine, `swanlab watch`) or offline in a copy of the recipe")
    return out


def _has_terminal() -> bool:
    import sys

    try:
        return bool(sys.stdin is not None and sys.stdin.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def _swanlab_key_known() -> bool:
    """Whether SwanLab would find an API key (the environment, or a saved login: its settings read both)."""
    import os

    if os.environ.get("SWANLAB_API_KEY"):
        return True
    try:
        from swanlab.sdk.internal.settings import Settings

        return Settings().api_key is not None
    except Exception:  # a SwanLab whose settings this check does not know: leave the question to it
        return True


def recipe_problems(cfg: Namespace, check_data: bool = True, check_model: bool = True) -> list[str]:
    """Every problem of a resolved recipe (trainer, model, data and callbacks), one string each."""
    model = cfg.model.as_dict()
    problems = AlfrlPolicy.problems(model)
    max_steps = cfg.trainer.get("max_steps")
    if max_steps is not None and max_steps < 1 and max_steps != -1:
        problems.append(f"trainer.max_steps={max_steps}: the number of updates must be >= 1 (or -1 to train until stopped)")
    every = cfg.trainer.get("log_every_n_steps")
    if every is not None and every != 1:
        problems.append(f"trainer.log_every_n_steps={every}: alfrl logs every update's row (an update takes seconds, not "
                        "milliseconds; a checkpoint's or an evaluation's figures are in their update's row only): leave it at 1")
    for key, value in (("checkpoint.save_every", cfg.checkpoint.save_every), ("periodic_eval.every_n_steps", cfg.periodic_eval.every_n_steps),
                       ("weight_sync.canary_at_step", cfg.weight_sync.canary_at_step)):
        if value < 0:
            problems.append(f"{key}={value} must be >= 0 (0 turns it off)")
    problems += _checkpoint_problems(cfg)
    problems += _logger_problems(cfg.trainer.get("logger"))
    limit = cfg.periodic_eval.limit_per_split
    if limit is not None and limit < 1:
        problems.append(f"periodic_eval.limit_per_split={limit} must be >= 1 (or null for every game)")
    try:
        data = data_dict(cfg.data)
    except TypeError as e:
        return problems + [f"data: {e}"]
    problems += RolloutDataModule.problems(data)
    rollout_cfg: RolloutConfig = data["rollout"]
    trajectories = data.get("games_per_batch", 8) * data.get("group_size", 8)
    minibatches = _setting(model, "ppo", "minibatches", 1)
    if rollout_cfg.context == "full" and minibatches > trajectories > 0:  # a count below 1 is reported as itself
        problems.append(f"model.ppo.minibatches={minibatches} exceeds the {trajectories} trajectories of a step "
                        "(data.games_per_batch x data.group_size): every minibatch needs at least one")
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
        found, context = _model_problems(model)
        problems += found
        if context is not None and budget > context:
            problems.append(
                f"data.rollout.max_trajectory_tokens / data.eval.max_trajectory_tokens ({budget}) exceed the model's context "
                f"of {context} tokens: lower them to at most {context}"
            )
    train_split = data.get("train_split", "train")
    if train_split not in SPLITS:
        problems.append(f"data.train_split={train_split!r} is not a split: choose one of {', '.join(SPLITS)}")
    elif check_data:
        for key, splits in (("data.data_dir", [train_split] + [s for s in evalc.splits if s in SPLITS]),):
            try:
                discover_games(data.get("data_dir"), sorted(set(splits)))
            except DataError as e:
                problems.append(f"{key}: {e}")
    return problems


class AlfrlCLI(LightningCLI):
    """``alfrl fit``: LightningCLI over AlfrlPolicy and RolloutDataModule with alfrl's callbacks."""

    check_data = True
    prog = "alfrl fit"
    model_class = AlfrlPolicy
    data_class = RolloutDataModule
    trainer_defaults = TRAINER_DEFAULTS

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("parser_kwargs", {})
        kwargs["parser_kwargs"].setdefault("parser_mode", "omegaconf+")
        kwargs.setdefault("trainer_defaults", dict(self.trainer_defaults))
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(self.model_class, self.data_class, *args, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """Only ``fit``: alfrl evaluates with ``alfrl eval``, not Lightning's validate/test/predict (each subcommand's
        parser costs about a second to build, most of it reading the classes' attribute docstrings)."""
        return {"fit": LightningCLI.subcommands()["fit"]}

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs) -> None:
        super()._add_subcommands(parser, **kwargs)
        for sub in self._subcommand_parsers.values():  # "usage: alfrl sft ...", not jsonargparse's "alfrl [options] fit"
            sub.prog = self.prog

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
            self._claim_run_folder(cfg)

    def _claim_run_folder(self, cfg) -> None:
        """A fit (rank 0) takes its run folder: alone, and not over another run's checkpoints (alfrl.checkpoints)."""
        import os

        if self.subcommand != "fit" or int(os.environ.get("LOCAL_RANK", "0")) or int(os.environ.get("NODE_RANK", "0")):
            return
        from alfrl.checkpoints import claim_run_folder

        root = Path(cfg.trainer.get("default_root_dir") or ".")
        checkpoints = Path(cfg.checkpoint.dirpath) if cfg.checkpoint.get("dirpath") else root / "checkpoints"
        problems = claim_run_folder(root, checkpoints, cfg.get("ckpt_path"))
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
        from alfrl.checkpoints import resolve_ckpt_path

        try:
            self.config.fit.ckpt_path = resolve_ckpt_path(self.config.fit.ckpt_path)
        except (FileNotFoundError, ValueError) as e:  # missing, pruned or damaged
            raise RecipeError([f"--ckpt_path: {e}"]) from None
        import json

        adapter_config = Path(self.config.fit.ckpt_path).parent / "adapter" / "adapter_config.json"
        if adapter_config.is_file():
            saved = json.loads(adapter_config.read_text())
            model = self.config.fit.model
            for key, mine in (("r", "rank"), ("lora_alpha", "alpha")):
                value = _setting(model.as_dict(), "lora", mine, None)
                if saved.get(key) != value:
                    raise RecipeError([f"--ckpt_path {self.config.fit.ckpt_path}: the checkpoint's adapter has {key}={saved.get(key)} but "
                                       f"model.lora.{mine}={value}: resume with the recipe the run was started with"])


class _Parsed(Exception):
    def __init__(self, config: Namespace):
        self.config = config




def _with_argv(args: list[str], make):
    """LightningCLI warns when both sys.argv and args are given; show it only ``args``."""
    saved = sys.argv
    sys.argv = [saved[0], *args]
    try:
        return make()
    finally:
        sys.argv = saved


def parse_recipe(args: list[str], cli: type[AlfrlCLI] | None = None) -> Namespace:
    """The resolved configuration of a recipe plus overrides, without checks or instantiation
    (``cli``: ``AlfrlCLI`` for RL recipes, ``SFTCLI`` for warm-start ones)."""

    class ParseOnly(cli or AlfrlCLI):
        def before_instantiate_classes(self) -> None:
            raise _Parsed(self.config)

    try:
        run_cli(lambda: ParseOnly(run=False), list(args))
    except _Parsed as parsed:
        return parsed.config
    raise AssertionError("unreachable")


def load_recipe(args: list[str]) -> AlfrlCLI:
    """Parse and validate a recipe plus overrides, and build the model (not yet loaded) and DataModule."""
    return run_cli(lambda: AlfrlCLI(run=False), list(args) + ["--trainer.logger=false"])


def main_fit(args: list[str], cli: type[AlfrlCLI] = AlfrlCLI, name: str = "fit") -> int:
    """``alfrl fit`` (or ``alfrl sft``): 0 when training ended, 2 with one message for a recipe or data problem, 1 when an
    engine or a weight sync stopped it (its message last)."""
    try:
        done = run_cli(cli, ["fit", *args])
    except (RecipeError, DataError) as e:
        print(e if isinstance(e, RecipeError) else f"alfrl {name}: {e}", file=sys.stderr)
        return EXIT_RECIPE
    except Exception as e:
        code = report_stop(e, name)
        if code is None:
            raise
        return code
    if done.trainer.is_global_zero:
        print(finished_message(done.trainer, _recipe_arg(args), name))
    return 0


def _recipe_arg(args: list[str]) -> str:
    for i, a in enumerate(args):
        if a in ("-c", "--config") and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return "RECIPE"


def finished_message(trainer, recipe: str, name: str = "fit") -> str:
    """Where a finished run's outputs are, and the command that uses its newest checkpoint."""
    root = Path(trainer.default_root_dir)
    saver = next((c for c in trainer.callbacks if isinstance(c, Checkpointing)), None)
    folder = saver.folder(trainer) if saver else root / "checkpoints"
    last = folder / "last"
    metrics = f"metrics: {root}/csv, " if (root / "csv").is_dir() else ""
    lines = [f"alfrl {name}: finished at update {trainer.global_step}; the run is in {root} ({metrics}"
             f"checkpoints: {folder}" + (f", newest {last.read_text().strip()})" if last.is_file() else ")")]
    if last.is_file():
        if name == "sft":
            lines.append(f"  RL from it: alfrl fit --config RECIPE --model.init_adapter {last}")
        else:
            lines.append(f"  evaluate it: alfrl eval --config {recipe} --adapter {last} --out {root}/eval.jsonl")
            lines.append(f"  go on with it: alfrl fit --config {recipe} --ckpt_path {last} --trainer.max_steps N")
    return "\n".join(lines)


def sft_problems(cfg: Namespace, check_model: bool = True) -> list[str]:
    """Every problem of a resolved warm-start recipe (model, expert data, callbacks)."""
    model = cfg.model.as_dict()
    problems = AlfrlPolicy.problems(model)
    max_steps = cfg.trainer.get("max_steps")
    if max_steps is not None and max_steps < 1:
        problems.append(f"trainer.max_steps={max_steps}: the number of optimizer steps must be >= 1")
    if cfg.checkpoint.save_every < 0:
        problems.append(f"checkpoint.save_every={cfg.checkpoint.save_every} must be >= 0 (0 turns it off)")
    problems += _checkpoint_problems(cfg)
    problems += ExpertDataModule.problems(cfg.data.as_dict())
    if check_model and model.get("model_name"):
        problems += _model_problems(model)[0]
    return problems


class SFTCLI(AlfrlCLI):
    """``alfrl sft``: the supervised warm start on expert trajectories (same model, logging, checkpoints)."""

    trainer_defaults = {**TRAINER_DEFAULTS, "limit_val_batches": None, "num_sanity_val_steps": 0}
    prog = "alfrl sft"
    model_class = SFTPolicy
    data_class = ExpertDataModule

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(Checkpointing, "checkpoint")
        parser.add_lightning_class_args(RolloutProgressBar, "progress_bar")

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        problems = sft_problems(cfg)
        if problems:
            raise RecipeError(problems)
        self._claim_run_folder(cfg)

    def after_instantiate_classes(self) -> None:
        """The expert file against the model's tokenizer, before the model loads (one line and exit 2 if they differ)."""
        from alfrl.expert import tokenizer_problem

        problem = tokenizer_problem(self.datamodule.expert_file, self.model.load_tokenizer(), self.model.hparams.model_name)
        if problem:
            raise DataError(problem)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_fit(sys.argv[1:]))
