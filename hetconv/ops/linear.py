"""Fully connected layer as a pure function: y = x @ w.T + b, forward and backward.

The classifier head of the CNN runs on the master only; weights follow the
PyTorch layout (out_features, in_features) so checkpoints map one to one.
"""
from __future__ import annotations

from typing import Any

from hetconv.backend import get_array_module
from hetconv.ops.timers import timed

Array = Any  # a numpy or cupy ndarray


def linear(x: Array, w: Array, b: Array) -> Array:
    """Affine map. x: (B, D), w: (O, D), b: (O,) -> y: (B, O)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1] or b.shape != (w.shape[0],):
        raise ValueError(
            f"linear: incompatible shapes x {x.shape}, w {w.shape}, b {b.shape}; "
            "expected x (B, D), w (O, D), b (O,)"
        )
    with timed("dense"):
        y = x @ w.T
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
        dx = dy @ w
        dw = dy.T @ x
        db = xp.add.reduce(dy, axis=0)
    return dx, dw, db
