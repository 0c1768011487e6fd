"""CUDA MPS: the trainer's share of the GPU's SMs, and its priority, beside vLLM's engine core in a process of its own.

Two processes on one GPU take turns by time slices; under an MPS daemon (``nvidia-cuda-mps-control -d``, a user-space
server that changes no GPU setting) their kernels run side by side, but the update's large kernels can still fill every
SM and the engine's small decode steps wait for blocks to drain (on the H200 a rollout's last trajectories stepped at
6.80-9.58 ms beside the update under MPS, 6.73-9.13 ms without, against 3.60 ms while the update was compiling its first
pass; bench/leases/2026-12-04b.md). ``data.engine.trainer_sm_percentage`` caps this process's contexts at that share of the SMs
(``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, read when CUDA starts in a process); ``data.engine.trainer_mps_priority:
below_normal`` makes MPS schedule its work after the engine core's (``CUDA_MPS_CLIENT_PRIORITY``), as a stream priority
would inside one process. The engine core is spawned with every SM and the normal priority.
"""

from __future__ import annotations

import contextlib
import os

import torch

THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
CLIENT_PRIORITY = "CUDA_MPS_CLIENT_PRIORITY"  # 0: normal, 1: below normal (its work scheduled after the normal clients')
PRIORITIES = {"normal": "0", "below_normal": "1"}


def control_pipe() -> str:
    """Where a running MPS daemon's control pipe is (``CUDA_MPS_PIPE_DIRECTORY``, by default /tmp/nvidia-mps)."""
    return os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps", "control")


def limits(percentage: int | None, priority: str = "normal") -> dict[str, tuple[str, str]]:
    """What these recipe values ask of MPS: each key set (``key=value``) -> (its environment variable, the value)."""
    out = {}
    if percentage is not None:
        out[f"data.engine.trainer_sm_percentage={percentage}"] = (THREAD_PERCENTAGE, str(percentage))
    if priority != "normal":
        out[f"data.engine.trainer_mps_priority={priority}"] = (CLIENT_PRIORITY, PRIORITIES[priority])
    return out


def limit_this_process(percentage: int | None, priority: str = "normal") -> None:
    """This process's CUDA work gets ``percentage`` of the SMs (None: no limit) and MPS's client ``priority`` (``normal`` or
    ``below_normal``). Called by ``alfrl fit`` once the recipe is read, before anything initializes CUDA; a ValueError
    (one line) where no MPS daemon runs or CUDA already has."""
    asked = limits(percentage, priority)
    if not asked:
        return
    keys, wanted = " and ".join(asked), dict(asked.values())
    if not os.path.exists(control_pipe()):
        raise ValueError(f"{keys} needs a CUDA MPS daemon and none runs here (no {control_pipe()}): start one with "
                         "`nvidia-cuda-mps-control -d` (and the same CUDA_MPS_PIPE_DIRECTORY), or leave it at its default")
    if torch.cuda.is_initialized() and any(os.environ.get(k) != v for k, v in wanted.items()):
        set_them = " ".join(f"{k}={v}" for k, v in wanted.items())
        raise ValueError(f"{keys}: this process's CUDA context had started before the recipe was read, so it cannot apply: "
                         f"set {set_them} in the environment of the command instead, or leave it at its default")
    os.environ.update(wanted)


def context_sm_count() -> int | None:
    """The SMs the current thread's CUDA context may use (the driver's ``cuCtxGetExecAffinity``): under MPS with a limit,
    fewer than the device has. None without a CUDA driver or a current context."""
    import ctypes

    class Affinity(ctypes.Structure):  # CUexecAffinityParam: its type, then the union's one member (smCount.val)
        _fields_ = [("type", ctypes.c_int), ("sm_count", ctypes.c_uint)]

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    found = Affinity()
    if driver.cuCtxGetExecAffinity(ctypes.byref(found), 0) != 0:  # CU_EXEC_AFFINITY_TYPE_SM_COUNT; nonzero: an error code
        return None
    return int(found.sm_count)


@contextlib.contextmanager
def full_gpu_for_children(limited: bool):
    """Processes started inside (vLLM's engine core) get every SM and the normal priority although this one, ``limited``,
    has less; this process's settings come back after."""
    if not limited:
        yield
        return
    before = {k: os.environ.get(k) for k in (THREAD_PERCENTAGE, CLIENT_PRIORITY)}
    os.environ.update({THREAD_PERCENTAGE: "100", CLIENT_PRIORITY: PRIORITIES["normal"]})
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
