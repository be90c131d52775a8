"""Fast 2-D convolution kernels (im2col + GEMM) for any share of a layer's kernels.

The convolution is a cross-correlation, ``y[b, k] = sum_c w[k, c] * x[b, c] + bias[k]``.
The zero-padded input is unfolded into a column matrix ``col`` whose rows are the
``Q = C*kh*kw`` kernel taps and whose columns are output positions, so that each of
the three products of training is one matrix product (GEMM) on contiguous operands:

    forward         y    = W (K x Q) @ col (Q x N)
    weight grad     dW   = dy (K x N) @ col^T
    input grad      dcol = W^T @ dy,  then col2im: kh*kw strided adds into dx

The algorithm is chosen per shape and kernel share by ``choose_layout``
(:mod:`hetconv.ops.conv_geometry`, which describes the two im2col column layouts,
``batch_inner`` and ``sample_major``, and ``shifted_taps``).

A fourth, ``winograd`` (``hetconv.ops.conv_winograd``), needs 36/144 or 16/36 (3x3) or
36/100 (5x5) of the multiply-adds; it replaces im2col for stride-1 3x3 and 5x5 layers
with an even output and enough channels and kernels (WINOGRAD_MIN_CHANNELS), where the
cost model does not already pick shifted taps. ``choose_layout`` itself names only the
three im2col-family algorithms.

On numpy the batch is split into chunks small enough that each chunk's big temporary
(the unfolded input, or the per-tap products) stays in cache (CHUNK_WORKING_BYTES),
and at least a few per host thread, run by the backend's thread pool
(``hetconv.backend.run_parallel``: one thread per BLAS thread while BLAS is held to one
thread), so the memory-bound copies run in parallel too. The cached pair keeps only the
padded input; the backward pass unfolds each chunk again while it is hot, which is
cheaper than writing the kh*kw times larger unfolded input to memory and reading it
back. Everything is dtype-generic and works on cupy through ``get_array_module`` (one
chunk). The per-chunk kernels live in ``hetconv.ops.conv_chunks``.

Chunk hooks (numpy and cupy, batch-inner and shifted-taps layouts): instead of y, a
``ChunkSink`` receives every chunk's product (K, Ho*Wo*nb), batch innermost, on the
thread that computed it, while it is in cache; a ``ChunkSource`` hands each chunk's dy
in that layout to the backward pass. The layer's batch norm, ReLU and pooling do their
work there (``hetconv.ops.block_fast``) instead of in passes of their own over y.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetconv.backend import get_array_module, host_threads, run_parallel
from hetconv.ops import conv_winograd
from hetconv.ops.conv_chunks import (
    BATCH_INNER,
    SAMPLE_MAJOR,
    SHIFTED_TAPS,  # no unfolding: see hetconv.ops.conv_shifted
    ChunkSink,
    ChunkSource,
    backward_rows,
    backward_sample_major,
    by_kernels,
    forward_chunk,
    padded_input,
    product,
    rows_of,
    run_chunks,
    sum_in_order,
    unfold,
)
from hetconv.ops.conv_geometry import (
    LAYOUTS,
    MODEL_COPY_S,
    MODEL_FLOP_PER_S,
    SAMPLE_MAJOR_MIN_POSITIONS,
    SAMPLE_MAJOR_MIN_POSITIONS_FEW_TAPS,
    ConvGeometry,
    choose_im2col_layout,
    choose_layout,
    estimated_seconds,
    make_geometry,
)
from hetconv.ops.conv_shifted import (
    shifted_backward,
    shifted_forward,
    shifted_product,
    tap_weights,
)
from hetconv.ops.workspace import Workspace, thread_scratch

__all__ = [
    "BATCH_INNER", "LAYOUTS", "MODEL_COPY_S", "MODEL_FLOP_PER_S", "SAMPLE_MAJOR",
    "SAMPLE_MAJOR_MIN_POSITIONS", "SAMPLE_MAJOR_MIN_POSITIONS_FEW_TAPS", "SHIFTED_TAPS",
    "WINOGRAD", "WINOGRAD_MIN_CHANNELS", "ChunkSink", "ChunkSource", "ConvCache",
    "ConvGeometry", "choose_im2col_layout", "choose_layout", "conv2d", "conv2d_backward",
    "conv2d_backward_cached", "conv2d_forward_cached", "estimated_seconds",
    "final_weight_gradient", "make_geometry", "summed_weight_gradient"]

WINOGRAD = "winograd"  # F(2x2, r x r) for 3x3 and 5x5 kernels: see hetconv.ops.conv_winograd
WINOGRAD_MIN_CHANNELS = {3: 16, 5: 8}  # by kernel size: with fewer input channels or kernels
# the transforms cost more than the multiply-adds they save (measured, one thread)
PARALLEL_MIN_FLOP = 2e7  # below this a forward runs on the calling thread only
CHUNKS_PER_THREAD = 2  # more chunks than threads: a busy core does not hold the rest up
MIN_CHUNK_COLUMNS = 1024  # ... but each chunk's GEMMs stay at least this wide (nb*Ho*Wo)
CHUNK_WORKING_BYTES = 2 << 20  # numpy: batch chunks whose big temporary stays in cache
MIN_CACHE_CHUNK = 4  # ... but at least this many samples (fewer: per-call overheads win)
MIN_SINK_CHUNK = 8  # with a sink: samples per chunk at least (its views run nb numbers long)
SINK_CHUNKS_PER_THREAD = 2
SINK_WORKING_BYTES = 8 << 20  # ... and as many as keep the unfolded input within this


@dataclass
class ConvCache:
    """What ``conv2d_backward_cached`` needs from ``conv2d_forward_cached`` (opaque).

    weight_matrix: (K, Q) contiguous; inputs: the forward's input, one array per batch
    chunk, zero-padded as (C, Hp, Wp, nb) for the batch-inner and shifted-taps layouts,
    (nb, C, Hp, Wp) for the sample-major one. The backward pass unfolds each chunk
    again while it is in cache rather than keeping (and re-reading) the kh*kw times
    larger unfolded input.
    """

    geometry: ConvGeometry
    layout: str
    weight_matrix: Any
    chunks: list[tuple[int, int]]  # batch ranges [start, stop)
    threads: int  # threads that run the chunks
    inputs: list[Any]
    weights_by_tap: Any = None  # (kh*kw*K, C), shifted taps only
    transformed: Any = None  # (a*a, K, C) transformed weights, Winograd only
    keep: Workspace | None = None  # the forward's workspace, also for the backward's parts



# ---------------------------------------------------------------- chunks


def _working_bytes_per_sample(g: ConvGeometry, layout: str, itemsize: int) -> int:
    """Bytes of the largest per-chunk temporary, per sample: the unfolded input for
    im2col, the per-tap products (kh*kw*K numbers per padded position) for shifted taps."""
    if layout == SHIFTED_TAPS:
        padded_positions = (g.height + 2 * g.padding) * (g.width + 2 * g.padding)
        return g.kernel_h * g.kernel_w * g.kernels * padded_positions * itemsize
    return g.taps * g.positions * itemsize


def _plan_chunks(xp: Any, g: ConvGeometry, layout: str, itemsize: int, sink: bool = False
                 ) -> tuple[list[tuple[int, int]], int]:
    """(batch ranges [start, stop), threads to run them).

    cupy: one range. numpy: a few ranges per host thread for large work (backend),
    and ranges small enough that each chunk's big temporary stays in cache
    (CHUNK_WORKING_BYTES, at least MIN_CACHE_CHUNK samples). With a sink the plan does
    not depend on the kernel count (a share of a layer's kernels sums its statistics in
    the whole layer's order): chunks of at least MIN_SINK_CHUNK samples,
    more while the unfolded input stays within SINK_WORKING_BYTES, the same number for
    every thread, and a few per thread when the batch allows.
    """
    threads, count = 1, 1
    if xp is np and sink:
        if 2.0 * g.batch * g.taps * g.positions * 16 >= PARALLEL_MIN_FLOP:
            threads = host_threads(g.batch)
        per_sample = max(1, _working_bytes_per_sample(g, BATCH_INNER, itemsize))
        samples = max(MIN_SINK_CHUNK, SINK_WORKING_BYTES // per_sample)
        count = -(-g.batch // samples)
        if g.batch >= threads * SINK_CHUNKS_PER_THREAD * MIN_SINK_CHUNK:
            count = max(count, threads * SINK_CHUNKS_PER_THREAD)
        count = -(-max(count, threads) // threads) * threads  # the same number per thread
    elif xp is np:
        if g.forward_flop >= PARALLEL_MIN_FLOP:
            threads = host_threads(g.batch)
            widest = max(1, g.batch * g.positions // MIN_CHUNK_COLUMNS)
            count = max(threads, min(threads * CHUNKS_PER_THREAD, widest, g.batch))
        per_sample = max(1, _working_bytes_per_sample(g, layout, itemsize))
        samples = max(MIN_CACHE_CHUNK, CHUNK_WORKING_BYTES // per_sample)
        count = max(count, -(-g.batch // samples))
    count = max(1, min(count, g.batch))
    edges = [g.batch * i // count for i in range(count + 1)]
    chunks = [(edges[i], edges[i + 1]) for i in range(count) if edges[i + 1] > edges[i]]
    return chunks, threads


# ---------------------------------------------------------------- public functions
def _prepare(x: Any, w: Any, stride: int, padding: int, layout: str | None,
             sink: bool = False, winograd: bool = True, keep: Workspace | None = None
             ) -> tuple[Any, Any, ConvCache]:
    """(xp, x cast to the common dtype, cache without inputs)."""
    xp = get_array_module(x, w)
    dtype = xp.result_type(x.dtype, w.dtype)
    g = make_geometry(tuple(x.shape), tuple(w.shape), stride, padding)
    if sink and layout == SAMPLE_MAJOR:
        raise ValueError("conv2d: a chunk sink needs the batch-inner, shifted-taps or "
                         "Winograd layout")
    if layout is None:
        layout = choose_layout(g)
        if winograd and layout != SHIFTED_TAPS and (conv_winograd.supported(g) and min(
                g.channels, g.kernels) >= WINOGRAD_MIN_CHANNELS.get(g.kernel_h, g.channels + 1)):
            layout = WINOGRAD  # where the kernel share is not small enough for shifted taps
        elif sink and layout == SAMPLE_MAJOR:
            layout = BATCH_INNER
    if layout == WINOGRAD and not conv_winograd.supported(g):
        raise ValueError("conv2d: Winograd needs stride 1, a 3x3 or 5x5 kernel and an even "
                         "output")
    if layout not in (*LAYOUTS, WINOGRAD):
        raise ValueError(f"conv2d: unknown layout {layout!r}, use one of {LAYOUTS}")
    weight_matrix = xp.ascontiguousarray(w, dtype=dtype).reshape(g.kernels, g.taps)
    cache = ConvCache(g, layout, weight_matrix,
                      *_plan_chunks(xp, g, layout, np.dtype(dtype).itemsize, sink), [])
    if layout == SHIFTED_TAPS:
        cache.weights_by_tap = tap_weights(xp, weight_matrix, g)
    if layout == WINOGRAD:
        tile, weights = conv_winograd.tile_of(g), weight_matrix.reshape(w.shape)
        size = conv_winograd.transformed_input_shape(g)[0]
        shape = (size, g.kernels, g.channels)
        cache.transformed = (xp.empty(shape, dtype) if keep is None or xp is not np
                             else keep.get("conv winograd weights", shape, dtype))
        by_kernels(xp, g.kernels, cache.threads, lambda k: cache.transformed.__setitem__(
            (slice(None), k), conv_winograd.weight_transform(xp, weights[k], tile)))
    return xp, x.astype(dtype, copy=False), cache


def conv2d_forward_cached(x: Any, w: Any, b: Any | None = None, stride: int = 1,
                          padding: int = 0, *, layout: str | None = None,
                          rows_ready: Callable[[int], None] | None = None,
                          sink: ChunkSink | None = None, workspace: Workspace | None = None,
                          winograd: bool = True) -> tuple[Any, ConvCache]:
    """Forward convolution that keeps the (padded) input for the backward pass.

    x: (B, C, H, W); w: (K, C, kh, kw), any slice of a layer's kernels (K may be 0);
    b: (K,) or None. stride, padding: pixels (zero padding on all four sides).
    Returns y (B, K, Ho, Wo) contiguous, Ho = (H + 2*padding - kh)//stride + 1 (same
    for Wo), in the common dtype of x and w, and an opaque cache for
    ``conv2d_backward_cached``. layout: force one of LAYOUTS (tests, benchmarks);
    default ``choose_layout``.

    sink: every chunk's product goes to ``sink`` (module docstring; b must be None)
    and y is None. winograd: False keeps the default layout within the im2col family. workspace: keep the padded input there between calls (numpy; the
    next call with the same workspace reuses it).

    rows_ready (streaming, for overlapping a transfer with the products): x is a buffer
    still being filled in batch order; ``rows_ready(n)`` is called before the chunks
    that read samples below ``n`` run and returns once samples [0, n) of x are in. x
    must then already have the common dtype (no copy is made of it). The chunks and
    their order are those of the unstreamed call, so the result is bit for bit the same.
    """
    if rows_ready is not None and x.dtype != get_array_module(x, w).result_type(x.dtype,
                                                                                 w.dtype):
        raise ValueError("conv2d: a streamed input must already have the weights' dtype")
    if sink is not None and b is not None:
        raise ValueError("conv2d: a chunk sink takes the product without a bias")
    keep = workspace if get_array_module(x, w) is np else None
    xp, x, cache = _prepare(x, w, stride, padding, layout, sink is not None, winograd, keep)
    g = cache.geometry
    cache.keep = keep
    y: Any = None if sink is not None else xp.empty((g.batch, g.kernels, g.out_h, g.out_w),
                                                    x.dtype)
    bias = None if b is None else xp.asarray(b, dtype=x.dtype).reshape(g.kernels)

    def task(index: int) -> Any:
        start, stop = cache.chunks[index]
        where = (None if keep is None else (thread_scratch(), "winograd padded")
                 if cache.layout == WINOGRAD else (keep, f"conv padded {index}"))
        padded = padded_input(xp, g, cache.layout, x[start:stop], where)
        if not g.kernels:
            return padded
        if cache.layout == WINOGRAD:  # keeps V, the transformed input, not the padded one
            shape = (g.kernels, g.positions * (stop - start))
            size, channels, tiles = conv_winograd.transformed_input_shape(g)
            v_shape = (size, channels, tiles * (stop - start))
            inputs = conv_winograd.input_transform(
                xp, g, padded, xp.empty(v_shape, x.dtype) if keep is None
                else keep.get(f"conv winograd input {index}", v_shape, x.dtype))
            rows = conv_winograd.chunk_forward(xp, g, cache.transformed, inputs, None if sink is None
                                     else sink.rows(index, shape, x.dtype))
            if sink is not None:
                sink.done(index, start, stop, rows)
            else:
                y[start:stop] = rows.reshape(g.kernels, g.out_h, g.out_w, stop - start
                                             ).transpose(3, 0, 1, 2)
                if bias is not None:
                    y[start:stop] += bias[:, None, None]
            return inputs
        elif sink is not None:
            shape = (g.kernels, g.positions * (stop - start))
            if cache.layout == SHIFTED_TAPS:
                rows = sink.rows(index, shape, x.dtype)
                rows[...] = shifted_product(xp, g, cache.weights_by_tap, padded).reshape(shape)
            else:
                rows = product(xp, g, cache.weight_matrix, unfold(xp, g, cache.layout, padded),
                               out=sink.rows(index, shape, x.dtype))
            sink.done(index, start, stop, rows)
        elif cache.layout == SHIFTED_TAPS:
            shifted_forward(xp, g, cache.weights_by_tap, padded, bias, y[start:stop])
        else:
            forward_chunk(xp, g, cache.layout, cache.weight_matrix,
                          unfold(xp, g, cache.layout, padded), bias, y[start:stop])
        return padded

    cache.inputs = run_chunks(task, cache.chunks, cache.threads, before=rows_ready)
    return y, cache


def conv2d_backward_cached(cache: ConvCache, dy: Any, need_dx: bool = True,
                           dx_rows: Callable[[Any, int, int], None] | None = None,
                           need_db: bool = True, source: ChunkSource | None = None
                           ) -> tuple[Any | None, Any, Any]:
    """Gradients from the cache of ``conv2d_forward_cached`` and dy (B, K, Ho, Wo), or,
    with a ``source`` (dy None), each chunk's dy from the source.

    Returns (dx (B, C, H, W) or None when need_dx is False, dw (K, C, kh, kw),
    db (K,); zeros when need_db is False), all in the forward's dtype. With 0 kernels
    dx is zeros.

    dx_rows (streaming, for sending dx while the rest is computed): called on the
    calling thread as ``dx_rows(dx, start, stop)`` each time samples [start, stop) of dx
    are final, in batch order, ending at B (only when need_dx). Same chunks, same result.
    """
    g = cache.geometry
    xp = get_array_module(cache.weight_matrix) if source is not None else get_array_module(
        dy, cache.weight_matrix)
    dtype = cache.weight_matrix.dtype
    if source is None:
        expected = (g.batch, g.kernels, g.out_h, g.out_w)
        if tuple(dy.shape) != expected:
            raise ValueError(f"conv2d backward: dy has shape {tuple(dy.shape)}, "
                             f"expected {expected}")
        dy = xp.ascontiguousarray(dy, dtype=dtype)
    dx_shape = (g.batch, g.channels, g.height, g.width)
    dx = (xp.zeros if g.kernels == 0 else xp.empty)(dx_shape, dtype) if need_dx else None
    dw: Any = None
    db: Any = None
    if g.kernels and cache.chunks:
        offset_weights = None
        if need_dx and cache.layout != SHIFTED_TAPS:
            # (K, C, kh, kw) -> (K, kh, kw, C): one small copy of the weights
            weights4 = cache.weight_matrix.reshape(g.kernels, g.channels, g.kernel_h, g.kernel_w)
            offset_weights = xp.ascontiguousarray(weights4.transpose(0, 2, 3, 1))
            offset_weights = offset_weights.reshape(g.kernels, g.taps)

        def kept_part(index: int, shape: tuple[int, ...]) -> Any:
            """Where chunk ``index``'s weight gradient goes: the workspace, or new."""
            return None if cache.keep is None else cache.keep.get(f"conv dw {index}", shape,
                                                                  dtype)

        def task(index: int) -> tuple[Any, Any]:
            start, stop = cache.chunks[index]
            padded, dx_chunk = cache.inputs[index], None if dx is None else dx[start:stop]
            # (Winograd keeps V, the transformed input, instead of the padded input)
            if cache.layout == SHIFTED_TAPS:
                dy_t = (source.gradient_rows(index, start, stop).reshape(
                    g.kernels, g.out_h, g.out_w, stop - start) if source is not None
                    else dy[start:stop].transpose(1, 2, 3, 0))
                return shifted_backward(xp, g, cache.weights_by_tap if need_dx else None,
                                        padded, dy_t, dx_chunk, need_db)
            if cache.layout == WINOGRAD:
                rows = source.gradient_rows(index, start, stop) if source is not None \
                    else rows_of(xp, g, dy[start:stop])
                return conv_winograd.chunk_backward(
                    xp, g, cache.transformed, padded, rows, dx_chunk, need_db,
                    kept_part(index, cache.transformed.shape))[:2]
            if cache.layout == SAMPLE_MAJOR:
                return backward_sample_major(xp, g, offset_weights,
                                             unfold(xp, g, cache.layout, padded),
                                             dy[start:stop], dx_chunk, need_db)
            rows = source.gradient_rows(index, start, stop) if source is not None else rows_of(
                xp, g, dy[start:stop])
            return backward_rows(xp, g, offset_weights, unfold(xp, g, cache.layout, padded),
                                 rows, dx_chunk, need_db,
                                 kept_part(index, (g.taps, g.kernels)))

        after = None if dx_rows is None or dx is None else (
            lambda start, stop: dx_rows(dx, start, stop))
        parts = run_chunks(task, cache.chunks, cache.threads, after=after)
        dw = summed_weight_gradient(xp, cache, [chunk_dw for chunk_dw, _ in parts])
        if need_db:
            db = parts[0][1]
            for _, part_db in parts[1:]:
                db += part_db
    elif dx_rows is not None and dx is not None:
        dx_rows(dx, 0, g.batch)
    if db is None:
        db = xp.zeros((g.kernels,), dtype)
    return dx, final_weight_gradient(xp, cache, dw), db


def summed_weight_gradient(xp: Any, cache: ConvCache, parts: list[Any]) -> Any:
    """The chunks' weight gradients (K, Q) each, or dU (a*a, K, C) each under Winograd,
    added in chunk order: dw (K, Q), or (K, C, kh, kw) under Winograd."""
    g = cache.geometry
    dw = sum_in_order(xp, parts, cache.threads)
    if cache.layout == WINOGRAD:
        d_transformed, tile = dw, conv_winograd.tile_of(g)
        dw = xp.empty((g.kernels, g.channels, g.kernel_h, g.kernel_w), cache.weight_matrix.dtype)
        by_kernels(xp, g.kernels, cache.threads, lambda k: dw.__setitem__(
            k, conv_winograd.weight_gradient(xp, d_transformed[:, k], g.kernel_h, tile)))
    return dw


def final_weight_gradient(xp: Any, cache: ConvCache, dw: Any | None) -> Any:
    """dw as a new (K, C, kh, kw) array of its own (the parts may be the workspace's);
    zeros for None (no kernels or no chunks)."""
    g, dtype = cache.geometry, cache.weight_matrix.dtype
    if dw is None:
        dw = xp.zeros((g.kernels, g.taps), dtype)
    dw = xp.array(dw, dtype=dtype, order="C") if cache.keep is not None and cache.layout != \
        WINOGRAD else xp.ascontiguousarray(dw)
    return dw.reshape(g.kernels, g.channels, g.kernel_h, g.kernel_w)


def conv2d(x: Any, w: Any, b: Any | None = None, stride: int = 1, padding: int = 0) -> Any:
    """y (B, K, Ho, Wo) = x (B, C, H, W) cross-correlated with w (K, C, kh, kw) + b (K,).

    Same as ``conv2d_forward_cached`` without keeping the cache.
    """
    y, _ = conv2d_forward_cached(x, w, b, stride, padding)
    return y


def conv2d_backward(x: Any, w: Any, dy: Any, stride: int = 1, padding: int = 0,
                    need_dx: bool = True) -> tuple[Any | None, Any, Any]:
    """(dx (B, C, H, W) or None, dw (K, C, kh, kw), db (K,)) for dy (B, K, Ho, Wo).

    Pads x again (no forward product); use the cached pair in training.
    """
    xp, x, cache = _prepare(x, w, stride, padding, None)
    g = cache.geometry

    def kept_input(index: int) -> Any:  # what the forward pass would have kept
        padded = padded_input(xp, g, cache.layout, x[slice(*cache.chunks[index])])
        if cache.layout == WINOGRAD:
            size, channels, tiles = conv_winograd.transformed_input_shape(g)
            out = xp.empty((size, channels, tiles * padded.shape[3]), x.dtype)
            return conv_winograd.input_transform(xp, g, padded, out)
        return padded
    cache.inputs = run_parallel(kept_input, len(cache.chunks), cache.threads)
    return conv2d_backward_cached(cache, dy, need_dx)
