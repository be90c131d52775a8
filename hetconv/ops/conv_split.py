"""The backward pass of a conv layer with a chunk source, in two parts: dx now, the
weight gradient later (``conv2d_backward_split``).

The sample split's backward chain (hetconv/participant/samples/chain.py) computes a layer's weight
gradient while the next layer down waits for its peers' batch-norm sums: dx is needed
at once (it is the next layer's dy), dW only by the reduction. Both parts are the
chunk kernels of ``hetconv.ops.conv`` (``need_dw=False`` for the first, no dx for the
second), so the values are ``conv2d_backward_cached``'s (tests/unit/test_backward_split.py).
Under Winograd the first part keeps each chunk's transformed dy (dM, (a/m)^2 times dy's
size) in the layer's workspace for the second, which is then one GEMM per chunk
(transforming dy again in the second part made the split measurably slower than the
one-part backward: the transform is a large part of the backward's work).
"""
from __future__ import annotations

from typing import Any

from hetconv.backend import get_array_module, run_parallel
from hetconv.ops import conv_winograd
from hetconv.ops.conv import (
    BATCH_INNER,
    SAMPLE_MAJOR,
    SHIFTED_TAPS,
    WINOGRAD,
    ChunkSource,
    ConvCache,
    final_weight_gradient,
    summed_weight_gradient,
)
from hetconv.ops.conv_chunks import backward_rows, unfold
from hetconv.ops.conv_shifted import shifted_backward

__all__ = ["PendingWeightGradient", "conv2d_backward_split"]


class PendingWeightGradient:
    """The weight gradient of a backward pass whose dx is done already
    (``conv2d_backward_split``): :meth:`compute` returns dw (K, C, kh, kw) in the
    forward's dtype, from the chunks' dy rows and the forward's cache, which it keeps
    until then. Compute it before the next forward through the same workspace."""

    def __init__(self, cache: ConvCache, rows: list[Any]):
        self._cache: ConvCache | None = cache
        self._rows = rows

    def compute(self) -> Any:
        cache = self._cache
        if cache is None:
            raise RuntimeError("this weight gradient was computed already")
        self._cache = None
        g, xp = cache.geometry, get_array_module(cache.weight_matrix)
        rows, dtype = self._rows, cache.weight_matrix.dtype
        self._rows = []
        if not (g.kernels and cache.chunks):
            return final_weight_gradient(xp, cache, None)

        def task(index: int) -> Any:
            padded, chunk_rows = cache.inputs[index], rows[index]
            if cache.layout == SHIFTED_TAPS:
                nb = cache.chunks[index][1] - cache.chunks[index][0]
                return shifted_backward(xp, g, None, padded, chunk_rows.reshape(
                    g.kernels, g.out_h, g.out_w, nb), None, False)[0]
            keep = None if cache.keep is None else cache.keep.get(
                f"conv dw {index}", cache.transformed.shape if cache.layout == WINOGRAD
                else (g.taps, g.kernels), dtype)
            if cache.layout == WINOGRAD:  # chunk_rows: its transformed dy, kept
                return conv_winograd.transformed_weight_gradient(xp, chunk_rows, padded, keep)
            return backward_rows(xp, g, None, unfold(xp, g, cache.layout, padded),
                                 chunk_rows, None, False, keep)[0]

        parts = run_parallel(task, len(cache.chunks), cache.threads)
        return final_weight_gradient(xp, cache, summed_weight_gradient(xp, cache, parts))


def conv2d_backward_split(cache: ConvCache, source: ChunkSource
                          ) -> tuple[Any, PendingWeightGradient]:
    """``conv2d_backward_cached(cache, None, need_dx=True, need_db=False, source=source)``
    in two parts: dx (B, C, H, W) now, the weight gradient when the returned
    :class:`PendingWeightGradient` is computed (e.g. while a barrier's pieces are in
    flight). The source's rows must stay valid until then (``hetconv.ops.block_fast``'s
    are its kept conv output). Same values as the one-part call; under shifted taps
    (stride 1) the weight gradient is the one-part call's without dx, summed in another
    order."""
    g = cache.geometry
    xp = get_array_module(cache.weight_matrix)
    dtype = cache.weight_matrix.dtype
    if cache.layout == SAMPLE_MAJOR:
        raise ValueError("conv2d backward: a chunk source needs the batch-inner, shifted-taps "
                         "or Winograd layout")
    dx = (xp.zeros if g.kernels == 0 else xp.empty)(
        (g.batch, g.channels, g.height, g.width), dtype)
    rows: list[Any] = [None] * len(cache.chunks)
    if g.kernels and cache.chunks:
        offset_weights = None
        if cache.layout == BATCH_INNER:
            weights4 = cache.weight_matrix.reshape(g.kernels, g.channels, g.kernel_h, g.kernel_w)
            offset_weights = xp.ascontiguousarray(weights4.transpose(0, 2, 3, 1)).reshape(
                g.kernels, g.taps)

        def task(index: int) -> None:
            start, stop = cache.chunks[index]
            chunk_rows = rows[index] = source.gradient_rows(index, start, stop)
            padded, dx_chunk = cache.inputs[index], dx[start:stop]
            if cache.layout == SHIFTED_TAPS:
                shifted_backward(xp, g, cache.weights_by_tap, padded, chunk_rows.reshape(
                    g.kernels, g.out_h, g.out_w, stop - start), dx_chunk, False, need_dw=False)
            elif cache.layout == WINOGRAD:  # keeps the transformed dy for the second part
                shape = conv_winograd.transformed_gradient_shape(g, stop - start)
                kept = xp.empty(shape, dtype) if cache.keep is None else cache.keep.get(
                    f"conv winograd dy {index}", shape, dtype)
                rows[index] = conv_winograd.chunk_backward(
                    xp, g, cache.transformed, padded, chunk_rows, dx_chunk, False,
                    need_dw=False, keep_transformed_dy=kept)[2]
            else:
                backward_rows(xp, g, offset_weights, None, chunk_rows, dx_chunk, False,
                              need_dw=False)

        run_parallel(task, len(cache.chunks), cache.threads)
    return dx, PendingWeightGradient(cache, rows)
