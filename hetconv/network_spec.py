"""A network as the user writes it: ``--arch`` / ``--model`` tokens parsed into layer specs.

The grammar (:func:`parse_network`)::

    c<K>k<size>[p<pad>][s<stride>][nobn]   conv of K kernels (batch norm + ReLU after it)
    pool | avgpool                         2x2 max / average pool, fused into the conv before
    res<K>[s<stride>]                      basic residual block of K kernels (docs/residual.md)
    gap                                    global average pooling, after the last conv token
    fc<N>                                  hidden dense layer of N units with ReLU
    drop<p>                                dropout (0 <= p < 1) after fc or before the classifier
    resnet20 | resnet32 | resnet44 | resnet56 | resnet110   the CIFAR ResNets, first token

or the paper's kernel counts (``32:64``). Each token becomes :class:`ConvSpec` or
:class:`DenseSpec` entries of a :class:`NetworkSpec`; a spec that cannot work is one
UserError line naming the token. :mod:`hetconv.model` turns a spec into shapes and
parameters.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import tomllib

from hetconv.errors import UserError

_CONV = re.compile(r"c(\d+)k(\d+)(?:p(\d+))?(?:s(\d+))?(nobn)?")
_FC = re.compile(r"fc(\d+)")
_DROP = re.compile(r"drop(\d*\.?\d+(?:e-?\d+)?)")
_RES = re.compile(r"res(\d+)(?:s(\d+))?")
_RESNET = re.compile(r"resnet(\d+)")
_PAPER = re.compile(r"[^,]*:[^,]*|\d+")
GRAMMAR = ("c<K>k<size>[p<pad>][s<stride>][nobn], pool, avgpool, res<K>[s<stride>], gap, "
           "fc<N>, drop<p>, resnet20/32/44/56/110 (or kernel counts like 32:64)")
RESNET_DEPTHS = (20, 32, 44, 56, 110)
NO_ROUTE = -1
"""``input_from``/``shortcut_from`` of a layer that takes the previous layer's output /
adds nothing."""


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
    relu: bool = True  # False: batch norm's output as it is (a block's second conv, a shortcut)
    input_from: int = NO_ROUTE  # the activation it reads (NO_ROUTE: the layer before's)
    shortcut_from: int = NO_ROUTE  # the activation added before the ReLU (NO_ROUTE: none)

    @property
    def routed(self) -> bool:
        """Whether the layer is part of a residual block (reads or adds an activation
        that is not the previous layer's output, or has no ReLU of its own)."""
        return (not self.relu or self.input_from != NO_ROUTE
                or self.shortcut_from != NO_ROUTE)


@dataclass(frozen=True)
class DenseSpec:
    """One master-side layer before the classifier: ``fc`` (``units`` outputs, ReLU),
    ``dropout`` (drop probability ``rate``) or ``gap`` (global average pooling of the
    last conv output's ``units`` channels: (B, K*H*W) -> (B, K))."""

    kind: str  # "fc" | "dropout" | "gap"
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

    @property
    def residual(self) -> bool:
        return any(c.routed for c in self.convs)


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


def resnet_tokens(depth: int) -> list[str]:
    """The CIFAR ResNet of ``depth`` (6n + 2 layers; He et al. 2016, section 4.2): a
    3x3 stem of 16 kernels, n blocks each of 16, 32 and 64 kernels (the first of the
    32 and 64 stages with stride 2), global average pooling."""
    blocks = (depth - 2) // 6
    stage = [f"res{k}{'s2' if k > 16 else ''}" for k in (16, 32, 64)]
    tokens = ["c16k3p1"]
    for first, kernels in zip(stage, (16, 32, 64)):
        tokens += [first] + [f"res{kernels}"] * (blocks - 1)
    return tokens + ["gap"]


def _expand_shorthand(tokens: list[str], where: str) -> list[str]:
    """``resnet20[,more tokens]`` -> its tokens (the shorthand only as the first token)."""
    for position, token in enumerate(tokens, 1):
        match = _RESNET.fullmatch(token)
        if match is None:
            continue
        if position != 1:
            raise UserError(f"{where}: token {position} {token!r}: a named network comes "
                            "first (it brings its own conv layers)")
        if int(match[1]) not in RESNET_DEPTHS:
            raise UserError(f"{where}: token {position} {token!r}: no such network; the "
                            f"CIFAR ResNets are resnet{', resnet'.join(map(str, RESNET_DEPTHS))}")
        return resnet_tokens(int(match[1])) + tokens[1:]
    return tokens


class _Builder:
    """The conv and dense layers of a spec as its tokens come (:func:`parse_network`)."""

    def __init__(self) -> None:
        self.convs: list[ConvSpec] = []
        self.dense: list[DenseSpec] = []

    def residual_block(self, kernels: int, stride: int, token: str, position: int) -> None:
        """conv1 (3x3, stride, ReLU), the projection shortcut where needed (1x1, stride,
        no ReLU), conv2 (3x3, no ReLU, the shortcut added before the block's ReLU)."""
        block_input = len(self.convs)  # activation index of the block's input
        width = self.convs[-1].kernels
        self.convs.append(ConvSpec(kernels, 3, 1, stride, True, "none", token=token,
                                   position=position))
        first_output = len(self.convs)
        shortcut = block_input
        if stride != 1 or width != kernels:
            self.convs.append(ConvSpec(kernels, 1, 0, stride, True, "none", token=token,
                                       position=position, relu=False,
                                       input_from=block_input))
            shortcut = len(self.convs)
        self.convs.append(ConvSpec(kernels, 3, 1, 1, True, "none", token=token,
                                   position=position, relu=False,
                                   input_from=first_output if shortcut != block_input
                                   else NO_ROUTE, shortcut_from=shortcut))


def parse_network(spec: str | list[str] | tuple[str, ...], kernel_size: int = 5,
                  padding: int = 0, where: str = "--arch") -> NetworkSpec:
    """A spec (``"32:64"``, ``"c32k3p1,pool,fc128,drop0.5"``, ``"resnet20"`` or a token
    list) -> :class:`NetworkSpec`; the paper form takes ``kernel_size``/``padding``.

    Raises UserError with one line naming the offending token: unknown token, a pool
    with nothing to pool, conv after fc, a residual block with no conv before it or
    pooled, ``gap`` not last among the conv tokens, dropout out of place or out of range.
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
    written = list(tokens)
    tokens = _expand_shorthand(tokens, where)
    built = _Builder()
    convs, dense = built.convs, built.dense
    previous = ""  # kind of the token before: conv, pool, res, gap, fc, dropout
    for position, token in enumerate(tokens, 1):
        def fail(problem: str, position: int = position, token: str = token) -> UserError:
            return UserError(f"{where}: token {position} {token!r}: {problem}")

        if not token:
            raise fail(f"empty token (a stray comma?); expected one of {GRAMMAR}")
        conv_match, res_match = _CONV.fullmatch(token), _RES.fullmatch(token)
        if conv_match is not None or res_match is not None:
            if previous == "gap":
                raise fail("a conv layer after gap; gap comes after the last conv layer")
            if dense:
                raise fail("a conv layer after a dense layer (fc/drop); conv layers come first")
        if conv_match is not None:
            kernels, size = int(conv_match[1]), int(conv_match[2])
            pad = int(conv_match[3]) if conv_match[3] is not None else 0
            stride = int(conv_match[4]) if conv_match[4] is not None else 1
            if kernels < 1 or size < 1 or stride < 1:
                raise fail("kernels, kernel size and stride must be at least 1")
            convs.append(ConvSpec(kernels, size, pad, stride, conv_match[5] is None, "none",
                                  token=token, position=position))
            previous = "conv"
        elif res_match is not None:
            kernels = int(res_match[1])
            stride = int(res_match[2]) if res_match[2] is not None else 1
            if kernels < 1 or stride < 1:
                raise fail("kernels and stride must be at least 1")
            if not convs:
                raise fail("a residual block needs a conv layer before it (the stem), "
                           "e.g. c16k3p1,res16")
            built.residual_block(kernels, stride, token, position)
            previous = "res"
        elif token in ("pool", "avgpool"):
            if previous != "conv":
                what = {"": "at the start", "pool": "right after another pool",
                        "res": "after a residual block; give the block a stride "
                               "(res<K>s2) to downsample",
                        "gap": "after gap",
                        "fc": "after a dense layer", "dropout": "after a dense layer"}[previous]
                raise fail(f"a pooling with nothing to pool ({what}); a pool follows a conv")
            last = convs[-1]
            convs[-1] = replace(last, pool="max" if token == "pool" else "avg",
                                pool_token=token, pool_position=position)
            previous = "pool"
        elif token == "gap":
            if previous not in ("conv", "pool", "res"):
                raise fail("gap comes right after the last conv layer (or its pool), "
                           "before any fc or drop" if convs else
                           "gap before any conv layer")
            dense.append(DenseSpec("gap", units=convs[-1].kernels, token=token))
            previous = "gap"
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
    return NetworkSpec(tuple(convs), tuple(dense), ",".join(written))


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
