"""A participant's replica of the dense part under the sample split (docs/dense-replica.md).

The master hands every worker the dense part (``AssignDense``) whenever it hands out
the conv layers; the master's own replica is its trainer's :class:`DensePart` (one copy).
In the step chain each participant runs the dense part on its slice
(:meth:`DenseReplica.train_slice`), scatters the gradient of every dense array as one
(N,) vector, layer ``layer`` of the reduction plan, and applies the summed vector with
the next step's update (:meth:`DenseReplica.apply`), as the conv layers' updates.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from hetconv.engine.dense_part import DensePart, DenseStep, Rows, flatten, unflatten
from hetconv.model import DenseSpec
from hetconv.names import CLASSIFIER, hidden_prefix
from hetconv.protocol import AssignDense

MAX_DENSE_LAYERS = 64
"""Dense layers an ``AssignDense`` may describe."""


class DenseReplica:
    """The dense part, its place in the reduction plan and its optimizer's settings."""

    def __init__(self, part: DensePart, layer: int, momentum: float, weight_decay: float):
        self.part = part
        self.layer = layer
        self.momentum = momentum
        self.weight_decay = weight_decay

    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(self.part.arrays[n].shape) for n in self.part.names()]

    def classes(self) -> int:
        return int(self.part.arrays[f"{CLASSIFIER}.bias"].shape[0])

    def train_slice(self, flat: np.ndarray, labels: np.ndarray, step: int, rows: Rows
                    ) -> tuple[DenseStep, np.ndarray]:
        """The dense part's forward and backward on rows ``rows`` of the batch:
        (the pass, every dense gradient flattened (N,) float32)."""
        done = self.part.train_pass(flat, labels, step, rows)
        return done, flatten(done.grads, self.part.names())

    def evaluate(self, features: np.ndarray) -> np.ndarray:
        """Evaluation-mode logits (B, classes) of features (B, ...) flattened (the
        result audit's request at layer ``layer``)."""
        flat = np.ascontiguousarray(features, np.float32).reshape(features.shape[0], -1)
        hidden, _ = self.part.forward(flat, False, -1)
        return self.part.logits(hidden)

    def apply(self, vector: np.ndarray, learning_rate: float) -> None:
        """The SGD step with the whole batch's gradient (N,) (flattened in key order)."""
        names = self.part.names()
        self.part.apply(unflatten(vector, names, self.shapes(), copy=False), learning_rate,
                        self.momentum, self.weight_decay)

    def message(self, request_id: int) -> AssignDense:
        """The ``AssignDense`` that gives a worker this replica."""
        names = self.part.names()
        return AssignDense(
            request_id=request_id, layer=self.layer, names=names,
            shapes=[list(s) for s in self.shapes()],
            layers=[[spec.kind, spec.units, spec.rate] for spec in self.part.specs],
            seed=self.part.seed, momentum=self.momentum, weight_decay=self.weight_decay,
            values=flatten(self.part.arrays, names),
            velocity=flatten(self.part.velocity, names))


def dense_refusal(request: AssignDense) -> str | None:
    """Why an ``AssignDense`` does not describe a dense part (one line), or None: the
    layers well formed, the names those the layers imply in order, each fc's weight
    (units, features) chaining from the one before, the classifier last, and
    ``values`` and ``velocity`` float32, finite, of the arrays' total size."""
    if request.layer < 0:
        return f"layer must be at least 0, got {request.layer}"
    if not 0.0 <= request.momentum <= 1.0 or not math.isfinite(request.weight_decay) \
            or request.weight_decay < 0:
        return "momentum must lie in [0, 1] and weight_decay be finite and >= 0"
    layers = request.layers
    if len(layers) > MAX_DENSE_LAYERS:
        return f"at most {MAX_DENSE_LAYERS} dense layers"
    specs = []
    for item in layers:
        if not isinstance(item, list) or len(item) != 3 \
                or item[0] not in ("fc", "dropout", "gap") \
                or type(item[1]) is not int or not isinstance(item[2], (int, float)):
            return "layers must be [kind, units, rate] with kind fc, dropout or gap"
        kind, units, rate = item[0], item[1], float(item[2])
        if (kind in ("fc", "gap") and units < 1) \
                or (kind == "dropout" and not 0.0 <= rate < 1.0):
            return ("an fc layer or gap needs units >= 1 and a dropout a rate in [0, 1)")
        specs.append(DenseSpec(kind, units, rate))
    if any(s.kind == "gap" for s in specs[1:]):
        return "gap comes first among the dense layers"
    prefixes = [hidden_prefix(i) for i in range(sum(s.kind == "fc" for s in specs))]
    expected = [f"{p}.{n}" for p in prefixes + [CLASSIFIER] for n in ("weight", "bias")]
    if list(request.names) != expected:
        return f"names must be {expected}"
    shapes: list[tuple[int, ...]] = []
    for shape in request.shapes:
        if not isinstance(shape, list) or not 1 <= len(shape) <= 2 \
                or not all(type(n) is int and n >= 1 for n in shape):
            return "shapes must be lists of one or two sizes >= 1"
        shapes.append(tuple(shape))
    if len(shapes) != len(expected):
        return f"{len(expected)} shapes expected, got {len(shapes)}"
    widths = [s.units for s in specs if s.kind == "fc"]
    features = specs[0].units if specs and specs[0].kind == "gap" else None
    for index, prefix in enumerate(prefixes + [CLASSIFIER]):
        weight, bias = shapes[2 * index], shapes[2 * index + 1]
        if len(weight) != 2 or bias != (weight[0],) or \
                (index < len(widths) and weight[0] != widths[index]) or \
                (features is not None and weight[1] != features):
            return f"{prefix}: weight (O, D) and bias (O,) must chain from the layer before"
        features = weight[0]
    size = sum(int(np.prod(s)) for s in shapes)
    for name in ("values", "velocity"):
        array = getattr(request, name)
        if array.dtype != np.float32 or array.shape != (size,):
            return f"{name} must be float32 ({size},), got {array.dtype} {tuple(array.shape)}"
        if not np.isfinite(array).all():
            return f"{name} holds NaN or Inf"
    return None


def replica_from(request: AssignDense) -> DenseReplica:
    """The replica an ``AssignDense`` describes (check it with :func:`dense_refusal`)."""
    specs = [DenseSpec(str(k), int(u), float(r)) for k, u, r in request.layers]
    shapes = [tuple(int(n) for n in s) for s in request.shapes]
    names = [str(n) for n in request.names]
    arrays = unflatten(request.values, names, shapes)
    velocity = unflatten(request.velocity, names, shapes)
    return DenseReplica(DensePart(specs, arrays, velocity, int(request.seed)), request.layer,
                        float(request.momentum), float(request.weight_decay))


def as_labels(array: Any, samples: int, classes: int) -> np.ndarray | None:
    """``array`` as int64 class ids (samples,), or None when it is not that."""
    if not isinstance(array, np.ndarray) or array.shape != (samples,) \
            or array.dtype.kind not in "iu":
        return None
    if samples and (int(array.min()) < 0 or int(array.max()) >= classes):
        return None
    return array.astype(np.int64)
