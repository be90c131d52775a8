"""Fully connected layer as a pure function: y = x @ w.T + b, forward and backward.

The classifier head of the CNN runs on the master only; weights follow the
PyTorch layout (out_features, in_features) so checkpoints map one to one. On numpy the
products split their output rows over the host threads (``hetconv.backend``: BLAS runs
single-threaded inside them), each part one GEMM; the split depends only on the
thread count, so a run is reproducible at a given ``--threads``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hetconv.backend import get_array_module, host_threads, run_parallel
from hetconv.ops.timers import timed

Array = Any  # a numpy or cupy ndarray
PARALLEL_MIN_PRODUCT = 1 << 20  # multiply-adds below which a product stays on one thread


def _by_rows(xp: Any, rows: int, work: int, part: Callable[[slice], None]) -> None:
    """part(rows slice) over every row: numpy splits them over the host threads when the
    product (``work`` multiply-adds) is big enough, otherwise one call."""
    count = host_threads(rows) if xp is np and work >= PARALLEL_MIN_PRODUCT else 1
    edges = [rows * i // count for i in range(count + 1)]
    run_parallel(lambda i: part(slice(edges[i], edges[i + 1])), count, count)


def linear(x: Array, w: Array, b: Array) -> Array:
    """Affine map. x: (B, D), w: (O, D), b: (O,) -> y: (B, O)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1] or b.shape != (w.shape[0],):
        raise ValueError(
            f"linear: incompatible shapes x {x.shape}, w {w.shape}, b {b.shape}; "
            "expected x (B, D), w (O, D), b (O,)"
        )
    xp = get_array_module(x, w, b)
    with timed("dense"):
        y = xp.empty((x.shape[0], w.shape[0]), xp.result_type(x.dtype, w.dtype))
        _by_rows(xp, x.shape[0], x.size * w.shape[0],
                 lambda rows: xp.matmul(x[rows], w.T, out=y[rows]))
        y += b
    return y


def linear_backward(x: Array, w: Array, dy: Array) -> tuple[Array, Array, Array]:
    """Gradients of ``linear`` given dy (B, O).

    x: (B, D) forward input, w: (O, D). Returns (dx (B, D), dw (O, D), db (O,)).
    """
    if dy.shape != (x.shape[0], w.shape[0]):
        raise ValueError(f"dy has shape {dy.shape}, expected {(x.shape[0], w.shape[0])}")
    xp = get_array_module(x, w, dy)
    with timed("dense"):
        dtype = xp.result_type(x.dtype, w.dtype, dy.dtype)
        dx = xp.empty(x.shape, dtype)
        dw = xp.empty(w.shape, dtype)
        work = x.size * w.shape[0]
        _by_rows(xp, x.shape[0], work, lambda rows: xp.matmul(dy[rows], w, out=dx[rows]))
        _by_rows(xp, w.shape[0], work, lambda rows: xp.matmul(dy[:, rows].T, x, out=dw[rows]))
        db = xp.add.reduce(dy, axis=0)
    return dx, dw, db
