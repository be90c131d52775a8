"""The calibration benchmark a device runs for one conv layer's shape.

A device times what one training step does with a shard of the layer: the whole
block (conv -> [batch norm] -> ReLU -> [pool]) forward and backward with the optimizer
update, on random data of the layer's real shape (batch, input channels, spatial
size) and a given number of kernels (the master asks for an equal share of the
layer, the size each device will roughly own). It runs through
:meth:`ConvShard.forward_host` / :meth:`ConvShard.backward_host` on the device, so a
GPU's timing includes the copies a step makes (x and dy to the device, y and dx
back). Only the time matters, so the data are random (as in the paper, section
4.1.1). Returns the median seconds.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from hetconv.engine.shard import ConvShard, LayerSettings
from hetconv.names import PARAMETER_NAMES


def time_block(batch: int, in_channels: int, height: int, width: int, kernels: int,
               kernel_size: int, padding: int = 0, stride: int = 1, need_dx: bool = True,
               repeats: int = 3, device: str = "cpu", seed: int = 0,
               min_total_s: float = 0.3, max_repeats: int = 50, pool: str = "max",
               batch_norm: bool = True) -> float:
    """Median seconds of one block forward + backward at this shape on ``device``
    (``cpu`` or ``gpu:N``), host copies included, after a warm-up.

    ``pool`` ("max", "avg", "none") and ``batch_norm`` are the layer's (the paper's
    block by default). Runs at least ``repeats`` times and keeps going (up to ``max_repeats``) until the
    timed runs add up to ``min_total_s``, so short layers are not judged on a single
    scheduler time slice.
    """
    if min(batch, in_channels, height, width, kernels, kernel_size, repeats) < 1:
        raise ValueError("calibration shape and repeats must be positive")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, in_channels, height, width), dtype=np.float32)
    state = {name: np.zeros(kernels, np.float32) for name in PARAMETER_NAMES}
    state.update(
        weight=rng.standard_normal((kernels, in_channels, kernel_size, kernel_size),
                                   dtype=np.float32) * np.float32(0.1),
        gamma=np.ones(kernels, np.float32), running_var=np.ones(kernels, np.float32))
    settings = LayerSettings(stride=stride, padding=padding, pool=pool, batch_norm=batch_norm)
    shard = ConvShard(0, 0, kernels, settings, state, device=device)
    dy: np.ndarray | None = None
    times: list[float] = []
    attempt = 0
    while attempt <= repeats or (sum(times) < min_total_s and len(times) < max_repeats):
        start = time.perf_counter()
        y = shard.forward_host(x, train=True)
        if dy is None:
            dy = np.ones_like(y)
        shard.backward_host(dy, need_dx, learning_rate=0.0)  # the update, but no change
        if attempt:  # the first run warms caches and allocators
            times.append(time.perf_counter() - start)
        attempt += 1
    return statistics.median(times)
