"""Batch norm, ReLU and 2x2 pooling of a conv layer, done inside the conv's batch chunks.

The convolution (``hetconv.ops.conv``) computes its output one batch chunk at a time,
as rows (K, Ho, Wo, nb) with the batch innermost, on the host-thread pool. A
:class:`BlockPass` is its chunk sink and source: while a chunk's product is still in
cache it takes the batch-norm statistics of the chunk (per channel: count, sum and the
sum of squares around the chunk's own mean) and max-pools it; once every chunk is done
the statistics are combined in chunk order (Chan et al.'s parallel variance) and a
pass over the chunks normalises the pooled values, applies the ReLU and writes the
layer output. Backward, one pass over the chunks takes the ReLU/pool mask of dy and the
per-channel sums of batch norm's gradient; the conv's backward then asks for each
chunk's gradient, which is computed in place of the chunk's kept conv output right
before its products use it. The conv output is written once and read once; nothing is
transposed between layouts. Results depend on the chunks (the order of the sums), which
depend on the batch and the thread count only (not on the kernel share): a run is bit
for bit reproducible at the same ``--threads``.

The max pool runs before the normalisation. Batch norm is, per channel, a composition
of roundings of ``y - mean``, ``* inv_std``, ``* gamma`` and ``+ beta``: non-decreasing in
y when gamma > 0, so the largest normalised value of a window is the normalised largest
y, bit for bit; for gamma < 0 it is the normalised smallest y; for gamma == 0 all four
are equal and the first position wins. Only the four-times smaller pooled map is then
normalised. The one difference from pooling the normalised map (the separate ops,
``hetconv.ops.conv_layer`` with ``fast=False``) is where two different conv outputs of
one window round to the same normalised value: there the gradient goes to the first of
them, here to the larger conv output.

numpy runs the ops with ``out=`` into per-thread scratch and applies masks by bitwise
AND (exactly ``where(mask, x, 0)``, without its branches); other array modules (cupy)
run the same arithmetic as expressions (``block_kernels.Ops``), one chunk, bit for bit the numpy
result where the module is numpy underneath. Slow, obvious references:
``batch_norm_forward``/``_backward``, ``max_pool2x2``, ``avg_pool2x2``, ``relu`` and their
backward functions, composed by ``hetconv.ops.conv_layer`` with ``fast=False``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from hetconv.backend import run_parallel
from hetconv.ops.block_kernels import CUT, Array, Ops, normalise, pool_max, windows
from hetconv.ops.workspace import Workspace


def supported(pool: str, conv_h: int, conv_w: int) -> bool:
    """Whether this pass handles the block: no pool, or a 2x2 pool on an even map (the
    separate ops' dropped odd row or column is not modelled here)."""
    return pool == "none" or (conv_h % 2 == 0 and conv_w % 2 == 0)


def combine_moments(parts: list[tuple[int, Array, Array]], xp: Any = np
                    ) -> tuple[int, Array, Array]:
    """(count, sum (K,), M2 (K,)) of the union of ``parts`` [(n, sum, M2 around the
    part's own mean)], combined in list order (Chan et al.): sum = the sums added in
    order; M2 = the sum of (M2_p + n_p (mean_p - mean)^2). The mean is sum / count, the
    biased variance M2 / count."""
    count = sum(int(n) for n, _, _ in parts)
    total = parts[0][1].copy()
    for _, part_total, _ in parts[1:]:
        total += part_total
    mean = total / count
    squares = xp.zeros_like(total)
    for n, part_total, part_m2 in parts:
        if not n:
            continue
        offset = part_total / n - mean
        offset *= offset
        offset *= n
        offset += part_m2
        squares += offset
    return count, total, squares


class BlockPass:
    """Batch norm (or the bias ``beta``), ReLU and a pool ("max", "avg", "none") of one
    conv layer, as the sink and the source of its convolution's chunks (``relu`` False:
    no ReLU and no pool, a residual block's layer before its join).

    Forward: pass it as ``sink`` to ``conv2d_forward_cached``, then call ``finish``
    with the conv's cache. Backward: ``backward_sums(dy)``, then pass it as ``source``
    to ``conv2d_backward_cached``. Arrays: gamma, beta, running statistics (K,); the
    output (B, K, H', W'); dy the same. ``keep``: a :class:`Workspace` for the arrays
    kept from forward to backward (numpy; reused by the next forward with it).
    """

    def __init__(self, xp: Any, batch: int, conv_size: tuple[int, int], gamma: Array,
                 beta: Array,
                 running_mean: Array, running_var: Array, train: bool, pool: str,
                 batch_norm: bool, momentum: float, eps: float, dtype: Any,
                 keep: Workspace | None = None, total_batch: int | None = None,
                 relu: bool = True):
        if not relu and pool != "none":
            raise ValueError("a conv layer without its ReLU has no pool")
        self.xp, self.pool, self.batch_norm, self.train = xp, pool, batch_norm, bool(train)
        self.relu = relu  # False: batch norm's output as it is (a residual block's join follows)
        # the whole batch's samples: more than ``batch`` where a sample split gives this
        # pass a slice of it (the statistics and sums then come from every participant)
        self.total_batch = batch if total_batch is None else int(total_batch)
        self.out_h, self.out_w = conv_size
        self.momentum, self.eps, self.dtype = momentum, eps, np.dtype(dtype)
        self.keep = keep if xp is np else None
        self.gamma = gamma.astype(dtype, copy=True)  # the caller may update gamma in place
        self.beta = beta.astype(dtype, copy=False)
        self.running_mean, self.running_var = running_mean, running_var
        kernels = gamma.shape[0]
        self.mean = xp.zeros((kernels,), dtype)
        self.inv_std = xp.ones((kernels,), dtype)
        if batch_norm and not train:
            self.mean[...] = running_mean.astype(dtype, copy=False)
            self.inv_std[...] = (1.0 / (running_var + eps) ** 0.5).astype(dtype, copy=False)
        self.gamma_host = gamma if xp is np else None  # the max pool's sign test
        self.statistics_later = batch_norm and train  # else every chunk finishes at once
        self.rows_of: dict[int, Array] = {}  # chunk -> its conv output (K, Ho*Wo*nb)
        self.partial: dict[int, tuple[int, Array, Array]] = {}  # chunk -> (n, sum, M2)
        self.kept: dict[tuple[str, int], Array] = {}  # (what, chunk) -> array
        height, width = ((self.out_h, self.out_w) if pool == "none"
                          else (self.out_h // 2, self.out_w // 2))
        self.out = xp.empty((batch, kernels, height, width), dtype)
        self.chunks: list[tuple[int, int]] = []
        self.threads = 1
        self.var: Array = None
        self.dgamma: Array = None
        self.dbeta: Array = None

    # ---------------------------------------------------------------- helpers
    def _array(self, what: str, index: int, shape: tuple[int, ...], dtype: Any) -> Array:
        """A per-chunk array kept until the backward pass."""
        if self.keep is None:
            array = self.xp.empty(shape, dtype)
        else:
            array = self.keep.get(f"block {what} {index}", shape, dtype)
        self.kept[what, index] = array
        return array

    def _vector(self, vector: Array, ndim: int) -> Array:
        """(K,) -> (K, 1, ...) to broadcast over chunk arrays of ``ndim`` axes."""
        return vector.reshape((vector.shape[0],) + (1,) * (ndim - 1))

    def _pooled_shape(self, nb: int) -> tuple[int, ...]:
        return (self.gamma.shape[0], self.out_h // 2, self.out_w // 2, nb)

    # ---------------------------------------------------------------- forward
    def rows(self, index: int, shape: tuple[int, int], dtype: Any) -> Array:
        """ChunkSink: where chunk ``index``'s product goes (kept for the backward pass)."""
        rows = self._array("y", index, shape, dtype)
        self.rows_of[index] = rows
        return rows

    def done(self, index: int, start: int, stop: int, rows: Array) -> None:
        """ChunkSink: chunk [start, stop) is in ``rows``: statistics, max pool, and the
        rest when nothing waits for the whole batch's statistics."""
        ops, xp = Ops(self.xp), self.xp
        nb = stop - start
        self.rows_of[index] = rows
        if self.statistics_later:
            count = rows.shape[1]
            total = xp.add.reduce(rows, axis=1)
            centered = ops.subtract(rows, self._vector(total / count, 2),
                                    ops.empty("centered", rows.shape, rows.dtype))
            centered *= centered
            self.partial[index] = (count, total, xp.add.reduce(centered, axis=1))
        if self.pool == "max":
            pooled = self._array("pooled", index, self._pooled_shape(nb), rows.dtype)
            winners = self._array("winners", index, self._pooled_shape(nb), np.uint8)
            gamma = (self.gamma_host if self.xp is np else self.gamma) if self.batch_norm \
                else None
            pool_max(ops, windows(rows, self.out_h, self.out_w), gamma, pooled, winners)
        if not self.statistics_later:
            self._output(index, start, stop)

    def finish(self, chunks: list[tuple[int, int]], threads: int) -> tuple[Array, Array, Array]:
        """After the conv: (output (B, K, H', W'), new running mean, new running var)."""
        self.chunks, self.threads = chunks, threads
        if self.statistics_later:
            self._combine_statistics()
            run_parallel(lambda i: self._output(i, *chunks[i]), len(chunks), threads)
        return self._running()

    def local_statistics(self, chunks: list[tuple[int, int]], threads: int
                         ) -> tuple[int, Array, Array]:
        """Sample split, after the conv: this slice's (count, sum (K,), M2 (K,)) of the
        conv output per channel, its chunks combined in chunk order; the whole batch's
        statistics (``combine_moments`` over every participant's) go to
        :meth:`finish_with`."""
        self.chunks, self.threads = chunks, threads
        order = sorted(self.partial)
        return combine_moments([self.partial[i] for i in order], self.xp)

    def finish_with(self, mean: Array, var: Array) -> tuple[Array, Array, Array]:
        """Sample split: :meth:`finish` with the whole batch's mean and biased variance
        (K,) instead of this slice's."""
        self.mean[...] = mean.astype(self.dtype, copy=False)
        self.var = var.astype(self.dtype, copy=False)
        self.inv_std[...] = (1.0 / (self.var + self.eps) ** 0.5).astype(self.dtype, copy=False)
        run_parallel(lambda i: self._output(i, *self.chunks[i]), len(self.chunks), self.threads)
        return self._running()

    def _running(self) -> tuple[Array, Array, Array]:
        """(output, new running mean, new running var) once the output is written."""
        if not self.batch_norm or not self.train:
            return self.out, self.running_mean, self.running_var
        count = self.total_batch * self.out_h * self.out_w
        unbiased_var = self.var * (count / max(count - 1, 1))
        new_mean = ((1.0 - self.momentum) * self.running_mean + self.momentum * self.mean
                    ).astype(self.running_mean.dtype, copy=False)
        new_var = ((1.0 - self.momentum) * self.running_var + self.momentum * unbiased_var
                   ).astype(self.running_var.dtype, copy=False)
        return self.out, new_mean, new_var

    def _combine_statistics(self) -> None:
        """Mean and biased variance per channel from the chunks' (n, sum, M2), in chunk
        order (``combine_moments``)."""
        count, total, squares = combine_moments([self.partial[i] for i in sorted(self.partial)],
                                                self.xp)
        self.mean[...] = total / count
        self.var = squares / count
        self.inv_std[...] = (1.0 / (self.var + self.eps) ** 0.5).astype(self.dtype, copy=False)

    def set_sums(self, dgamma: Array, dbeta: Array) -> None:
        """Sample split: the whole batch's batch-norm sums (K,) (every participant's
        ``backward_sums`` added in participant order), before the conv's backward."""
        self.dgamma = dgamma.astype(self.dtype, copy=False)
        self.dbeta = dbeta.astype(self.dtype, copy=False)

    def _output(self, index: int, start: int, stop: int) -> None:
        """Normalise, ReLU (and the average pool) chunk ``index``; write its output."""
        ops, xp, dtype = Ops(self.xp), self.xp, self.dtype
        rows, nb = self.rows_of[index], stop - start
        gamma = self.gamma if self.batch_norm else None
        if self.pool == "max":
            pooled = self.kept["pooled", index]
            x_hat = self._array("x_hat", index, pooled.shape, dtype) if gamma is not None \
                else None
            z = ops.empty("z", pooled.shape, dtype)
            shaped = [self._vector(v, 4) for v in (self.mean, self.inv_std, self.gamma,
                                                   self.beta)]
            normalise(ops, pooled, z, shaped[0], shaped[1], shaped[2] if gamma is not None
                       else None, shaped[3], x_hat)
            xp.maximum(z, dtype.type(0), out=z)
            ops.cut(self.kept["winners", index], ops.greater(z, dtype.type(0), "passed"))
            result = z
        else:
            views = windows(rows, self.out_h, self.out_w) if self.pool == "avg" else [
                rows.reshape(rows.shape[0], self.out_h, self.out_w, nb)]
            masks = self._array("masks", index, (len(views),) + views[0].shape, np.bool_)
            shaped = [self._vector(v, 4) for v in (self.mean, self.inv_std, self.gamma,
                                                   self.beta)]
            rectified = []
            for position, view in enumerate(views):
                z = ops.empty(f"z {position}", view.shape, dtype)
                normalise(ops, view, z, shaped[0], shaped[1], shaped[2] if gamma is not None
                           else None, shaped[3], None)
                if self.relu:
                    masks[position] = ops.greater(z, dtype.type(0), "mask")
                    rectified.append(xp.maximum(z, dtype.type(0), out=z))
                else:  # every value passes
                    masks[position] = True
                    rectified.append(z)
            result = rectified[0]
            if self.pool == "avg":  # the separate ops' order: ((tl + tr) + bl) + br, / 4
                result += rectified[1]
                result += rectified[2]
                result += rectified[3]
                result *= dtype.type(0.25)
        target = self.out.reshape(self.out.shape[0], self.out.shape[1], -1)[start:stop]
        target[...] = result.reshape(result.shape[0], -1, nb).transpose(2, 0, 1)

    # ---------------------------------------------------------------- backward
    def backward_sums(self, dy: Array) -> tuple[Array, Array]:
        """dy (B, K, H', W') through the pool and the ReLU, chunk by chunk (kept for
        ``gradient_rows``); returns (dgamma (K,), dbeta (K,)), batch norm's sums (zero
        dgamma without batch norm)."""
        if tuple(dy.shape) != tuple(self.out.shape):
            raise ValueError(f"dy has shape {tuple(dy.shape)}, expected {tuple(self.out.shape)}")
        partial: dict[int, tuple[Array, Array | None]] = {}
        run_parallel(lambda i: partial.__setitem__(i, self._sums(i, dy, *self.chunks[i])),
                     len(self.chunks), self.threads)
        dbeta = partial[0][0].copy()
        for i in range(1, len(self.chunks)):
            dbeta += partial[i][0]
        dgamma = self.xp.zeros_like(dbeta)
        if self.batch_norm:
            for i in range(len(self.chunks)):
                dgamma += partial[i][1]
        self.dgamma, self.dbeta = dgamma, dbeta
        return dgamma, dbeta

    def _sums(self, index: int, dy: Array, start: int, stop: int) -> tuple[Array, Array | None]:
        """Chunk ``index``: keep the gradient after the ReLU/pool; its per-channel sums
        of that gradient and of its product with x_hat."""
        ops, xp, dtype = Ops(self.xp), self.xp, self.dtype
        kernels, nb = self.out.shape[1], stop - start
        incoming = ops.empty("incoming", (kernels,) + tuple(self.out.shape[2:]) + (nb,), dtype)
        incoming[...] = dy[start:stop].transpose(1, 2, 3, 0)
        if self.pool == "max":
            passed = ops.less(self.kept["winners", index], np.uint8(CUT), "passed")
            d_pooled = ops.masked(incoming, passed, "d_pooled",
                                  out=self._array("d_pooled", index, incoming.shape, dtype))
            total = xp.add.reduce(d_pooled.reshape(kernels, -1), axis=1)
            if not self.batch_norm:
                return total, None
            product = ops.multiply(d_pooled, self.kept["x_hat", index],
                                   ops.empty("product", d_pooled.shape, dtype))
            return total, xp.add.reduce(product.reshape(kernels, -1), axis=1)
        if self.pool == "avg":
            incoming *= dtype.type(0.25)  # the separate ops: dy * 0.25 over the window
        masks = self.kept["masks", index]
        d_z = self._array("d_z", index, masks.shape, dtype)
        views = self._views(index, nb)
        total = similar = None
        for position in range(masks.shape[0]):
            ops.masked(incoming, masks[position], "d_z", out=d_z[position])
            part = xp.add.reduce(d_z[position].reshape(kernels, -1), axis=1)
            total = part if total is None else total + part
            if self.batch_norm:
                x_hat = ops.subtract(views[position], self._vector(self.mean, 4),
                                     ops.empty("x_hat", incoming.shape, dtype))
                x_hat *= self._vector(self.inv_std, 4)
                x_hat *= d_z[position]
                part = xp.add.reduce(x_hat.reshape(kernels, -1), axis=1)
                similar = part if similar is None else similar + part
        return total, similar

    def _views(self, index: int, nb: int) -> list[Array]:
        rows = self.rows_of[index]
        if self.pool == "none":
            return [rows.reshape(rows.shape[0], self.out_h, self.out_w, nb)]
        return windows(rows, self.out_h, self.out_w)

    def gradient_rows(self, index: int, start: int, stop: int) -> Array:
        """ChunkSource: chunk ``index``'s conv gradient (K, Ho*Wo*nb), written over its
        kept conv output (the separate ops' formulas, per channel)."""
        ops = Ops(self.xp)
        rows, nb = self.rows_of[index], stop - start
        views = self._views(index, nb)
        train_bn = self.batch_norm and self.train
        if train_bn:  # ((x_hat * dgamma + dbeta) * (-1/N) + d_z) * scale
            count = self.total_batch * self.out_h * self.out_w
            ops.subtract(rows, self._vector(self.mean, 2), rows)
            rows *= self._vector(self.inv_std, 2)
            rows *= self._vector(self.dgamma, 2)
            rows += self._vector(self.dbeta, 2)
            rows *= -1.0 / count
        if self.pool == "max":
            d_pooled, winners = self.kept["d_pooled", index], self.kept["winners", index]
            if not train_bn:
                rows[...] = 0
            for position, view in enumerate(views):
                chosen = ops.equal(winners, np.uint8(position), "chosen")
                view += ops.masked(d_pooled, chosen, "routed")
        else:
            d_z = self.kept["d_z", index]
            for position, view in enumerate(views):
                if train_bn:
                    view += d_z[position]
                else:
                    view[...] = d_z[position]
        if self.batch_norm:
            rows *= self._vector(self.gamma * self.inv_std, 2)
        return rows
