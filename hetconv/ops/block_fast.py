"""Batch norm, ReLU and 2x2 pooling of a conv layer in one pass per channel block.

The convolution hands over its output channel-major, y (K, windows, L, B): for a 2x2
pool the four positions of every window as four contiguous runs of L*B numbers per
channel (``windows`` 4, L = Ho*Wo/4), without a pool the whole map (``windows`` 1). Every
op after the convolution acts on one channel at a time (batch norm's statistics
included), so on numpy the channels are split into blocks run by the host-thread pool,
and each block does all of its work while its rows are in cache: statistics,
normalisation, pooling, ReLU forward; masks, sums and the conv gradient backward. Each
channel's results come from its own rows only, summed in a fixed order (the pairwise
sum of one contiguous row), so they do not depend on the blocks, the threads or the
kernel share: a share of the channels gets exactly its slice of the whole layer's
result. Other array modules (cupy) run the same arithmetic on all channels at once
(``_Ops``), bit for bit the numpy result where the module is numpy underneath.

The max pool runs before the normalisation. Batch norm is, per channel, a composition
of roundings of ``y - mean``, ``* inv_std``, ``* gamma`` and ``+ beta``: non-decreasing in
y when gamma > 0, so the largest normalised value of a window is the normalised largest
y, bit for bit; for gamma < 0 it is the normalised smallest y; for gamma == 0 all four
are equal and the first position wins. Only the four-times smaller pooled map is then
normalised. The one difference from pooling the normalised map (the separate ops,
``hetconv.ops.conv_layer`` with ``fast=False``) is where two different conv outputs of
one window round to the same normalised value: there the gradient goes to the first of
them, here to the larger conv output.

The cache keeps the conv output (overwritten in place by its gradient in the backward
pass, which the convolution's backward reads next), the winning position of each
window as uint8 (CUT: cut by the ReLU) and the normalised winners, or the ReLU masks.
On numpy masks are applied with bitwise ANDs: exactly ``where(mask, x, 0)``, without
its branches.

Slow, obvious references: ``batch_norm_forward``/``_backward``, ``max_pool2x2``,
``avg_pool2x2``, ``relu`` and their backward functions, composed by
``hetconv.ops.conv_layer`` with ``fast=False``; the tests compare both.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetconv.backend import get_array_module, host_threads, run_parallel
from hetconv.ops.workspace import thread_scratch

Array = Any  # a numpy or cupy ndarray

BLOCK_BYTES = 1 << 18  # channels handled together: their rows fit in a core's L2 cache
PARALLEL_MIN_NUMBERS = 1 << 16  # smaller layers run on the calling thread
TASKS_PER_THREAD = 2
CUT = 4  # the winner index of a window whose pooled value the ReLU cut


@dataclass
class BlockCache:
    """What ``block_backward`` needs from ``block_forward``.

    y: the conv output (K, windows, L, B), the caller's buffer (the backward pass
    writes the conv gradient into it); pool, batch_norm, train: the block's kind.
    mean, inv_std, gamma: (K,) as used; winners: (K, L*B) uint8 window position
    0..3 of each pooled value or CUT (max pool); x_hat: (K, L*B) the normalised
    winners (max pool with batch norm); masks: (K, windows, L*B) bool, where the
    ReLU let the map through (average pool and no pool).
    """

    y: Array
    pool: str
    batch_norm: bool
    train: bool
    mean: Array
    inv_std: Array
    gamma: Array
    winners: Array = None
    x_hat: Array = None
    masks: Array = None


def supported(pool: str, conv_h: int, conv_w: int) -> bool:
    """Whether this pass handles the block: no pool, or a 2x2 pool on an even map (the
    separate ops' dropped odd row or column is not modelled here)."""
    return pool == "none" or (conv_h % 2 == 0 and conv_w % 2 == 0)


def windows_of(pool: str) -> int:
    """The channel-major layout the convolution must write for this pool."""
    return 1 if pool == "none" else 4


class _Ops:
    """The elementwise kernels of the pass. numpy: ufuncs with ``out=`` into the calling
    thread's scratch, masks by bitwise AND; other modules: plain expressions and
    ``where`` (no scratch). Both give the same numbers."""

    def __init__(self, xp: Any):
        self.xp = xp
        self.scratch = thread_scratch() if xp is np else None

    def empty(self, name: str, shape: tuple[int, ...], dtype: Any) -> Array:
        if self.scratch is None:
            return self.xp.empty(shape, dtype)
        return self.scratch.get(name, shape, dtype)

    def subtract(self, a: Array, b: Any, out: Array) -> Array:
        if self.scratch is None:
            out[...] = a - b
        else:
            np.subtract(a, b, out=out)
        return out

    def multiply(self, a: Array, b: Any, out: Array) -> Array:
        if self.scratch is None:
            out[...] = a * b
        else:
            np.multiply(a, b, out=out)
        return out

    def add(self, a: Array, b: Any, out: Array) -> Array:
        if self.scratch is None:
            out[...] = a + b
        else:
            np.add(a, b, out=out)
        return out

    def greater(self, a: Array, b: Any, name: str) -> Array:
        if self.scratch is None:
            return a > b
        return np.greater(a, b, out=self.empty(name, a.shape, np.bool_))

    def less(self, a: Array, b: Any, name: str) -> Array:
        if self.scratch is None:
            return a < b
        return np.less(a, b, out=self.empty(name, a.shape, np.bool_))

    def masked(self, values: Array, flags: Array, name: str) -> Array:
        """``where(flags, values, 0)``."""
        if self.scratch is None:
            return self.xp.where(flags, values, values.dtype.type(0))
        bits = np.uint32 if values.dtype.itemsize == 4 else np.uint64
        mask = np.negative(flags.view(np.uint8), out=self.empty(name + " mask", flags.shape, bits),
                           dtype=bits)
        out = self.empty(name, values.shape, values.dtype)
        np.bitwise_and(values.view(bits), mask, out=out.view(bits))
        return out

    def winner(self, lower: Array, lower_right: Array, right: Array, name: str) -> Array:
        """uint8 window position 2*row + column: row ``lower``, column ``lower_right``
        in the lower row and ``right`` in the upper one."""
        if self.scratch is None:
            column = self.xp.where(lower, lower_right, right)
            return lower.astype(np.uint8) * 2 + column.astype(np.uint8)
        column = np.bitwise_xor(lower_right, right, out=self.empty(name + " column",
                                                                   right.shape, np.bool_))
        np.bitwise_and(column, lower, out=column)
        np.bitwise_xor(column, right, out=column)
        index = np.left_shift(lower.view(np.uint8), 1,
                              out=self.empty(name, right.shape, np.uint8))
        np.bitwise_or(index, column.view(np.uint8), out=index)
        return index


def _max_windows(ops: _Ops, four: Array, negate: bool) -> tuple[Array, Array]:
    """(pooled (n, m), winner (n, m) uint8) of four (n, 4, m) window positions: the
    first maximum in row-major window order, as ``max_pool2x2``; with ``negate`` the
    first minimum (pooled is then the minimum itself)."""
    if negate:
        four = ops.multiply(four, four.dtype.type(-1), ops.empty("negated", four.shape,
                                                                 four.dtype))
    a, b, c, d = four[:, 0], four[:, 1], four[:, 2], four[:, 3]
    shape = a.shape
    xp = ops.xp
    top = xp.maximum(a, b, out=ops.empty("top", shape, four.dtype))
    bottom = xp.maximum(c, d, out=ops.empty("bottom", shape, four.dtype))
    pooled = xp.maximum(top, bottom, out=ops.empty("pooled", shape, four.dtype))
    winner = ops.winner(ops.greater(bottom, top, "lower"), ops.greater(d, c, "lower right"),
                        ops.greater(b, a, "right"), "winner")
    if negate:
        pooled *= four.dtype.type(-1)
    return pooled, winner


def _pool_max(ops: _Ops, four: Array, gamma: Array | None) -> tuple[Array, Array]:
    """Max-pool the conv output four (n, 4, m) as the normalisation will see it (see the
    module docstring), per channel by the sign of gamma (None: no batch norm)."""
    if gamma is None or (ops.scratch is not None and bool(np.all(gamma > 0))):
        return _max_windows(ops, four, False)
    xp = ops.xp
    if ops.scratch is None:  # everything, then a choice per channel: no host round trip
        largest, first_largest = _max_windows(ops, four, False)
        smallest, first_smallest = _max_windows(ops, four, True)
        negative, zero = (gamma < 0)[:, None], (gamma == 0)[:, None]
        pooled = xp.where(negative, smallest, xp.where(zero, four[:, 0], largest))
        winner = xp.where(negative, first_smallest, xp.where(zero, np.uint8(0), first_largest))
        return pooled, winner.astype(np.uint8)
    n, _, m = four.shape
    pooled, winner = np.empty((n, m), four.dtype), np.empty((n, m), np.uint8)
    for row in range(n):
        if gamma[row] == 0:  # constant: every position ties, the first wins
            pooled[row], winner[row] = four[row, 0], 0
        else:
            p, w = _max_windows(ops, four[row:row + 1], bool(gamma[row] < 0))
            pooled[row], winner[row] = p[0], w[0]
    return pooled, winner


def _normalise(ops: _Ops, values: Array, out: Array, mean: Array, inv_std: Array,
               gamma: Array | None, beta: Array, x_hat: Array | None) -> Array:
    """out = (values - mean) * inv_std * gamma + beta per row (the separate ops' order
    of roundings), or values + beta without batch norm (gamma None); x_hat, when given,
    receives the normalised values before the affine map."""
    if gamma is None:
        return ops.add(values, beta[:, None], out)
    target = out if x_hat is None else x_hat
    ops.subtract(values, mean[:, None], target)
    target *= inv_std[:, None]
    ops.multiply(target, gamma[:, None], out)
    out += beta[:, None]
    return out


def _run_blocks(xp: Any, block: Callable[[slice], None], kernels: int, numbers: int,
                itemsize: int) -> None:
    """block(channels) over every channel: numpy, cache-sized ranges on the host-thread
    pool (a few per thread); other modules, all channels at once."""
    if xp is not np:
        block(slice(0, kernels))
        return
    threads = host_threads(kernels) if kernels * numbers >= PARALLEL_MIN_NUMBERS else 1
    count = min(kernels, threads * TASKS_PER_THREAD) if threads > 1 else 1
    edges = [kernels * i // count for i in range(count + 1)]
    step = max(1, BLOCK_BYTES // max(1, numbers * itemsize))

    def task(index: int) -> None:
        for start in range(edges[index], edges[index + 1], step):
            block(slice(start, min(edges[index + 1], start + step)))
    run_parallel(task, count, threads)


def block_forward(y: Array, gamma: Array, beta: Array, running_mean: Array,
                  running_var: Array, train: bool, pool: str, batch_norm: bool,
                  momentum: float = 0.1, eps: float = 1e-5, keep: Any = None
                  ) -> tuple[Array, BlockCache, Array, Array]:
    """Batch norm (or the bias ``beta``), ReLU and the pool of a channel-major conv output.

    y: (K, windows, L, B) as ``conv2d_forward_cached(..., windows=windows_of(pool))``
    writes it (kept in the cache: do not reuse it before the backward pass); gamma,
    beta, running_mean, running_var: (K,). Semantics of ``conv_layer_forward``: batch
    statistics (biased variance; the running variance moves with the unbiased one) in
    train mode, running statistics otherwise; without batch norm beta is the
    convolution's bias and gamma and the statistics pass through.
    Returns (out (B, K, L), the layer output to reshape to (B, K, H', W'); the cache;
    new running mean (K,); new running var (K,)).
    keep: a ``Workspace`` for the cache's masks (numpy; reused by the next call).
    """
    xp = get_array_module(y)
    kernels, windows, length, batch = y.shape
    dtype = y.dtype
    numbers = windows * length * batch  # per channel: B * Ho * Wo
    if train and batch_norm and numbers < 2 and kernels > 0:
        raise ValueError(f"batch norm in train mode needs more than 1 value per channel, "
                         f"got {numbers}")
    pooled_numbers = length * batch

    def kept(name: str, shape: tuple[int, ...], kind: Any) -> Array:
        return xp.empty(shape, kind) if keep is None or xp is not np else keep.get(
            name, shape, kind)

    out_t = xp.empty((kernels, length, batch), dtype)  # channel-major output
    out = xp.empty((batch, kernels, length), dtype)
    mean, var, inv_std = (xp.empty((kernels,), dtype) for _ in range(3))
    gamma_used = gamma.astype(dtype, copy=True)  # the caller may update gamma in place
    beta_used = beta.astype(dtype, copy=False)
    if batch_norm and not train:
        mean[...] = running_mean.astype(dtype, copy=False)
        inv_std[...] = (1.0 / (running_var + eps) ** 0.5).astype(dtype, copy=False)
    cache = BlockCache(y, pool, batch_norm, bool(train), mean, inv_std, gamma_used)
    if pool == "max":
        cache.winners = kept("block winners", (kernels, pooled_numbers), np.uint8)
        if batch_norm:
            cache.x_hat = kept("block x_hat", (kernels, pooled_numbers), dtype)
    else:
        cache.masks = kept("block masks", (kernels, windows, pooled_numbers), np.bool_)
    rows = y.reshape(kernels, windows, pooled_numbers)

    def block(channels: slice) -> None:
        ops = _Ops(xp)
        four = rows[channels]
        n = four.shape[0]
        gamma_block = gamma_used[channels] if batch_norm else None
        if batch_norm and train:
            flat = four.reshape(n, numbers)
            mean[channels] = xp.add.reduce(flat, axis=1) / numbers
            centered = ops.subtract(flat, mean[channels][:, None],
                                    ops.empty("centered", flat.shape, dtype))
            centered *= centered
            var[channels] = xp.add.reduce(centered, axis=1) / numbers
            inv_std[channels] = (1.0 / (var[channels] + eps) ** 0.5).astype(dtype, copy=False)
        target = out_t[channels].reshape(n, pooled_numbers)
        if pool == "max":
            pooled, winner = _pool_max(ops, four, gamma_block)
            _normalise(ops, pooled, target, mean[channels], inv_std[channels], gamma_block,
                       beta_used[channels], None if cache.x_hat is None else
                       cache.x_hat[channels])
            xp.maximum(target, dtype.type(0), out=target)
            cut = ops.greater(target, dtype.type(0), "cut")  # not cut: let through
            cache.winners[channels] = xp.where(cut, winner, np.uint8(CUT)) \
                if ops.scratch is None else _merge_cut(winner, cut)
        else:
            rectified = ops.empty("rectified", four.shape, dtype)
            for position in range(windows):
                z = _normalise(ops, four[:, position], rectified[:, position],
                               mean[channels], inv_std[channels], gamma_block,
                               beta_used[channels], None)
                cache.masks[channels, position] = ops.greater(z, dtype.type(0), "mask")
                xp.maximum(z, dtype.type(0), out=z)
            if pool == "avg":  # the separate ops' order: ((tl + tr) + bl) + br, then / 4
                ops.add(rectified[:, 0], rectified[:, 1], target)
                target += rectified[:, 2]
                target += rectified[:, 3]
                target *= dtype.type(0.25)
            else:
                target[...] = rectified[:, 0]
        out[:, channels, :] = out_t[channels].transpose(2, 0, 1)

    _run_blocks(xp, block, kernels, numbers, y.itemsize)
    if batch_norm and train:
        unbiased_var = var * (numbers / max(numbers - 1, 1))
        new_mean = ((1.0 - momentum) * running_mean + momentum * mean).astype(
            running_mean.dtype, copy=False)
        new_var = ((1.0 - momentum) * running_var + momentum * unbiased_var).astype(
            running_var.dtype, copy=False)
    else:
        new_mean, new_var = running_mean, running_var
    return out, cache, new_mean, new_var


def _merge_cut(winner: np.ndarray, passed: np.ndarray) -> np.ndarray:
    """winner where ``passed``, else CUT (numpy, in place in winner's scratch)."""
    cut = np.bitwise_xor(passed.view(np.uint8), np.uint8(1), out=passed.view(np.uint8))
    np.left_shift(cut, 2, out=cut)  # CUT == 4, and winner < 4 where passed
    np.bitwise_or(winner, cut, out=winner)
    return winner


def block_backward(cache: BlockCache, dy: Array) -> tuple[Array, Array, Array]:
    """Back through pool, ReLU and batch norm: dy (B, K, L) (the pooled map, canonical)
    -> (d_conv (K, windows, L, B), written over the cache's conv output; dgamma (K,);
    dbeta (K,)). Formulas of ``batch_norm_backward`` per channel (train: the batch
    statistics depend on the input; eval: an affine map); without batch norm dgamma is
    zero."""
    y = cache.y
    xp = get_array_module(y)
    kernels, windows, length, batch = y.shape
    dtype = y.dtype
    numbers = windows * length * batch
    pooled_numbers = length * batch
    if tuple(dy.shape) != (batch, kernels, length):
        raise ValueError(f"dy has shape {dy.shape}, expected {(batch, kernels, length)}")
    rows = y.reshape(kernels, windows, pooled_numbers)
    dgamma, dbeta = xp.zeros((kernels,), dtype), xp.zeros((kernels,), dtype)
    scale = cache.gamma * cache.inv_std
    inverse_count = -1.0 / numbers

    def block(channels: slice) -> None:
        ops = _Ops(xp)
        four = rows[channels]
        n = four.shape[0]
        incoming = ops.empty("incoming", (n, length, batch), dtype)
        incoming[...] = dy[:, channels, :].transpose(1, 2, 0)
        incoming = incoming.reshape(n, pooled_numbers)
        if cache.pool == "max":
            winners = cache.winners[channels]
            passed = ops.less(winners, np.uint8(CUT), "passed")
            d_pooled = ops.masked(incoming, passed, "d_pooled")
            dbeta[channels] = xp.add.reduce(d_pooled, axis=1)
            if cache.batch_norm:
                product = ops.multiply(d_pooled, cache.x_hat[channels],
                                       ops.empty("product", d_pooled.shape, dtype))
                dgamma[channels] = xp.add.reduce(product, axis=1)
            for position in range(windows):
                chosen = winners == position if ops.scratch is None else np.equal(
                    winners, position, out=ops.empty("chosen", winners.shape, np.bool_))
                _conv_gradient(ops, four[:, position], ops.masked(d_pooled, chosen, "routed"),
                               cache, channels, dgamma, dbeta, scale, inverse_count)
            return
        if cache.pool == "avg":
            incoming *= dtype.type(0.25)  # the separate ops: dy * 0.25 over the window
        d_z = ops.empty("d_z", four.shape, dtype)
        for position in range(windows):
            d_z[:, position] = ops.masked(incoming, cache.masks[channels, position], "masked")
        dbeta[channels] = xp.add.reduce(d_z.reshape(n, numbers), axis=1)
        if cache.batch_norm:
            x_hat = ops.subtract(four, cache.mean[channels][:, None, None],
                                 ops.empty("x_hat", four.shape, dtype))
            x_hat *= cache.inv_std[channels][:, None, None]
            x_hat *= d_z
            dgamma[channels] = xp.add.reduce(x_hat.reshape(n, numbers), axis=1)
        for position in range(windows):
            _conv_gradient(ops, four[:, position], d_z[:, position], cache, channels, dgamma,
                           dbeta, scale, inverse_count)

    _run_blocks(xp, block, kernels, numbers, y.itemsize)
    if not cache.batch_norm:
        dgamma[...] = 0
    return y, dgamma, dbeta


def _conv_gradient(ops: _Ops, y_rows: Array, d_z: Array, cache: BlockCache, channels: slice,
                   dgamma: Array, dbeta: Array, scale: Array, inverse_count: float) -> None:
    """Write the conv gradient of one window position over its conv output y_rows
    (n, m), from d_z (n, m), the gradient of the normalised map there."""
    if not cache.batch_norm:
        y_rows[...] = d_z
        return
    if not cache.train:
        ops.multiply(d_z, scale[channels][:, None], y_rows)
        return
    # the separate ops' order: ((x_hat * dgamma + dbeta) * (-1/N) + d_z) * scale
    ops.subtract(y_rows, cache.mean[channels][:, None], y_rows)
    y_rows *= cache.inv_std[channels][:, None]
    y_rows *= dgamma[channels][:, None]
    y_rows += dbeta[channels][:, None]
    y_rows *= inverse_count
    y_rows += d_z
    y_rows *= scale[channels][:, None]
