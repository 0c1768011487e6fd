"""CUDA MPS: the trainer's share of the GPU's SMs beside vLLM's engine core in a process of its own.

Two processes on one GPU take turns by time slices; under an MPS daemon (``nvidia-cuda-mps-control -d``, a user-space
server that changes no GPU setting) their kernels run side by side, but the update's large kernels can still fill every
SM and the engine's small decode steps wait for blocks to drain (on the H200 a rollout's last trajectories stepped at
6.80-9.58 ms beside the update under MPS, 6.73-9.13 ms without, against 3.60 ms while the update was compiling its first
pass; bench/leases/2026-12-04b.md). ``data.engine.trainer_sm_percentage`` caps this process's contexts at that share of the SMs
(``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, read when CUDA starts in a process) and the engine core is spawned with all of them.
"""

from __future__ import annotations

import contextlib
import os

import torch

THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def control_pipe() -> str:
    """Where a running MPS daemon's control pipe is (``CUDA_MPS_PIPE_DIRECTORY``, by default /tmp/nvidia-mps)."""
    return os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps", "control")


def limit_this_process(percentage: int | None) -> None:
    """This process's CUDA contexts get ``percentage`` of the SMs (None: no limit). Called by ``alfrl fit`` once the
    recipe is read, before anything initializes CUDA; a ValueError (one line) where no MPS daemon runs or CUDA has."""
    if percentage is None:
        return
    if not os.path.exists(control_pipe()):
        raise ValueError(f"data.engine.trainer_sm_percentage={percentage} needs a CUDA MPS daemon and none runs here (no "
                         f"{control_pipe()}): start one with `nvidia-cuda-mps-control -d` (and the same "
                         "CUDA_MPS_PIPE_DIRECTORY), or set it to null")
    if torch.cuda.is_initialized() and os.environ.get(THREAD_PERCENTAGE) != str(percentage):
        raise ValueError(f"data.engine.trainer_sm_percentage={percentage}: this process's CUDA context had started before the "
                         f"recipe was read, so the limit cannot apply: set {THREAD_PERCENTAGE}={percentage} in the "
                         "environment of the command instead, or set it to null")
    os.environ[THREAD_PERCENTAGE] = str(percentage)


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
def full_gpu_for_children(percentage: int | None):
    """Processes started inside (vLLM's engine core) get all the SMs although this one is limited to ``percentage``."""
    if percentage is None:
        yield
        return
    before = os.environ.get(THREAD_PERCENTAGE)
    os.environ[THREAD_PERCENTAGE] = "100"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(THREAD_PERCENTAGE, None)
        else:
            os.environ[THREAD_PERCENTAGE] = before
