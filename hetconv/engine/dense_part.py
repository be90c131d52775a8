"""The dense part of the network (hidden fc layers, dropout, the classifier, the loss).

One implementation for every place it runs: the master's trainer on the whole batch,
and each participant of the sample split's step chain on its slice of the batch
(docs/dense-replica.md). A slice is rows [start, stop) of a batch of ``total``
samples: dropout takes the same rows of the whole batch's mask and the loss and its
gradient are divided by ``total``, so the slices' gradients added in member order are
the whole batch's (up to where the float sums are cut).

Arrays: ``arrays`` and ``velocity`` map the dense keys (``dense{j}.weight`` (O, D),
``dense{j}.bias`` (O,), then ``fc.weight``, ``fc.bias``) to float32 arrays, updated
in place by :meth:`DensePart.apply`; :func:`flatten` and :func:`unflatten` turn them into
one (N,) vector in key order (what travels in ``AssignDense`` and in the weight
reduction among the peers).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetconv.engine.optim import sgd_update
from hetconv.model import DenseSpec
from hetconv.names import CLASSIFIER, hidden_prefix
from hetconv.ops.activation import relu, relu_backward
from hetconv.ops.dropout import dropout_backward, dropout_forward, dropout_mask
from hetconv.ops.linear import linear, linear_backward
from hetconv.ops.loss import softmax_cross_entropy, softmax_cross_entropy_backward

Tape = list[tuple[str, str, np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Rows:
    """Rows [start, stop) of a batch of ``total`` samples."""

    start: int
    stop: int
    total: int


@dataclass
class DenseStep:
    """One training pass of the dense part over some rows: the loss summed over them
    (each sample's cross-entropy; the whole batch's mean is the sum over every slice
    divided by the batch), how many were classified right, every dense array's
    gradient of the whole batch's mean loss, and the gradient of the flattened conv
    output (rows, D)."""

    loss: float  # loss_sum / the batch's samples (the step record's loss)
    loss_sum: float
    correct: int
    grads: dict[str, np.ndarray]
    dflat: np.ndarray
    probs: np.ndarray


class DensePart:
    """The dense layers' arrays, velocities and the passes over them (module doc)."""

    def __init__(self, specs: Sequence[DenseSpec], arrays: dict[str, np.ndarray],
                 velocity: dict[str, np.ndarray], seed: int):
        self.specs = tuple(specs)
        self.arrays = arrays
        self.velocity = velocity
        self.seed = seed

    def names(self) -> list[str]:
        """The keys in the order they are flattened."""
        return list(self.arrays)

    def forward(self, flat: np.ndarray, train: bool, step: int, rows: Rows | None = None
                ) -> tuple[np.ndarray, Tape]:
        """flat (B_i, D) through the hidden dense layers (global average pooling, fc +
        ReLU; dropout when training, rows of the whole batch's mask drawn from (seed, step, layer)) ->
        (the classifier's input (B_i, D'), the tape :meth:`backward` needs)."""
        tape: Tape = []
        h, hidden = flat, 0
        for index, spec in enumerate(self.specs):
            if spec.kind == "fc":
                prefix = hidden_prefix(hidden)
                hidden += 1
                out = relu(linear(h, self.arrays[f"{prefix}.weight"],
                                  self.arrays[f"{prefix}.bias"]))
                tape.append(("fc", prefix, h, out))
                h = out
            elif spec.kind == "gap":  # (B_i, K*H*W) -> (B_i, K): the mean of each map
                maps = h.reshape(h.shape[0], spec.units, -1)
                tape.append(("gap", "", maps, maps))
                h = maps.mean(axis=2, dtype=np.float32)
            elif train and spec.rate > 0.0:
                if rows is None or (rows.start == 0 and rows.stop == rows.total):
                    mask = dropout_mask(h.shape, spec.rate, self.seed, step, index)
                else:
                    mask = dropout_mask((rows.total,) + h.shape[1:], spec.rate, self.seed,
                                        step, index)[rows.start:rows.stop]
                tape.append(("dropout", "", mask, mask))
                h = dropout_forward(h, mask)
        return h, tape

    def backward(self, tape: Tape, grad: np.ndarray, grads: dict[str, np.ndarray]
                 ) -> np.ndarray:
        """Back through the hidden dense layers: adds their weight and bias gradients
        to ``grads`` and returns the gradient of the flattened conv output (B_i, D)."""
        for kind, prefix, first, second in reversed(tape):
            if kind == "fc":
                dz = relu_backward(second, grad)
                grad, dweight, dbias = linear_backward(first, self.arrays[f"{prefix}.weight"],
                                                       dz)
                grads[f"{prefix}.weight"], grads[f"{prefix}.bias"] = dweight, dbias
            elif kind == "gap":  # each position of a map gets 1/(H*W) of its mean's gradient
                spatial = first.shape[2]
                spread = np.empty(first.shape, np.float32)
                spread[...] = (grad / np.float32(spatial))[:, :, None]
                grad = spread.reshape(first.shape[0], -1)
            else:
                grad = dropout_backward(first, grad)
        return grad

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """The classifier: (B_i, D') -> (B_i, classes)."""
        logits: np.ndarray = linear(hidden, self.arrays[f"{CLASSIFIER}.weight"],
                                    self.arrays[f"{CLASSIFIER}.bias"])
        return logits

    def train_pass(self, flat: np.ndarray, labels: np.ndarray, step: int,
                   rows: Rows | None = None) -> DenseStep:
        """Forward and backward over ``flat`` (B_i, D) with ``labels`` (B_i,): the loss
        and the gradients of the mean over ``rows.total`` samples (over B_i without
        ``rows``: the local run)."""
        total = flat.shape[0] if rows is None else rows.total
        hidden, tape = self.forward(flat, True, step, rows)
        logits = self.logits(hidden)
        if rows is None:  # the local run's mean, as it always was
            loss, probs = softmax_cross_entropy(logits, labels)
            loss_sum = loss * total
        else:
            loss_sum, probs = softmax_cross_entropy(logits, labels, divide_by=1)
            loss = loss_sum / total
        dlogits = softmax_cross_entropy_backward(probs, labels, divide_by=total)
        dhidden, dweight, dbias = linear_backward(hidden, self.arrays[f"{CLASSIFIER}.weight"],
                                                  dlogits)
        grads = {f"{CLASSIFIER}.weight": dweight, f"{CLASSIFIER}.bias": dbias}
        dflat = self.backward(tape, dhidden, grads)
        correct = int((probs.argmax(axis=1) == labels).sum())
        return DenseStep(float(loss), float(loss_sum), correct, grads, dflat, probs)

    def apply(self, grads: dict[str, np.ndarray], learning_rate: float, momentum: float,
              weight_decay: float) -> None:
        """The SGD step of every array (weight decay on the weights only), in place."""
        for name, grad in grads.items():
            decay = weight_decay if name.endswith("weight") else 0.0
            sgd_update(self.arrays[name], grad, self.velocity[name], learning_rate,
                       momentum, decay)

    def input_problem(self, features: int) -> str | None:
        """Why ``features`` values a sample cannot be this part's input (one line), or
        None: the first layer's width, or after a global pooling any C*H*W of its C maps."""
        if self.specs and self.specs[0].kind == "gap":
            maps = self.specs[0].units
            if features < maps or features % maps:
                return (f"the dense part pools {maps} maps a sample, got {features} values "
                        f"(not a multiple of {maps})")
            return None
        width = int(self.arrays[self.names()[0]].shape[1])
        if features != width:
            return f"the dense part takes {width} features a sample, got {features}"
        return None

    def size(self) -> int:
        """Values in every dense array together (N)."""
        return sum(int(a.size) for a in self.arrays.values())


def flatten(arrays: dict[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
    """The arrays of ``names`` raveled one after the other: (N,) float32."""
    if not names:
        return np.empty((0,), np.float32)
    return np.concatenate([np.ascontiguousarray(arrays[n], np.float32).ravel()
                           for n in names])


def unflatten(vector: np.ndarray, names: Sequence[str],
              shapes: Sequence[tuple[int, ...]], copy: bool = True) -> dict[str, np.ndarray]:
    """The inverse of :func:`flatten`: writable float32 copies of ``shapes`` (views of
    ``vector`` with ``copy`` false: a gradient read once, on the step's hot path)."""
    out: dict[str, np.ndarray] = {}
    position = 0
    for name, shape in zip(names, shapes):
        size = int(np.prod(shape)) if shape else 1
        part = vector[position:position + size].reshape(shape)
        out[name] = np.array(part, np.float32) if copy else part
        position += size
    if position != vector.size:
        raise ValueError(f"{vector.size} values for arrays of {position}")
    return out
