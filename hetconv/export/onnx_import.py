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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hetconv.errors import UserError
from hetconv.export.onnx_graph import ConvUnit, DenseUnit, GraphReader
from hetconv.names import layer_key


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



def convert(proto: Any, where: str = "--model") -> ImportedNetwork:
    """The :class:`ImportedNetwork` of an ``onnx.ModelProto``."""
    onnx = require_onnx()
    reader = GraphReader(onnx, proto.graph, where)
    reader.read()
    return _network(reader)


def _network(reader: GraphReader) -> ImportedNetwork:
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


def _conv_tokens(reader: GraphReader) -> tuple[list[str], list[ConvUnit]]:
    """The conv part as one chain of units: (tokens, the conv layers in hetconv's order)."""
    where = reader.where
    by_input: dict[str, list[ConvUnit]] = {}
    for conv in reader.convs:
        by_input.setdefault(conv.input, []).append(conv)
    tokens: list[str] = []
    order: list[ConvUnit] = []
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


def _conv_token(conv: ConvUnit) -> str:
    token = f"c{conv.kernels}k{conv.kernel}"
    token += f"p{conv.padding}" if conv.padding else ""
    token += f"s{conv.stride}" if conv.stride != 1 else ""
    return token + ("" if conv.norm else "nobn")


def _block_token(where: str, first: ConvUnit, second: ConvUnit, projection: ConvUnit | None,
                 block_input: str, width: int, reader: GraphReader) -> str:
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


def _parameters(order: list[ConvUnit], dense: list[DenseUnit]
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
