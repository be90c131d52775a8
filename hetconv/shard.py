"""A conv layer's kernel shard: the parameters a device keeps between batches.

A device that owns kernels ``kernel_start..kernel_stop-1`` of a block holds their
weights, batch-norm parameters and running statistics plus the SGD velocities
(weight-stationary). ``forward`` runs the whole block (conv -> batch norm -> ReLU ->
max pool) for its channels; ``backward`` computes the weight gradients, applies the
optimizer update in place and returns the partial input gradient. The master's own
share and every worker daemon use this same class, which is why a distributed run
reproduces a local one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hetconv.backend import ArrayModule, to_module, to_numpy
from hetconv.names import PARAMETER_NAMES, TRAINABLE_NAMES, velocity_name
from hetconv.ops.conv_layer import conv_layer_backward, conv_layer_forward
from hetconv.optim import sgd_update


@dataclass(frozen=True)
class LayerSettings:
    """Per-layer hyper-parameters shared by every shard of the layer."""

    stride: int = 1
    padding: int = 0
    bn_momentum: float = 0.1
    bn_eps: float = 1e-5
    momentum: float = 0.9
    weight_decay: float = 5e-4


class ConvShard:
    """Kernels [kernel_start, kernel_stop) of one conv layer on one device.

    Arrays: weight (K, C, k, k); gamma, beta, running_mean, running_var (K,);
    velocities shaped like the trainable arrays. K may be 0 (an empty share).
    """

    def __init__(self, layer: int, kernel_start: int, kernel_stop: int,
                 settings: LayerSettings, state: dict[str, Any], xp: ArrayModule = np):
        self.layer = layer
        self.kernel_start = kernel_start
        self.kernel_stop = kernel_stop
        self.settings = settings
        self.xp = xp
        kernels = kernel_stop - kernel_start
        self.state: dict[str, Any] = {}
        for name in PARAMETER_NAMES:
            array = to_module(np.ascontiguousarray(state[name], dtype=np.float32), xp)
            if array.shape[0] != kernels:
                raise ValueError(f"{name} has {array.shape[0]} kernels, expected {kernels}")
            self.state[name] = array.copy()
        for name in TRAINABLE_NAMES:
            velocity = state.get(velocity_name(name))
            self.state[velocity_name(name)] = (
                xp.zeros_like(self.state[name]) if velocity is None
                else to_module(np.array(velocity, dtype=np.float32), xp))
        self._cache: Any = None

    @property
    def kernels(self) -> int:
        return self.kernel_stop - self.kernel_start

    def forward(self, x: Any, train: bool) -> Any:
        """x (B, C, H, W) -> pooled block output (B, K, H', W'); keeps the cache when training."""
        s = self.state
        y, cache, mean, var = conv_layer_forward(
            x, s["weight"], s["gamma"], s["beta"], s["running_mean"], s["running_var"],
            train, stride=self.settings.stride, padding=self.settings.padding,
            bn_momentum=self.settings.bn_momentum, bn_eps=self.settings.bn_eps)
        if train:
            s["running_mean"], s["running_var"] = mean, var
            self._cache = cache
        return y

    def backward(self, dy: Any, need_dx: bool, learning_rate: float) -> Any:
        """dy (B, K, H', W') -> partial dx (B, C, H, W) or None; updates parameters in place."""
        if self._cache is None:
            raise RuntimeError(f"layer {self.layer}: backward without a training forward")
        dx, dweight, dgamma, dbeta = conv_layer_backward(self._cache, dy, need_dx)
        self._cache = None
        s, cfg = self.state, self.settings
        sgd_update(s["weight"], dweight, s["velocity_weight"], learning_rate,
                   cfg.momentum, cfg.weight_decay)
        sgd_update(s["gamma"], dgamma, s["velocity_gamma"], learning_rate, cfg.momentum, 0.0)
        sgd_update(s["beta"], dbeta, s["velocity_beta"], learning_rate, cfg.momentum, 0.0)
        return dx

    def snapshot(self) -> dict[str, np.ndarray]:
        """Host copies of every state array (parameters, statistics, velocities)."""
        return {name: to_numpy(value).copy() for name, value in self.state.items()}
