"""One conv layer, conv -> batch norm -> ReLU -> 2x2 pool, forward and backward.

This is the unit of work that the master and every worker daemon run: a device
that owns kernels ``a..b-1`` of a layer calls these functions with
``weight[a:b]``, ``gamma[a:b]``, ... and gets channels ``a..b-1`` of the full
block's output, because every op after the convolution acts on each channel on
its own (batch norm included, see :mod:`hetconv.ops.batchnorm`). In the backward
pass each device returns its *partial* input gradient; the master sums them.

Variants (``batch_norm``, ``pool``): without batch norm, ``beta`` is the
convolution's bias (``gamma`` and the running statistics pass through unused and
get zero gradients); the pool is ``max`` (the paper's), ``avg`` or ``none``.

ReLU and max pooling commute exactly (ReLU is monotonic, so the max of the
rectified window is the rectified max), and so do their gradients (the pooled
winner is positive exactly when the gradient survives the ReLU). The max-pool
block therefore pools first and rectifies the four-times smaller pooled map, and
keeps only that map for the ReLU backward. Average pooling does not commute with
ReLU: that block rectifies first and pools the rectified map. A share of zero
kernels is valid: it yields an output with 0 channels and a zero input gradient.

Two implementations. The fused one (``fast``, the default wherever
``hetconv.ops.block_fast.supported`` says so, numpy or cupy): the convolution hands
every batch chunk of its output to a ``block_fast.BlockPass`` while it is in cache
(statistics, pool; backward, the conv gradient), and the convolution itself may run
as Winograd. Otherwise (odd maps before a pool, ``fast=False``, or ``FUSED`` False)
the separate ops below compose the block over an im2col convolution: the path before
the fused one, and the reference the fused one is tested against. A ``workspace``
keeps the big arrays between training steps.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hetconv.backend import get_array_module
from hetconv.ops import block_fast
from hetconv.ops.activation import relu as apply_relu
from hetconv.ops.activation import relu_backward
from hetconv.ops.batchnorm import (
    BatchNormCache,
    batch_norm_backward,
    batch_norm_forward,
    channel_sum,
)
from hetconv.ops.conv import conv2d_backward_cached, conv2d_forward_cached
from hetconv.ops.pooling import (
    AvgPoolCache,
    MaxPoolCache,
    avg_pool2x2,
    avg_pool2x2_backward,
    max_pool2x2,
    max_pool2x2_backward,
)
from hetconv.ops.timers import timed
from hetconv.ops.workspace import Workspace

POOLS = ("max", "avg", "none")
FUSED = True
"""``fast=None`` means the fused pass where it applies; ``hetconv bench step --ops
separate`` sets this False to time the separate ops (the path before the fused one)."""

Array = Any  # a numpy or cupy ndarray


@dataclass(frozen=True)
class ConvBlockCache:
    """Everything ``conv_layer_backward`` needs from the forward pass.

    conv, batch_norm, pool: the caches of the three ops (None for 0 kernels, and
    batch_norm / pool None when the block has none).
    output: (B, K, H'', W'') the block output.
    rectified: the ReLU output, used as its mask: ``output`` itself for the max and
    no-pool blocks, the map before the average pool otherwise.
    input_shape: (B, C, H, W); weight_shape: (K, C, kh, kw).
    empty: a share of 0 kernels (nothing was computed).
    """

    conv: Any
    batch_norm: BatchNormCache | None
    pool: MaxPoolCache | AvgPoolCache | None
    output: Array
    input_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    rectified: Array = None
    empty: bool = False
    fused: block_fast.BlockPass | None = None  # the fast path's (then no batch_norm, pool)


def conv_output_size(size: int, kernel: int, stride: int, padding: int) -> int:
    """Spatial size after a convolution: floor((size + 2 padding - kernel) / stride) + 1."""
    return (size + 2 * padding - kernel) // stride + 1


def conv_layer_forward(
    x: Array,
    weight: Array,
    gamma: Array,
    beta: Array,
    running_mean: Array,
    running_var: Array,
    train: bool,
    stride: int = 1,
    padding: int = 0,
    bn_momentum: float = 0.1,
    bn_eps: float = 1e-5,
    rows_ready: Callable[[int], None] | None = None,
    pool: str = "max",
    batch_norm: bool = True,
    fast: bool | None = None,
    workspace: Workspace | None = None,
    relu: bool = True,
) -> tuple[Array, ConvBlockCache, Array, Array]:
    """Run the block on x (B, C, H, W) with weight (K, C, kh, kw) and (K,) BN arrays.

    Returns (y (B, K, Ho // 2, Wo // 2), or (B, K, Ho, Wo) with ``pool`` "none",
    cache, new_running_mean (K,), new_running_var (K,)) where Ho, Wo are the
    convolution's output size. In eval mode (``train`` False) batch norm uses and
    returns the running statistics; without ``batch_norm`` they pass through.
    rows_ready: stream x into the convolution as it arrives (see
    ``conv2d_forward_cached``); batch norm then waits for the whole batch, as it must.
    fast: the fused pass (None: wherever it applies; False: the separate ops);
    workspace: where the fused pass keeps its arrays until the backward pass (the next
    call with the same workspace reuses them). relu: False leaves batch norm's output
    as it is (only with ``pool`` "none": a residual block's layer before its join).
    """
    if x.ndim != 4 or weight.ndim != 4 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"conv layer: x {x.shape} and weight {weight.shape} must be (B, C, H, W) and "
            "(K, C, kh, kw) with the same C"
        )
    if pool not in POOLS:
        raise ValueError(f"conv layer: pool must be one of {POOLS}, got {pool!r}")
    if not relu and pool != "none":
        raise ValueError("conv layer: a layer without its ReLU has no pool")
    xp = get_array_module(x, weight)
    kernels = weight.shape[0]
    if kernels == 0:
        batch, _, height, width = x.shape
        out_h = conv_output_size(height, weight.shape[2], stride, padding)
        out_w = conv_output_size(width, weight.shape[3], stride, padding)
        if pool != "none":
            out_h, out_w = out_h // 2, out_w // 2
        if rows_ready is not None:
            rows_ready(batch)
        y = xp.zeros((batch, 0, max(out_h, 0), max(out_w, 0)), dtype=x.dtype)
        cache = ConvBlockCache(None, None, None, y, tuple(x.shape), tuple(weight.shape),
                               empty=True)
        return y, cache, running_mean, running_var
    for name, vector in (("gamma", gamma), ("beta", beta), ("running_mean", running_mean),
                         ("running_var", running_var)):
        if vector.shape != (kernels,):
            raise ValueError(f"{name} must have shape ({kernels},), got {vector.shape}")
    conv_h = conv_output_size(x.shape[2], weight.shape[2], stride, padding)
    conv_w = conv_output_size(x.shape[3], weight.shape[3], stride, padding)
    if (FUSED if fast is None else fast) and block_fast.supported(pool, conv_h, conv_w):
        return _fused_forward(x, weight, gamma, beta, running_mean, running_var, train,
                              stride, padding, bn_momentum, bn_eps, rows_ready, pool,
                              batch_norm, workspace, (conv_h, conv_w), relu)
    with timed("conv forward"):  # im2col: the separate ops are the path before the fused one
        conv_out, conv_cache = conv2d_forward_cached(x, weight, None, stride=stride,
                                                     padding=padding, rows_ready=rows_ready,
                                                     winograd=False)
    with timed("BN+ReLU+pool forward"):
        bn_cache: BatchNormCache | None = None
        if batch_norm:
            normalized, bn_cache, new_mean, new_var = batch_norm_forward(
                conv_out, gamma, beta, running_mean, running_var, train, momentum=bn_momentum,
                eps=bn_eps)
            del conv_out
        else:  # beta is the convolution's bias
            normalized = conv_out
            normalized += beta.astype(normalized.dtype, copy=False).reshape(1, -1, 1, 1)
            new_mean, new_var = running_mean, running_var
        pool_cache: MaxPoolCache | AvgPoolCache | None = None
        if pool == "max":
            pooled, pool_cache = max_pool2x2(normalized)
            del normalized
            y = rectified = apply_relu(pooled)
        elif pool == "avg":
            rectified = apply_relu(normalized)
            del normalized
            y, pool_cache = avg_pool2x2(rectified)
        elif relu:
            y = rectified = apply_relu(normalized)
        else:  # no ReLU: nothing to mask in the backward pass
            y, rectified = normalized, None
    cache = ConvBlockCache(conv_cache, bn_cache, pool_cache, y, tuple(x.shape),
                           tuple(weight.shape), rectified=rectified)
    return y, cache, new_mean, new_var


def conv_layer_backward(
    cache: ConvBlockCache, dy: Array, need_dx: bool,
    dx_rows: Callable[[Array, int, int], None] | None = None,
) -> tuple[Array | None, Array, Array, Array]:
    """Back-propagate dy (B, K, Ho // 2, Wo // 2) through the block.

    Returns (dx (B, C, H, W) or None when ``need_dx`` is False, dweight
    (K, C, kh, kw), dgamma (K,), dbeta (K,)). With several devices each holding a
    share of the kernels, the full dx is the sum of their dx. dx_rows: hand out dx
    in batch order as it is finished (see ``conv2d_backward_cached``).
    """
    if dy.shape != cache.output.shape:
        raise ValueError(f"dy has shape {dy.shape}, expected {cache.output.shape}")
    xp = get_array_module(cache.output)
    dtype = cache.output.dtype
    if cache.empty:  # a share of 0 kernels
        dx = xp.zeros(cache.input_shape, dtype=dtype) if need_dx else None
        if dx is not None and dx_rows is not None:
            dx_rows(dx, 0, cache.input_shape[0])
        dweight = xp.zeros(cache.weight_shape, dtype=dtype)
        empty = xp.zeros((0,), dtype=dtype)
        return dx, dweight, empty, empty.copy()
    if cache.fused is not None:
        with timed("BN+ReLU+pool backward"):
            dgamma, dbeta = cache.fused.backward_sums(dy)
        with timed("conv backward"):  # each chunk's conv gradient is made right before use
            dx, dweight, _ = conv2d_backward_cached(cache.conv, None, need_dx=need_dx,
                                                    dx_rows=dx_rows, need_db=False,
                                                    source=cache.fused)
        return (dx if need_dx else None), dweight, dgamma, dbeta
    with timed("BN+ReLU+pool backward"):
        if isinstance(cache.pool, MaxPoolCache):
            d_pooled = relu_backward(cache.rectified, dy)
            d_normalized = max_pool2x2_backward(cache.pool, d_pooled)
            del d_pooled
        elif isinstance(cache.pool, AvgPoolCache):
            d_normalized = relu_backward(cache.rectified, avg_pool2x2_backward(cache.pool, dy))
        elif cache.rectified is not None:
            d_normalized = relu_backward(cache.rectified, dy)
        else:  # a layer without its ReLU
            d_normalized = dy.copy()
        if cache.batch_norm is not None:
            d_conv, dgamma, dbeta = batch_norm_backward(cache.batch_norm, d_normalized)
        else:  # the bias: its gradient is the per-channel sum; gamma is unused
            d_conv, dbeta = d_normalized, channel_sum(d_normalized)
            dgamma = xp.zeros_like(dbeta)
        del d_normalized
    with timed("conv backward"):
        dx, dweight, _ = conv2d_backward_cached(cache.conv, d_conv, need_dx=need_dx,
                                                dx_rows=dx_rows, need_db=False)
    return (dx if need_dx else None), dweight, dgamma, dbeta


def _fused_forward(x: Array, weight: Array, gamma: Array, beta: Array, running_mean: Array,
                   running_var: Array, train: bool, stride: int, padding: int,
                   bn_momentum: float, bn_eps: float, rows_ready: Callable[[int], None] | None,
                   pool: str, batch_norm: bool, workspace: Workspace | None,
                   conv_size: tuple[int, int], relu: bool = True
                   ) -> tuple[Array, ConvBlockCache, Array, Array]:
    """The fast path of ``conv_layer_forward``: the convolution hands every batch chunk
    to a ``block_fast.BlockPass`` while it is in cache; then the pass finishes."""
    xp = get_array_module(x, weight)
    dtype = xp.result_type(x.dtype, weight.dtype)
    fused = block_fast.BlockPass(xp, x.shape[0], conv_size, gamma, beta, running_mean,
                                 running_var, train, pool, batch_norm, bn_momentum, bn_eps,
                                 dtype, keep=workspace, relu=relu)
    with timed("conv forward"):  # with the chunks' statistics and max pool
        _, conv_cache = conv2d_forward_cached(x, weight, None, stride=stride, padding=padding,
                                              rows_ready=rows_ready, sink=fused,
                                              workspace=workspace)
    with timed("BN+ReLU+pool forward"):
        y, new_mean, new_var = fused.finish(conv_cache.chunks, conv_cache.threads)
    cache = ConvBlockCache(conv_cache, None, None, y, tuple(x.shape), tuple(weight.shape),
                           fused=fused)
    return y, cache, new_mean, new_var
