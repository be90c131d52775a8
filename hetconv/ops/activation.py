"""Elementwise activations: ReLU forward and backward.

ReLU is applied after batch norm in every conv layer. The backward pass needs
only the forward *output* (the mask ``y > 0``), so callers can drop the input.
"""
from __future__ import annotations

from typing import Any

from hetconv.backend import get_array_module

Array = Any  # a numpy or cupy ndarray


def relu(x: Array) -> Array:
    """max(x, 0) elementwise; any shape, same shape and dtype out."""
    xp = get_array_module(x)
    return xp.maximum(x, x.dtype.type(0))


def relu_backward(y: Array, dy: Array) -> Array:
    """dx = dy where the forward output y > 0, else 0.

    y: forward output, dy: upstream gradient, both the same shape; returns dx of
    that shape in dy's dtype. The gradient at exactly 0 is taken as 0.
    """
    if y.shape != dy.shape:
        raise ValueError(f"relu_backward: y has shape {y.shape} but dy has {dy.shape}")
    xp = get_array_module(y, dy)
    return xp.where(y > 0, dy, dy.dtype.type(0))
