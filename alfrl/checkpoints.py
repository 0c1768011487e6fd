"""Checkpoint folders on disk: finding them, reading their adapters, writing merged models.

A checkpoint is a folder ``<dirpath>/step-000020/`` holding ``adapter/`` (the LoRA adapter in peft
format), ``trainer.ckpt`` (Lightning's checkpoint: LoRA weights, optimizer, step, RNG states, the
game cursor) and, with ``checkpoint.save_merged``, ``merged/`` (base + LoRA as a Hugging Face
folder). ``<dirpath>/last`` names the newest one. The ``Checkpointing`` callback writes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CKPT_FILE = "trainer.ckpt"


class CheckpointSpaceError(OSError):
    """The checkpoint folder's disk is full (the message says what to change)."""


_RUN_LOCK = None  # the open lock file of the run folder this process trains into (held until it exits)


def claim_run_folder(root: Path, checkpoints: Path, ckpt_path: str | None) -> list[str]:
    """One fit per run folder, and one run's checkpoints per folder: the problems (one line each) that stop this fit.

    ``root/.alfrl.lock`` is locked for as long as this process lives (``flock``: the kernel releases it when the process
    ends, a crash or ``kill -9`` included, so no stale lock is left). ``checkpoints`` holding another run's checkpoints
    is only written into by a fit that resumes from one of them (``--ckpt_path`` inside it)."""
    import fcntl
    import os

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
    """A checkpoint folder's ``last`` file (the pointer to the newest step) -> that step's folder."""
    return p.parent / p.read_text().strip() if p.name == "last" and p.is_file() else p


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
    return str(p)


def adapter_source(path: str) -> Path:
    """The file or folder ``load_adapter_into`` reads for ``path`` (a checkpoint folder, ``last``, its
    ``adapter/`` folder or its ``trainer.ckpt``), found without loading anything; FileNotFoundError if none."""
    p = _follow_last(Path(path))
    if p.is_dir() and (p / "adapter").is_dir():
        p = p / "adapter"
    if p.is_file() and p.suffix == ".ckpt":
        return p
    if not ((p / "adapter_config.json").is_file() and (p / "adapter_model.safetensors").is_file()):
        raise FileNotFoundError(f"no LoRA adapter at {path}: pass a checkpoint folder, its adapter/ folder or trainer.ckpt")
    return p


def load_adapter_into(model: torch.nn.Module, path: str, rank: int, alpha: int) -> str:
    """Load LoRA weights into the peft ``model`` from a checkpoint folder (or ``last``), its ``adapter/``
    folder or its ``trainer.ckpt``; the adapter's rank and alpha must be ``rank`` and ``alpha``.
    Returns the file that was read."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    p = adapter_source(path)
    if p.suffix == ".ckpt":
        state = torch.load(p, map_location="cpu", weights_only=False)["state_dict"]
        missing = {f"model.{k}" for k in model.state_dict() if "lora_" in k} - set(state)
        if missing:
            raise ValueError(f"{p} lacks LoRA weights {sorted(missing)[:3]}: was it trained with these LoRA settings?")
        model.load_state_dict({k[len("model.") :]: v for k, v in state.items()}, strict=False)
        return str(p)
    config_file, weights = p / "adapter_config.json", p / "adapter_model.safetensors"
    config = json.loads(config_file.read_text())
    for key, mine, name in (("r", rank, "model.lora.rank"), ("lora_alpha", alpha, "model.lora.alpha")):
        if config.get(key) != mine:
            raise ValueError(f"adapter {p} has {key}={config.get(key)} but {name}={mine}: use the LoRA settings the adapter was trained with")
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
