"""A CNN from an ONNX file (``torch.onnx.export`` or any file of the same ops) as a
hetconv network, its initializers as the starting weights.

From PyTorch, export in training mode with the TorchScript exporter, which keeps every
batch norm as its own node and every parameter under its module name::

    torch.onnx.export(module.train(), (example,), "net.onnx", dynamo=False,
                      training=torch.onnx.TrainingMode.TRAINING)

(an eval-mode export folds batch norm into the convs and renames the weights; the
``dynamo`` exporter's graph adds shape ops hetconv does not read.)

The graph is read node by node (ONNX keeps them in topological order) into hetconv's
units: a plain conv layer (``Conv`` [-> ``BatchNormalization``] -> ``Relu`` [->
``MaxPool``/``AveragePool`` 2x2]), a basic residual block (two 3x3 convs, the second's
batch norm ``Add``-ed to the block's input or to a 1x1 projection's batch norm, then
``Relu``), ``GlobalAveragePool`` (or ``ReduceMean`` over H and W), ``Flatten``/``Reshape``,
dense layers (``Gemm``, or ``MatMul`` + ``Add``; ``Relu`` after each hidden one),
``Dropout``; ``Identity`` passes through and a final ``Softmax`` is the classifier's. The
units must form one chain (each reads the one before's output), as hetconv's grammar
does: the result is a token list (:mod:`hetconv.model`), so a run from an ONNX file is
saved, resumed and exported like any other. An op, an attribute or a branch hetconv
cannot train is one :class:`~hetconv.errors.UserError` line naming the node and its op.

Names: every hetconv array keeps the initializer it came from (``source_names``), so the
safetensors export writes the original names (a PyTorch module's ``load_state_dict``
takes them back) and the ONNX export keeps the graph's input and output names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hetconv.errors import UserError
from hetconv.names import layer_key

BN_EPSILON = 1e-5  # hetconv's batch norm (ModelConfig.bn_eps)
PASS_THROUGH = ("Identity",)


@dataclass
class _Conv:
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
class _Dense:
    node: str
    weight: np.ndarray  # (O, D)
    weight_name: str
    bias: np.ndarray
    bias_name: str
    relu: bool = False
    transposed: bool = False  # the file holds weight.T (MatMul, Gemm transB=0)


@dataclass(frozen=True)
class ImportedNetwork:
    """A network read from an ONNX file (module doc)."""

    tokens: tuple[str, ...]
    input_shape: tuple[int, int, int]  # (C, H, W)
    classes: int
    params: dict[str, np.ndarray]  # hetconv's keys (hetconv.names) -> starting weights
    source_names: dict[str, str]  # hetconv key -> the initializer it came from
    transposed: tuple[str, ...]  # hetconv keys whose source is the transpose (dense, (D, O))
    input_name: str
    output_name: str


def is_onnx(path: str | Path) -> bool:
    """Whether a ``--model`` file is an ONNX model (by its suffix)."""
    return Path(path).suffix.lower() == ".onnx"


def require_onnx() -> Any:
    try:
        import onnx
    except ImportError as error:
        raise UserError(f"reading an ONNX model needs the Python package 'onnx', which is not "
                        f"installed ({error}); install hetconv[export] "
                        "(pip install 'hetconv[export]')") from None
    return onnx


def load_onnx(path: str | Path, where: str = "--model") -> ImportedNetwork:
    """Read and convert ``path`` (UserError with one line when it cannot be trained)."""
    onnx = require_onnx()
    try:
        proto = onnx.load(str(path))
    except (OSError, ValueError, Exception) as error:  # onnx raises DecodeError et al.
        raise UserError(f"{where} {path}: not a readable ONNX file ({error})") from None
    return convert(proto, f"{where} {path}")


def _attributes(onnx: Any, node: Any) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


class _Reader:
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
        self.convs: list[_Conv] = []
        self.dense: list[_Dense] = []
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
                value = _attributes(self.onnx, node).get("value")
                if value is None:
                    raise self.fail(node, "only tensor constants are read")
                self.constants[node.output[0]] = self.onnx.numpy_helper.to_array(value)
            elif handler is None:
                raise self.fail(node, "hetconv cannot train this op (it trains Conv, "
                                "BatchNormalization, Relu, MaxPool/AveragePool 2x2, Add of "
                                "residual blocks, GlobalAveragePool, Flatten/Reshape, Gemm, "
                                "MatMul + Add, Dropout)")
            else:
                handler(node, _attributes(self.onnx, node))

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
        conv = _Conv(node.name or node.output[0], node.input[0], weight,
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
                if isinstance(before, _Conv) and before.input == other_conv.input:
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

    def _dense(self, node: Any, weight: np.ndarray, name: str, transposed: bool) -> _Dense:
        self.of(node, 0, "flat", "dense", "dropout")
        dense = _Dense(node.name or node.output[0], weight, name,
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


def convert(proto: Any, where: str = "--model") -> ImportedNetwork:
    """The :class:`ImportedNetwork` of an ``onnx.ModelProto``."""
    onnx = require_onnx()
    reader = _Reader(onnx, proto.graph, where)
    reader.read()
    return _network(reader)


def _network(reader: _Reader) -> ImportedNetwork:
    """Units -> tokens and parameters (module doc)."""
    where = reader.where
    dims = [d.dim_value for d in reader.input.type.tensor_type.shape.dim]
    if len(dims) != 4 or not all(dims[1:]):
        raise UserError(f"{where}: the input {reader.input.name!r} must be (N, C, H, W) with "
                        f"C, H and W fixed, got {dims}")
    input_shape = (int(dims[1]), int(dims[2]), int(dims[3]))
    if not reader.convs:
        raise UserError(f"{where}: no Conv node: hetconv trains convolutional networks")
    if not reader.dense:
        raise UserError(f"{where}: no classifier (Gemm or MatMul) after the conv layers")
    tokens, order = _conv_tokens(reader)
    tokens += reader.tail
    layers = len(reader.dense)
    for at, _ in reader.drops:
        if at == layers or (at == 0 and layers > 1):
            place = "after the classifier" if at else "before a hidden dense layer"
            raise UserError(f"{where}: a Dropout {place}: hetconv drops right after a hidden "
                            "dense layer or before the classifier")
    for index, dense in enumerate(reader.dense[:-1]):
        if not dense.relu:
            raise UserError(f"{where}: node {dense.node!r}: a hidden dense layer needs a Relu "
                            "after it (the last one is the classifier)")
        tokens.append(f"fc{dense.weight.shape[0]}")
        tokens += [f"drop{rate:g}" for at, rate in reader.drops if at == index + 1]
    tokens += [f"drop{rate:g}" for at, rate in reader.drops if at == 0]
    if reader.dense[-1].relu:
        raise UserError(f"{where}: node {reader.dense[-1].node!r}: the classifier has a Relu "
                        "after it; hetconv's last dense layer gives the logits")
    params, names, transposed = _parameters(order, reader.dense)
    return ImportedNetwork(tuple(tokens), input_shape, int(reader.dense[-1].weight.shape[0]),
                           params, names, tuple(transposed), reader.input.name,
                           reader.output_name)


def _conv_tokens(reader: _Reader) -> tuple[list[str], list[_Conv]]:
    """The conv part as one chain of units: (tokens, the conv layers in hetconv's order)."""
    where = reader.where
    by_input: dict[str, list[_Conv]] = {}
    for conv in reader.convs:
        by_input.setdefault(conv.input, []).append(conv)
    tokens: list[str] = []
    order: list[_Conv] = []
    current = reader.input.name
    width = reader.input.type.tensor_type.shape.dim[1].dim_value
    seen: set[int] = set()
    while current in by_input:
        readers = [c for c in by_input[current] if id(c) not in seen]
        if not readers:
            break
        first = next((c for c in readers if c.relu and c.shortcut is None), None)
        if first is None:
            raise UserError(f"{where}: node {readers[0].node!r}: a conv layer without a ReLU "
                            "is read only as a residual block's")
        second = next((c for c in reader.convs if c.input == first.output
                       and c.shortcut is not None), None)
        if second is None:  # a plain conv layer
            if len(readers) != 1:
                raise UserError(f"{where}: node {readers[1].node!r}: a branch hetconv cannot "
                                "express (only residual blocks branch)")
            tokens.append(_conv_token(first))
            if first.pool != "none":
                tokens.append("pool" if first.pool == "max" else "avgpool")
            order.append(first)
            seen.add(id(first))
            current, width = first.output, first.kernels
            continue
        projection = None if second.shortcut == current else next(
            (c for c in reader.convs if c.normed == second.shortcut and not c.relu), None)
        token = _block_token(where, first, second, projection, current, width, reader)
        tokens.append(token)
        block = [first] + ([projection] if projection is not None else []) + [second]
        order += block
        seen.update(id(c) for c in block)
        current, width = second.output, second.kernels
    if len(order) != len(reader.convs):
        left = next(c for c in reader.convs if id(c) not in seen)
        raise UserError(f"{where}: node {left.node!r}: a conv layer off the network's chain "
                        "(hetconv trains one chain of conv layers and residual blocks)")
    return tokens, order


def _conv_token(conv: _Conv) -> str:
    token = f"c{conv.kernels}k{conv.kernel}"
    token += f"p{conv.padding}" if conv.padding else ""
    token += f"s{conv.stride}" if conv.stride != 1 else ""
    return token + ("" if conv.norm else "nobn")


def _block_token(where: str, first: _Conv, second: _Conv, projection: _Conv | None,
                 block_input: str, width: int, reader: _Reader) -> str:
    """``res<K>[s<S>]`` for a basic block that is hetconv's (module doc), else the error."""
    kernels, stride = second.kernels, first.stride
    plain = all(c.kernel == 3 and c.padding == 1 and c.norm for c in (first, second))
    if not plain or second.stride != 1 or first.kernels != kernels:
        raise UserError(f"{where}: node {second.node!r}: a residual block hetconv trains is "
                        "two 3x3 convs (padding 1, batch norm, the first with the stride) of "
                        "the same width")
    needs_projection = stride != 1 or width != kernels
    if projection is None:
        if second.shortcut != block_input or needs_projection:
            raise UserError(f"{where}: node {second.node!r}: the shortcut must be the block's "
                            "input (or a 1x1 projection where the stride or width changes)")
    else:
        if not needs_projection or projection.kernel != 1 or projection.padding != 0 \
                or projection.stride != stride or not projection.norm or projection.relu \
                or projection.input != block_input:
            raise UserError(f"{where}: node {projection.node!r}: a projection shortcut is a "
                            "1x1 conv with the block's stride and batch norm, only where the "
                            "stride or the width changes")
    return f"res{kernels}" + (f"s{stride}" if stride != 1 else "")


def _parameters(order: list[_Conv], dense: list[_Dense]
                ) -> tuple[dict[str, np.ndarray], dict[str, str], list[str]]:
    """hetconv's arrays (conv layers in ``order``, then the dense part), the source name of
    each and the keys whose source is transposed."""
    from hetconv.names import CLASSIFIER, hidden_prefix

    params: dict[str, np.ndarray] = {}
    names: dict[str, str] = {}
    for index, conv in enumerate(order):
        kernels = conv.kernels
        params[layer_key(index, "weight")] = np.ascontiguousarray(conv.weight)
        names[layer_key(index, "weight")] = conv.weight_name
        if conv.norm:
            for name, (array, source) in conv.norm.items():
                params[layer_key(index, name)] = np.ascontiguousarray(array.reshape(kernels))
                names[layer_key(index, name)] = source
            if conv.bias is not None:  # folded: (conv + b - mean) = (conv - (mean - b))
                params[layer_key(index, "running_mean")] = \
                    params[layer_key(index, "running_mean")] - conv.bias
        else:  # nobn: beta is the conv's bias
            params[layer_key(index, "gamma")] = np.ones(kernels, np.float32)
            params[layer_key(index, "beta")] = (conv.bias if conv.bias is not None
                                                else np.zeros(kernels, np.float32))
            params[layer_key(index, "running_mean")] = np.zeros(kernels, np.float32)
            params[layer_key(index, "running_var")] = np.ones(kernels, np.float32)
            if conv.bias is not None:
                names[layer_key(index, "beta")] = conv.bias_name
    transposed: list[str] = []
    for index, layer in enumerate(dense):
        prefix = CLASSIFIER if index == len(dense) - 1 else hidden_prefix(index)
        params[f"{prefix}.weight"] = np.ascontiguousarray(layer.weight, np.float32)
        params[f"{prefix}.bias"] = np.ascontiguousarray(layer.bias, np.float32)
        names[f"{prefix}.weight"] = layer.weight_name
        if layer.bias_name:
            names[f"{prefix}.bias"] = layer.bias_name
        if layer.transposed:
            transposed.append(f"{prefix}.weight")
    return params, names, transposed


SOURCE_FILE = "source.json"
"""In a run directory trained from an ONNX file: where its arrays came from (the export
writes them back under those names)."""


@dataclass(frozen=True)
class OnnxStart:
    """The starting point of a run from an ONNX file: its initializers (or, ``fresh``,
    hetconv's seeded weights), and the names kept for the export
    (:class:`hetconv.commands.train.StartingPoint`)."""

    network: ImportedNetwork
    fresh: bool = False

    def check(self, model: Any) -> None:
        imported = self.network
        if tuple(model.input_shape) != imported.input_shape or model.classes != imported.classes:
            raise UserError(
                f"the ONNX model takes {'x'.join(map(str, imported.input_shape))} images into "
                f"{imported.classes} classes; the data has {model.classes} classes of "
                f"{'x'.join(map(str, model.input_shape))} images")

    def weights_for(self, seeded: dict[str, np.ndarray], run_dir: Path
                    ) -> dict[str, np.ndarray]:
        from hetconv.engine.checkpoint import save_json

        imported = self.network
        save_json(run_dir / SOURCE_FILE, {
            "format": "onnx", "input_name": imported.input_name,
            "output_name": imported.output_name, "names": imported.source_names,
            "transposed": list(imported.transposed)})
        if self.fresh:
            return seeded
        weights = dict(seeded)
        for key, array in imported.params.items():
            if key not in seeded or seeded[key].shape != array.shape:
                expected = seeded[key].shape if key in seeded else "nothing"
                raise UserError(f"the ONNX model's {imported.source_names.get(key, key)!r} has "
                                f"shape {array.shape}, the network needs {expected}")
            weights[key] = np.ascontiguousarray(array, dtype=np.float32)
        return weights


def read_source(run_dir: Path) -> dict[str, Any] | None:
    """The run's ``source.json`` (a run from an ONNX file), or None."""
    import json

    path = Path(run_dir) / SOURCE_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UserError(f"{path}: unreadable ({error})") from None
    if not isinstance(record, dict) or not isinstance(record.get("names"), dict):
        raise UserError(f"{path}: not a hetconv source record")
    return record
