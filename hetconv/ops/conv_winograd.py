"""Convolution by Winograd's minimal filtering F(m x m, r x r): 3x3 and 5x5 kernels.

A stride-1 convolution's output is cut into m x m tiles (m = 4 for 3x3 kernels on maps
that 4 divides or nearly fills, else 2: ``tile_of``; where m does not divide the map the
last row and column of tiles reach past it, over zeros, and only the map is kept:
``ragged``); each tile needs an ``a x a`` input patch
(a = m + r - 1) and, per kernel and channel, the elementwise product of two ``a x a``
transforms instead of m*m*r*r multiply-adds (Lavin and Gray, 2016):

    Y = A^T [ sum_c (G g_kc G^T) * (B^T d_c B) ] A          (* elementwise)

so the GEMM work is a*a / (m*m*r*r) of im2col's: 36/144 for F(4x4, 3x3), 16/36 for
F(2x2, 3x3), 36/100 for F(2x2, 5x5). The a*a products are independent GEMMs, batched:
U (a*a, K, C) @ V (a*a, C, tiles*nb). The matrices come from the Toom-Cook construction
at the points of POINTS and infinity: G evaluates the kernel polynomial, A^T the output
one, B^T = V^-T with V the evaluation (Vandermonde) matrix of the a points. The backward pass is the transpose of
each step: dV = U^T @ dM with dM = A dY A^T, then dX patches = B dV B^T added into the
padded input gradient (patches overlap); dU = dM @ V^T summed over the batch, and
dW = G^T dU G. Rounding differs from the direct sum (the transforms add and subtract
scaled values first): about 2e-6 of the largest output in float32 for a = 6 (F(4x4,
3x3), F(2x2, 5x5); im2col about 5e-7), a few ulps for F(2x2, 3x3); the tests hold it
to the slow reference.

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
POINTS = {3: (0.0, 1.0, -1.0), 5: (0.0, 1.0, -1.0, 2.0, -0.5)}
"""The finite interpolation points by their number, a - 1 for a patch side a = m + r - 1
(the last point is infinity); of the sets tried for a = 6 this one rounds least."""


RAGGED_MAX_WASTE = 1.5
"""F(4x4, 3x3) on a map that 4 does not divide computes whole tiles over it (the last
row and column of tiles reach past the map, over zeros, and are cut off): taken while
those tiles' outputs are at most this many times the map's, with at least
RAGGED_MIN_CHANNELS input channels. At 6x6 (8x8 computed, 1.78 times) the GEMM work
would be F(2x2)'s and the transforms' more."""
RAGGED_MIN_CHANNELS = 64
"""Ragged F(4x4, 3x3) against F(2x2, 3x3), 32 samples, one thread, forward and backward
with dx (docs/figures/ab/ragged-winograd.log): 64 channels, 64 kernels: 10.4 % less CPU at
14x14, 8.3 % at 10x10; 64 -> 256 at 14x14: 3.9 % less; 32 -> 64: level at 14x14, 19.6 %
more at 10x10 (with 32 channels the 36 thinner GEMMs of F(4x4) run slower than
F(2x2)'s 16)."""


def tiles_of(geometry: Any) -> tuple[int, int]:
    """(tile rows, tile columns) over the output map: ceil(Ho / m), ceil(Wo / m)."""
    g, m = geometry, tile_of(geometry)
    return -(-g.out_h // m), -(-g.out_w // m)


def tile_of(geometry: Any) -> int:
    """m, the output tile side: 4 for 3x3 kernels on maps that 4 divides, or, with at
    least RAGGED_MIN_CHANNELS channels, where whole 4x4 tiles cover at most
    RAGGED_MAX_WASTE times the map's outputs; else 2."""
    g = geometry
    if g.kernel_h != 3:
        return 2
    if g.out_h % 4 == 0 and g.out_w % 4 == 0:
        return 4
    covered = (-(-g.out_h // 4) * 4) * (-(-g.out_w // 4) * 4)
    return 4 if (g.channels >= RAGGED_MIN_CHANNELS
                 and covered <= RAGGED_MAX_WASTE * g.out_h * g.out_w) else 2


def ragged(geometry: Any) -> bool:
    """Whether the tiles reach past the output map (tile_of does not divide it)."""
    g, m = geometry, tile_of(geometry)
    th, tw = tiles_of(g)
    return bool(th * m != g.out_h or tw * m != g.out_w)


def tiled_extent(geometry: Any) -> tuple[int, int]:
    """(rows, columns) of the padded input the tiles read, Hp x Wp or more: a ragged
    map's last tiles read zeros past the padded input."""
    g, m = geometry, tile_of(geometry)
    th, tw = tiles_of(g)
    return (max(g.height + 2 * g.padding, th * m + g.kernel_h - 1),
            max(g.width + 2 * g.padding, tw * m + g.kernel_w - 1))


def _zero_extended(xp: Any, array: Array, rows: int, columns: int, name: str) -> Array:
    """array (C, H, W, nb) with zero rows and columns appended up to rows x columns, in
    the thread's scratch ``name``; ``array`` itself where it already is that size."""
    channels, height, width, nb = array.shape
    if (height, width) == (rows, columns):
        return array
    out = scratch_array(xp, name, (channels, rows, columns, nb), array.dtype)
    out[:, :height, :width] = array
    out[:, height:] = 0
    out[:, :height, width:] = 0
    return out


@functools.cache
def matrices(kernel: int, tile: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A^T (m, a), G (a, r), B^T (a, a)) float64 for F(m x m, r x r), m = tile."""
    size = tile + kernel - 1
    points = POINTS[size - 1]

    def evaluation(columns: int) -> np.ndarray:  # rows: polynomial at each point, then infinity
        rows = [[p**i for i in range(columns)] for p in points]
        rows.append([0.0] * (columns - 1) + [1.0])
        return np.array(rows, dtype=np.float64)

    return evaluation(tile).T, evaluation(kernel), np.linalg.inv(evaluation(size)).T


def supported(geometry: Any) -> bool:
    """Stride 1, square 3x3 or 5x5 kernels, an output of whole 2x2 tiles."""
    g = geometry
    return (g.stride == 1 and g.kernel_h == g.kernel_w and g.kernel_h in (3, 5)
            and g.out_h % 2 == 0 and g.out_w % 2 == 0)


def _constant(xp: Any, matrix: np.ndarray, dtype: Any) -> Array:
    return xp.asarray(matrix.astype(dtype))


def weight_transform(xp: Any, weights: Array, tile: int) -> Array:
    """w (K, C, r, r) -> U (a*a, K, C) = G w G^T per kernel and channel."""
    kernels, channels, size, _ = weights.shape
    _, g_matrix, _ = matrices(size, tile)
    g = _constant(xp, g_matrix, weights.dtype)
    a = g.shape[0]
    # (r, r, K*C): contract rows, then columns
    flat = xp.ascontiguousarray(weights.transpose(2, 3, 0, 1)).reshape(size, size * kernels
                                                                         * channels)
    rows = (g @ flat).reshape(a, size, kernels * channels)
    return xp.ascontiguousarray(xp.matmul(g, rows)).reshape(a * a, kernels, channels)


def _two_sided(xp: Any, left: Array, values: Array, right_t: Array, name: str,
               out: Array = None) -> Array:
    """left @ X @ right_t^T for every column of values (p, q, n): (left rows, right rows,
    n), into ``out`` (default the thread's scratch)."""
    p, q, n = values.shape
    first = scratch_array(xp, name + " half", (left.shape[0], q * n), values.dtype)
    xp.matmul(left, values.reshape(p, q * n), out=first)
    shape = (left.shape[0], right_t.shape[0], n)
    out = scratch_array(xp, name, shape, values.dtype) if out is None else out.reshape(shape)
    xp.matmul(right_t, first.reshape(left.shape[0], q, n), out=out)
    return out


def transformed_input_shape(g: Any) -> tuple[int, int, int]:
    """V's shape per sample: (a*a, C, tiles); a chunk's is (a*a, C, tiles*nb)."""
    m = tile_of(g)
    a = m + g.kernel_h - 1
    th, tw = tiles_of(g)
    return a * a, g.channels, th * tw


def input_transform(xp: Any, g: Any, padded: Array, out: Array = None) -> Array:
    """padded (C, Hp, Wp, nb) -> V (a*a, C, tiles*nb) = B^T d B of every input patch,
    columns ordered (tile row, tile column, sample); into ``out`` (default scratch).
    Ragged tiles read zeros past the padded input."""
    _, _, bt_matrix = matrices(g.kernel_h, tile_of(g))
    bt = _constant(xp, bt_matrix, padded.dtype)
    a = bt.shape[0]
    padded = _zero_extended(xp, padded, *tiled_extent(g), "winograd extended input")
    channels, nb = padded.shape[0], padded.shape[3]
    m = tile_of(g)
    th, tw = tiles_of(g)
    s0, s1, s2, s3 = padded.strides
    patches = xp.lib.stride_tricks.as_strided(
        padded, (a, a, channels, th, tw, nb), (s1, s2, s0, m * s1, m * s2, s3))
    columns = channels * th * tw * nb
    gathered = scratch_array(xp, "winograd patches", (a, a, columns), padded.dtype)
    gathered.reshape(a, a, channels, th, tw, nb)[...] = patches
    return _two_sided(xp, bt, gathered, bt, "winograd input", out).reshape(
        a * a, channels, th * tw * nb)


def output_rows(xp: Any, g: Any, products: Array, out: Array) -> Array:
    """products M (a*a, K, tiles*nb) -> out (K, Ho*Wo*nb) batch-inner, = A^T M A
    (ragged tiles: the part on the map)."""
    at_matrix, _, _ = matrices(g.kernel_h, tile_of(g))
    at = _constant(xp, at_matrix, products.dtype)
    a, kernels = at.shape[1], products.shape[1]
    m = tile_of(g)
    th, tw = tiles_of(g)
    nb = products.shape[2] // (th * tw)
    tiles = _two_sided(xp, at, products.reshape(a, a, -1), at, "winograd output")
    by_tile = tiles.reshape(m, m, kernels, th, tw, nb).transpose(2, 3, 0, 4, 1, 5)
    if not ragged(g):
        out.reshape(kernels, th, m, tw, m, nb)[...] = by_tile
        return out
    whole = scratch_array(xp, "winograd whole tiles", (kernels, th * m, tw * m, nb),
                          products.dtype)
    whole.reshape(kernels, th, m, tw, m, nb)[...] = by_tile
    out.reshape(kernels, g.out_h, g.out_w, nb)[...] = whole[:, :g.out_h, :g.out_w]
    return out


def gradient_transform(xp: Any, g: Any, rows: Array, out: Array = None) -> Array:
    """dy rows (K, Ho*Wo*nb) -> dM (a*a, K, tiles*nb) = A dY A^T of every output tile,
    into ``out`` (default the thread's scratch). Ragged tiles: dy is 0 past the map."""
    at_matrix, _, _ = matrices(g.kernel_h, tile_of(g))
    a_matrix = _constant(xp, at_matrix.T, rows.dtype)  # (a, m)
    a = a_matrix.shape[0]
    kernels = rows.shape[0]
    m = tile_of(g)
    th, tw = tiles_of(g)
    nb = rows.shape[1] // (g.out_h * g.out_w)
    rows = _zero_extended(xp, rows.reshape(kernels, g.out_h, g.out_w, nb), th * m, tw * m,
                          "winograd whole dy")
    tiles = scratch_array(xp, "winograd dy tiles", (m, m, kernels * th * tw * nb),
                          rows.dtype)
    tiles.reshape(m, m, kernels, th, tw, nb)[...] = rows.reshape(
        kernels, th, m, tw, m, nb).transpose(2, 4, 0, 1, 3, 5)
    return _two_sided(xp, a_matrix, tiles, a_matrix, "winograd dy", out).reshape(
        a * a, kernels, th * tw * nb)


def add_input_gradient(xp: Any, g: Any, d_input: Array, dx_padded: Array) -> None:
    """dx_padded (C, rows, columns, nb) += the patches B dV B^T of d_input dV (a*a, C,
    tiles*nb); rows x columns: ``tiled_extent`` (Hp x Wp, more for ragged tiles)."""
    _, _, bt_matrix = matrices(g.kernel_h, tile_of(g))
    b = _constant(xp, bt_matrix.T, d_input.dtype)
    a = b.shape[0]
    channels, nb = dx_padded.shape[0], dx_padded.shape[3]
    m = tile_of(g)
    th, tw = tiles_of(g)
    patches = _two_sided(xp, b, d_input.reshape(a, a, -1), b, "winograd dx").reshape(
        a, a, channels, th, tw, nb)
    for i in range(a):
        for j in range(a):
            dx_padded[:, i:i + m * th:m, j:j + m * tw:m, :] += patches[i, j]


def weight_gradient(xp: Any, d_transformed: Array, size: int, tile: int) -> Array:
    """dU (a*a, K, C) summed over the batch -> dw (K, C, r, r) = G^T dU G."""
    _, g_matrix, _ = matrices(size, tile)
    gt = _constant(xp, g_matrix.T, d_transformed.dtype)  # (r, a)
    a, kernels, channels = g_matrix.shape[0], d_transformed.shape[1], d_transformed.shape[2]
    weights = _two_sided(xp, gt, d_transformed.reshape(a, a, kernels * channels), gt,
                         "winograd dw")
    return xp.ascontiguousarray(weights.reshape(size, size, kernels, channels).transpose(
        2, 3, 0, 1))


# ---------------------------------------------------------------- one chunk, both ways
def chunk_forward(xp: Any, g: Any, transformed: Any, inputs: Any,
                      out: Any | None) -> Any:
    """A chunk's product (K, Ho*Wo*nb) by Winograd from its transformed input V
    (a*a, C, tiles*nb), into ``out`` (default scratch)."""
    products = scratch_array(xp, "winograd products",
                             (inputs.shape[0], g.kernels, inputs.shape[2]), inputs.dtype)
    xp.matmul(transformed, inputs, out=products)
    if out is None:
        out = scratch_array(xp, "product", (g.kernels, products.shape[2] * g.positions
                                            // transformed_input_shape(g)[2]),
                            inputs.dtype)
    return output_rows(xp, g, products, out)


def transformed_gradient_shape(g: Any, nb: int) -> tuple[int, int, int]:
    """dM's shape for a chunk of ``nb`` samples: (a*a, K, tiles*nb)."""
    size, _, tiles = transformed_input_shape(g)
    return size, g.kernels, tiles * nb


def transformed_weight_gradient(xp: Any, d_products: Any, inputs: Any,
                                out: Any = None) -> Any:
    """A chunk's dU (a*a, K, C) = dM (a*a, K, tiles*nb) @ V^T, V its transformed input
    (a*a, C, tiles*nb); into ``out`` (default new)."""
    return xp.matmul(d_products, inputs.transpose(0, 2, 1), out=out)


def chunk_backward(xp: Any, g: Any, transformed: Any, inputs: Any, rows: Any,
                   dx_chunk: Any | None, need_db: bool, d_transformed: Any = None,
                   need_dw: bool = True, keep_transformed_dy: Any = None
                   ) -> tuple[Any, Any, Any]:
    """(dU (a*a, K, C) of the chunk or None without ``need_dw``, db (K,) or None, dM
    (a*a, K, tiles*nb), the transformed dy) from its transformed input V and dy rows;
    writes dx_chunk when given. d_transformed: where dU goes (default new);
    keep_transformed_dy: where dM goes (default the thread's scratch, overwritten by
    its next chunk)."""
    db = rows.sum(axis=1) if need_db else None
    d_products = gradient_transform(xp, g, rows, keep_transformed_dy)
    d_transformed = transformed_weight_gradient(xp, d_products, inputs, d_transformed) \
        if need_dw else None
    if dx_chunk is not None:
        d_inputs = scratch_array(xp, "winograd d inputs",
                                 (inputs.shape[0], g.channels, inputs.shape[2]), rows.dtype)
        xp.matmul(transformed.transpose(0, 2, 1), d_products, out=d_inputs)
        pad, nb = g.padding, dx_chunk.shape[0]
        dx_padded = scratch_array(xp, "dx_padded", (g.channels, *tiled_extent(g), nb),
                                  rows.dtype)
        dx_padded[...] = 0
        add_input_gradient(xp, g, d_inputs, dx_padded)
        dx_chunk[...] = dx_padded[:, pad:pad + g.height, pad:pad + g.width, :].transpose(
            3, 0, 1, 2)
    return d_transformed, db, d_products
