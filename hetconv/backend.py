"""The one place that chooses between numpy and cupy, and how many host threads compute.

Everything else asks this module for an array module (the ``xp`` pattern) and moves
arrays between host and device only through ``to_module`` / ``to_numpy``; no other
module imports cupy. Importing hetconv works with no GPU and no cupy installed.

Host threads: on numpy, an op splits its work into independent parts and runs them on
a pool of host threads, each calling a single-threaded BLAS (numpy releases the GIL in
copies, adds and BLAS calls), so the memory-bound passes run in parallel too, not only
the products (``host_threads``, ``run_parallel``). ``set_blas_threads(n)`` (the
commands' ``--threads``) gives the pool n threads and holds numpy's BLAS to one thread
for the whole process: OpenBLAS's own worker threads busy-wait for a while after every
multi-threaded call, and would take a core from the pool's threads; the few products
outside the pool (the dense layers) split their rows over the pool instead.

Test-only: when the environment variable ``HETCONV_TEST_GPU_MODULE`` names a module
(``tests.support.strict_gpu``), that module stands in for cupy for every ``gpu:N``
device, and cupy is not imported at all. The stand-in refuses implicit host/device
conversions and counts copies, so the GPU path is tested on machines without a GPU.
Real runs never set it.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from hetconv.errors import UserError

ArrayModule = types.ModuleType
TEST_GPU_MODULE_VARIABLE = "HETCONV_TEST_GPU_MODULE"


def _load_gpu_module() -> Any:
    """The test stand-in named by TEST_GPU_MODULE_VARIABLE, else cupy, else None."""
    stand_in = os.environ.get(TEST_GPU_MODULE_VARIABLE)
    if stand_in:
        return importlib.import_module(stand_in)  # fails loudly: a test asked for it
    try:  # cupy is optional: the `gpu` extra installs it.
        import cupy
    except Exception:  # pragma: no cover - depends on the machine
        return None
    return cupy


_cupy = _load_gpu_module()


def cupy_or_none() -> ArrayModule | None:
    """The GPU array module (cupy, or the test stand-in) when there is one, else None."""
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


def gpu_index(device: str) -> int:
    """N of ``gpu:N`` (0 for plain ``gpu``)."""
    return int(device.split(":", 1)[1]) if ":" in device else 0


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
    """Make ``gpu:N`` the current CUDA device inside the block (no-op for cpu).

    The current device belongs to the calling thread: a helper thread that computes
    on ``gpu:N`` must enter this block itself.
    """
    if device.startswith("gpu") and _cupy is not None:
        with _cupy.cuda.Device(gpu_index(device)):
            yield
    else:
        yield


def current_device(xp: ArrayModule) -> str:
    """The device new arrays of ``xp`` land on now: ``cpu``, or the current ``gpu:N``."""
    if _cupy is not None and xp is _cupy:
        return f"gpu:{int(_cupy.cuda.Device().id)}"
    return "cpu"


def to_numpy(a: Any) -> np.ndarray:
    """A host numpy array (copies from the GPU when needed)."""
    if _cupy is not None and isinstance(a, _cupy.ndarray):
        return _cupy.asnumpy(a)  # type: ignore[no-any-return]
    return np.asarray(a)


def to_module(a: Any, xp: ArrayModule) -> Any:
    """``a`` as an array of module ``xp`` (a no-op when it already is one).

    For the GPU module the copy lands on the current device (see ``on_device``).
    """
    if xp is np:
        return to_numpy(a)
    return xp.asarray(a)


def synchronize(xp: ArrayModule) -> None:
    """Wait for queued GPU work (for honest timings); no-op for numpy."""
    if _cupy is not None and xp is _cupy:
        _cupy.cuda.get_current_stream().synchronize()


# ---------------------------------------------------------------- host threads
def set_blas_threads(count: int | None) -> None:
    """Compute with ``count`` host threads from now on (None: every core): the pool of
    ``run_parallel`` gets that many, numpy's BLAS one (see the module docstring)."""
    if count is not None and count < 1:
        raise ValueError(f"thread count must be >= 1, got {count}")
    from threadpoolctl import threadpool_limits

    global _thread_limiter, _host_thread_count
    _host_thread_count = count or os.cpu_count() or 1
    _thread_limiter = threadpool_limits(limits=1, user_api="blas")


@contextlib.contextmanager
def computing_threads(count: int) -> Iterator[None]:
    """``set_blas_threads(count)`` inside the block only (benchmarks), restored after."""
    if count < 1:
        raise ValueError(f"thread count must be >= 1, got {count}")
    from threadpoolctl import threadpool_limits

    global _host_thread_count
    before = _host_thread_count
    _host_thread_count = count
    try:
        with threadpool_limits(limits=1, user_api="blas"):
            yield
    finally:
        _host_thread_count = before


_thread_limiter: Any = None
_host_thread_count: int | None = None  # the pool's size once set; before, BLAS's threads
_pools: dict[int, ThreadPoolExecutor] = {}  # one pool per thread count, made on first use
_lock = threading.Lock()  # guards the pools and the BLAS thread setting below
_blas_users = 0  # calls now running with BLAS held to one thread
_blas_saved: list[tuple[Any, int]] = []  # (library, threads) to restore after the last one
_blas_libs: list[Any] | None = None


def _blas_libraries() -> list[Any]:
    global _blas_libs
    if _blas_libs is None:
        try:
            from threadpoolctl import ThreadpoolController

            with warnings.catch_warnings():  # e.g. about OpenMP runtimes: not ours to report
                warnings.simplefilter("ignore")
                controller = ThreadpoolController().select(user_api="blas")
            _blas_libs = list(controller.lib_controllers)
        except Exception:  # pragma: no cover - threadpoolctl is a dependency
            _blas_libs = []
    return _blas_libs


def _forget_threads_after_fork() -> None:  # a forked child has none of the pool threads
    global _lock, _blas_users
    _pools.clear()
    _lock, _blas_users = threading.Lock(), 0


os.register_at_fork(after_in_child=_forget_threads_after_fork)


def blas_threads() -> int:
    """Threads numpy's BLAS may use right now (1 while a ``run_parallel`` holds it)."""
    return max([int(lib.num_threads) for lib in _blas_libraries()] or [1])


def host_threads(parts: int) -> int:
    """Threads worth using for ``parts`` independent pieces of numpy work: the threads
    set by ``set_blas_threads`` (before that, numpy's BLAS threads), no more than the
    cores or the pieces."""
    count = blas_threads() if _host_thread_count is None else _host_thread_count
    return max(1, min(count, os.cpu_count() or 1, parts))


@contextlib.contextmanager
def _single_blas_thread() -> Iterator[None]:
    """Hold BLAS to one thread (process-wide, reference-counted across callers)."""
    global _blas_users, _blas_saved
    with _lock:
        if _blas_users == 0:
            _blas_saved = [(lib, int(lib.num_threads)) for lib in _blas_libraries()]
            for lib, _ in _blas_saved:
                lib.set_num_threads(1)
        _blas_users += 1
    try:
        yield
    finally:
        with _lock:
            _blas_users -= 1
            if _blas_users == 0:
                for lib, count in _blas_saved:
                    lib.set_num_threads(count)


def run_parallel(task: Callable[[int], Any], count: int, threads: int) -> list[Any]:
    """[task(i) for i < count], on a pool of ``threads`` threads with one BLAS thread
    each (in order on the calling thread when threads or count is 1)."""
    if threads <= 1 or count <= 1:
        return [task(i) for i in range(count)]
    with _lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(threads, "hetconv-conv")
        pool = _pools[threads]
    with _single_blas_thread():
        futures = [pool.submit(task, i) for i in range(count)]
        wait(futures)
        return [f.result() for f in futures]
