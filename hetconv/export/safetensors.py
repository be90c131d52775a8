"""The trained weights as a safetensors file under PyTorch's names and layouts.

Conv layer ``i`` becomes the ``torch.nn.Conv2d`` ``conv{i}`` (``weight`` (K, C, k, k);
``bias`` (K,) only for a ``nobn`` layer, holding hetconv's ``beta``) and, with batch
norm, the ``torch.nn.BatchNorm2d`` ``bn{i}`` (``weight`` = gamma, ``bias`` = beta,
``running_mean``, ``running_var`` (K,), ``num_batches_tracked`` int64 scalar 0);
a residual network of a stem and blocks takes torchvision's ResNet names instead
(:mod:`hetconv.export.torch_names`); hidden dense layer ``j`` is the ``torch.nn.Linear`` ``dense{j}`` and the classifier
``fc`` (``weight`` (out, in), ``bias`` (out,)). Every float tensor is float32, C
order. A module with those attributes loads the file with ``load_state_dict``
(strict); docs/export.md has one, built from the header's metadata
(:func:`hetconv.export.metadata.export_metadata`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hetconv.engine.checkpoint import write_atomically
from hetconv.export import missing_extra
from hetconv.export.metadata import export_metadata
from hetconv.export.torch_names import module_names
from hetconv.inference.use import Preprocessing
from hetconv.model import ModelConfig, conv_layer_shapes, dense_shapes
from hetconv.names import layer_key

BATCH_NORM_NAMES = {"gamma": "weight", "beta": "bias", "running_mean": "running_mean",
                    "running_var": "running_var"}
"""hetconv's batch-norm array -> ``torch.nn.BatchNorm2d``'s."""


def source_tensors(params: dict[str, np.ndarray], source: dict[str, Any]
                   ) -> dict[str, np.ndarray]:
    """A run from an ONNX file: every array under the initializer name it came from
    (``source.json``; dense weights transposed back where the file held them so), and a
    ``num_batches_tracked`` (int64 0) beside each batch norm's ``.weight``, as a PyTorch
    module's ``state_dict`` has them."""
    names: dict[str, str] = source["names"]
    transposed = set(source.get("transposed", ()))
    out: dict[str, np.ndarray] = {}
    for key, name in names.items():
        array = np.asarray(params[key], dtype=np.float32)
        out[name] = np.ascontiguousarray(array.T if key in transposed else array)
        if key.endswith(".gamma") and name.endswith(".weight"):
            out[name[:-len("weight")] + "num_batches_tracked"] = np.array(0, dtype=np.int64)
    return out


def torch_tensors(model: ModelConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """hetconv's arrays under the PyTorch names above, float32 and contiguous."""
    def f32(name: str) -> np.ndarray:
        return np.ascontiguousarray(params[name], dtype=np.float32)

    out: dict[str, np.ndarray] = {}
    modules = module_names(model)
    for shape in conv_layer_shapes(model):
        i = shape.index
        conv, batch_norm = modules[i]
        out[f"{conv}.weight"] = f32(layer_key(i, "weight"))
        if shape.batch_norm:
            for ours, theirs in BATCH_NORM_NAMES.items():
                out[f"{batch_norm}.{theirs}"] = f32(layer_key(i, ours))
            out[f"{batch_norm}.num_batches_tracked"] = np.array(0, dtype=np.int64)
        else:
            out[f"{conv}.bias"] = f32(layer_key(i, "beta"))
    for prefix, _, _ in dense_shapes(model):
        out[f"{prefix}.weight"] = f32(f"{prefix}.weight")
        out[f"{prefix}.bias"] = f32(f"{prefix}.bias")
    return out


def require_safetensors() -> Any:
    try:
        import safetensors.numpy
    except ImportError as error:
        raise missing_extra("safetensors", error) from None
    return safetensors.numpy


def safetensors_bytes(model: ModelConfig, params: dict[str, np.ndarray], network: str,
                      preprocessing: Preprocessing, source: dict[str, Any] | None = None
                      ) -> bytes:
    """The whole file: the tensors of :func:`torch_tensors` (of :func:`source_tensors`
    for a run from an ONNX file) and the metadata."""
    writer = require_safetensors()
    tensors = torch_tensors(model, params) if source is None else source_tensors(params, source)
    data: bytes = writer.save(tensors, metadata=export_metadata(model, network, preprocessing))
    return data


def write_safetensors(path: str | Path, model: ModelConfig, params: dict[str, np.ndarray],
                      network: str, preprocessing: Preprocessing,
                      source: dict[str, Any] | None = None) -> int:
    """Write the safetensors file atomically; returns its size in bytes."""
    data = safetensors_bytes(model, params, network, preprocessing, source)
    return write_atomically(Path(path), lambda handle: handle.write(data))
