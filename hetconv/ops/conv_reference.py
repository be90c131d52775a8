"""Slow, obviously-correct 2-D convolution, the yardstick for ``hetconv.ops.conv``.

The convolution is a cross-correlation: for every kernel offset (i, j) the padded
input is sliced at the positions that offset touches, and one ``einsum`` over the
channels adds that offset's contribution. The backward pass reverses each step. No
unfolding, no layouts, no threads: read it to know what the fast kernels must return.
Works on numpy and cupy arrays (``xp`` pattern) and in any float dtype.
"""
from __future__ import annotations

from typing import Any

from hetconv.backend import get_array_module


def _output_size(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def _pad(xp: Any, x: Any, padding: int) -> Any:
    """x (B, C, H, W) with ``padding`` zeros on each side of H and W."""
    return xp.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))


def _window(i: int, j: int, out_h: int, out_w: int, stride: int) -> tuple[slice, ...]:
    """Index of the padded-input pixels that kernel offset (i, j) multiplies."""
    return (slice(None), slice(None), slice(i, i + stride * (out_h - 1) + 1, stride),
            slice(j, j + stride * (out_w - 1) + 1, stride))


def conv2d_reference(x: Any, w: Any, b: Any | None = None, stride: int = 1,
                     padding: int = 0) -> Any:
    """y (B, K, Ho, Wo) = sum over c, i, j of w[k, c, i, j] * x_padded[b, c, s*ho+i, s*wo+j] + b[k].

    x: (B, C, H, W); w: (K, C, kh, kw); b: (K,) or None; stride, padding in pixels.
    Ho = (H + 2*padding - kh)//stride + 1, likewise Wo.
    """
    xp = get_array_module(x, w)
    batch, _, height, width = x.shape
    kernels, _, kernel_h, kernel_w = w.shape
    out_h = _output_size(height, kernel_h, stride, padding)
    out_w = _output_size(width, kernel_w, stride, padding)
    x_padded = _pad(xp, x, padding)
    y = xp.zeros((batch, kernels, out_h, out_w), dtype=xp.result_type(x.dtype, w.dtype))
    for i in range(kernel_h):
        for j in range(kernel_w):
            patch = x_padded[_window(i, j, out_h, out_w, stride)]
            y += xp.einsum("bchw,kc->bkhw", patch, w[:, :, i, j])
    if b is not None:
        y += b.reshape(1, kernels, 1, 1)
    return y


def conv2d_backward_reference(x: Any, w: Any, dy: Any, stride: int = 1, padding: int = 0,
                              need_dx: bool = True) -> tuple[Any | None, Any, Any]:
    """Gradients of ``conv2d_reference`` for the upstream gradient dy (B, K, Ho, Wo).

    Returns (dx (B, C, H, W) or None when need_dx is False, dw (K, C, kh, kw), db (K,)).
    """
    xp = get_array_module(x, w, dy)
    _, _, height, width = x.shape
    _, _, kernel_h, kernel_w = w.shape
    out_h, out_w = dy.shape[2], dy.shape[3]
    x_padded = _pad(xp, x, padding)
    dx_padded = xp.zeros_like(x_padded) if need_dx else None
    dw = xp.zeros_like(w)
    for i in range(kernel_h):
        for j in range(kernel_w):
            window = _window(i, j, out_h, out_w, stride)
            dw[:, :, i, j] = xp.einsum("bkhw,bchw->kc", dy, x_padded[window])
            if dx_padded is not None:
                dx_padded[window] += xp.einsum("bkhw,kc->bchw", dy, w[:, :, i, j])
    db = dy.sum(axis=(0, 2, 3))
    dx = None
    if dx_padded is not None:
        dx = xp.ascontiguousarray(
            dx_padded[:, :, padding:padding + height, padding:padding + width])
    return dx, dw, db
