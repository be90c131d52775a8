"""SGD with momentum and weight decay, and the learning-rate schedules.

The update is element-wise, so a device that owns a slice of a layer's kernels
applies exactly the slice of the update the master would apply to the whole
layer. PyTorch semantics::

    g = grad + weight_decay * param          (decay only where enabled)
    velocity = momentum * velocity + g
    param -= learning_rate * velocity
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetconv.config import SCHEDULES
from hetconv.ops.timers import timed
from hetconv.ops.workspace import thread_scratch


@dataclass(frozen=True)
class OptimizerConfig:
    """Hyper-parameters of SGD and its learning-rate schedule."""

    learning_rate: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    schedule: str = "cosine"
    step_epochs: int = 1  # step schedule: multiply by step_gamma every step_epochs
    step_gamma: float = 0.5
    warmup_steps: int = 0


def sgd_update(param: Any, grad: Any, velocity: Any, learning_rate: float,
               momentum: float, weight_decay: float) -> None:
    """Update ``param`` and ``velocity`` in place (any shape, same dtype).

    One temporary the size of param (numpy: the calling thread's scratch, not a new
    array every step), the same roundings as the formulas in the module docstring.
    """
    with timed("SGD update"):
        velocity *= momentum
        if weight_decay:
            step = _temporary(param)
            step[...] = param
            step *= weight_decay
            step += grad
            velocity += step
        else:
            velocity += grad
            step = _temporary(param)
        step[...] = velocity
        step *= learning_rate
        param -= step


def _temporary(like: Any) -> Any:
    """A scratch array shaped like ``like`` (numpy: the thread's, kept between calls)."""
    if isinstance(like, np.ndarray):
        return thread_scratch().get("sgd step", like.shape, like.dtype)
    return like.copy()


def learning_rate_at(config: OptimizerConfig, step: int, steps_per_epoch: int,
                     epochs: int) -> float:
    """Learning rate for global step ``step`` (0-based) of ``epochs * steps_per_epoch``."""
    total = max(1, steps_per_epoch * epochs)
    base = config.learning_rate
    if config.warmup_steps and step < config.warmup_steps:
        return base * (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return base
    if config.schedule == "step":
        epoch = step // max(1, steps_per_epoch)
        return base * config.step_gamma ** (epoch // max(1, config.step_epochs))
    if config.schedule == "cosine":
        return 0.5 * base * (1.0 + math.cos(math.pi * min(step, total) / total))
    raise ValueError(f"unknown schedule {config.schedule!r}: choose from {', '.join(SCHEDULES)}")
