"""Scratch arrays that are kept between calls instead of allocated per call.

A training step allocates the same big temporaries every time (the unfolded input of
each batch chunk, the padded input, the conv output). Fresh allocations of many
megabytes come from the operating system as untouched pages, and every first touch
of a page is a page fault: a measurable share of a small network's step. A
:class:`Workspace` hands out arrays by name and keeps them for the next call with the
same name; it only ever grows.

Two kinds are used:

* ``thread_scratch()``: one workspace per host thread (the calling thread and the
  ``run_parallel`` pool threads live as long as the process), for temporaries that
  die within one chunk's task. A name is reused by the next ``get`` with the same
  name *on the same thread*, so a scratch array must never outlive its task.
* A :class:`Workspace` owned by a layer's shard (``hetconv.engine.shard.ConvShard``), for
  arrays that live from a training forward to its backward (the conv output, the
  padded input chunks, the pooling masks). The next training forward reuses them.

numpy only: other array modules (cupy) keep allocating through their own pools.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np


class Workspace:
    """Named numpy scratch arrays, each the view of a 1-D buffer that only grows.

    ``get(name, shape, dtype)`` returns an uninitialised C-contiguous array of that
    shape; the same name returns the same memory next time (previous contents are
    whatever the caller left). ``zeros`` is ``get`` filled with zeros.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}
        self._zeroed: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = 1
        for size in shape:
            count *= int(size)
        nbytes = max(1, count * dtype.itemsize)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = np.empty(nbytes, np.uint8)
            self._buffers[name] = buffer
            self._zeroed.pop(name, None)
        array: np.ndarray = buffer[:count * dtype.itemsize].view(dtype).reshape(shape)
        return array

    def zeros(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        array = self.get(name, shape, dtype)
        array.fill(0)
        return array

    def kept_zeros(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """``zeros`` the first time (or after a change of shape or dtype), else the array
        as left: for arrays whose zero parts nobody writes (the border of a padded input,
        whose inside every call overwrites). Use a name either with this or with ``get``."""
        key = (tuple(int(size) for size in shape), np.dtype(dtype))
        array = self.get(name, shape, dtype)
        if self._zeroed.get(name) != key:
            array.fill(0)
            self._zeroed[name] = key
        return array

    def nbytes(self) -> int:
        """Bytes held (for tests and memory reports)."""
        return sum(buffer.nbytes for buffer in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()
        self._zeroed.clear()


_local = threading.local()


def thread_scratch() -> Workspace:
    """The calling thread's own workspace (made on first use)."""
    workspace: Workspace | None = getattr(_local, "workspace", None)
    if workspace is None:
        workspace = Workspace()
        _local.workspace = workspace
    return workspace
