"""Inverted dropout with a mask drawn from (seed, step, layer), forward and backward.

Training zeroes each activation with probability ``rate`` and scales the survivors
by ``1 / (1 - rate)``, so evaluation is the identity. The mask comes from an RNG
seeded with ``(seed, step, layer)`` and nothing else: a step replayed after a
fault, or run again after ``--resume``, draws exactly the same mask.
"""
from __future__ import annotations

import numpy as np


def dropout_mask(shape: tuple[int, ...], rate: float, seed: int, step: int,
                 layer: int) -> np.ndarray:
    """float32 mask of ``shape``: 0 with probability ``rate``, else 1 / (1 - rate).

    seed: the run's seed; step: the training step (>= 0); layer: which dropout of
    the network (its index among the dense layers), so two dropouts differ.
    """
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    if step < 0:
        raise ValueError(f"dropout needs a training step >= 0, got {step}")
    rng = np.random.default_rng([abs(int(seed)), int(seed) < 0, int(step), int(layer)])
    keep = rng.random(shape, dtype=np.float32) >= np.float32(rate)
    return keep.astype(np.float32) * np.float32(1.0 / (1.0 - rate))


def dropout_forward(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """x * mask (same shape), in x's dtype."""
    y: np.ndarray = x * mask.astype(x.dtype, copy=False)
    return y


def dropout_backward(mask: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """dx = dy * mask (the same mask as the forward pass)."""
    dx: np.ndarray = dy * mask.astype(dy.dtype, copy=False)
    return dx
