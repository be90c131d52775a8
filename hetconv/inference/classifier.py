"""A trained network in eval mode (:class:`Classifier`): the conv layers run through a
:class:`~hetconv.engine.stage.LocalConvStage` (the training code's own conv blocks, batch norm
on its running statistics) and the dense layers as the training code's :class:`DensePart` (dropout
is the identity in eval mode; residual blocks chained by :mod:`hetconv.engine.routing`), so its outputs are the training code's.
"""
from __future__ import annotations

import numpy as np

from hetconv.engine.dense_part import DensePart
from hetconv.engine.routing import Routing, run_forward
from hetconv.engine.stage import LocalConvStage, layer_settings
from hetconv.model import ModelConfig, conv_layer_shapes, dense_parameter_names

DEFAULT_BATCH = 500


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax of (B, O) logits (max subtracted first), same dtype."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp: np.ndarray = np.exp(shifted)
    exp /= exp.sum(axis=1, keepdims=True)
    return exp


class Classifier:
    """A trained network in eval mode: images (B, C, H, W) float32, normalised ->
    logits or probabilities (B, classes). The conv layers run in a LocalConvStage
    (the training code's blocks); the dense layers use the training code's ops."""

    def __init__(self, model: ModelConfig, params: dict[str, np.ndarray], device: str = "cpu"):
        self.model = model
        self.stage = LocalConvStage(model, params, layer_settings(model, 0.0, 0.0), device)
        self.routing = Routing.of(conv_layer_shapes(model))
        dense = {name: np.asarray(params[name], np.float32)
                 for name in dense_parameter_names(model)}
        self.part = DensePart(model.dense, dense, {}, seed=0)  # the training code's dense part

    def logits(self, images: np.ndarray) -> np.ndarray:
        """(B, C, H, W) -> (B, classes) float32 logits of one batch."""
        x = np.ascontiguousarray(images, dtype=np.float32)
        x, _ = run_forward(self.routing,
                           lambda layer, a: self.stage.forward(layer, a, False, -1), x)
        hidden, _ = self.part.forward(x.reshape(x.shape[0], -1), False, -1)
        return self.part.logits(hidden)

    def probabilities(self, images: np.ndarray, batch: int = DEFAULT_BATCH) -> np.ndarray:
        """(N, C, H, W) -> (N, classes) softmax probabilities, ``batch`` images at a time."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        parts = [softmax(self.logits(images[begin:begin + batch]))
                 for begin in range(0, len(images), batch)]
        if not parts:
            return np.zeros((0, self.model.classes), np.float32)
        return np.concatenate(parts)

    def close(self) -> None:
        self.stage.close()
