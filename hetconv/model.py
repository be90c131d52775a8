"""The network, described as data: conv layers (distributed) then dense layers (master).

A conv layer is ``conv kxk -> [batch norm] -> ReLU -> [2x2 max or average pool]``.
The paper's network (section 5.2, batch norm as the per-channel normalization) is
a stack of such blocks with 5x5 kernels and max pooling, written ``--arch 32:64``.
The general form is a comma-separated token sequence, parsed by
:mod:`hetconv.network_spec` (re-exported here: :func:`parse_network`, :class:`ConvSpec`,
...).

A residual block is two or three conv layers: conv 3x3 (stride) -> BN -> ReLU, then conv
3x3 -> BN whose output is added to the shortcut before the ReLU; the shortcut is the
block's input, or (where the stride or the width changes) a 1x1 conv (stride) -> BN,
a layer of its own placed between the two. Each :class:`ConvSpec` says where its input
comes from and what is added to it (``input_from``, ``shortcut_from``: activation
indices, activation 0 the network's input and activation i+1 layer i's output);
:mod:`hetconv.engine.routing` runs them.

The classifier (``fc`` to ``classes``) is added automatically. :func:`conv_layer_shapes`
derives every conv layer's input/output shape and refuses impossible ones, naming
the token; :func:`init_parameters` draws seeded He-initialised weights, so the same
seed always gives the same network.

Parameter names: see :mod:`hetconv.names`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hetconv.errors import UserError
from hetconv.names import (
    CLASSIFIER,
    DENSE_BIAS,
    DENSE_WEIGHT,
    PARAMETER_NAMES,
    hidden_prefix,
    layer_key,
)
from hetconv.network_spec import GRAMMAR as GRAMMAR
from hetconv.network_spec import NO_ROUTE as NO_ROUTE
from hetconv.network_spec import RESNET_DEPTHS as RESNET_DEPTHS
from hetconv.network_spec import ConvSpec as ConvSpec
from hetconv.network_spec import DenseSpec as DenseSpec
from hetconv.network_spec import NetworkSpec as NetworkSpec
from hetconv.network_spec import load_network_file as load_network_file
from hetconv.network_spec import paper_spec as paper_spec
from hetconv.network_spec import parse_arch as parse_arch
from hetconv.network_spec import parse_network as parse_network
from hetconv.network_spec import resnet_tokens as resnet_tokens


@dataclass(frozen=True)
class ModelConfig:
    """What the network looks like: kernels per conv layer, kernel size, input.

    Without ``convs`` the network is the paper's: one block per entry of
    ``conv_kernels`` with ``kernel_size``/``padding``, batch norm and max pooling.
    With ``convs`` (and ``dense``) it is that spec; ``conv_kernels`` must then list
    the same kernel counts (:func:`model_config` builds it so).
    """

    conv_kernels: tuple[int, ...]
    input_shape: tuple[int, int, int]  # (channels, height, width)
    classes: int = 10
    kernel_size: int = 5
    padding: int = 0
    bn_momentum: float = 0.1
    bn_eps: float = 1e-5
    convs: tuple[ConvSpec, ...] = field(default=())
    dense: tuple[DenseSpec, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.convs and tuple(c.kernels for c in self.convs) != tuple(self.conv_kernels):
            raise ValueError("ModelConfig: conv_kernels must list the kernels of convs")

    def conv_specs(self) -> tuple[ConvSpec, ...]:
        """Every conv layer's spec (the paper's blocks when ``convs`` is empty)."""
        if self.convs:
            return self.convs
        return tuple(ConvSpec(k, self.kernel_size, self.padding, 1, True, "max")
                     for k in self.conv_kernels)

    @property
    def residual(self) -> bool:
        """Whether some layer is routed (a residual block): such a network runs only
        where its layers are chained by :mod:`hetconv.engine.routing`."""
        return any(c.routed for c in self.convs)

    @property
    def global_pool(self) -> bool:
        return any(d.kind == "gap" for d in self.dense)


def model_config(spec: NetworkSpec, input_shape: tuple[int, int, int], classes: int = 10,
                 kernel_size: int = 5, padding: int = 0) -> ModelConfig:
    """The :class:`ModelConfig` of a parsed spec. A paper spec (every conv a 5x5-style
    block with max pool and no dense layer, as :func:`parse_network` makes from
    ``32:64``) keeps ``convs`` empty, so the model is exactly the paper's."""
    if spec.paper:
        return ModelConfig(spec.kernels, input_shape, classes, kernel_size, padding)
    return ModelConfig(spec.kernels, input_shape, classes, kernel_size, padding,
                       convs=spec.convs, dense=spec.dense)


@dataclass(frozen=True)
class ConvLayerShape:
    """Shapes of one conv layer for a single image (multiply by the batch).

    conv_height/conv_width: the convolution's output; pooled_height/pooled_width:
    the layer's output (after the pool, or the conv output when ``pool`` is none).
    """

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
    stride: int = 1
    pool: str = "max"
    batch_norm: bool = True
    relu: bool = True
    input_from: int = NO_ROUTE
    shortcut_from: int = NO_ROUTE

    def input_shape(self, batch: int) -> tuple[int, int, int, int]:
        return (batch, self.in_channels, self.height, self.width)

    def output_shape(self, batch: int) -> tuple[int, int, int, int]:
        return (batch, self.kernels, self.pooled_height, self.pooled_width)

    @property
    def weight_values(self) -> int:
        """Values of the layer's weight (K, C, k, k)."""
        return self.kernels * self.in_channels * self.kernel_size**2

    def conv_flops(self, batch: int) -> int:
        """Multiply-adds x2 of the forward convolution for ``batch`` images."""
        return (2 * batch * self.kernels * self.in_channels * self.kernel_size**2
                * self.conv_height * self.conv_width)


# --- shapes and parameters -------------------------------------------------------------
def conv_layer_shapes(config: ModelConfig) -> list[ConvLayerShape]:
    """Every conv layer's shapes; raises UserError naming the layer (its token) when a
    conv or pool would make the map smaller than 1x1. A routed layer (a residual
    block's) reads the activation its spec names."""
    activations = [config.input_shape]  # (C, H, W) of activation 0, 1, ...
    shapes = []
    for index, spec in enumerate(config.conv_specs()):
        source = index if spec.input_from == NO_ROUTE else spec.input_from
        channels, height, width = activations[source]
        k, p, s = spec.kernel_size, spec.padding, spec.stride
        conv_h, conv_w = (height + 2 * p - k) // s + 1, (width + 2 * p - k) // s + 1
        paper = not config.convs
        if paper and (conv_h < 2 or conv_w < 2):
            raise UserError(
                f"conv layer {index + 1} gets a {height}x{width} input, too small for a "
                f"{k}x{k} kernel and 2x2 pooling; use fewer blocks, --padding or a smaller --kernel-size"
            )
        if conv_h < 1 or conv_w < 1:
            raise UserError(
                f"network: token {spec.position} {spec.token!r} (conv layer {index + 1}) gets a "
                f"{height}x{width} map, too small for a {k}x{k} kernel with padding {p}"
                f"{f' and stride {s}' if s > 1 else ''}: the output would be smaller than 1x1")
        out_h, out_w = conv_h, conv_w
        if spec.pool != "none":
            if conv_h < 2 or conv_w < 2:
                raise UserError(
                    f"network: token {spec.pool_position} {spec.pool_token!r} after conv layer "
                    f"{index + 1} ({spec.token}) gets a {conv_h}x{conv_w} map: 2x2 pooling "
                    "would make it smaller than 1x1")
            out_h, out_w = conv_h // 2, conv_w // 2
        if spec.shortcut_from != NO_ROUTE \
                and activations[spec.shortcut_from] != (spec.kernels, out_h, out_w):
            raise UserError(
                f"network: token {spec.position} {spec.token!r} (conv layer {index + 1}): its "
                f"output {spec.kernels}x{out_h}x{out_w} cannot be added to its shortcut "
                f"{'x'.join(map(str, activations[spec.shortcut_from]))}")
        shapes.append(ConvLayerShape(index, channels, height, width, spec.kernels, k, p,
                                     conv_h, conv_w, out_h, out_w, s, spec.pool,
                                     spec.batch_norm, spec.relu, spec.input_from,
                                     spec.shortcut_from))
        activations.append((spec.kernels, out_h, out_w))
    return shapes


def dense_features(config: ModelConfig) -> int:
    """Length of the flattened last conv layer output that feeds the dense layers."""
    last = conv_layer_shapes(config)[-1]
    if config.global_pool:
        return last.kernels
    return last.kernels * last.pooled_height * last.pooled_width


def dense_shapes(config: ModelConfig) -> list[tuple[str, int, int]]:
    """(key prefix, in features, out features) of every dense weight matrix, in
    order: the hidden fc layers (``dense{j}``) then the classifier (``fc``)."""
    features = dense_features(config)
    out: list[tuple[str, int, int]] = []
    hidden = 0
    for spec in config.dense:
        if spec.kind == "fc":
            out.append((hidden_prefix(hidden), features, spec.units))
            features, hidden = spec.units, hidden + 1
    out.append((CLASSIFIER, features, config.classes))
    return out


def dense_parameter_names(config: ModelConfig) -> list[str]:
    """Keys of every dense array (weights and biases), hidden layers first."""
    return [f"{prefix}.{name}" for prefix, _, _ in dense_shapes(config)
            for name in ("weight", "bias")]


def init_parameters(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Seeded He initialisation (float32); the same seed gives the same weights.

    Draw order: every conv layer's weight, then the hidden dense layers' (He, for
    their ReLU), then the classifier's (scale sqrt(1 / features)).
    """
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
    shapes = dense_shapes(config)
    for prefix, features, units in shapes[:-1]:
        hidden = rng.standard_normal((units, features)) * np.sqrt(2.0 / features)
        params[f"{prefix}.weight"] = hidden.astype(np.float32)
        params[f"{prefix}.bias"] = np.zeros(units, np.float32)
    _, features, classes = shapes[-1]
    fc = rng.standard_normal((classes, features)) * np.sqrt(1.0 / features)
    params[DENSE_WEIGHT] = fc.astype(np.float32)
    params[DENSE_BIAS] = np.zeros(classes, np.float32)
    return params


def layer_parameters(params: dict[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    """The five arrays of conv layer ``layer`` keyed by their short names."""
    return {name: params[layer_key(layer, name)] for name in PARAMETER_NAMES}
