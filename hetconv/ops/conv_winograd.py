"""Convolution by Winograd's minimal filtering F(2x2, r x r), for 3x3 and 5x5 kernels.

A stride-1 convolution's output is cut into 2x2 tiles; each tile needs an
``a x a`` input patch (a = r + 1) and, per kernel and channel, the product of two
``a x a`` transforms instead of 4*r*r multiply-adds (Lavin and Gray, 2016):

    Y = A^T [ sum_c (G g_kc G^T) * (B^T d_c B) ] A          (* elementwise)

so the GEMM work is a*a / (4*r*r) of im2col's: 16/36 for 3x3, 36/100 for 5x5. The
a*a products are independent GEMMs, batched: U (a*a, K, C) @ V (a*a, C, tiles*nb). The
matrices come from the Toom-Cook construction at the points 0, 1, -1, (2, -2,) and
infinity: G evaluates the kernel polynomial, A^T the output one, B^T = V^-T with V the
evaluation (Vandermonde) matrix of the a points. The backward pass is the transpose of
each step: dV = U^T @ dM with dM = A dY A^T, then dX patches = B dV B^T added into the
padded input gradient (patches overlap); dU = dM @ V^T summed over the batch, and
dW = G^T dU G. Rounding differs from the direct sum (the transforms add and subtract
scaled values first): a few float32 ulps more for 3x3, somewhat more for 5x5; the tests
hold it to the slow reference.

All functions take one batch chunk in the batch-inner layout of ``hetconv.ops.conv``
(padded input (C, Hp, Wp, nb), output rows (K, Ho, Wo, nb)) and work on numpy or cupy
(``xp``), in any float dtype; their big temporaries are the calling thread's scratch
(numpy), valid until the thread's next call of the same function.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from hetconv.ops.conv_chunks import scratch_array

Array = Any  # a numpy or cupy ndarray
TILE = 2  # outputs per tile side (m)
POINTS = {3: (0.0, 1.0, -1.0), 5: (0.0, 1.0, -1.0, 2.0, -0.5)}  # finite points by kernel size


@functools.cache
def matrices(kernel: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A^T (m, a), G (a, r), B^T (a, a)) float64 for F(m x m, r x r), m = TILE."""
    points = POINTS[kernel]
    size = TILE + kernel - 1

    def evaluation(columns: int) -> np.ndarray:  # rows: polynomial at each point, then infinity
        rows = [[p**i for i in range(columns)] for p in points]
        rows.append([0.0] * (columns - 1) + [1.0])
        return np.array(rows, dtype=np.float64)

    return evaluation(TILE).T, evaluation(kernel), np.linalg.inv(evaluation(size)).T


def supported(geometry: Any) -> bool:
    """Stride 1, square 3x3 or 5x5 kernels, an output of whole 2x2 tiles."""
    g = geometry
    return (g.stride == 1 and g.kernel_h == g.kernel_w and g.kernel_h in POINTS
            and g.out_h % TILE == 0 and g.out_w % TILE == 0)


def _constant(xp: Any, matrix: np.ndarray, dtype: Any) -> Array:
    return xp.asarray(matrix.astype(dtype))


def weight_transform(xp: Any, weights: Array) -> Array:
    """w (K, C, r, r) -> U (a*a, K, C) = G w G^T per kernel and channel."""
    kernels, channels, size, _ = weights.shape
    _, g_matrix, _ = matrices(size)
    g = _constant(xp, g_matrix, weights.dtype)
    a = g.shape[0]
    # (r, r, K*C): contract rows, then columns
    flat = xp.ascontiguousarray(weights.transpose(2, 3, 0, 1)).reshape(size, size * kernels
                                                                         * channels)
    rows = (g @ flat).reshape(a, size, kernels * channels)
    return xp.ascontiguousarray(xp.matmul(g, rows)).reshape(a * a, kernels, channels)


def _two_sided(xp: Any, left: Array, values: Array, right_t: Array, name: str) -> Array:
    """left @ X @ right_t^T for every column of values (p, q, n): (left rows, right rows,
    n), in the thread's scratch."""
    p, q, n = values.shape
    first = scratch_array(xp, name + " half", (left.shape[0], q * n), values.dtype)
    xp.matmul(left, values.reshape(p, q * n), out=first)
    out = scratch_array(xp, name, (left.shape[0], right_t.shape[0], n), values.dtype)
    xp.matmul(right_t, first.reshape(left.shape[0], q, n), out=out)
    return out


def input_transform(xp: Any, g: Any, padded: Array) -> Array:
    """padded (C, Hp, Wp, nb) -> V (a*a, C, tiles*nb) = B^T d B of every input patch,
    columns ordered (tile row, tile column, sample)."""
    _, _, bt_matrix = matrices(g.kernel_h)
    bt = _constant(xp, bt_matrix, padded.dtype)
    a = bt.shape[0]
    channels, nb = padded.shape[0], padded.shape[3]
    th, tw = g.out_h // TILE, g.out_w // TILE
    s0, s1, s2, s3 = padded.strides
    patches = xp.lib.stride_tricks.as_strided(
        padded, (a, a, channels, th, tw, nb), (s1, s2, s0, TILE * s1, TILE * s2, s3))
    columns = channels * th * tw * nb
    gathered = scratch_array(xp, "winograd patches", (a, a, columns), padded.dtype)
    gathered.reshape(a, a, channels, th, tw, nb)[...] = patches
    return _two_sided(xp, bt, gathered, bt, "winograd input").reshape(a * a, channels,
                                                                       th * tw * nb)


def output_rows(xp: Any, g: Any, products: Array, out: Array) -> Array:
    """products M (a*a, K, tiles*nb) -> out (K, Ho*Wo*nb) batch-inner, = A^T M A."""
    at_matrix, _, _ = matrices(g.kernel_h)
    at = _constant(xp, at_matrix, products.dtype)
    a, kernels = at.shape[1], products.shape[1]
    th, tw = g.out_h // TILE, g.out_w // TILE
    nb = products.shape[2] // (th * tw)
    tiles = _two_sided(xp, at, products.reshape(a, a, -1), at, "winograd output")
    target = out.reshape(kernels, th, TILE, tw, TILE, nb)
    target[...] = tiles.reshape(TILE, TILE, kernels, th, tw, nb).transpose(2, 3, 0, 4, 1, 5)
    return out


def gradient_transform(xp: Any, g: Any, rows: Array) -> Array:
    """dy rows (K, Ho*Wo*nb) -> dM (a*a, K, tiles*nb) = A dY A^T of every output tile."""
    at_matrix, _, _ = matrices(g.kernel_h)
    a_matrix = _constant(xp, at_matrix.T, rows.dtype)  # (a, m)
    a = a_matrix.shape[0]
    kernels = rows.shape[0]
    th, tw = g.out_h // TILE, g.out_w // TILE
    nb = rows.shape[1] // (g.out_h * g.out_w)
    tiles = scratch_array(xp, "winograd dy tiles", (TILE, TILE, kernels * th * tw * nb),
                          rows.dtype)
    tiles.reshape(TILE, TILE, kernels, th, tw, nb)[...] = rows.reshape(
        kernels, th, TILE, tw, TILE, nb).transpose(2, 4, 0, 1, 3, 5)
    return _two_sided(xp, a_matrix, tiles, a_matrix, "winograd dy").reshape(
        a * a, kernels, th * tw * nb)


def add_input_gradient(xp: Any, g: Any, d_input: Array, dx_padded: Array) -> None:
    """dx_padded (C, Hp, Wp, nb) += the patches B dV B^T of d_input dV (a*a, C, tiles*nb)."""
    _, _, bt_matrix = matrices(g.kernel_h)
    b = _constant(xp, bt_matrix.T, d_input.dtype)
    a = b.shape[0]
    channels, nb = dx_padded.shape[0], dx_padded.shape[3]
    th, tw = g.out_h // TILE, g.out_w // TILE
    patches = _two_sided(xp, b, d_input.reshape(a, a, -1), b, "winograd dx").reshape(
        a, a, channels, th, tw, nb)
    for i in range(a):
        for j in range(a):
            dx_padded[:, i:i + TILE * th:TILE, j:j + TILE * tw:TILE, :] += patches[i, j]


def weight_gradient(xp: Any, d_transformed: Array, size: int) -> Array:
    """dU (a*a, K, C) summed over the batch -> dw (K, C, r, r) = G^T dU G."""
    _, g_matrix, _ = matrices(size)
    gt = _constant(xp, g_matrix.T, d_transformed.dtype)  # (r, a)
    a, kernels, channels = g_matrix.shape[0], d_transformed.shape[1], d_transformed.shape[2]
    weights = _two_sided(xp, gt, d_transformed.reshape(a, a, kernels * channels), gt,
                         "winograd dw")
    return xp.ascontiguousarray(weights.reshape(size, size, kernels, channels).transpose(
        2, 3, 0, 1))
