"""The checkpoint callback's pruning of old training states and its one-line error on a full disk."""

import errno
from pathlib import Path
from types import SimpleNamespace

import pytest

from alfrl.checkpoints import CheckpointSpaceError, resolve_ckpt_path
from callbacks.checkpointing import Checkpointing
from tests.helpers import EMPTY_SAFETENSORS


def _zip(path: Path, which: str) -> None:
    """A whole zip archive at ``path`` (what torch.save writes) holding ``which``."""
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("which", which)


def _which(path: Path) -> str:
    import zipfile

    with zipfile.ZipFile(path) as archive:
        return archive.read("which").decode()


def _steps(root: Path, n: int) -> list[Path]:
    folders = []
    for step in range(1, n + 1):
        d = root / f"step-{step:06d}"
        (d / "adapter").mkdir(parents=True)
        (d / "adapter" / "adapter_model.safetensors").write_bytes(EMPTY_SAFETENSORS)
        _zip(d / "trainer.ckpt", "t")
        folders.append(d)
    return folders


def test_only_the_newest_checkpoints_keep_their_training_state(tmp_path):
    folders = _steps(tmp_path, 5)
    deleted = Checkpointing(keep_resume_states=2).prune(tmp_path, keep=folders[-1])
    assert sorted(deleted) == [f / "trainer.ckpt" for f in folders[:3]]
    assert [(f / "trainer.ckpt").is_file() for f in folders] == [False, False, False, True, True]
    assert all((f / "adapter" / "adapter_model.safetensors").is_file() for f in folders)  # every adapter stays


def test_zero_keeps_every_training_state(tmp_path):
    folders = _steps(tmp_path, 3)
    assert Checkpointing(keep_resume_states=0).prune(tmp_path, keep=folders[-1]) == []
    assert all((f / "trainer.ckpt").is_file() for f in folders)


def test_the_checkpoint_just_written_is_kept_even_when_older_numbers_are_newer(tmp_path):
    # a run resumed from step 2 into a folder that still holds steps 3-5 of an abandoned branch
    folders = _steps(tmp_path, 5)
    Checkpointing(keep_resume_states=1).prune(tmp_path, keep=folders[1])
    assert (folders[1] / "trainer.ckpt").is_file() and (folders[4] / "trainer.ckpt").is_file()
    assert not (folders[0] / "trainer.ckpt").is_file()


def test_a_negative_count_is_refused():
    with pytest.raises(ValueError, match="checkpoint.keep_resume_states=-1 must be >= 0"):
        Checkpointing(keep_resume_states=-1)


def test_resuming_from_a_pruned_checkpoint_says_what_to_do(tmp_path):
    folders = _steps(tmp_path, 3)
    Checkpointing(keep_resume_states=1).prune(tmp_path, keep=folders[-1])
    with pytest.raises(FileNotFoundError, match="keeps only its adapter .* --model.init_adapter"):
        resolve_ckpt_path(str(folders[0]))
    assert resolve_ckpt_path(str(folders[2])) == str(folders[2] / "trainer.ckpt")


class _FullDiskTrainer:
    """What Checkpointing.save touches of a Trainer; writing trainer.ckpt fails as on a full disk."""

    def __init__(self, root: Path, step: int):
        self.global_step, self.default_root_dir, self.is_global_zero = step, str(root), True
        self.strategy = SimpleNamespace(barrier=lambda name: None)

    def save_checkpoint(self, path, weights_only=None):
        Path(path).write_bytes(b"half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_is_one_clear_line_and_leaves_the_last_checkpoint_as_it_was(tmp_path):
    root = tmp_path / "checkpoints"
    _steps(root, 1)
    (root / "last").write_text("step-000001")
    cb = Checkpointing(save_every=1, keep_resume_states=2)
    with pytest.raises(CheckpointSpaceError) as e:
        cb.save(_FullDiskTrainer(tmp_path, step=2), policy=None)
    message = str(e.value)
    assert "\n" not in message
    for part in ("checkpoint of step 2", "no space left", "step-000001", "checkpoint.keep_resume_states", "checkpoint.save_every"):
        assert part in message, part
    assert sorted(p.name for p in root.iterdir()) == ["last", "step-000001"]  # no partial folder left
    assert (root / "last").read_text() == "step-000001" and (root / "step-000001" / "trainer.ckpt").is_file()


def test_other_os_errors_pass_through(tmp_path):
    class Denied(_FullDiskTrainer):
        def save_checkpoint(self, path, weights_only=None):
            raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(PermissionError):
        Checkpointing().save(Denied(tmp_path, step=1), policy=None)


def _fit_cli(root: Path, tiny_model_dir: str, *extra: str):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "alfrl.cli", "fit", "--config", "recipes/tiny.yaml", "--trainer.default_root_dir", str(root),
           "--model.model_name", tiny_model_dir, "--trainer.logger", "false", *extra]
    return subprocess.run(cmd, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600)


def test_a_fit_into_a_folder_holding_another_runs_checkpoints_stops_with_one_line(tmp_path, tiny_model_dir):
    """A second fit into a run folder with checkpoints (here: step-000002, `last`) would overwrite some of them and move
    `last`: it stops before any model loads and names the three ways on."""
    step = tmp_path / "run" / "checkpoints" / "step-000002"
    (step / "adapter").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last").write_text("step-000002")
    out = _fit_cli(tmp_path / "run", tiny_model_dir)
    assert out.returncode == 2, out.stderr[-2000:]
    assert (f"{tmp_path / 'run' / 'checkpoints'} holds another run's checkpoints (newest step-000002): resume that run with "
            f"--ckpt_path {tmp_path / 'run' / 'checkpoints' / 'last'}, give this one its own --trainer.default_root_dir") in out.stderr
    assert "Traceback" not in out.stderr and "Loading weights" not in out.stderr
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["last", "step-000002"]  # nothing written


def test_a_run_folder_is_taken_by_one_fit_at_a_time_and_a_killed_holder_leaves_no_lock(tmp_path, tiny_model_dir):
    """Two processes: while one holds the run folder (as a running fit does), a fit into it stops with one line naming the
    holder; once the holder is killed (-9, no cleanup), the folder can be taken again."""
    import signal
    import subprocess
    import sys

    root = tmp_path / "run"
    hold = ("import sys, time; from pathlib import Path; from alfrl.checkpoints import claim_run_folder; "
            "root = Path(sys.argv[1]); assert claim_run_folder(root, root / 'checkpoints', None) == []; "
            "print('held', flush=True); time.sleep(300)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(root)], cwd=Path(__file__).parents[1], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        out = _fit_cli(root, tiny_model_dir)
        assert out.returncode == 2, out.stderr[-2000:]
        assert f"{root} is in use by another alfrl run (pid {holder.pid}): wait for it to end" in out.stderr
        assert "Traceback" not in out.stderr and "Loading weights" not in out.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    again = subprocess.run([sys.executable, "-c", hold.replace("time.sleep(300)", "pass"), str(root)], cwd=Path(__file__).parents[1],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout.strip() == "held", again.stderr[-2000:]


class _Trainer(_FullDiskTrainer):
    """A trainer whose checkpoint is written whole (its bytes name the save)."""

    def __init__(self, root: Path, step: int, which: str):
        super().__init__(root, step)
        self.which = which

    def save_checkpoint(self, path, weights_only=None):
        _zip(Path(path), self.which)


_SAVE_KILLED_IN_THE_SWAP = """
import os, sys, time
from types import SimpleNamespace
from pathlib import Path
sys.path.insert(0, {repo!r})
from tests.test_checkpointing import _Trainer
import callbacks.checkpointing as ckpt

real = os.replace
def replace(src, dst):  # the swap's first rename done, the process stops here to be killed
    real(src, dst)
    if str(dst).endswith(".old"):
        Path({flag!r}).write_text("in the window")
        time.sleep(60)
ckpt.os.replace = replace
from tests.test_checkpointing import _write_adapter
ckpt.save_adapter = _write_adapter
ckpt.Checkpointing(keep_resume_states=2).save(_Trainer(Path({root!r}), 3, "new"), policy=SimpleNamespace(model=None))
"""


def _write_adapter(model, folder: Path) -> None:
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(EMPTY_SAFETENSORS)


def test_a_step_saved_again_and_killed_between_its_renames_leaves_last_loadable(tmp_path, monkeypatch):
    # a run resumed from step 2 saves step 3 again while `last` names the old step 3; kill -9 between the swap's renames
    import subprocess
    import sys
    import time

    root = tmp_path / "checkpoints"
    _steps(root, 3)
    (root / "last").write_text("step-000003")
    _zip(root / "step-000003" / "trainer.ckpt", "old")
    flag = tmp_path / "flag"
    script = _SAVE_KILLED_IN_THE_SWAP.format(repo=str(Path(__file__).parents[1]), flag=str(flag), root=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not flag.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert flag.exists(), "the save never reached its swap"
    child.kill()
    child.wait()
    assert not (root / "step-000003").exists() and (root / ".step-000003.old").is_dir()  # killed inside the window
    assert _which(Path(resolve_ckpt_path(str(root / "last")))) == "old"  # the old step 3 is back, whole
    assert (root / "step-000003" / "adapter" / "adapter_model.safetensors").is_file()
    # the next save of that step swaps cleanly: the new one in place, nothing aside or partial left
    monkeypatch.setattr("callbacks.checkpointing.save_adapter", _write_adapter)
    Checkpointing(keep_resume_states=2).save(_Trainer(tmp_path, 3, "new"), policy=SimpleNamespace(model=None))
    assert _which(root / "step-000003" / "trainer.ckpt") == "new"
    assert sorted(p.name for p in root.iterdir()) == ["last", "step-000001", "step-000002", "step-000003"]


def _saved_steps(root: Path, n: int) -> list[Path]:
    """``n`` step folders as the callback writes them: a real ``trainer.ckpt`` (torch's zip), a real safetensors adapter,
    ``checksums.json``; ``last`` names the newest."""
    import torch
    from safetensors.torch import save_file

    from alfrl.checkpoints import write_checksums

    folders = []
    for step in range(1, n + 1):
        d = root / f"step-{step:06d}"
        (d / "adapter").mkdir(parents=True)
        torch.save({"state_dict": {"w": torch.full((64,), float(step))}}, d / "trainer.ckpt")
        save_file({"lora_A": torch.full((8, 8), float(step))}, str(d / "adapter" / "adapter_model.safetensors"))
        (d / "adapter" / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
        write_checksums(d)
        folders.append(d)
    (root / "last").write_text(folders[-1].name)
    return folders


def _cut(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 if keep is None else keep])


@pytest.mark.parametrize("how,why", [("truncated", "bytes where checksums.json says"), ("empty", "bytes where checksums.json says"),
                                     ("altered", "sha256 differs"), ("truncated, no checksums", "not a whole zip archive"),
                                     ("empty, no checksums", "it is empty")])
def test_a_damaged_trainer_ckpt_is_one_line_naming_the_newest_intact_checkpoint(tmp_path, how, why):
    from alfrl.checkpoints import CheckpointDamagedError

    folders = _saved_steps(tmp_path, 3)
    ckpt = folders[2] / "trainer.ckpt"
    if "no checksums" in how:
        (folders[2] / "checksums.json").unlink()
    if how.startswith("truncated"):
        _cut(ckpt)
    elif how.startswith("empty"):
        _cut(ckpt, 0)
    else:  # one byte changed, the size kept
        data = bytearray(ckpt.read_bytes())
        data[len(data) // 2] ^= 0xFF
        ckpt.write_bytes(bytes(data))
    with pytest.raises(CheckpointDamagedError) as e:
        resolve_ckpt_path(str(tmp_path / "last"))
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{ckpt} is damaged: ") and why in message
    assert message.endswith(f"use the newest intact checkpoint: --ckpt_path {folders[1]}")
    assert resolve_ckpt_path(str(folders[1])) == str(folders[1] / "trainer.ckpt")  # the intact ones still load


def test_a_damaged_adapter_is_caught_where_it_is_read_and_on_resume(tmp_path):
    from alfrl.checkpoints import CheckpointDamagedError, adapter_source, check_adapter

    folders = _saved_steps(tmp_path, 2)
    assert adapter_source(str(tmp_path / "last")) == folders[1] / "adapter"
    weights = folders[1] / "adapter" / "adapter_model.safetensors"
    _cut(weights)
    for read in (lambda: adapter_source(str(tmp_path / "last")), lambda: resolve_ckpt_path(str(tmp_path / "last"))):
        with pytest.raises(CheckpointDamagedError, match=f"^{weights} is damaged: .* use the newest intact checkpoint: .*{folders[0].name}$"):
            read()
    (folders[1] / "checksums.json").unlink()  # no checksum: its header says how long it must be
    with pytest.raises(CheckpointDamagedError, match="bytes where its header describes"):
        adapter_source(str(folders[1]))
    with pytest.raises(ValueError, match=r"has r=8 but model.lora.rank=32"):
        check_adapter(str(folders[0]), 32, 64)
    assert check_adapter(str(folders[0]), 8, 16) == folders[0] / "adapter"
    for step in folders:  # nothing intact is left
        _cut(step / "adapter" / "adapter_model.safetensors", 4)
    with pytest.raises(CheckpointDamagedError, match=f"no intact checkpoint is left in {tmp_path}$"):
        adapter_source(str(folders[0]))


def test_resuming_from_a_damaged_checkpoint_stops_before_the_model_loads_and_makes_no_log_folder(tmp_path, tiny_model_dir):
    root = tmp_path / "run"
    folders = _saved_steps(root / "checkpoints", 2)
    _cut(folders[1] / "trainer.ckpt")
    out = _fit_cli(root, tiny_model_dir, "--ckpt_path", str(root / "checkpoints" / "last"), "--trainer.logger", "true")
    assert out.returncode == 2, out.stderr[-2000:]
    line = [x for x in out.stderr.splitlines() if "is damaged" in x]
    assert len(line) == 1 and line[0].endswith(f"use the newest intact checkpoint: --ckpt_path {folders[0]}"), out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "Loading weights" not in out.stderr
    assert sorted(p.name for p in root.iterdir()) == ["checkpoints"]  # no csv/, swanlog/ or lock left behind


def test_a_sigterm_saves_the_update_in_flight_and_the_run_goes_on_from_it_as_if_never_stopped(tmp_path, tiny_model_dir):
    """`kill` (a scheduler's preemption, `bench/lease.sh stop`) once update 1 has written its rollouts, in a fit that saves
    only at its end: the update in flight (1, or 2 if 1 had ended) ends, is saved, and the process exits 0 naming the
    checkpoint; resumed from it, the next update plays the same trajectories and gives the same adapter to the bit as a fit
    never stopped."""
    import signal
    import subprocess
    import sys
    import time

    short = ("--data.rollout.max_episode_steps", "2", "--data.games_per_batch", "1", "--data.save_rollouts", "true",
             "--checkpoint.save_every", "0")
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    cmd = [sys.executable, "-m", "alfrl.cli", "fit", "--config", "recipes/tiny.yaml", "--trainer.default_root_dir", str(stopped),
           "--model.model_name", tiny_model_dir, "--trainer.logger", "false", "--trainer.max_steps", "6", *short]
    fit = subprocess.Popen(cmd, cwd=Path(__file__).parents[1], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (stopped / "rollouts" / "step-000001-rank0.jsonl").is_file() and fit.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        fit.send_signal(signal.SIGTERM)  # update 1 has written its rollouts: it may still be ending, or update 2 has begun
        out, err = fit.communicate(timeout=300)
    finally:
        fit.kill()
    assert fit.returncode == 0, err[-2000:]
    steps = sorted(p.name for p in (stopped / "checkpoints").glob("step-*"))
    assert len(steps) == 1 and steps[0] in ("step-000001", "step-000002"), steps   # the update in flight, not update 6
    n = int(steps[0][-6:])
    assert (stopped / "checkpoints" / "last").read_text() == steps[0]
    assert f"stopped by SIGTERM after update {n}: saved {stopped / 'checkpoints' / steps[0]}; go on with --ckpt_path" in out
    resumed = _fit_cli(stopped, tiny_model_dir, "--trainer.max_steps", str(n + 1), "--ckpt_path", str(stopped / "checkpoints" / "last"), *short)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    never = _fit_cli(whole, tiny_model_dir, "--trainer.max_steps", str(n + 1), *short)
    assert never.returncode == 0, never.stderr[-2000:]
    name = f"step-{n + 1:06d}-rank0.jsonl"
    assert (stopped / "rollouts" / name).read_bytes() == (whole / "rollouts" / name).read_bytes()
    adapter = f"checkpoints/step-{n + 1:06d}/adapter/adapter_model.safetensors"
    assert (stopped / adapter).read_bytes() == (whole / adapter).read_bytes()
