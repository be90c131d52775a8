"""A conv layer's kernel shard: the parameters a device keeps between batches.

A device that owns kernels ``kernel_start..kernel_stop-1`` of a block holds their
weights, batch-norm parameters and running statistics plus the SGD velocities
(weight-stationary). ``forward`` runs the whole block (conv -> batch norm -> ReLU ->
pool, as its :class:`LayerSettings` say) for its channels; ``backward`` computes
the weight gradients, applies the optimizer update in place and returns the
partial input gradient; ``forward_host`` and ``backward_host`` do the same from
and to host arrays with exactly the copies a training step makes (x and dy to the
device, y and dx back). The master's own share and every worker daemon use this
same class, which is why a distributed run reproduces a local one.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetconv.backend import (
    ArrayModule,
    array_module_for,
    current_device,
    on_device,
    synchronize,
    to_module,
    to_numpy,
)
from hetconv.engine.optim import sgd_update
from hetconv.names import PARAMETER_NAMES, TRAINABLE_NAMES, velocity_name
from hetconv.ops.conv_layer import conv_layer_backward, conv_layer_forward
from hetconv.ops.workspace import Workspace


@dataclass(frozen=True)
class LayerSettings:
    """Per-layer hyper-parameters shared by every shard of the layer.

    pool: "max" (the paper's), "avg" or "none" after the ReLU; batch_norm: False
    makes ``beta`` the conv's bias. ``per_layer``: a whole network's settings, one
    entry per conv layer; :meth:`for_layer` picks a layer's (a :class:`ConvShard`
    does so itself), so one object can be handed around for every layer.
    """

    stride: int = 1
    padding: int = 0
    bn_momentum: float = 0.1
    bn_eps: float = 1e-5
    momentum: float = 0.9
    weight_decay: float = 5e-4
    pool: str = "max"
    batch_norm: bool = True
    relu: bool = True  # False: no ReLU (a residual block's layer before its join)
    input_from: int = -1  # the activation read (-1: the layer before's output; routing.py)
    shortcut_from: int = -1  # the activation added before the ReLU (-1: none)
    per_layer: tuple[LayerSettings, ...] = ()

    def for_layer(self, layer: int) -> LayerSettings:
        """The settings of conv layer ``layer``: its ``per_layer`` entry, or these
        settings themselves when they do not vary by layer."""
        if not self.per_layer:
            return self
        if not 0 <= layer < len(self.per_layer):
            raise ValueError(f"no settings for layer {layer} ({len(self.per_layer)} layers)")
        return self.per_layer[layer]


class ConvShard:
    """Kernels [kernel_start, kernel_stop) of one conv layer on one device.

    Arrays: weight (K, C, k, k); gamma, beta, running_mean, running_var (K,);
    velocities shaped like the trainable arrays. K may be 0 (an empty share).
    The shard owns its device: ``device`` (``cpu`` or ``gpu:N``) picks the array
    module, and every method makes that device current in the calling thread, so a
    helper thread may call it. Without ``device`` it is derived from ``xp`` (the
    device current at construction for a GPU module).
    """

    def __init__(self, layer: int, kernel_start: int, kernel_stop: int,
                 settings: LayerSettings, state: dict[str, Any], xp: ArrayModule = np,
                 *, device: str | None = None):
        self.layer = layer
        self.kernel_start = kernel_start
        self.kernel_stop = kernel_stop
        self.settings = settings.for_layer(layer)
        self.device = current_device(xp) if device is None else device
        self.xp = xp if device is None else array_module_for(device)
        kernels = kernel_stop - kernel_start
        self.state: dict[str, Any] = {}
        with on_device(self.device):
            for name in PARAMETER_NAMES:
                host = np.ascontiguousarray(state[name], dtype=np.float32)
                if host.shape[0] != kernels:
                    raise ValueError(f"{name} has {host.shape[0]} kernels, expected {kernels}")
                self.state[name] = to_module(host, self.xp).copy()  # never the caller's
            for name in TRAINABLE_NAMES:
                velocity = state.get(velocity_name(name))
                self.state[velocity_name(name)] = (
                    self.xp.zeros_like(self.state[name]) if velocity is None
                    else to_module(np.array(velocity, dtype=np.float32), self.xp))
        self._cache: Any = None
        # the training forward's big arrays (conv output, padded input, masks), reused by
        # the next training step instead of allocated anew (numpy only)
        self.workspace = Workspace()

    @property
    def kernels(self) -> int:
        return self.kernel_stop - self.kernel_start

    def forward(self, x: Any, train: bool,
                rows_ready: Callable[[int], None] | None = None) -> Any:
        """x (B, C, H, W) -> pooled block output (B, K, H', W'); keeps the cache when training.

        x and the output are arrays of the shard's module on its device. rows_ready:
        x is still being filled in batch order (see ``conv_layer_forward``).
        """
        s = self.state
        with on_device(self.device):
            y, cache, mean, var = conv_layer_forward(
                x, s["weight"], s["gamma"], s["beta"], s["running_mean"], s["running_var"],
                train, stride=self.settings.stride, padding=self.settings.padding,
                bn_momentum=self.settings.bn_momentum, bn_eps=self.settings.bn_eps,
                rows_ready=rows_ready, pool=self.settings.pool,
                batch_norm=self.settings.batch_norm, relu=self.settings.relu,
                workspace=self.workspace if train else None)
        if train:
            s["running_mean"], s["running_var"] = mean, var
            self._cache = cache
        return y

    def backward(self, dy: Any, need_dx: bool, learning_rate: float,
                 dx_rows: Callable[[Any, int, int], None] | None = None) -> Any:
        """dy (B, K, H', W') -> partial dx (B, C, H, W) or None; updates parameters in place.

        dy and dx are arrays of the shard's module on its device. dx_rows(dx, start,
        stop): called as samples [start, stop) of dx are final, in batch order.
        """
        if self._cache is None:
            raise RuntimeError(f"layer {self.layer}: backward without a training forward")
        s, cfg = self.state, self.settings
        with on_device(self.device):
            dx, dweight, dgamma, dbeta = conv_layer_backward(self._cache, dy, need_dx,
                                                             dx_rows=dx_rows)
            self._cache = None
            sgd_update(s["weight"], dweight, s["velocity_weight"], learning_rate,
                       cfg.momentum, cfg.weight_decay)
            sgd_update(s["gamma"], dgamma, s["velocity_gamma"], learning_rate, cfg.momentum, 0.0)
            sgd_update(s["beta"], dbeta, s["velocity_beta"], learning_rate, cfg.momentum, 0.0)
        return dx

    def forward_host(self, x: np.ndarray, train: bool) -> np.ndarray:
        """``forward`` from and to the host, as a training step does it: x (any float
        dtype) is copied to the device as float32, the float32 output back."""
        with on_device(self.device):
            y = self.forward(to_module(np.ascontiguousarray(x, dtype=np.float32), self.xp),
                             train)
            return to_numpy(y)

    def backward_host(self, dy: np.ndarray, need_dx: bool, learning_rate: float
                      ) -> np.ndarray | None:
        """``backward`` from and to the host: dy copied to the device as float32, the
        float32 partial dx back (None when not needed). Returns when the update is done."""
        with on_device(self.device):
            dx = self.backward(to_module(np.ascontiguousarray(dy, dtype=np.float32), self.xp),
                               need_dx, learning_rate)
            if dx is None:
                synchronize(self.xp)  # the copy back would have waited for the update
                return None
            return to_numpy(dx)

    def forward_host_streamed(self, x: np.ndarray, rows_ready: Callable[[int], None],
                              train: bool) -> np.ndarray:
        """``forward_host`` on a host buffer x (B, C, H, W) float32 that is still being
        filled in batch order: ``rows_ready(n)`` returns once samples [0, n) are in.

        On the host (numpy) the convolution takes each chunk of samples as it arrives,
        so a transfer overlaps the products; the result is bit for bit that of
        ``forward_host``. On a GPU it waits for the whole input, then runs as
        ``forward_host`` (one copy to the device).
        """
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            raise ValueError("a streamed input must be a C-contiguous float32 buffer")
        if self.xp is not np:
            rows_ready(x.shape[0])
            return self.forward_host(x, train)
        with on_device(self.device):
            return to_numpy(self.forward(x, train, rows_ready=rows_ready))

    def backward_host_streamed(self, dy: np.ndarray, need_dx: bool, learning_rate: float,
                               dx_rows: Callable[[np.ndarray, int, int], None]) -> None:
        """``backward_host`` that hands out the host dx (B, C, H, W) float32 as it is
        finished: ``dx_rows(dx, start, stop)`` for samples [start, stop), in batch order
        (on the host while the rest is computed; on a GPU once, at the end). Returns when
        the update is done."""
        if self.xp is not np:
            dx = self.backward_host(dy, need_dx, learning_rate)
            if dx is not None:
                dx_rows(dx, 0, dx.shape[0])
            return
        with on_device(self.device):
            self.backward(np.ascontiguousarray(dy, dtype=np.float32), need_dx, learning_rate,
                          dx_rows=dx_rows if need_dx else None)

    def snapshot(self) -> dict[str, np.ndarray]:
        """Host copies of every state array (parameters, statistics, velocities)."""
        with on_device(self.device):
            return {name: to_numpy(value).copy() for name, value in self.state.items()}
