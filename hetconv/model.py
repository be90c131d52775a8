"""The paper's network, described as data: conv layers then one dense layer.

A conv layer is ``conv kxk -> batch norm -> ReLU -> max pool 2x2`` (section 5.2 of
the paper, with batch norm as the per-channel normalization). After the blocks come
a fully connected layer and a softmax loss. :func:`parse_arch` turns ``--arch
50:500`` into kernel counts, :func:`conv_layer_shapes` derives every block's
input/output shape, and :func:`init_parameters` draws seeded He-initialised
weights, so the same seed always gives the same network.

Parameter names: see :mod:`hetconv.names`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetconv.errors import UserError
from hetconv.names import DENSE_BIAS, DENSE_WEIGHT, PARAMETER_NAMES, layer_key


@dataclass(frozen=True)
class ModelConfig:
    """What the network looks like: kernels per conv layer, kernel size, input."""

    conv_kernels: tuple[int, ...]
    input_shape: tuple[int, int, int]  # (channels, height, width)
    classes: int = 10
    kernel_size: int = 5
    padding: int = 0
    bn_momentum: float = 0.1
    bn_eps: float = 1e-5


@dataclass(frozen=True)
class ConvLayerShape:
    """Shapes of one conv layer for a single image (multiply by the batch)."""

    index: int
    in_channels: int
    height: int
    width: int
    kernels: int
    kernel_size: int
    padding: int
    conv_height: int
    conv_width: int
    pooled_height: int
    pooled_width: int

    def input_shape(self, batch: int) -> tuple[int, int, int, int]:
        return (batch, self.in_channels, self.height, self.width)

    def output_shape(self, batch: int) -> tuple[int, int, int, int]:
        return (batch, self.kernels, self.pooled_height, self.pooled_width)

    def conv_flops(self, batch: int) -> int:
        """Multiply-adds x2 of the forward convolution for ``batch`` images."""
        return (2 * batch * self.kernels * self.in_channels * self.kernel_size**2
                * self.conv_height * self.conv_width)


def parse_arch(text: str) -> tuple[int, ...]:
    """``"50:500"`` -> ``(50, 500)``: kernels of each conv layer, in order."""
    parts = text.split(":")
    try:
        kernels = tuple(int(p) for p in parts)
    except ValueError:
        raise UserError(f"--arch {text!r}: expected kernel counts like 50:500") from None
    if not kernels or any(k < 1 for k in kernels):
        raise UserError(f"--arch {text!r}: every block needs at least one kernel")
    return kernels


def conv_layer_shapes(config: ModelConfig) -> list[ConvLayerShape]:
    """Every block's shapes; raises UserError when the input becomes too small."""
    channels, height, width = config.input_shape
    shapes = []
    for index, kernels in enumerate(config.conv_kernels):
        k, p = config.kernel_size, config.padding
        conv_h, conv_w = height + 2 * p - k + 1, width + 2 * p - k + 1
        if conv_h < 2 or conv_w < 2:
            raise UserError(
                f"conv layer {index + 1} gets a {height}x{width} input, too small for a "
                f"{k}x{k} kernel and 2x2 pooling; use fewer blocks, --padding or a smaller --kernel-size"
            )
        shapes.append(ConvLayerShape(index, channels, height, width, kernels, k, p,
                                     conv_h, conv_w, conv_h // 2, conv_w // 2))
        channels, height, width = kernels, conv_h // 2, conv_w // 2
    return shapes


def dense_features(config: ModelConfig) -> int:
    """Length of the flattened last block output that feeds the dense layer."""
    last = conv_layer_shapes(config)[-1]
    return last.kernels * last.pooled_height * last.pooled_width


def init_parameters(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Seeded He initialisation (float32); the same seed gives the same weights."""
    rng = np.random.default_rng(seed)
    params: dict[str, np.ndarray] = {}
    for shape in conv_layer_shapes(config):
        fan_in = shape.in_channels * shape.kernel_size**2
        w = rng.standard_normal((shape.kernels, shape.in_channels, shape.kernel_size,
                                 shape.kernel_size)) * np.sqrt(2.0 / fan_in)
        i = shape.index
        params[layer_key(i, "weight")] = w.astype(np.float32)
        params[layer_key(i, "gamma")] = np.ones(shape.kernels, np.float32)
        params[layer_key(i, "beta")] = np.zeros(shape.kernels, np.float32)
        params[layer_key(i, "running_mean")] = np.zeros(shape.kernels, np.float32)
        params[layer_key(i, "running_var")] = np.ones(shape.kernels, np.float32)
    features = dense_features(config)
    fc = rng.standard_normal((config.classes, features)) * np.sqrt(1.0 / features)
    params[DENSE_WEIGHT] = fc.astype(np.float32)
    params[DENSE_BIAS] = np.zeros(config.classes, np.float32)
    return params


def layer_parameters(params: dict[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    """The five arrays of conv layer ``layer`` keyed by their short names."""
    return {name: params[layer_key(layer, name)] for name in PARAMETER_NAMES}
