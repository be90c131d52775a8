"""The network, described as data: conv layers (distributed) then dense layers (master).

A conv layer is ``conv kxk -> [batch norm] -> ReLU -> [2x2 max or average pool]``.
The paper's network (section 5.2, batch norm as the per-channel normalization) is
a stack of such blocks with 5x5 kernels and max pooling, written ``--arch 32:64``.
The general form is a comma-separated token sequence (:func:`parse_network`)::

    c<K>k<size>[p<pad>][s<stride>][nobn]   conv of K kernels (batch norm + ReLU after it)
    pool | avgpool                         2x2 max / average pool, fused into the conv before
    fc<N>                                  hidden dense layer of N units with ReLU
    drop<p>                                dropout (0 <= p < 1) after fc or before the classifier

The classifier (``fc`` to ``classes``) is added automatically. :func:`conv_layer_shapes`
derives every conv layer's input/output shape and refuses impossible ones, naming
the token; :func:`init_parameters` draws seeded He-initialised weights, so the same
seed always gives the same network.

Parameter names: see :mod:`hetconv.names`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tomllib

from hetconv.errors import UserError
from hetconv.names import (
    CLASSIFIER,
    DENSE_BIAS,
    DENSE_WEIGHT,
    PARAMETER_NAMES,
    hidden_prefix,
    layer_key,
)

_CONV = re.compile(r"c(\d+)k(\d+)(?:p(\d+))?(?:s(\d+))?(nobn)?")
_FC = re.compile(r"fc(\d+)")
_DROP = re.compile(r"drop(\d*\.?\d+(?:e-?\d+)?)")
_PAPER = re.compile(r"[^,]*:[^,]*|\d+")
GRAMMAR = ("c<K>k<size>[p<pad>][s<stride>][nobn], pool, avgpool, fc<N>, drop<p> "
           "(or kernel counts like 32:64)")


@dataclass(frozen=True)
class ConvSpec:
    """One conv layer: ``kernels`` of ``kernel_size`` x ``kernel_size``, zero ``padding``
    pixels on each side, ``stride``; batch norm or not; then ``pool``
    (``hetconv.ops.conv_layer.POOLS``: "max", "avg" or "none").
    ``token``/``pool_token`` name where it came from, for error lines."""

    kernels: int
    kernel_size: int
    padding: int = 0
    stride: int = 1
    batch_norm: bool = True
    pool: str = "none"
    token: str = ""
    pool_token: str = ""
    position: int = 0  # of the token in the spec, from 1
    pool_position: int = 0


@dataclass(frozen=True)
class DenseSpec:
    """One master-side layer before the classifier: ``fc`` (``units`` outputs, ReLU)
    or ``dropout`` (drop probability ``rate``)."""

    kind: str  # "fc" | "dropout"
    units: int = 0
    rate: float = 0.0
    token: str = ""


@dataclass(frozen=True)
class NetworkSpec:
    """A parsed ``--arch`` / ``--model``: conv layers, then dense layers, then the
    classifier (implicit). ``text`` is the canonical comma-separated form (or the
    paper's ``32:64``)."""

    convs: tuple[ConvSpec, ...]
    dense: tuple[DenseSpec, ...] = ()
    text: str = ""
    paper: bool = False  # written as kernel counts (32:64): the paper's blocks

    @property
    def kernels(self) -> tuple[int, ...]:
        return tuple(c.kernels for c in self.convs)


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


# --- parsing -------------------------------------------------------------------------
def parse_arch(text: str) -> tuple[int, ...]:
    """``"50:500"`` -> ``(50, 500)``: kernels of each conv layer, in order (any spec
    :func:`parse_network` takes: the kernels of its conv layers)."""
    if not _PAPER.fullmatch(text.strip()):
        return parse_network(text).kernels
    return _paper_kernels(text)


def _paper_kernels(text: str) -> tuple[int, ...]:
    parts = text.split(":")
    try:
        kernels = tuple(int(p) for p in parts)
    except ValueError:
        raise UserError(f"--arch {text!r}: expected kernel counts like 50:500 or a "
                        f"layer list like c32k3p1,pool,fc128 ({GRAMMAR})") from None
    if not kernels or any(k < 1 for k in kernels):
        raise UserError(f"--arch {text!r}: every block needs at least one kernel")
    return kernels


def paper_spec(kernels: tuple[int, ...], kernel_size: int = 5, padding: int = 0) -> NetworkSpec:
    """The paper's blocks: conv ``kernel_size`` -> batch norm -> ReLU -> 2x2 max pool."""
    convs = tuple(ConvSpec(k, kernel_size, padding, 1, True, "max", token=f"block {i + 1}",
                           pool_token=f"block {i + 1}")
                  for i, k in enumerate(kernels))
    return NetworkSpec(convs, (), ":".join(map(str, kernels)), paper=True)


def parse_network(spec: str | list[str] | tuple[str, ...], kernel_size: int = 5,
                  padding: int = 0, where: str = "--arch") -> NetworkSpec:
    """A spec (``"32:64"``, ``"c32k3p1,pool,fc128,drop0.5"`` or a token list) ->
    :class:`NetworkSpec`; the paper form takes ``kernel_size``/``padding``.

    Raises UserError with one line naming the offending token: unknown token, a pool
    with nothing to pool, conv after fc, dropout out of place or out of range.
    """
    if isinstance(spec, str):
        text = spec.strip()
        if _PAPER.fullmatch(text):
            return paper_spec(_paper_kernels(text), kernel_size, padding)
        tokens = [t.strip() for t in text.split(",")]
    else:
        tokens = [str(t).strip() for t in spec]
    if not tokens or tokens == [""]:
        raise UserError(f"{where}: empty network; expected tokens like {GRAMMAR}")
    convs: list[ConvSpec] = []
    dense: list[DenseSpec] = []
    previous = ""  # kind of the token before: conv, pool, fc, dropout
    for position, token in enumerate(tokens, 1):
        def fail(problem: str, position: int = position, token: str = token) -> UserError:
            return UserError(f"{where}: token {position} {token!r}: {problem}")

        if not token:
            raise fail(f"empty token (a stray comma?); expected one of {GRAMMAR}")
        if (match := _CONV.fullmatch(token)) is not None:
            if dense:
                raise fail("a conv layer after a dense layer (fc/drop); conv layers come first")
            kernels, size = int(match[1]), int(match[2])
            pad = int(match[3]) if match[3] is not None else 0
            stride = int(match[4]) if match[4] is not None else 1
            if kernels < 1 or size < 1 or stride < 1:
                raise fail("kernels, kernel size and stride must be at least 1")
            convs.append(ConvSpec(kernels, size, pad, stride, match[5] is None, "none",
                                  token=token, position=position))
            previous = "conv"
        elif token in ("pool", "avgpool"):
            if previous != "conv":
                what = {"": "at the start", "pool": "right after another pool",
                        "fc": "after a dense layer", "dropout": "after a dense layer"}[previous]
                raise fail(f"a pooling with nothing to pool ({what}); a pool follows a conv")
            last = convs[-1]
            convs[-1] = ConvSpec(last.kernels, last.kernel_size, last.padding, last.stride,
                                 last.batch_norm, "max" if token == "pool" else "avg",
                                 last.token, token, last.position, position)
            previous = "pool"
        elif (match := _FC.fullmatch(token)) is not None:
            units = int(match[1])
            if units < 1:
                raise fail("a dense layer needs at least 1 unit")
            dense.append(DenseSpec("fc", units=units, token=token))
            previous = "fc"
        elif (match := _DROP.fullmatch(token)) is not None:
            rate = float(match[1])
            if not 0.0 <= rate < 1.0:
                raise fail("the drop probability must be in [0, 1)")
            last_token = position == len(tokens)
            if previous == "dropout":
                raise fail("two dropouts in a row")
            if previous != "fc" and not last_token:
                raise fail("dropout goes right after an fc layer or last, before the "
                           "classifier")
            if not convs:
                raise fail("dropout before any conv layer")
            dense.append(DenseSpec("dropout", rate=rate, token=token))
            previous = "dropout"
        else:
            raise fail(f"unknown token; expected one of {GRAMMAR}")
    if not convs:
        raise UserError(f"{where}: the network needs at least one conv layer "
                        "(c<K>k<size>); the dense layers alone run on the master")
    return NetworkSpec(tuple(convs), tuple(dense), ",".join(tokens))


def load_network_file(path: str | Path) -> list[str]:
    """The token list of a ``--model`` file: JSON (``{"layers": [...]}`` or a list) or
    TOML (``layers = [...]``); UserError with one line when it is not one."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"--model {file}: cannot read it ({error})") from None
    data: Any
    if file.suffix.lower() == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise UserError(f"--model {file}: not valid TOML ({error})") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as error:
            raise UserError(f"--model {file}: not valid JSON ({error}); TOML files end "
                            "in .toml") from None
    layers = data.get("layers") if isinstance(data, dict) else data
    if not isinstance(layers, list) or not all(isinstance(t, str) for t in layers):
        raise UserError(f"--model {file}: expected a list of layer tokens, as "
                        '{"layers": ["c32k3p1", "pool", ...]} or layers = [...] in TOML')
    return layers


# --- shapes and parameters -------------------------------------------------------------
def conv_layer_shapes(config: ModelConfig) -> list[ConvLayerShape]:
    """Every conv layer's shapes; raises UserError naming the layer (its token) when a
    conv or pool would make the map smaller than 1x1."""
    channels, height, width = config.input_shape
    shapes = []
    for index, spec in enumerate(config.conv_specs()):
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
                f"{height}x{width} map, too small for a {k}x{k} kernel with padding {p}: the "
                "output would be smaller than 1x1")
        out_h, out_w = conv_h, conv_w
        if spec.pool != "none":
            if conv_h < 2 or conv_w < 2:
                raise UserError(
                    f"network: token {spec.pool_position} {spec.pool_token!r} after conv layer "
                    f"{index + 1} ({spec.token}) gets a {conv_h}x{conv_w} map: 2x2 pooling "
                    "would make it smaller than 1x1")
            out_h, out_w = conv_h // 2, conv_w // 2
        shapes.append(ConvLayerShape(index, channels, height, width, spec.kernels, k, p,
                                     conv_h, conv_w, out_h, out_w, s, spec.pool,
                                     spec.batch_norm))
        channels, height, width = spec.kernels, out_h, out_w
    return shapes


def dense_features(config: ModelConfig) -> int:
    """Length of the flattened last conv layer output that feeds the dense layers."""
    last = conv_layer_shapes(config)[-1]
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
