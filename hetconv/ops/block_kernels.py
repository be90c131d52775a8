"""The per-chunk arithmetic of the fused block pass (``hetconv.ops.block_fast``).

:class:`Ops` runs the elementwise kernels (numpy: ufuncs with ``out=`` into per-thread
scratch, masks by bitwise AND; other array modules such as cupy: the same arithmetic as
expressions), and the window functions max-pool a chunk's conv output (the winner of
each 2x2 window, its position, ``CUT`` where the ReLU cut it) and normalise the pooled
values. Both paths give the same numbers; ``block_fast.BlockPass`` drives them chunk by
chunk.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from hetconv.ops.workspace import thread_scratch

Array = Any  # a numpy or cupy ndarray
CUT = 4  # the winner index of a window whose pooled value the ReLU cut
POSITIONS = ((0, 0), (0, 1), (1, 0), (1, 1))  # window positions, row-major: winner index


class Ops:
    """The elementwise kernels. numpy: ufuncs with ``out=`` into the calling thread's
    scratch, masks by bitwise AND; other modules: expressions and ``where`` (no
    scratch). Both give the same numbers."""

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

    def equal(self, a: Array, b: Any, name: str) -> Array:
        if self.scratch is None:
            return a == b
        return np.equal(a, b, out=self.empty(name, a.shape, np.bool_))

    def masked(self, values: Array, flags: Array, name: str, out: Array = None) -> Array:
        """``where(flags, values, 0)`` (into ``out`` when given)."""
        if self.scratch is None:
            result = self.xp.where(flags, values, values.dtype.type(0))
            if out is None:
                return result
            out[...] = result
            return out
        bits = np.uint32 if values.dtype.itemsize == 4 else np.uint64
        mask = np.negative(flags.view(np.uint8), dtype=bits,
                           out=self.empty(name + " mask", flags.shape, bits))
        if out is None:
            out = self.empty(name, values.shape, values.dtype)
        np.bitwise_and(values.view(bits), mask, out=out.view(bits))
        return out

    def winner(self, lower: Array, lower_right: Array, right: Array, out: Array) -> Array:
        """uint8 window position 2*row + column into out: row ``lower``, column
        ``lower_right`` in the lower row and ``right`` in the upper one."""
        if self.scratch is None:
            column = self.xp.where(lower, lower_right, right)
            out[...] = lower.astype(np.uint8) * 2 + column.astype(np.uint8)
            return out
        np.bitwise_xor(lower_right, right, out=lower_right)
        np.bitwise_and(lower_right, lower, out=lower_right)
        np.bitwise_xor(lower_right, right, out=lower_right)  # the column of the row
        np.left_shift(lower.view(np.uint8), 1, out=out)
        np.bitwise_or(out, lower_right.view(np.uint8), out=out)
        return out

    def cut(self, winners: Array, passed: Array) -> None:
        """winners = CUT where not ``passed`` (winners < 4 there before)."""
        if self.scratch is None:
            winners[...] = self.xp.where(passed, winners, np.uint8(CUT))
            return
        flags = passed.view(np.uint8)
        np.bitwise_xor(flags, np.uint8(1), out=flags)
        np.left_shift(flags, 2, out=flags)
        np.bitwise_or(winners, flags, out=winners)


def windows(rows: Array, out_h: int, out_w: int) -> list[Array]:
    """The four window positions of chunk rows (K, Ho*Wo*nb): (K, Ho/2, Wo/2, nb) views."""
    kernels, nb = rows.shape[0], rows.shape[1] // (out_h * out_w)
    grid = rows.reshape(kernels, out_h // 2, 2, out_w // 2, 2, nb)
    return [grid[:, :, r, :, c, :] for r, c in POSITIONS]


def max_windows(ops: Ops, four: list[Array], pooled: Array, winners: Array,
                 negate: bool) -> None:
    """pooled, winners (n, ...) = the first maximum of the four window positions in
    row-major order and its index, as ``max_pool2x2``; with ``negate`` the first minimum
    (pooled is then the minimum itself)."""
    shape, dtype = four[0].shape, four[0].dtype
    if negate:
        four = [ops.multiply(view, dtype.type(-1), ops.empty(f"negated {i}", shape, dtype))
                for i, view in enumerate(four)]
    a, b, c, d = four
    xp = ops.xp
    top = xp.maximum(a, b, out=ops.empty("top", shape, dtype))
    bottom = xp.maximum(c, d, out=ops.empty("bottom", shape, dtype))
    xp.maximum(top, bottom, out=pooled)
    ops.winner(ops.greater(bottom, top, "lower"), ops.greater(d, c, "lower right"),
               ops.greater(b, a, "right"), winners)
    if negate:
        pooled *= dtype.type(-1)


def pool_max(ops: Ops, four: list[Array], gamma: Array | None, pooled: Array,
              winners: Array) -> None:
    """Max-pool the conv output as the normalisation will see it (module docstring), per
    channel by the sign of gamma (None: no batch norm; numpy: gamma on the host)."""
    if gamma is None or (ops.scratch is not None and bool(np.all(gamma > 0))):
        max_windows(ops, four, pooled, winners, False)
        return
    xp = ops.xp
    if ops.scratch is None:  # both, then a choice per channel: no host round trip
        largest, first = xp.empty(pooled.shape, pooled.dtype), xp.empty(winners.shape, np.uint8)
        max_windows(ops, four, largest, first, False)
        max_windows(ops, four, pooled, winners, True)
        shape = (gamma.shape[0],) + (1,) * (pooled.ndim - 1)
        positive, zero = (gamma > 0).reshape(shape), (gamma == 0).reshape(shape)
        pooled[...] = xp.where(positive, largest, xp.where(zero, four[0], pooled))
        winners[...] = xp.where(positive, first, xp.where(zero, np.uint8(0), winners))
        return
    # numpy: every channel as if gamma > 0, then the channels of gamma < 0 (the first
    # minimum) and gamma == 0 (every position ties, the first wins) again, together: the
    # same numbers as channel by channel, in a few calls however many channels there are
    # (one call per channel made a layer with a negative gamma pay ~4x for its pooling)
    max_windows(ops, four, pooled, winners, False)
    negative = np.flatnonzero(gamma < 0)
    if negative.size:
        shape = (negative.size,) + pooled.shape[1:]
        low = ops.empty("pooled of gamma < 0", shape, pooled.dtype)
        low_winners = ops.empty("winners of gamma < 0", shape, winners.dtype)
        max_windows(ops, [view[negative] for view in four], low, low_winners, True)
        pooled[negative], winners[negative] = low, low_winners
    zero = np.flatnonzero(gamma == 0)
    if zero.size:
        pooled[zero], winners[zero] = four[0][zero], 0


def normalise(ops: Ops, values: Array, out: Array, mean: Array, inv_std: Array,
               gamma: Array | None, beta: Array, x_hat: Array | None) -> Array:
    """out = (values - mean) * inv_std * gamma + beta per channel (the separate ops'
    order of roundings), or values + beta without batch norm (gamma None); the vectors
    are shaped to broadcast over the channel axis 0. x_hat, when given, receives the
    normalised values before the affine map."""
    if gamma is None:
        return ops.add(values, beta, out)
    target = out if x_hat is None else x_hat
    ops.subtract(values, mean, target)
    target *= inv_std
    ops.multiply(target, gamma, out)
    out += beta
    return out
