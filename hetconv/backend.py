"""The one place that chooses between numpy and cupy (the ``xp`` pattern).

Everything else asks this module for an array module; no other module imports
cupy. Importing hetconv works with no GPU and no cupy installed.
"""
from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import numpy as np

from hetconv.errors import UserError

try:  # cupy is optional: the `gpu` extra installs it.
    import cupy as _cupy
except Exception:  # pragma: no cover - depends on the machine
    _cupy = None

ArrayModule = types.ModuleType


def cupy_or_none() -> ArrayModule | None:
    """The cupy module when it imported, else None."""
    return _cupy  # type: ignore[no-any-return]


def gpu_count() -> int:
    """Number of CUDA devices cupy can see (0 without cupy or a driver)."""
    if _cupy is None:
        return 0
    try:
        return int(_cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def gpu_available() -> bool:
    return gpu_count() > 0


def get_array_module(*arrays: Any) -> ArrayModule:
    """numpy, or cupy when any argument is a cupy array."""
    if _cupy is not None:
        for a in arrays:
            if isinstance(a, _cupy.ndarray):
                return _cupy  # type: ignore[no-any-return]
    return np


def array_module_for(device: str) -> ArrayModule:
    """The array module for a device name: ``cpu`` or ``gpu[:N]``."""
    if device == "cpu":
        return np
    if device.startswith("gpu"):
        if not gpu_available():
            raise UserError(
                f"device {device!r} needs cupy and a CUDA GPU; install the `gpu` extra "
                "(pip install 'hetconv[gpu]') or use --device cpu"
            )
        return _cupy  # type: ignore[no-any-return]
    raise UserError(f"unknown device {device!r}: use 'cpu' or 'gpu:N'")


@contextlib.contextmanager
def on_device(device: str) -> Iterator[None]:
    """Make ``gpu:N`` the current CUDA device inside the block (no-op for cpu)."""
    if device.startswith("gpu") and _cupy is not None:
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        with _cupy.cuda.Device(index):
            yield
    else:
        yield


def to_numpy(a: Any) -> np.ndarray:
    """A host numpy array (copies from the GPU when needed)."""
    if _cupy is not None and isinstance(a, _cupy.ndarray):
        return _cupy.asnumpy(a)  # type: ignore[no-any-return]
    return np.asarray(a)


def to_module(a: Any, xp: ArrayModule) -> Any:
    """``a`` as an array of module ``xp`` (a no-op when it already is one)."""
    if xp is np:
        return to_numpy(a)
    return xp.asarray(a)


def synchronize(xp: ArrayModule) -> None:
    """Wait for queued GPU work (for honest timings); no-op for numpy."""
    if _cupy is not None and xp is _cupy:
        _cupy.cuda.get_current_stream().synchronize()


def set_blas_threads(count: int | None) -> None:
    """Limit BLAS/OpenMP threads in this process (None leaves the default)."""
    if count is None:
        return
    if count < 1:
        raise ValueError(f"thread count must be >= 1, got {count}")
    from threadpoolctl import threadpool_limits

    global _thread_limiter
    _thread_limiter = threadpool_limits(limits=count)


_thread_limiter: Any = None
