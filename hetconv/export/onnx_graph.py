"""An ONNX graph read node by node into hetconv's units (:class:`GraphReader`): conv
layers with their batch norm, ReLU, pool and residual join, the global pooling, the dense
layers and dropouts, each with the initializer names its arrays came from. ONNX keeps the
nodes in topological order, so one pass suffices; a node hetconv cannot train is one
UserError line naming it and its op. :mod:`hetconv.export.onnx_import` turns the units
into tokens and starting weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetconv.errors import UserError

BN_EPSILON = 1e-5  # hetconv's batch norm (ModelConfig.bn_eps)
PASS_THROUGH = ("Identity",)


@dataclass
class ConvUnit:
    """One conv layer as read: weight (K, C, k, k), optional bias, batch norm arrays."""

    node: str
    input: str  # the tensor it reads
    weight: np.ndarray
    weight_name: str
    kernel: int
    padding: int
    stride: int
    bias: np.ndarray | None = None
    bias_name: str = ""
    norm: dict[str, tuple[np.ndarray, str]] = field(default_factory=dict)  # gamma.. -> (array, name)
    relu: bool = False
    pool: str = "none"
    shortcut: str | None = None  # the tensor added before the ReLU
    output: str = ""  # the tensor the next unit reads (after the ReLU and the pool)
    normed: str = ""  # its batch norm's output (a projection's is a shortcut)

    @property
    def kernels(self) -> int:
        return int(self.weight.shape[0])


@dataclass
class DenseUnit:
    node: str
    weight: np.ndarray  # (O, D)
    weight_name: str
    bias: np.ndarray
    bias_name: str
    relu: bool = False
    transposed: bool = False  # the file holds weight.T (MatMul, Gemm transB=0)



def attributes(onnx: Any, node: Any) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


class GraphReader:
    """The node-by-node walk (module doc); ``fail`` makes the one error line."""

    def __init__(self, onnx: Any, graph: Any, where: str):
        self.onnx, self.graph, self.where = onnx, graph, where
        self.constants: dict[str, np.ndarray] = {
            t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
        inputs = [i for i in graph.input if i.name not in self.constants]
        if len(inputs) != 1:
            raise UserError(f"{where}: the graph needs one image input, it has "
                            f"{len(inputs)}: {', '.join(i.name for i in inputs)}")
        self.input = inputs[0]
        if len(graph.output) != 1:
            raise UserError(f"{where}: the graph needs one output, it has {len(graph.output)}")
        self.output_name = graph.output[0].name
        self.convs: list[ConvUnit] = []
        self.dense: list[DenseUnit] = []
        self.tail: list[str] = []  # gap between the conv part and the dense layers
        self.drops: list[tuple[int, float]] = []  # (dense layers before it, rate)
        self.kind: dict[str, tuple[str, Any]] = {self.input.name: ("act", None)}
        self.aliases: dict[str, str] = {}  # an Identity's output -> the initializer
        self.readers: dict[str, int] = {}
        for node in graph.node:
            for name in node.input:
                self.readers[name] = self.readers.get(name, 0) + 1

    def source(self, name: str) -> str:
        """The initializer a constant input came from (through Identity nodes)."""
        return self.aliases.get(name, name)

    def fail(self, node: Any, problem: str) -> UserError:
        return UserError(f"{self.where}: node {node.name or node.output[0]!r} ({node.op_type}): "
                         f"{problem}")

    def constant(self, node: Any, name: str) -> np.ndarray:
        if name not in self.constants:
            raise self.fail(node, f"input {name!r} must be a constant (an initializer)")
        return np.asarray(self.constants[name])

    def of(self, node: Any, index: int, *kinds: str) -> tuple[str, Any]:
        name = node.input[index]
        got = self.kind.get(name)
        if got is None or got[0] not in kinds:
            what = "nothing hetconv can follow" if got is None else got[0]
            raise self.fail(node, f"input {name!r} is {what}; expected {' or '.join(kinds)}")
        return got

    # ------------------------------------------------------------------ the walk
    def read(self) -> None:
        for node in self.graph.node:
            handler = getattr(self, f"_{node.op_type}", None)
            if node.op_type in PASS_THROUGH:
                self.kind[node.output[0]] = self.kind.get(node.input[0], ("?", None))
                if node.input[0] in self.constants:  # a parameter under a second name
                    self.constants[node.output[0]] = self.constants[node.input[0]]
                    self.aliases[node.output[0]] = self.source(node.input[0])
            elif node.op_type == "Constant":
                value = attributes(self.onnx, node).get("value")
                if value is None:
                    raise self.fail(node, "only tensor constants are read")
                self.constants[node.output[0]] = self.onnx.numpy_helper.to_array(value)
            elif handler is None:
                raise self.fail(node, "hetconv cannot train this op (it trains Conv, "
                                "BatchNormalization, Relu, MaxPool/AveragePool 2x2, Add of "
                                "residual blocks, GlobalAveragePool, Flatten/Reshape, Gemm, "
                                "MatMul + Add, Dropout)")
            else:
                handler(node, attributes(self.onnx, node))

    def _Conv(self, node: Any, attrs: dict[str, Any]) -> None:
        self.of(node, 0, "act")
        weight = self.constant(node, node.input[1]).astype(np.float32)
        if weight.ndim != 4 or weight.shape[2] != weight.shape[3]:
            raise self.fail(node, f"a square 2-D kernel is needed, got weight {weight.shape}")
        if attrs.get("group", 1) != 1:
            raise self.fail(node, f"group {attrs['group']}: only groups 1 train here")
        if any(d != 1 for d in attrs.get("dilations", [1, 1])):
            raise self.fail(node, f"dilations {list(attrs['dilations'])}: only 1 trains here")
        if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            raise self.fail(node, "auto_pad: give explicit pads")
        pads = list(attrs.get("pads", [0, 0, 0, 0]))
        strides = list(attrs.get("strides", [1, 1]))
        if len(set(pads)) != 1 or len(set(strides)) != 1:
            raise self.fail(node, f"pads {pads} and strides {strides} must be the same on "
                            "every side")
        conv = ConvUnit(node.name or node.output[0], node.input[0], weight,
                     self.source(node.input[1]),
                     int(weight.shape[2]), int(pads[0]), int(strides[0]))
        if len(node.input) > 2 and node.input[2]:
            conv.bias = self.constant(node, node.input[2]).astype(np.float32)
            conv.bias_name = self.source(node.input[2])
        self.convs.append(conv)
        self.kind[node.output[0]] = ("conv", conv)

    def _BatchNormalization(self, node: Any, attrs: dict[str, Any]) -> None:
        _, conv = self.of(node, 0, "conv")
        epsilon = float(attrs.get("epsilon", 1e-5))
        if abs(epsilon - BN_EPSILON) > 1e-9:
            raise self.fail(node, f"epsilon {epsilon:g}: hetconv's batch norm uses {BN_EPSILON:g}")
        for name, index in (("gamma", 1), ("beta", 2), ("running_mean", 3), ("running_var", 4)):
            conv.norm[name] = (self.constant(node, node.input[index]).astype(np.float32),
                               self.source(node.input[index]))
        conv.normed = node.output[0]
        self.kind[node.output[0]] = ("bn", conv)

    def _Relu(self, node: Any, attrs: dict[str, Any]) -> None:
        kind, item = self.of(node, 0, "conv", "bn", "join", "dense")
        if kind == "dense":
            item.relu = True
            self.kind[node.output[0]] = ("dense", item)
            return
        if item.relu:
            raise self.fail(node, "a second ReLU")
        item.relu = True
        item.output = node.output[0]
        self.kind[node.output[0]] = ("act", item)

    def _Add(self, node: Any, attrs: dict[str, Any]) -> None:
        kinds = [self.kind.get(name, ("?", None)) for name in node.input[:2]]
        if kinds[0][0] == "matmul" or kinds[1][0] == "matmul":  # the bias of MatMul + Add
            which = 0 if kinds[0][0] == "matmul" else 1
            dense = kinds[which][1]
            dense.bias = self.constant(node, node.input[1 - which]).astype(np.float32).reshape(-1)
            dense.bias_name = self.source(node.input[1 - which])
            self.kind[node.output[0]] = ("dense", dense)
            return
        joined = [k[1] for k in kinds if k[0] == "bn" and not k[1].relu]
        if not joined:
            raise self.fail(node, "an Add hetconv trains joins a residual block: a batch "
                            "norm's output plus the block's input or its projection")
        target = joined[-1]
        if len(joined) == 2:  # the block's second conv reads the first's ReLU, which reads
            # what the projection reads
            for candidate, other_conv in ((joined[0], joined[1]), (joined[1], joined[0])):
                before = self.kind.get(candidate.input, ("?", None))[1]
                if isinstance(before, ConvUnit) and before.input == other_conv.input:
                    target = candidate
        mine = 0 if kinds[0][0] == "bn" and kinds[0][1] is target else 1
        other = node.input[1 - mine]
        if self.kind.get(other, ("?", None))[0] not in ("act", "bn"):
            raise self.fail(node, f"input {other!r} is not an activation or a projection")
        target.shortcut = other
        self.kind[node.output[0]] = ("join", target)

    def _pool(self, node: Any, attrs: dict[str, Any], kind: str) -> None:
        _, conv = self.of(node, 0, "act")
        if conv is None or conv.pool != "none" or conv.shortcut is not None:
            raise self.fail(node, "a pool follows a plain conv layer's ReLU (a residual "
                            "block downsamples with its stride)")
        if self.readers.get(node.input[0], 0) != 1:
            raise self.fail(node, "the map before the pool is read elsewhere too")
        if list(attrs.get("kernel_shape", [])) != [2, 2] or \
                list(attrs.get("strides", [1, 1])) != [2, 2] or \
                any(attrs.get("pads", [0, 0, 0, 0])) or attrs.get("ceil_mode", 0) or \
                any(d != 1 for d in attrs.get("dilations", [1, 1])):
            raise self.fail(node, "only a 2x2 pool of stride 2 without padding trains here")
        conv.pool = kind
        conv.output = node.output[0]
        self.kind[node.output[0]] = ("act", conv)

    def _MaxPool(self, node: Any, attrs: dict[str, Any]) -> None:
        if len(node.output) > 1 and node.output[1]:
            raise self.fail(node, "the indices output is not read")
        self._pool(node, attrs, "max")

    def _AveragePool(self, node: Any, attrs: dict[str, Any]) -> None:
        if attrs.get("count_include_pad", 0):
            raise self.fail(node, "count_include_pad: only a pool without padding trains")
        self._pool(node, attrs, "avg")

    def _GlobalAveragePool(self, node: Any, attrs: dict[str, Any]) -> None:
        self.of(node, 0, "act")
        self.tail.append("gap")
        self.kind[node.output[0]] = ("pooled", None)

    def _ReduceMean(self, node: Any, attrs: dict[str, Any]) -> None:
        self.of(node, 0, "act")
        axes = list(attrs.get("axes", [])) or (
            list(self.constant(node, node.input[1]).reshape(-1)) if len(node.input) > 1 else [])
        if sorted(int(a) % 4 for a in axes) != [2, 3]:
            raise self.fail(node, f"axes {axes}: only the mean over H and W (global average "
                            "pooling) trains here")
        self.tail.append("gap")
        self.kind[node.output[0]] = ("flat" if not attrs.get("keepdims", 1) else "pooled", None)

    def _Flatten(self, node: Any, attrs: dict[str, Any]) -> None:
        self.of(node, 0, "act", "pooled", "flat")
        if attrs.get("axis", 1) != 1:
            raise self.fail(node, f"axis {attrs['axis']}: only a flatten to (N, features)")
        self.kind[node.output[0]] = ("flat", None)

    def _Reshape(self, node: Any, attrs: dict[str, Any]) -> None:
        self.of(node, 0, "act", "pooled", "flat")
        shape = self.constant(node, node.input[1]).reshape(-1)
        if len(shape) != 2 or int(shape[1]) not in (-1,) and int(shape[0]) not in (-1, 0):
            raise self.fail(node, f"shape {list(shape)}: only a reshape to (N, features)")
        self.kind[node.output[0]] = ("flat", None)

    def _dense(self, node: Any, weight: np.ndarray, name: str, transposed: bool) -> DenseUnit:
        self.of(node, 0, "flat", "dense", "dropout")
        dense = DenseUnit(node.name or node.output[0], weight, name,
                       np.zeros(weight.shape[0], np.float32), "", transposed=transposed)
        self.dense.append(dense)
        return dense

    def _Gemm(self, node: Any, attrs: dict[str, Any]) -> None:
        if attrs.get("transA", 0) or float(attrs.get("alpha", 1.0)) != 1.0 \
                or float(attrs.get("beta", 1.0)) != 1.0:
            raise self.fail(node, "only Gemm with transA 0, alpha 1 and beta 1 trains here")
        weight = self.constant(node, node.input[1]).astype(np.float32)
        transposed = not attrs.get("transB", 0)
        dense = self._dense(node, weight.T if transposed else weight, self.source(node.input[1]),
                            transposed)
        if len(node.input) > 2 and node.input[2]:
            dense.bias = self.constant(node, node.input[2]).astype(np.float32).reshape(-1)
            dense.bias_name = self.source(node.input[2])
        self.kind[node.output[0]] = ("dense", dense)

    def _MatMul(self, node: Any, attrs: dict[str, Any]) -> None:
        weight = self.constant(node, node.input[1]).astype(np.float32)
        if weight.ndim != 2:
            raise self.fail(node, "only a product with a (features, units) matrix trains here")
        dense = self._dense(node, weight.T, self.source(node.input[1]), True)
        self.kind[node.output[0]] = ("matmul", dense)

    def _Dropout(self, node: Any, attrs: dict[str, Any]) -> None:
        kind, _ = self.of(node, 0, "flat", "dense", "pooled", "dropout")
        ratio = float(attrs.get("ratio", 0.5))
        if len(node.input) > 1 and node.input[1]:
            ratio = float(self.constant(node, node.input[1]))
        self.drops.append((len(self.dense), ratio))
        self.kind[node.output[0]] = ("dropout" if kind != "pooled" else "pooled", None)

    def _Softmax(self, node: Any, attrs: dict[str, Any]) -> None:
        self.of(node, 0, "dense")
        if node.output[0] != self.output_name:
            raise self.fail(node, "a softmax is read only as the network's output")
        self.kind[node.output[0]] = self.kind[node.input[0]]

    _LogSoftmax = _Softmax
