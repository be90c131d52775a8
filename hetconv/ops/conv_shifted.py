"""Convolution by shifted taps: no unfolded input, for small kernel shares.

im2col (``hetconv.ops.conv``) copies the input ``kh*kw`` times (Q = C*kh*kw rows), a
cost that does not shrink with the kernel share K. This formulation moves the
``kh*kw`` factor to the output side, where it scales with K instead of C. With the
input chunk laid out as ``X`` (C, Hp*Wp*nb) (zero-padded, batch innermost, the same
layout as im2col's batch-inner one) and the weights stacked by tap,
``W_taps`` (kh*kw*K, C) with rows (i, j, k):

    forward      Z = W_taps @ X                  (kh*kw*K, Hp*Wp*nb), one GEMM
                 y[k, ho, wo] = sum_ij Z[i, j, k, s*ho + i, s*wo + j]   (kh*kw adds)
    backward     U[i, j, k, s*ho + i, s*wo + j] = dy[k, ho, wo], zero elsewhere
                 dW_taps = U @ X^T,  dX = W_taps^T @ U   (two GEMMs, U is K-sized)

Every GEMM runs over all Hp*Wp padded positions instead of the Ho*Wo outputs, so it
does Hp*Wp/(Ho*Wo) times im2col's multiply-adds: worth it while K is small, which is
what ``hetconv.ops.conv.choose_layout`` decides. When dx is not needed and the stride
is 1, dW is taken from shifted views of X instead (one strided GEMM per tap, no U).
Works on numpy and cupy (``xp``) and in any float dtype.
"""
from __future__ import annotations

from typing import Any

Array = Any  # a numpy or cupy ndarray


def _taps(geometry: Any) -> list[tuple[int, int, slice, slice]]:
    """(i, j, rows, cols): the padded-grid positions kernel offset (i, j) touches."""
    st = geometry.stride
    out = []
    for i in range(geometry.kernel_h):
        rows = slice(i, i + st * (geometry.out_h - 1) + 1, st)
        for j in range(geometry.kernel_w):
            out.append((i, j, rows, slice(j, j + st * (geometry.out_w - 1) + 1, st)))
    return out


def tap_weights(xp: Any, weight_matrix: Array, geometry: Any) -> Array:
    """(kh*kw*K, C) rows ordered (i, j, k), from the (K, C*kh*kw) weight matrix."""
    g = geometry
    weights4 = weight_matrix.reshape(g.kernels, g.channels, g.kernel_h, g.kernel_w)
    return xp.ascontiguousarray(weights4.transpose(2, 3, 0, 1)).reshape(
        g.kernel_h * g.kernel_w * g.kernels, g.channels)


def shifted_product(xp: Any, geometry: Any, weights_by_tap: Array, padded: Array) -> Array:
    """The convolution of padded (C, Hp, Wp, nb) as (K, Ho, Wo, nb), batch innermost."""
    g = geometry
    nb = padded.shape[3]
    hp, wp = padded.shape[1], padded.shape[2]
    products = (weights_by_tap @ padded.reshape(g.channels, hp * wp * nb)).reshape(
        g.kernel_h, g.kernel_w, g.kernels, hp, wp, nb)
    taps = _taps(g)
    i, j, rows, cols = taps[0]
    summed = products[i, j, :, rows, cols, :].copy()  # (K, Ho, Wo, nb)
    for i, j, rows, cols in taps[1:]:
        summed += products[i, j, :, rows, cols, :]
    return summed


def shifted_forward(xp: Any, geometry: Any, weights_by_tap: Array, padded: Array,
                    bias: Array | None, y_chunk: Array) -> None:
    """Write y_chunk (nb, K, Ho, Wo) from padded (C, Hp, Wp, nb) and (kh*kw*K, C) weights."""
    summed = shifted_product(xp, geometry, weights_by_tap, padded)
    y_chunk[...] = summed.transpose(3, 0, 1, 2)
    if bias is not None:
        y_chunk += bias[:, None, None]


def shifted_backward(xp: Any, geometry: Any, weights_by_tap: Array | None, padded: Array,
                     dy_t: Array, dx_chunk: Array | None, need_db: bool = True,
                     need_dw: bool = True) -> tuple[Array | None, Array | None]:
    """(dw (K, C*kh*kw) or None without ``need_dw``, db (K,) or None) of one chunk;
    writes dx_chunk (nb, C, H, W) when given.

    dy_t: the chunk's dy as (K, Ho, Wo, nb) (a transposed view of the canonical dy is
    fine); weights_by_tap: (kh*kw*K, C) as from ``tap_weights`` (None when dx is not
    needed).
    """
    g = geometry
    nb, hp, wp = padded.shape[3], padded.shape[1], padded.shape[2]
    kh, kw, kernels, channels, pad = g.kernel_h, g.kernel_w, g.kernels, g.channels, g.padding
    positions = hp * wp * nb
    columns = padded.reshape(channels, positions)
    db = dy_t.sum(axis=(1, 2, 3)) if need_db else None
    if dx_chunk is None and g.stride == 1:
        dw_taps = _weight_grad_from_views(xp, g, columns, dy_t, hp, wp, nb)
    else:
        spread = xp.zeros((kh, kw, kernels, hp, wp, nb), dy_t.dtype)
        for i, j, rows, cols in _taps(g):
            spread[i, j, :, rows, cols, :] = dy_t
        spread2 = spread.reshape(kh * kw * kernels, positions)
        if dx_chunk is not None and weights_by_tap is not None:
            dx_padded = (weights_by_tap.T @ spread2).reshape(channels, hp, wp, nb)
            inner = dx_padded[:, pad:pad + g.height, pad:pad + g.width, :]
            dx_chunk[...] = inner.transpose(3, 0, 1, 2)
        if not need_dw:
            return None, db
        dw_taps = (spread2 @ columns.T).reshape(kh, kw, kernels, channels)
    dw = xp.ascontiguousarray(dw_taps.transpose(2, 3, 0, 1)).reshape(kernels, g.taps)
    return dw, db


def _weight_grad_from_views(xp: Any, g: Any, columns: Array, dy_t: Array, hp: int, wp: int,
                            nb: int) -> Array:
    """(kh, kw, K, C) weight gradient for stride 1: one GEMM per tap on a shifted view.

    dy is laid on the padded grid's row length (zeros in the last wp - Wo columns), so
    tap (i, j) pairs it with the contiguous run of X that starts at (i*wp + j)*nb.
    """
    on_grid = xp.zeros((g.kernels, g.out_h, wp, nb), dy_t.dtype)
    on_grid[:, :, :g.out_w, :] = dy_t
    length = ((g.out_h - 1) * wp + g.out_w) * nb
    dy_rows = on_grid.reshape(g.kernels, g.out_h * wp * nb)[:, :length]
    item = columns.itemsize
    shifted = xp.lib.stride_tricks.as_strided(
        columns, (g.kernel_h, g.kernel_w, length, g.channels),
        (wp * nb * item, nb * item, item, columns.strides[0]))
    return xp.matmul(dy_rows, shifted)
