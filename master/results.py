"""A worker's result checked on arrival, on either split: the right shape, floats, finite.

A result that fails is wrong work, not a lost link: :func:`checked_result` raises a
:class:`~hetconv.master.cluster.WorkerLost` that evicts the worker, and the run goes on
from its snapshot without it (docs/resilience.md). Results that are finite and shaped
but wrong are the audit's (:mod:`hetconv.master.audit`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hetconv.master.cluster import WorkerLost


def checked_result(participant: str, layer: int, name: str, array: Any,
                   expected: Sequence[int | None]) -> np.ndarray:
    """``participant``'s array ``name`` of conv layer ``layer`` (0-based) as float32, if
    its shape is ``expected`` (None: any size on that axis), it holds floats and they are
    finite; WorkerLost evicting the participant otherwise."""
    wanted = "(" + ", ".join("?" if want is None else str(want) for want in expected) + ")"
    problem = None
    if not isinstance(array, np.ndarray):
        problem = f"with nothing, expected {wanted}"
    elif array.ndim != len(expected) or any(
            want is not None and got != want for got, want in zip(array.shape, expected)):
        problem = f"of shape {tuple(array.shape)}, expected {wanted}"
    elif array.dtype.kind != "f":
        problem = f"of dtype {array.dtype}"
    elif not np.isfinite(array).all():
        problem = "holding NaN or Inf"
    if problem is not None:
        raise WorkerLost(f"worker {participant} sent {name} of layer {layer + 1} {problem}; "
                         "evicting it", participant, evict=True)
    return np.asarray(array, dtype=np.float32)
