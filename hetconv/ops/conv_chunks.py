"""The per-chunk kernels of the im2col convolution (``hetconv.ops.conv``), the copies
between its layouts, the chunk hooks and how the chunks run.

Every function works on one batch chunk of ``nb`` samples. Layouts of a chunk:

* canonical: x (nb, C, H, W), y and dy (nb, K, Ho, Wo), as the caller sees them;
* batch-inner: padded input (C, Hp, Wp, nb), columns (Q, Ho*Wo*nb), the product and
  dy rows (K, Ho*Wo*nb), i.e. (K, Ho, Wo, nb): the batch innermost, so that the
  unfolding and folding copy runs of ``Wo*nb`` numbers;
* sample-major: padded input (nb, C, Hp, Wp), columns (nb, Q, Ho*Wo);
* chunk hooks: a ``ChunkSink`` takes each chunk's batch-inner product, a
  ``ChunkSource`` gives each chunk's dy rows, so that the layer's following ops work on
  a chunk while it is in cache (``hetconv.ops.block_fast``).

The chunks run on the host-thread pool (``run_chunks``); what they return is combined
in chunk order (``sum_in_order``), so results never depend on which thread ran what.

Temporaries come from the calling thread's scratch (``thread_scratch``) when ``xp`` is
numpy; nothing returned to a caller is scratch unless the docstring says so.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from hetconv.backend import run_parallel
from hetconv.ops.workspace import Workspace, thread_scratch

BATCH_INNER = "batch_inner"
SAMPLE_MAJOR = "sample_major"
SHIFTED_TAPS = "shifted_taps"
TRANSPOSE_BLOCK_ELEMENTS = 1 << 15  # numbers per block of the y / dy transposes
SAMPLE_BLOCK = 8  # samples per GEMM batch in the sample-major layout


def _scratch(xp: Any) -> Workspace | None:
    return thread_scratch() if xp is np else None


def _empty(xp: Any, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
    """Uninitialised scratch (numpy: the thread's ``name`` array; else a new array)."""
    scratch = _scratch(xp)
    return xp.empty(shape, dtype) if scratch is None else scratch.get(name, shape, dtype)


def scratch_array(xp: Any, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
    """The calling thread's scratch ``name`` (numpy), or a new array (other modules)."""
    return _empty(xp, name, shape, dtype)


def _zeros(xp: Any, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
    scratch = _scratch(xp)
    return xp.zeros(shape, dtype) if scratch is None else scratch.zeros(name, shape, dtype)


def padded_input(xp: Any, g: Any, layout: str, x_chunk: Any,
                 keep: tuple[Workspace, str] | None = None) -> Any:
    """x_chunk (nb, C, H, W) zero-padded: (C, Hp, Wp, nb) for the batch-inner and
    shifted-taps layouts, (nb, C, Hp, Wp) for the sample-major one. ``keep``
    (workspace, name): the array is that workspace's, kept for the next step (its zero
    border is written once), else a new array."""
    nb, pad = x_chunk.shape[0], g.padding
    hp, wp = g.height + 2 * pad, g.width + 2 * pad
    shape = (nb, g.channels, hp, wp) if layout == SAMPLE_MAJOR else (g.channels, hp, wp, nb)
    if keep is not None and xp is np:
        padded = keep[0].kept_zeros(keep[1], shape, x_chunk.dtype)
    elif layout == SAMPLE_MAJOR and not pad:
        return x_chunk.copy()
    else:
        padded = (xp.zeros if pad else xp.empty)(shape, x_chunk.dtype)
    if layout == SAMPLE_MAJOR:
        padded[:, :, pad:pad + g.height, pad:pad + g.width] = x_chunk
    else:
        padded[:, pad:pad + g.height, pad:pad + g.width, :] = x_chunk.transpose(1, 2, 3, 0)
    return padded


def unfold(xp: Any, g: Any, layout: str, padded: Any) -> Any:
    """im2col of a padded chunk into the thread's scratch: (Q, P*nb) batch-inner or
    (nb, Q, P) sample-major. Scratch: valid until the thread's next ``unfold``."""
    kh, kw, ho, wo, st = g.kernel_h, g.kernel_w, g.out_h, g.out_w, g.stride
    as_strided = xp.lib.stride_tricks.as_strided
    s0, s1, s2, s3 = padded.strides
    if layout == BATCH_INNER:
        nb = padded.shape[3]
        shape = (g.channels, kh, kw, ho, wo, nb)
        strides = (s0, s1, s2, s1 * st, s2 * st, s3)
        columns = _empty(xp, "columns", (g.taps, g.positions * nb), padded.dtype)
    else:
        nb = padded.shape[0]
        shape = (nb, g.channels, kh, kw, ho, wo)
        strides = (s0, s1, s2, s3, s2 * st, s3 * st)
        columns = _empty(xp, "columns", (nb, g.taps, g.positions), padded.dtype)
    columns.reshape(shape)[...] = as_strided(padded, shape, strides)
    return columns


def kernel_blocks(xp: Any, kernels: int, numbers_per_kernel: int) -> list[slice]:
    """Kernel ranges whose slice of y holds about TRANSPOSE_BLOCK_ELEMENTS numbers."""
    step = max(1, TRANSPOSE_BLOCK_ELEMENTS // max(1, numbers_per_kernel))
    step = step if xp is np else kernels
    return [slice(start, min(kernels, start + step)) for start in range(0, kernels, step)]


def product(xp: Any, g: Any, weight_matrix: Any, columns: Any, out: Any = None) -> Any:
    """W (K, Q) @ columns (Q, P*nb): (K, P*nb), the batch-inner y, into ``out`` (default
    the thread's scratch)."""
    if out is None:
        out = _empty(xp, "product", (g.kernels, columns.shape[1]), columns.dtype)
    xp.matmul(weight_matrix, columns, out=out)
    return out


def forward_chunk(xp: Any, g: Any, layout: str, weight_matrix: Any, columns: Any,
                  bias: Any, y_chunk: Any) -> None:
    """Write y_chunk (nb, K, Ho, Wo) = conv of the chunk whose unfolding is ``columns``."""
    nb, kernels, positions = y_chunk.shape[0], g.kernels, g.positions
    y3 = y_chunk.reshape(nb, kernels, positions)  # a view: y_chunk is contiguous
    if layout == BATCH_INNER:
        rows = product(xp, g, weight_matrix, columns).reshape(kernels, positions, nb)
        for block in kernel_blocks(xp, kernels, positions * nb):
            target = y3[:, block]
            target[...] = rows[block].transpose(2, 0, 1)
            if bias is not None:
                target += bias[block, None]
        return
    for start in range(0, nb, SAMPLE_BLOCK):
        target = y3[start:start + SAMPLE_BLOCK]
        xp.matmul(weight_matrix, columns[start:start + SAMPLE_BLOCK], out=target)
        if bias is not None:
            target += bias[:, None]


def rows_of(xp: Any, g: Any, dy_chunk: Any) -> Any:
    """Canonical dy (nb, K, Ho, Wo) as batch-inner rows (K, Ho*Wo*nb), in the thread's
    scratch (valid until its next ``rows_of``)."""
    nb, kernels, positions = dy_chunk.shape[0], g.kernels, g.positions
    dy3 = dy_chunk.reshape(nb, kernels, positions)
    rows = _empty(xp, "dy_rows", (kernels, positions, nb), dy_chunk.dtype)
    for block in kernel_blocks(xp, kernels, positions * nb):
        rows[block] = dy3[:, block].transpose(1, 2, 0)
    return rows.reshape(kernels, positions * nb)


def col2im_add(g: Any, dcol: Any, dx_padded: Any, batch_last: bool) -> None:
    """dx_padded += col2im(dcol): kh*kw strided adds, each of one contiguous dcol block.

    batch_last: dcol (kh, kw, C, Ho, Wo, nb) into dx_padded (C, Hp, Wp, nb);
    otherwise dcol (nb, kh, kw, C, Ho, Wo) into dx_padded (nb, C, Hp, Wp).
    """
    st = g.stride
    for i in range(g.kernel_h):
        rows = slice(i, i + st * (g.out_h - 1) + 1, st)
        for j in range(g.kernel_w):
            cols = slice(j, j + st * (g.out_w - 1) + 1, st)
            if batch_last:
                dx_padded[:, rows, cols, :] += dcol[i, j]
            else:
                dx_padded[:, :, rows, cols] += dcol[:, i, j]


def backward_rows(xp: Any, g: Any, offset_weights: Any | None, columns: Any, dy_rows: Any,
                  dx_chunk: Any | None, need_db: bool, dw_t: Any = None,
                  need_dw: bool = True) -> tuple[Any, Any]:
    """Batch-inner backward of one chunk: (dw (K, Q) or None without ``need_dw``, db
    (K,) or None) from dy rows (K, Ho*Wo*nb) and the chunk's columns (Q, Ho*Wo*nb;
    unused without ``need_dw``); writes dx_chunk (nb, C, H, W) when given
    (offset_weights: (K, kh*kw*C), the weights with taps ordered (i, j, c), so that the
    rows of dcol for one kernel offset are contiguous)."""
    kh, kw, ho, wo, pad = g.kernel_h, g.kernel_w, g.out_h, g.out_w, g.padding
    hp, wp = g.height + 2 * pad, g.width + 2 * pad
    db = dy_rows.sum(axis=1) if need_db else None
    # as dw^T: OpenBLAS's AVX-512 kernels run this shape faster
    dw = xp.matmul(columns, dy_rows.T, out=dw_t).T if need_dw else None
    if dx_chunk is not None and offset_weights is not None:
        nb = dx_chunk.shape[0]
        dcol = _empty(xp, "dcol", (g.taps, dy_rows.shape[1]), dy_rows.dtype)
        xp.matmul(offset_weights.T, dy_rows, out=dcol)
        dx_padded = _zeros(xp, "dx_padded", (g.channels, hp, wp, nb), dy_rows.dtype)
        col2im_add(g, dcol.reshape(kh, kw, g.channels, ho, wo, nb), dx_padded, batch_last=True)
        inner = dx_padded[:, pad:pad + g.height, pad:pad + g.width, :]
        dx_chunk[...] = inner.transpose(3, 0, 1, 2)
    return dw, db


def backward_sample_major(xp: Any, g: Any, offset_weights: Any | None, columns: Any,
                          dy_chunk: Any, dx_chunk: Any | None, need_db: bool
                          ) -> tuple[Any, Any]:
    """Sample-major backward of one chunk: (dw (K, Q), db (K,) or None) from canonical
    dy_chunk (nb, K, Ho, Wo) and columns (nb, Q, P); writes dx_chunk when given."""
    nb, kernels, positions = dy_chunk.shape[0], g.kernels, g.positions
    kh, kw, ho, wo, pad = g.kernel_h, g.kernel_w, g.out_h, g.out_w, g.padding
    hp, wp = g.height + 2 * pad, g.width + 2 * pad
    dy3 = dy_chunk.reshape(nb, kernels, positions)
    db = dy3.sum(axis=(0, 2)) if need_db else None
    dw = xp.zeros((kernels, g.taps), dy_chunk.dtype)
    for start in range(0, nb, SAMPLE_BLOCK):
        stop = min(nb, start + SAMPLE_BLOCK)
        dy_block = dy3[start:stop]
        dw += xp.matmul(dy_block, columns[start:stop].transpose(0, 2, 1)).sum(axis=0)
        if dx_chunk is not None and offset_weights is not None:
            dcol = xp.matmul(offset_weights.T, dy_block)
            dcol = dcol.reshape(stop - start, kh, kw, g.channels, ho, wo)
            dx_padded = _zeros(xp, "dx_padded", (stop - start, g.channels, hp, wp),
                               dy_chunk.dtype)
            col2im_add(g, dcol, dx_padded, batch_last=False)
            dx_chunk[start:stop] = dx_padded[:, :, pad:pad + g.height, pad:pad + g.width]
    return dw, db


# ---------------------------------------------------------------- hooks and running
class ChunkSink(Protocol):
    """Where ``conv2d_forward_cached`` puts each chunk's product instead of into y."""

    def rows(self, index: int, shape: tuple[int, int], dtype: Any) -> Any:
        """The (K, Ho*Wo*nb) array that chunk ``index``'s product is written into; it
        must stay the sink's (it is not scratch), and may be written from any thread."""
        ...

    def done(self, index: int, start: int, stop: int, rows: Any) -> None:
        """Samples [start, stop) are in ``rows`` (K, Ho, Wo, nb as (K, Ho*Wo*nb)); runs
        on the thread that computed them, right after."""
        ...


class ChunkSource(Protocol):
    """What ``conv2d_backward_cached`` reads each chunk's dy from instead of dy."""

    def gradient_rows(self, index: int, start: int, stop: int) -> Any:
        """dy of samples [start, stop) as (K, Ho*Wo*nb), batch innermost (the sink's
        layout); runs on the chunk's thread, and may return the thread's scratch."""
        ...


def by_kernels(xp: Any, kernels: int, threads: int, part: Callable[[slice], None]) -> None:
    """part(kernel range) over every kernel, the ranges split over the host threads."""
    count = max(1, min(threads, kernels)) if xp is np else 1
    edges = [kernels * i // count for i in range(count + 1)]
    run_parallel(lambda i: part(slice(edges[i], edges[i + 1])), count, count)


def sum_in_order(xp: Any, parts: list[Any], threads: int) -> Any:
    """parts[0] + parts[1] + ... (the chunks' weight gradients, (K, Q) each) in this
    order, into parts[0]; numpy splits the rows over the host threads (every row still
    summed in the same order, so the result does not depend on the threads)."""
    total = parts[0]
    if len(parts) == 1:
        return total
    rows = total.shape[0]
    count = min(threads, rows) if xp is np and total.size >= 1 << 16 else 1
    edges = [rows * i // count for i in range(count + 1)]

    def add(index: int) -> None:
        block = slice(edges[index], edges[index + 1])
        for part in parts[1:]:
            total[block] += part[block]
    run_parallel(add, count, count)
    return total


def _shifted_task(task: Callable[[int], Any], offset: int, index: int) -> Any:
    return task(offset + index)


def run_chunks(task: Callable[[int], Any], chunks: list[tuple[int, int]], threads: int,
               before: Callable[[int], None] | None = None,
               after: Callable[[int, int], None] | None = None) -> list[Any]:
    """[task(i) for every chunk i], as ``run_parallel`` does it, with optional hooks.

    With hooks the chunks run in groups of ``threads`` in batch order:
    ``before(stop)`` before a group whose samples end at ``stop``, ``after(start, stop)``
    once the group's samples [start, stop) are done; both on the calling thread.
    """
    if before is None and after is None:
        return run_parallel(task, len(chunks), threads)
    results: list[Any] = []
    group = max(1, threads)
    for first in range(0, len(chunks), group):
        last = min(first + group, len(chunks)) - 1
        if before is not None:
            before(chunks[last][1])
        results.extend(run_parallel(functools.partial(_shifted_task, task, first),
                                    last - first + 1, threads))
        if after is not None:
            after(chunks[first][0], chunks[last][1])
    return results
