"""2x2 max and average pooling with stride 2 over (B, C, H, W), forward and backward.

The forward pass views the input as (B, C, H/2, 2, W/2, 2) windows without
copying, takes the maximum of the four window positions elementwise and records
*which* position won as a small uint8 index, so the backward pass routes each
output gradient to exactly one input position. Ties go to the first maximum in
row-major window order: (0, 0), (0, 1), (1, 0), (1, 1). Odd heights or widths
drop the last row or column, like ``torch.nn.MaxPool2d(2)``. Pooling acts on each
channel independently, so a slice of channels pools to the slice of the result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hetconv.backend import get_array_module

Array = Any  # a numpy or cupy ndarray

# Window positions in row-major order; the index stored in the cache is the
# position in this tuple.
WINDOW_POSITIONS: tuple[tuple[int, int], ...] = ((0, 0), (0, 1), (1, 0), (1, 1))


@dataclass(frozen=True)
class MaxPoolCache:
    """What the backward pass needs.

    argmax: (B, C, H//2, W//2) uint8, index into ``WINDOW_POSITIONS`` of the
        winning input in each window.
    input_shape: (B, C, H, W) of the forward input (odd sizes included).
    """

    argmax: Array
    input_shape: tuple[int, int, int, int]


def _windows(a: Array) -> Array:
    """(B, C, H, W) -> (B, C, H//2, 2, W//2, 2) view of the even-sized crop."""
    batch, channels, height, width = a.shape
    out_h, out_w = height // 2, width // 2
    cropped = a[:, :, : 2 * out_h, : 2 * out_w]
    return cropped.reshape(batch, channels, out_h, 2, out_w, 2)


def max_pool2x2(x: Array) -> tuple[Array, MaxPoolCache]:
    """Max over non-overlapping 2x2 windows.

    x: (B, C, H, W) -> y: (B, C, H//2, W//2), same dtype; plus the cache for
    ``max_pool2x2_backward``. NaNs propagate to y (their gradient position is then
    unspecified but still unique).
    """
    if x.ndim != 4:
        raise ValueError(f"max_pool2x2 expects (B, C, H, W), got shape {x.shape}")
    xp = get_array_module(x)
    windows = _windows(x)
    top_left, top_right = windows[:, :, :, 0, :, 0], windows[:, :, :, 0, :, 1]
    bottom_left, bottom_right = windows[:, :, :, 1, :, 0], windows[:, :, :, 1, :, 1]
    top = xp.maximum(top_left, top_right)
    bottom = xp.maximum(bottom_left, bottom_right)
    y = xp.maximum(top, bottom)
    # First maximum in row-major order: within a row the left wins unless the right
    # is strictly larger; the top row wins unless the bottom one is strictly larger.
    top_index = (top_right > top_left).astype(xp.uint8)
    bottom_index = (bottom_right > bottom_left).astype(xp.uint8)
    bottom_index += xp.uint8(2)
    argmax = xp.where(bottom > top, bottom_index, top_index)
    return y, MaxPoolCache(argmax=argmax, input_shape=tuple(x.shape))


def max_pool2x2_backward(cache: MaxPoolCache, dy: Array) -> Array:
    """Route dy (B, C, H//2, W//2) to the winning positions -> dx (B, C, H, W).

    Every output gradient lands on exactly one input position; dropped odd rows
    and columns, and the other three positions of each window, get zero.
    """
    if dy.shape != cache.argmax.shape:
        raise ValueError(f"dy has shape {dy.shape}, expected {cache.argmax.shape}")
    xp = get_array_module(dy)
    dx = xp.zeros(cache.input_shape, dtype=dy.dtype)
    dx_windows = _windows(dx)  # a view: writes land in dx
    zero = dy.dtype.type(0)
    for index, (row, col) in enumerate(WINDOW_POSITIONS):
        dx_windows[:, :, :, row, :, col] = xp.where(cache.argmax == index, dy, zero)
    return dx


@dataclass(frozen=True)
class AvgPoolCache:
    """What ``avg_pool2x2_backward`` needs: the forward input's (B, C, H, W) shape."""

    input_shape: tuple[int, int, int, int]


def avg_pool2x2(x: Array) -> tuple[Array, AvgPoolCache]:
    """Mean over non-overlapping 2x2 windows.

    x: (B, C, H, W) -> y: (B, C, H//2, W//2), same dtype (odd last rows and columns
    dropped, like ``torch.nn.AvgPool2d(2)``); plus the cache. The four terms are
    added in row-major window order, then scaled by 1/4, per channel.
    """
    if x.ndim != 4:
        raise ValueError(f"avg_pool2x2 expects (B, C, H, W), got shape {x.shape}")
    windows = _windows(x)
    y = windows[:, :, :, 0, :, 0] + windows[:, :, :, 0, :, 1]
    y += windows[:, :, :, 1, :, 0]
    y += windows[:, :, :, 1, :, 1]
    y *= x.dtype.type(0.25)
    return y, AvgPoolCache(input_shape=tuple(x.shape))


def avg_pool2x2_backward(cache: AvgPoolCache, dy: Array) -> Array:
    """Spread dy (B, C, H//2, W//2) evenly over each window -> dx (B, C, H, W); dropped
    odd rows and columns get zero."""
    batch, channels, height, width = cache.input_shape
    if dy.shape != (batch, channels, height // 2, width // 2):
        raise ValueError(f"dy has shape {dy.shape}, expected "
                         f"{(batch, channels, height // 2, width // 2)}")
    xp = get_array_module(dy)
    dx = xp.zeros(cache.input_shape, dtype=dy.dtype)
    dx_windows = _windows(dx)
    quarter = dy * dy.dtype.type(0.25)
    for row, col in WINDOW_POSITIONS:
        dx_windows[:, :, :, row, :, col] = quarter
    return dx
