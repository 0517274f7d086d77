"""Is a backend there?  A check that costs milliseconds, made before anything heavy loads.

    check_backend("cuda")      # raises BackendUnavailable (one line naming the fix) on a machine without one

The devices themselves (``engine.executable.get_device``) make the full check when they start;
this one only answers what it can without importing the compiler or a GPU runtime: ``cuda``
needs the NVIDIA driver (``libcuda.so.1``) to report a GPU, then ``cuda-bindings``; ``hip``
needs the amdgpu driver's ``/dev/kfd``, then ``hip-python``.  ``cpu`` and ``reference`` run
everywhere.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os

from engine.errors import ModelError


class BackendUnavailable(ModelError):
    """The backend asked for cannot run here; the message says why and what to use instead."""


def _spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):                  # a parent package that is not there
        return False


def _cuda_gpus() -> str | None:
    """None when the NVIDIA driver reports a GPU, else why not."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver (libcuda.so.1 not found)"
    err = lib.cuInit(0)
    if err != 0:
        return f"the NVIDIA driver found no usable GPU (cuInit error {err})"
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return "the NVIDIA driver reports no GPU"
    return None


def why_not(backend: str) -> str | None:
    """Why ``backend`` surely cannot run here (no driver or device, no Python bindings), with
    the fix; None when it may (its device can still fail to start)."""
    if backend == "cuda":
        gpus = _cuda_gpus()
        if gpus:
            return f"{gpus}; use --backend cpu"
        if not _spec("cuda.bindings"):
            return "it needs cuda-python: pip install cuda-bindings"
    elif backend == "hip":
        if not os.path.exists("/dev/kfd"):
            return "no AMD GPU (/dev/kfd is missing: no amdgpu kernel driver); use --backend cpu"
        if not _spec("rocm.bindings"):
            return "it needs hip-python: pip install hip-python"
    return None


def check_backend(backend: str, gpu_only: str = "") -> None:
    """Raise :class:`BackendUnavailable` (``the cuda backend cannot run here: ...``) when
    :func:`why_not` has a reason; ``gpu_only``: the option asked for that only a GPU runs (then the
    line says so instead of pointing at the CPU)."""
    why = why_not(backend)
    if why and gpu_only:
        why = why.replace("; use --backend cpu", "") + f"; {gpu_only} needs a GPU"
    if why:
        raise BackendUnavailable(f"the {backend} backend cannot run here: {why}")
