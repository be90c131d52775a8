"""Softmax cross-entropy loss over class logits, forward and backward.

The forward pass subtracts each row's maximum before exponentiating, so large
logits never overflow, and computes the loss from log-sum-exp rather than from
the probabilities, so tiny probabilities never produce log(0).
"""
from __future__ import annotations

from typing import Any

from hetconv.backend import get_array_module
from hetconv.ops.timers import timed

Array = Any  # a numpy or cupy ndarray


def _check_labels(labels: Array, batch: int, classes: int) -> None:
    if labels.shape != (batch,):
        raise ValueError(f"labels must have shape ({batch},), got {labels.shape}")
    if labels.dtype.kind not in "iu":
        raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
    if batch and (int(labels.min()) < 0 or int(labels.max()) >= classes):
        raise ValueError(f"labels must lie in [0, {classes}), got {int(labels.min())}.."
                         f"{int(labels.max())}")


def softmax_cross_entropy(logits: Array, labels: Array,
                          divide_by: int | None = None) -> tuple[float, Array]:
    """Mean cross-entropy of softmax(logits) against integer labels.

    logits: (B, O) floats, labels: (B,) integers in [0, O).
    Returns (loss as a Python float, probs (B, O) in logits' dtype). ``divide_by``:
    the sum is divided by it instead of B (1: the sum, a slice's part of a batch's).
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be (B, O), got shape {logits.shape}")
    batch, classes = logits.shape
    _check_labels(labels, batch, classes)
    if batch == 0:
        raise ValueError("softmax_cross_entropy needs a non-empty batch")
    xp = get_array_module(logits, labels)
    with timed("loss"):
        shifted = logits - logits.max(axis=1, keepdims=True)
        exp = xp.exp(shifted)
        sum_exp = exp.sum(axis=1, keepdims=True)
        rows = xp.arange(batch)
        log_likelihood = shifted[rows, labels] - xp.log(sum_exp[:, 0])
        loss = -float(log_likelihood.sum()) / (batch if divide_by is None else divide_by)
        probs = exp
        probs /= sum_exp
    return loss, probs


def softmax_cross_entropy_backward(probs: Array, labels: Array,
                                   divide_by: int | None = None) -> Array:
    """dLoss/dlogits = (probs - onehot(labels)) / B for the mean loss.

    probs: (B, O) from the forward pass, labels: (B,). Returns (B, O). ``divide_by``:
    instead of B (the whole batch's samples, for rows of it: the mean over the batch).
    """
    batch = probs.shape[0]
    if labels.shape != (batch,):
        raise ValueError(f"labels must have shape ({batch},), got {labels.shape}")
    xp = get_array_module(probs, labels)
    with timed("loss"):
        dlogits = probs.copy()
        dlogits[xp.arange(batch), labels] -= 1
        dlogits /= batch if divide_by is None else divide_by
    return dlogits
