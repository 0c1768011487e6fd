"""Checkpoint folders on disk: finding them, reading their adapters, writing merged models.

A checkpoint is a folder ``<dirpath>/step-000020/`` holding ``adapter/`` (the LoRA adapter in peft
format), ``trainer.ckpt`` (Lightning's checkpoint: LoRA weights, optimizer, step, RNG states, the
game cursor) and, with ``checkpoint.save_merged``, ``merged/`` (base + LoRA as a Hugging Face
folder). ``<dirpath>/last`` names the newest one. The ``Checkpointing`` callback writes them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

CKPT_FILE = "trainer.ckpt"
CHECKSUMS = "checksums.json"  # each checkpoint's files: size and sha256, written with it
ADAPTER_FILE = "adapter/adapter_model.safetensors"


class CheckpointSpaceError(OSError):
    """The checkpoint folder's disk is full (the message says what to change)."""


_RUN_LOCK = None  # the open lock file of the run folder this process trains into (held until it exits)


def claim_run_folder(root: Path, checkpoints: Path, ckpt_path: str | None) -> list[str]:
    """One fit per run folder, and one run's checkpoints per folder: the problems (one line each) that stop this fit.

    ``root/.alfrl.lock`` is locked for as long as this process lives (``flock``: the kernel releases it when the process
    ends, a crash or ``kill -9`` included, so no stale lock is left). ``checkpoints`` holding another run's checkpoints
    is only written into by a fit that resumes from one of them (``--ckpt_path`` inside it)."""
    import fcntl

    global _RUN_LOCK
    if _RUN_LOCK is not None:
        return []
    if checkpoints.is_dir():
        found = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step-") or p.name == "last")
        resuming = ckpt_path is not None and Path(ckpt_path).resolve().is_relative_to(checkpoints.resolve())
        if found and not resuming:
            newest = (checkpoints / "last").read_text().strip() if (checkpoints / "last").is_file() else found[-1]
            return [f"{checkpoints} holds another run's checkpoints (newest {newest}): resume that run with --ckpt_path "
                    f"{checkpoints / 'last'}, give this one its own --trainer.default_root_dir, or delete that folder to start over"]
    root.mkdir(parents=True, exist_ok=True)
    lock = open(root / ".alfrl.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        return [f"{root} is in use by another alfrl run ({holder}): wait for it to end, or give this one its own "
                "--trainer.default_root_dir"]
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()}")
    lock.flush()
    _RUN_LOCK = lock
    return []


class CheckpointDamagedError(ValueError):
    """A checkpoint file is truncated or altered (the message names it and the newest intact checkpoint)."""


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write_checksums(folder: Path) -> None:
    """``folder/checksums.json``: the size and sha256 of the checkpoint's ``trainer.ckpt`` and adapter weights."""
    files = {name: {"bytes": (folder / name).stat().st_size, "sha256": _sha256(folder / name)}
             for name in (CKPT_FILE, ADAPTER_FILE) if (folder / name).is_file()}
    (folder / CHECKSUMS).write_text(json.dumps(files, indent=1, sort_keys=True) + "\n")


def _shape_damage(path: Path) -> str | None:
    """What is wrong with a checkpoint file's own structure (no checksum needed): a ``.ckpt`` is a zip archive whose
    directory is at its end; a ``.safetensors`` file is a length, a JSON header and the tensors' bytes it describes."""
    size = path.stat().st_size
    if size == 0:
        return "it is empty"
    if path.suffix == ".ckpt":
        import zipfile

        try:
            with zipfile.ZipFile(path) as archive:
                archive.infolist()
        except (zipfile.BadZipFile, OSError, ValueError):
            return "it is not a whole zip archive (truncated?)"
        return None
    if path.suffix == ".safetensors":
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                return "its header is cut short (truncated?)"
            try:
                header = json.loads(f.read(n))
                end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
            except (ValueError, KeyError, TypeError, IndexError):
                return "its header is not valid"
        if 8 + n + end != size:
            return f"it holds {size} bytes where its header describes {8 + n + end} (truncated?)"
    return None


def damage(path: Path) -> str | None:
    """Why the checkpoint file ``path`` cannot be trusted, or None: its size or sha256 against the step folder's
    ``checksums.json`` (when the file is listed there), else its own structure (``_shape_damage``)."""
    for folder in (path.parent, path.parent.parent):
        listing = folder / CHECKSUMS
        if listing.is_file():
            try:
                entry = json.loads(listing.read_text()).get(path.relative_to(folder).as_posix())
            except (ValueError, AttributeError):
                return f"{listing} is not valid JSON"
            if entry:
                size = path.stat().st_size
                if size != entry.get("bytes"):
                    return f"it holds {size} bytes where {CHECKSUMS} says {entry.get('bytes')} (truncated?)"
                if _sha256(path) != entry.get("sha256"):
                    return f"its sha256 differs from the one in {CHECKSUMS} (altered on disk)"
                return None
    return _shape_damage(path)


def newest_intact(checkpoints: Path, files: tuple[str, ...] = (CKPT_FILE,)) -> Path | None:
    """The newest step folder of ``checkpoints`` whose ``files`` (``trainer.ckpt``, the adapter) are there and intact."""
    for step in sorted(checkpoints.glob("step-*"), reverse=True):
        if all((step / f).is_file() and damage(step / f) is None for f in files):
            return step
    return None


def _damaged(path: Path, why: str, files: tuple[str, ...], option: str) -> CheckpointDamagedError:
    """The one-line error for ``path`` (``why``: what ``damage`` found) and the newest checkpoint whose ``files`` are intact."""
    step = path.parent if path.name == CKPT_FILE else path.parent.parent
    intact = newest_intact(step.parent, files) if step.name.startswith("step-") else None
    fix = f"use the newest intact checkpoint: {option + ' ' if option else ''}{intact}" if intact else f"no intact checkpoint is left in {step.parent}"
    return CheckpointDamagedError(f"{path} is damaged: {why}: {fix}")


def save_adapter(model, folder: Path) -> None:
    """The peft ``model``'s adapter in ``folder``, its ``adapter_config.json`` byte-identical across runs: peft writes
    ``target_modules`` in the order of a Python set, which differs from process to process."""
    model.save_pretrained(folder)
    config_file = folder / "adapter_config.json"
    config = json.loads(config_file.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _follow_last(p: Path) -> Path:
    """A checkpoint folder's ``last`` file (the pointer to the newest step) -> that step's folder. A step folder that is
    missing while ``.step-N.old`` is there was being saved again when its run was killed between the swap's two renames
    (``callbacks/checkpointing.py``): the old copy, intact, goes back in place."""
    if p.name == "last" and p.is_file():
        p = p.parent / p.read_text().strip()
    aside = p.parent / f".{p.name}.old"
    if p.name.startswith("step-") and not p.exists() and aside.is_dir():
        os.replace(aside, p)
    return p


def resolve_ckpt_path(path: str) -> str:
    """A step folder, ``.../last`` or a ``trainer.ckpt`` file -> the ``trainer.ckpt`` file to load."""
    p = _follow_last(Path(path))
    if p.is_dir():
        p = p / CKPT_FILE
    if not p.is_file() and (p.parent / "adapter").is_dir():
        raise FileNotFoundError(f"{path} keeps only its adapter (checkpoint.keep_resume_states prunes the training state of "
                                "older checkpoints): resume from a newer one (.../checkpoints/last), or start a new run from "
                                f"this adapter with --model.init_adapter {p.parent}")
    if not p.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: pass a step folder such as runs/x/checkpoints/step-000020, "
                                "runs/x/checkpoints/last, or its trainer.ckpt")
    for file in (p, p.parent / ADAPTER_FILE):  # the step's adapter too: what `alfrl eval` reads of this step later
        why = damage(file) if file.is_file() else None
        if why:
            raise _damaged(file, why, (CKPT_FILE, ADAPTER_FILE), "--ckpt_path")
    return str(p)


def adapter_source(path: str) -> Path:
    """The file or folder ``load_adapter_into`` reads for ``path`` (a checkpoint folder, ``last``, its
    ``adapter/`` folder or its ``trainer.ckpt``), found without loading anything; FileNotFoundError if none,
    CheckpointDamagedError if its weights are truncated or altered."""
    p = _follow_last(Path(path))
    if p.is_dir() and (p / "adapter").is_dir():
        p = p / "adapter"
    is_ckpt = p.is_file() and p.suffix == ".ckpt"
    if not is_ckpt and not ((p / "adapter_config.json").is_file() and (p / "adapter_model.safetensors").is_file()):
        raise FileNotFoundError(f"no LoRA adapter at {path}: pass a checkpoint folder, its adapter/ folder or trainer.ckpt")
    weights = p if is_ckpt else p / "adapter_model.safetensors"
    why = damage(weights)
    if why:
        raise _damaged(weights, why, (CKPT_FILE,) if is_ckpt else (ADAPTER_FILE,), "")
    return p


def check_adapter(path: str, rank: int, alpha: int) -> Path:
    """``adapter_source(path)``, and its ``adapter_config.json`` names LoRA ``rank`` and ``alpha`` (ValueError if not):
    what can be known of an adapter before any model loads."""
    p = adapter_source(path)
    if p.suffix == ".ckpt":
        return p
    try:
        config = json.loads((p / "adapter_config.json").read_text())
    except (ValueError, UnicodeDecodeError):
        config = None
    if not isinstance(config, dict):
        raise ValueError(f"{p / 'adapter_config.json'} is not a JSON object: write the adapter again (alfrl sft / alfrl fit)")
    for key, mine, name in (("r", rank, "model.lora.rank"), ("lora_alpha", alpha, "model.lora.alpha")):
        if config.get(key) != mine:
            raise ValueError(f"adapter {p} has {key}={config.get(key)} but {name}={mine}: use the LoRA settings the adapter was trained with")
    return p


def load_adapter_into(model: torch.nn.Module, path: str, rank: int, alpha: int) -> str:
    """Load LoRA weights into the peft ``model`` from a checkpoint folder (or ``last``), its ``adapter/``
    folder or its ``trainer.ckpt``; the adapter's rank and alpha must be ``rank`` and ``alpha``.
    Returns the file that was read."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    p = check_adapter(path, rank, alpha)
    if p.suffix == ".ckpt":
        state = torch.load(p, map_location="cpu", weights_only=False)["state_dict"]
        missing = {f"model.{k}" for k in model.state_dict() if "lora_" in k} - set(state)
        if missing:
            raise ValueError(f"{p} lacks LoRA weights {sorted(missing)[:3]}: was it trained with these LoRA settings?")
        model.load_state_dict({k[len("model.") :]: v for k, v in state.items()}, strict=False)
        return str(p)
    weights = p / "adapter_model.safetensors"
    result = set_peft_model_state_dict(model, load_file(str(weights)))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ValueError(f"adapter {p} has weights this model lacks: {unexpected[:3]}")
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if missing:
        raise ValueError(f"adapter {p} lacks {len(missing)} LoRA weights of this model (e.g. {missing[:2]}): "
                         "was it trained with these model.lora.target_modules?")
    return str(weights)


def save_merged_model(policy, out: Path) -> None:
    """Base weights with the LoRA merged in, as a Hugging Face folder (tokenizer included)."""
    from transformers import AutoModelForCausalLM

    from alfrl.logprobs import causal_lm_of

    merged = dict(policy.merged_weights())
    base = causal_lm_of(policy.model)
    state = {}
    for name, tensor in base.state_dict().items():
        if "lora_" in name:
            continue
        clean = name.replace(".base_layer", "")
        state[clean] = merged.get(clean, tensor).detach().to("cpu").contiguous()
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(base.config)
    shell.save_pretrained(out, state_dict=state)
    policy.load_tokenizer().save_pretrained(out)
