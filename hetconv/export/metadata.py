"""What every exported file records besides its tensors: the network, the input, the
class names and the normalisation, as string key/value pairs (ONNX ``metadata_props``,
the safetensors header's ``__metadata__``). Values that are not plain text are JSON.
The keys are listed in docs/export.md."""
from __future__ import annotations

import json
from typing import Any

from hetconv.export.torch_names import module_names
from hetconv.inference.use import Preprocessing
from hetconv.model import ModelConfig, conv_layer_shapes, dense_shapes

FORMAT_VERSION = "1"
NORMALIZATION = "x[c] = (pixel / 255 - mean[c]) / std[c], pixels 0..255, channels RGB or grey"


def layer_records(model: ModelConfig) -> list[dict[str, Any]]:
    """The network in order, one dict per layer: ``conv`` (index, in_channels,
    kernels, kernel_size, stride, padding, batch_norm, bn_eps, pool, relu, input_from,
    shortcut_from: a residual block's routing, docs/residual.md; module, bn_module: its
    PyTorch names in the safetensors file), ``gap`` (global average pooling), ``fc`` (index,
    in_features, out_features; ReLU after it), ``dropout`` (rate; the identity at
    inference), then ``classifier`` (in_features, out_features; softmax after it)."""
    records: list[dict[str, Any]] = []
    modules = module_names(model)
    for shape in conv_layer_shapes(model):
        records.append({"kind": "conv", "index": shape.index, "in_channels": shape.in_channels,
                        "kernels": shape.kernels, "kernel_size": shape.kernel_size,
                        "stride": shape.stride, "padding": shape.padding,
                        "batch_norm": shape.batch_norm, "bn_eps": model.bn_eps,
                        "pool": shape.pool, "relu": shape.relu,
                        "input_from": shape.input_from, "shortcut_from": shape.shortcut_from,
                        "module": modules[shape.index][0],
                        "bn_module": modules[shape.index][1]})
    dense = dense_shapes(model)
    hidden = 0
    for spec in model.dense:
        if spec.kind == "fc":
            _, features, units = dense[hidden]
            records.append({"kind": "fc", "index": hidden, "in_features": features,
                            "out_features": units})
            hidden += 1
        elif spec.kind == "gap":
            records.append({"kind": "gap"})
        else:
            records.append({"kind": "dropout", "rate": spec.rate})
    _, features, classes = dense[-1]
    records.append({"kind": "classifier", "in_features": features, "out_features": classes})
    return records


def export_metadata(model: ModelConfig, network: str,
                    preprocessing: Preprocessing) -> dict[str, str]:
    """The string key/value pairs every exported file carries."""
    return {
        "hetconv_format": FORMAT_VERSION,
        "network": network,
        "input_shape": json.dumps(list(model.input_shape)),
        "classes": str(model.classes),
        "class_names": json.dumps(list(preprocessing.class_names)),
        "mean": json.dumps(list(preprocessing.mean)),
        "std": json.dumps(list(preprocessing.std)),
        "normalization": NORMALIZATION,
        "layers": json.dumps(layer_records(model)),
    }
