"""The update still to apply after a step: what it is, and what the requests carry of it.

Under the sample split every layer's SGD step rides with the next request that reaches
every participant (the next forward round or chain, or an update-only round before a
snapshot or an evaluation), so between steps the master holds one pending update.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetconv.protocol.samples import NO_LAYER


@dataclass(frozen=True)
class PendingUpdate:
    """A layer's SGD step still to apply: the whole batch's ``dweight`` (summed by the
    master: ``--data-plane star``), or None when the peers reduce it as reduction
    ``reduce_id`` of the ``contributors``' gradients
    (hetconv/participant/samples/weight_reduce.py); its batch-norm ``sums`` (2, K) float32.
    After a backward chain (hetconv/participant/samples/chain.py) it covers layers
    [``layer``, ``stop``) and every participant kept their sums."""

    layer: int
    dweight: np.ndarray | None
    sums: np.ndarray | None  # None: each participant kept them (the chain)
    reduce_id: int = 0
    contributors: tuple[str, ...] = ()
    stop: int = NO_LAYER  # > layer: layers [layer, stop) of one backward chain


def update_fields(update: PendingUpdate | None) -> dict[str, Any]:
    """A request's fields of the update it carries (none: NO_LAYER)."""
    if update is None:
        return {"update_layer": NO_LAYER, "dweight": None, "update_sums": None,
                "update_id": 0, "contributors": [], "update_stop": NO_LAYER}
    return {"update_layer": update.layer, "dweight": update.dweight,
            "update_sums": update.sums, "update_id": update.reduce_id,
            "contributors": list(update.contributors), "update_stop": update.stop}


@dataclass
class Updates:
    """The master's side of the updates between rounds: the one pending (``pending``),
    the learning rate of the step it belongs to, and the whole batch's batch-norm sums
    (dgamma, dbeta), each (K,), of the layers whose backward round started (star)."""

    pending: PendingUpdate | None = None
    learning_rate: float = 0.0
    sums: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def take(self) -> PendingUpdate | None:
        """The pending update, taken to travel with the next request."""
        update, self.pending = self.pending, None
        return update

    def forget(self) -> None:
        """Drop the pending update and the sums (every layer was handed out afresh)."""
        self.pending = None
        self.sums.clear()
