"""The calibration benchmark a device runs for one conv layer's shape.

A device times the whole block (conv -> batch norm -> ReLU -> pool) forward and
backward on random data of the layer's real shape: batch, input channels, spatial
size, and a given number of kernels (the master asks for an equal share of the
layer, the size each device will roughly own). Only the time matters, so the data
are random (as in the paper, section 4.1.1). Returns the median seconds.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from hetconv.backend import ArrayModule, synchronize
from hetconv.ops.conv_layer import conv_layer_backward, conv_layer_forward


def time_block(batch: int, in_channels: int, height: int, width: int, kernels: int,
               kernel_size: int, padding: int = 0, stride: int = 1, need_dx: bool = True,
               repeats: int = 3, xp: ArrayModule = np, seed: int = 0,
               min_total_s: float = 0.3, max_repeats: int = 50) -> float:
    """Median seconds of one block forward + backward at this shape (after a warm-up).

    Runs at least ``repeats`` times and keeps going (up to ``max_repeats``) until the
    timed runs add up to ``min_total_s``, so short layers are not judged on a single
    scheduler time slice.
    """
    if min(batch, in_channels, height, width, kernels, kernel_size, repeats) < 1:
        raise ValueError("calibration shape and repeats must be positive")
    rng = np.random.default_rng(seed)
    x = xp.asarray(rng.standard_normal((batch, in_channels, height, width), dtype=np.float32))
    w = xp.asarray(rng.standard_normal((kernels, in_channels, kernel_size, kernel_size),
                                       dtype=np.float32) * 0.1)
    gamma, beta = xp.ones(kernels, np.float32), xp.zeros(kernels, np.float32)
    mean, var = xp.zeros(kernels, np.float32), xp.ones(kernels, np.float32)
    times: list[float] = []
    attempt = 0
    while attempt <= repeats or (sum(times) < min_total_s and len(times) < max_repeats):
        synchronize(xp)
        start = time.perf_counter()
        y, cache, _, _ = conv_layer_forward(x, w, gamma, beta, mean, var, True,
                                            stride=stride, padding=padding)
        conv_layer_backward(cache, xp.ones_like(y), need_dx)
        synchronize(xp)
        if attempt:  # the first run warms caches and allocators
            times.append(time.perf_counter() - start)
        attempt += 1
    return statistics.median(times)
