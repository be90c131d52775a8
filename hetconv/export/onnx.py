"""The trained network as an ONNX graph (opset 17), built with the ``onnx`` helper API.

Input ``images`` float32 (N, C, H, W), normalised as training normalised its data
(metadata ``mean``/``std``); output ``probabilities`` float32 (N, classes). Each conv
layer is ``Conv`` (no bias; with ``nobn`` the bias is ``beta``) -> ``BatchNormalization``
(its running statistics, the layer's epsilon) -> then, as hetconv's block does it,
``MaxPool`` 2x2 -> ``Relu`` (the two commute exactly), or ``Relu`` -> ``AveragePool``
2x2, or ``Relu`` alone; a residual block's second conv ``Add``s its shortcut before the
``Relu``, a projection shortcut has no ``Relu``. Then ``GlobalAveragePool`` (``gap``), ``Flatten``, each hidden ``fc`` as ``Gemm`` (transB) ->
``Relu`` (dropout is the identity at inference, so it has no node), the classifier
``Gemm`` -> ``Softmax``. Initializer names are hetconv's (:mod:`hetconv.names`);
``metadata_props`` carry :func:`hetconv.export.metadata.export_metadata`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hetconv.engine.checkpoint import write_atomically
from hetconv.export import missing_extra
from hetconv.export.metadata import export_metadata
from hetconv.inference.use import Preprocessing
from hetconv.model import NO_ROUTE, ModelConfig, conv_layer_shapes, dense_shapes
from hetconv.names import layer_key

OPSET = 17
IR_VERSION = 8  # the IR of opset 17: runtimes from onnxruntime 1.11 on load it
INPUT_NAME = "images"
OUTPUT_NAME = "probabilities"


def require_onnx() -> Any:
    try:
        import onnx
    except ImportError as error:
        raise missing_extra("onnx", error) from None
    return onnx


def build_onnx_model(model: ModelConfig, params: dict[str, np.ndarray], network: str,
                     preprocessing: Preprocessing, source: dict[str, Any] | None = None) -> Any:
    """An ``onnx.ModelProto`` of the network in eval mode, checked by ``onnx.checker``;
    a run from an ONNX file (``source``) keeps that file's input and output names."""
    input_name = INPUT_NAME if source is None else str(source["input_name"])
    output_name = OUTPUT_NAME if source is None else str(source["output_name"])
    onnx = require_onnx()
    helper, numpy_helper = onnx.helper, onnx.numpy_helper
    nodes: list[Any] = []
    initializers: list[Any] = []

    def constant(name: str) -> str:
        initializers.append(numpy_helper.from_array(
            np.ascontiguousarray(params[name], dtype=np.float32), name))
        return name

    def node(op: str, inputs: list[str], output: str, **attributes: Any) -> str:
        nodes.append(helper.make_node(op, inputs, [output], name=output, **attributes))
        return output

    activations = [input_name]  # activation 0 the input, i + 1 conv layer i's output
    for shape in conv_layer_shapes(model):
        i = shape.index
        key = f"layer{i}"
        reads = i if shape.input_from == NO_ROUTE else shape.input_from
        conv_inputs = [activations[reads], constant(layer_key(i, "weight"))]
        if not shape.batch_norm:
            conv_inputs.append(constant(layer_key(i, "beta")))  # beta is the conv's bias
        p, k = shape.padding, shape.kernel_size
        x = node("Conv", conv_inputs, f"{key}.conv", kernel_shape=[k, k], pads=[p, p, p, p],
                 strides=[shape.stride, shape.stride])
        if shape.batch_norm:
            x = node("BatchNormalization",
                     [x] + [constant(layer_key(i, n))
                            for n in ("gamma", "beta", "running_mean", "running_var")],
                     f"{key}.batch_norm", epsilon=float(model.bn_eps))
        pool = {"kernel_shape": [2, 2], "strides": [2, 2]}
        if shape.shortcut_from != NO_ROUTE:  # a residual block's join
            x = node("Add", [x, activations[shape.shortcut_from]], f"{key}.add")
            x = node("Relu", [x], f"{key}.relu")
        elif not shape.relu:
            pass  # a projection shortcut: batch norm's output as it is
        elif shape.pool == "max":
            x = node("MaxPool", [x], f"{key}.pool", **pool)
            x = node("Relu", [x], f"{key}.relu")
        elif shape.pool == "avg":
            x = node("Relu", [x], f"{key}.relu")
            x = node("AveragePool", [x], f"{key}.pool", **pool)
        else:
            x = node("Relu", [x], f"{key}.relu")
        activations.append(x)
    if model.global_pool:
        x = node("GlobalAveragePool", [x], "global_pool")
    x = node("Flatten", [x], "flatten", axis=1)
    shapes = dense_shapes(model)
    for prefix, _, _ in shapes[:-1]:
        x = node("Gemm", [x, constant(f"{prefix}.weight"), constant(f"{prefix}.bias")],
                 f"{prefix}.linear", transB=1)
        x = node("Relu", [x], f"{prefix}.relu")
    prefix = shapes[-1][0]
    x = node("Gemm", [x, constant(f"{prefix}.weight"), constant(f"{prefix}.bias")],
             "logits", transB=1)
    node("Softmax", [x], output_name, axis=1)

    channels, height, width = model.input_shape
    graph = helper.make_graph(
        nodes, "hetconv", [helper.make_tensor_value_info(
            input_name, onnx.TensorProto.FLOAT, ["N", channels, height, width])],
        [helper.make_tensor_value_info(output_name, onnx.TensorProto.FLOAT,
                                       ["N", model.classes])],
        initializer=initializers)
    proto = helper.make_model(graph, producer_name="hetconv", ir_version=IR_VERSION,
                              opset_imports=[helper.make_opsetid("", OPSET)],
                              doc_string=f"hetconv network {network}")
    helper.set_model_props(proto, export_metadata(model, network, preprocessing))
    onnx.checker.check_model(proto, full_check=True)
    return proto


def write_onnx(path: str | Path, model: ModelConfig, params: dict[str, np.ndarray],
               network: str, preprocessing: Preprocessing,
               source: dict[str, Any] | None = None) -> int:
    """Write the ONNX file atomically; returns its size in bytes."""
    data = build_onnx_model(model, params, network, preprocessing, source).SerializeToString()
    return write_atomically(Path(path), lambda handle: handle.write(data))
