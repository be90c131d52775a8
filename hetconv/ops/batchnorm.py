"""Per-channel batch normalization over (B, C, H, W) activations, forward and backward.

Batch norm is the one op in a conv layer that reduces over the batch, so it is
written to be strictly *per channel*: every statistic of channel ``c`` is computed
from channel ``c`` alone, in an order that does not depend on how many other
channels are present. A device that owns kernels ``a..b-1`` of a conv layer can
therefore normalize its slice of channels and obtain exactly (bit for bit on numpy)
the slice of the full layer's result, which is what lets the master split a block
between heterogeneous workers. The functions are pure: running statistics go in
and the updated ones come out (PyTorch semantics), nothing is modified in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hetconv.backend import get_array_module

Array = Any  # a numpy or cupy ndarray


@dataclass(frozen=True)
class BatchNormCache:
    """What the backward pass needs from the forward pass.

    x_hat: (B, C, H, W) normalized input, ``(x - mean) * inv_std``.
    inv_std: (C,) ``1 / sqrt(var + eps)`` (batch variance in train mode,
        running variance in eval mode).
    gamma: (C,) scale used by the forward pass.
    train: whether the batch statistics were used (selects the backward formula).
    """

    x_hat: Array
    inv_std: Array
    gamma: Array
    train: bool


def channel_sum(a: Array) -> Array:
    """Sum of ``a`` (B, C, H, W) over batch and space, per channel -> (C,).

    Each channel is reduced in two stages, first over its contiguous H*W row for
    every image, then over the batch as one contiguous row; both stages see the
    same data in the same order whatever C is, so the result for a channel does
    not depend on its neighbours (unlike a single reduction over axes (0, 2, 3),
    which numpy may coalesce differently when C == 1). The accumulation stays in
    ``a``'s dtype (float32 inputs use numpy's pairwise float32 summation).
    """
    xp = get_array_module(a)
    batch, channels = a.shape[0], a.shape[1]
    per_image = xp.add.reduce(a.reshape(batch, channels, a.shape[2] * a.shape[3]), axis=2)
    return xp.add.reduce(xp.ascontiguousarray(per_image.T), axis=1)  # (C,)


def _per_channel(v: Array) -> Array:
    """(C,) -> (1, C, 1, 1) for broadcasting against (B, C, H, W)."""
    return v.reshape(1, -1, 1, 1)


def batch_norm_forward(
    x: Array,
    gamma: Array,
    beta: Array,
    running_mean: Array,
    running_var: Array,
    train: bool,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> tuple[Array, BatchNormCache, Array, Array]:
    """Normalize ``x`` per channel and apply the affine transform.

    x: (B, C, H, W); gamma, beta, running_mean, running_var: (C,).
    Train mode normalizes with the batch mean and biased batch variance and
    returns running statistics updated as ``(1 - momentum) * old + momentum *
    batch`` with the *unbiased* batch variance, like ``torch.nn.BatchNorm2d``.
    Eval mode normalizes with the running statistics and returns them unchanged.

    Returns (y (B, C, H, W), cache, new_running_mean (C,), new_running_var (C,)).
    All arrays keep ``x``'s dtype; no float64 temporaries for float32 inputs.
    """
    if x.ndim != 4:
        raise ValueError(f"batch norm expects (B, C, H, W), got shape {x.shape}")
    channels = x.shape[1]
    for name, v in (("gamma", gamma), ("beta", beta), ("running_mean", running_mean),
                    ("running_var", running_var)):
        if v.shape != (channels,):
            raise ValueError(f"{name} must have shape ({channels},), got {v.shape}")
    dtype = x.dtype
    if train:
        count = x.shape[0] * x.shape[2] * x.shape[3]
        if count < 2 and channels > 0:
            raise ValueError(
                f"batch norm in train mode needs more than 1 value per channel, got {x.shape}"
            )
        mean = channel_sum(x) / count
        centered = x - _per_channel(mean)
        var = channel_sum(centered * centered) / count
        inv_std = (1.0 / (var + eps) ** 0.5).astype(dtype, copy=False)
        x_hat = centered
        x_hat *= _per_channel(inv_std)
        unbiased_var = var * (count / max(count - 1, 1))
        new_running_mean = ((1.0 - momentum) * running_mean + momentum * mean).astype(
            running_mean.dtype, copy=False
        )
        new_running_var = ((1.0 - momentum) * running_var + momentum * unbiased_var).astype(
            running_var.dtype, copy=False
        )
    else:
        inv_std = (1.0 / (running_var + eps) ** 0.5).astype(dtype, copy=False)
        x_hat = (x - _per_channel(running_mean.astype(dtype, copy=False)))
        x_hat *= _per_channel(inv_std)
        new_running_mean, new_running_var = running_mean, running_var
    gamma = gamma.astype(dtype, copy=True)  # a copy: the caller may update gamma in place
    y = x_hat * _per_channel(gamma)
    y += _per_channel(beta.astype(dtype, copy=False))
    cache = BatchNormCache(x_hat=x_hat, inv_std=inv_std, gamma=gamma, train=bool(train))
    return y, cache, new_running_mean, new_running_var


def batch_norm_backward(cache: BatchNormCache, dy: Array) -> tuple[Array, Array, Array]:
    """Gradients of batch norm given dy (B, C, H, W) = dLoss/dy.

    Train mode uses the fused formula (the batch statistics depend on x):
        dx = gamma * inv_std / N * (N * dy - sum(dy) - x_hat * sum(dy * x_hat))
    with sums per channel over N = B * H * W values. Eval mode is a per-channel
    affine map, so dx = dy * gamma * inv_std.

    Returns (dx (B, C, H, W), dgamma (C,), dbeta (C,)).
    """
    x_hat = cache.x_hat
    if dy.shape != x_hat.shape:
        raise ValueError(f"dy has shape {dy.shape}, expected {x_hat.shape}")
    dbeta = channel_sum(dy)
    dgamma = channel_sum(dy * x_hat)
    scale = cache.gamma * cache.inv_std  # (C,)
    if cache.train:
        count = x_hat.shape[0] * x_hat.shape[2] * x_hat.shape[3]
        dx = x_hat * _per_channel(dgamma)
        dx += _per_channel(dbeta)
        dx *= -1.0 / count
        dx += dy
        dx *= _per_channel(scale)
    else:
        dx = dy * _per_channel(scale)
    return dx, dgamma, dbeta
