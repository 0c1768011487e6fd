"""The checkpoint callback's pruning of old training states and its one-line error on a full disk."""

import errno
from pathlib import Path
from types import SimpleNamespace

import pytest

from alfrl.checkpoints import CheckpointSpaceError, resolve_ckpt_path
from callbacks.checkpointing import Checkpointing


def _steps(root: Path, n: int) -> list[Path]:
    folders = []
    for step in range(1, n + 1):
        d = root / f"step-{step:06d}"
        (d / "adapter").mkdir(parents=True)
        (d / "adapter" / "adapter_model.safetensors").write_bytes(b"a")
        (d / "trainer.ckpt").write_bytes(b"t")
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
