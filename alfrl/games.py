"""ALFWorld games on disk: where the data lives, which games count, and how to prepare them.

The data folder holds ``json_2.1.1/<split>/<task>-<Obj>-<MRecep>-<Recep>-<scene>/<trial>/game.tw-pddl``
(what ``alfworld-download`` writes under ``$ALFWORLD_DATA``). A game is kept with the reference
filters: a ``game.tw-pddl`` whose JSON says ``"solvable": true``, one of the six task types (the
task folder's name before the first ``-``), and no ``movable`` / ``Sliced`` trial. Game ids are
``split:task_folder/trial`` and every listing is sorted by id, so game order never depends on the
file system.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

DATA_SUBDIR = "json_2.1.1"
SPLITS = ("train", "valid_seen", "valid_unseen", "valid_train")
EVAL_SPLITS = ("valid_seen", "valid_unseen")
TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
GAME_FILE = "game.tw-pddl"


class DataError(RuntimeError):
    """The ALFWorld data is missing or unusable; the message says how to fix it."""


@dataclass(frozen=True)
class Game:
    """One ALFWorld game file that passes the reference filters."""

    id: str
    """``split:task_folder/trial``, unique and stable across machines."""
    split: str
    """One of ``SPLITS``."""
    task_type: str
    """One of ``TASK_TYPES``, from the task folder's name."""
    path: str
    """Absolute path of the ``game.tw-pddl`` file."""

    def walkthrough(self) -> list[str]:
        """The expert action list stored in the game file."""
        with open(self.path) as f:
            return list(json.load(f)["walkthrough"])


def default_data_dir() -> Path:
    """``$ALFWORLD_DATA`` if set, else ``~/.cache/alfworld`` (what ``alfworld-download`` uses)."""
    env = os.environ.get("ALFWORLD_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "alfworld"


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path:
    return Path(data_dir).expanduser() if data_dir else default_data_dir()


def _how_to_prepare(data_dir: Path) -> str:
    return (
        f"prepare it with `alfrl data prepare --data-dir {data_dir} --archive PATH/json_2.1.1.tar.xz` "
        f"or `alfrl data prepare --data-dir {data_dir} --download`, or point --data-dir / $ALFWORLD_DATA "
        f"at a folder that holds {DATA_SUBDIR}/"
    )


def task_type_of(task_folder: str) -> str | None:
    """The task type of a task folder name, or None when it is not one of the six."""
    head = task_folder.split("-", 1)[0]
    return head if head in TASK_TYPES else None


def _keep(task_folder: str, trial: str, game_file: Path) -> bool:
    """Whether the game passes the reference filters; raises OSError / ValueError when its file cannot be read."""
    if task_type_of(task_folder) is None:
        return False
    if "movable" in task_folder or "Sliced" in task_folder or "movable" in trial or "Sliced" in trial:
        return False
    with open(game_file) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data.get("solvable", False) is True


@dataclass(frozen=True)
class GameScan:
    """What discovery found: the kept games and the game files it could not read."""

    games: list[Game]
    unreadable: list[tuple[str, str]]
    """(path, why) of every game file that is not valid JSON (truncated, corrupt): never silently dropped."""

    def warning(self) -> str | None:
        if not self.unreadable:
            return None
        shown = "; ".join(f"{path} ({why})" for path, why in self.unreadable[:5])
        more = f" and {len(self.unreadable) - 5} more" if len(self.unreadable) > 5 else ""
        return (f"{len(self.unreadable)} game file(s) could not be read and are left out: {shown}{more}. "
                "Unpack the games again (`alfrl data prepare`) to restore them.")


def fingerprint(games: list[Game]) -> str:
    """A digest of the game ids, in order: two runs with the same fingerprint play the same games."""
    return hashlib.sha256("\n".join(g.id for g in games).encode()).hexdigest()[:16]


def discover_games(data_dir: str | os.PathLike | None, splits: tuple[str, ...] | list[str]) -> list[Game]:
    """All kept games of ``splits``, sorted by id. Raises DataError when a split has none."""
    return scan_games(data_dir, splits).games


def scan_games(data_dir: str | os.PathLike | None, splits: tuple[str, ...] | list[str]) -> GameScan:
    """``discover_games`` and the files it could not read."""
    root = resolve_data_dir(data_dir)
    base = root / DATA_SUBDIR
    games: list[Game] = []
    unreadable: list[tuple[str, str]] = []
    for split in splits:
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}: choose from {', '.join(SPLITS)}")
        split_dir = base / split
        if not split_dir.is_dir():
            raise DataError(f"no ALFWorld split folder {split_dir}: {_how_to_prepare(root)}")
        found = []
        for game_file in split_dir.glob(f"*/*/{GAME_FILE}"):
            trial_dir = game_file.parent
            task_folder, trial = trial_dir.parent.name, trial_dir.name
            try:
                keep = _keep(task_folder, trial, game_file)
            except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
                unreadable.append((str(game_file), f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"))
                continue
            if keep:
                found.append(
                    Game(
                        id=f"{split}:{task_folder}/{trial}",
                        split=split,
                        task_type=task_type_of(task_folder),  # type: ignore[arg-type]
                        path=str(game_file.resolve()),
                    )
                )
        if not found:
            raise DataError(f"no ALFWorld games in {split_dir}: {_how_to_prepare(root)}")
        games.extend(sorted(found, key=lambda g: g.id))
    return GameScan(games, sorted(unreadable))


def find_game(data_dir: str | os.PathLike | None, game: str) -> Game:
    """A game by id (``split:task/trial``), by a path to its folder or file, or by a unique id suffix."""
    path = Path(game)
    if path.exists():
        game_file = path if path.is_file() else path / GAME_FILE
        trial_dir = game_file.parent
        split = trial_dir.parent.parent.name
        task_folder = trial_dir.parent.name
        return Game(
            id=f"{split}:{task_folder}/{trial_dir.name}",
            split=split,
            task_type=task_type_of(task_folder) or "unknown",
            path=str(game_file.resolve()),
        )
    split = game.split(":", 1)[0] if ":" in game else None
    pool = discover_games(data_dir, [split] if split in SPLITS else list(SPLITS))
    exact = [g for g in pool if g.id == game]
    if exact:
        return exact[0]
    matches = [g for g in pool if g.id.endswith(game) or game in g.id]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise DataError(f"no game matches {game!r}: give an id such as {pool[0].id!r} (see `alfrl data summary`)")
    raise DataError(f"{len(matches)} games match {game!r} (e.g. {matches[0].id!r}, {matches[1].id!r}): give more of the id")


def shuffled(games: list[Game], seed: int) -> list[Game]:
    """A seeded shuffle of ``games`` that does not touch the global random state."""
    out = list(games)
    random.Random(seed).shuffle(out)
    return out


def summarize(games: list[Game]) -> dict:
    """Counts per split and per (split, task type)."""
    per_split = Counter(g.split for g in games)
    per_task: dict[str, dict[str, int]] = {}
    for g in games:
        per_task.setdefault(g.split, Counter())[g.task_type] += 1  # type: ignore[index]
    return {
        "total": len(games),
        "splits": dict(sorted(per_split.items())),
        "task_types": {s: dict(sorted(c.items())) for s, c in sorted(per_task.items())},
    }


def available_splits(data_dir: str | os.PathLike | None) -> list[str]:
    base = resolve_data_dir(data_dir) / DATA_SUBDIR
    return [s for s in SPLITS if (base / s).is_dir()]


def prepare_from_archive(data_dir: str | os.PathLike | None, archive: str | os.PathLike) -> Path:
    """Unpack a ``json_2.1.1`` tar archive (.tar.xz / .tar.gz / .tar) into ``data_dir``.

    Unpacks into a temporary folder beside the target and renames it into place, so an
    interrupted unpack never leaves a half-filled ``json_2.1.1``. An existing complete folder is kept.
    """
    root = resolve_data_dir(data_dir)
    archive = Path(archive).expanduser()
    if not archive.is_file():
        raise DataError(f"archive {archive} not found: pass the path of json_2.1.1.tar.xz with --archive")
    target = root / DATA_SUBDIR
    if target.is_dir() and any(target.iterdir()):
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{DATA_SUBDIR}.unpacking-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        inner = tmp / DATA_SUBDIR
        if not inner.is_dir():
            raise DataError(f"archive {archive} has no top-level {DATA_SUBDIR}/ folder: is it the ALFWorld game archive?")
        os.replace(inner, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def prepare_by_download(data_dir: str | os.PathLike | None) -> Path:
    """Run ``alfworld-download`` into ``data_dir`` (needs internet)."""
    root = resolve_data_dir(data_dir)
    root.mkdir(parents=True, exist_ok=True)
    # the console script installed beside this interpreter (a venv that is not activated: `make data` after `make setup`)
    exe = shutil.which("alfworld-download", path=str(Path(sys.executable).parent)) or shutil.which("alfworld-download")
    if exe is None:
        raise DataError(f"alfworld-download is neither beside {sys.executable} nor on PATH: install the project (`make setup`) "
                        "or `pip install alfworld==0.4.2`")
    env = dict(os.environ, ALFWORLD_DATA=str(root))
    result = subprocess.run([exe, "--data-dir", str(root)], env=env)
    if result.returncode != 0:
        raise DataError(f"alfworld-download failed (exit {result.returncode}); with no internet use --archive instead")
    return root / DATA_SUBDIR
