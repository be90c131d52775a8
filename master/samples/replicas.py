"""The master's replicas under the sample split: every conv layer whole, and the dense part.

The master holds every layer whole whether or not it takes a slice: every update is
applied to its replicas too, so a snapshot is its own state. Its own slice is served by
a :class:`~hetconv.participant.samples.runner.SampleRunner` over these layers, exactly as
a worker serves its slice.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from hetconv.engine.shard import ConvShard
from hetconv.master.samples.settings import SampleSetup
from hetconv.names import layer_key
from hetconv.participant.samples.dense_replica import DenseReplica
from hetconv.participant.samples.runner import SampleRunner


class MasterReplicas:
    """The master's whole layers (``local``: layer -> shard; replaced by ``load``),
    its runner over them, and its replica of the dense part (None: the dense part stays
    on the master alone)."""

    def __init__(self, local: dict[int, ConvShard], setup: SampleSetup):
        self.local = local
        self.setup = setup
        self.runner = SampleRunner()  # the master's own slice, served like a worker's
        self.dense: DenseReplica | None = None

    def replica(self, layer: int) -> Any:
        """The replica of conv layer ``layer``."""
        return self.runner.layers.replica(self.local, layer)

    def state(self) -> dict[str, np.ndarray]:
        """Every conv layer's parameters and buffers, by array name."""
        out: dict[str, np.ndarray] = {}
        for layer in range(self.setup.layers):
            for name, value in self.local[layer].snapshot().items():
                out[layer_key(layer, name)] = value
        return out

    def load(self, state: dict[str, np.ndarray]) -> None:
        """Every layer rebuilt from ``state``; what the runner kept is forgotten."""
        fresh = {shape.index: ConvShard(shape.index, 0, shape.kernels, self.setup.settings,
                                        {n: state[layer_key(shape.index, n)]
                                         for n in _names_in(state, shape.index)},
                                        device=self.setup.device)
                 for shape in self.setup.shapes}
        self.local = fresh
        self.runner.layers.reset()
        self.runner.layers.dense = self.dense

    def attach_dense(self, dense: DenseReplica) -> None:
        self.dense = dense
        self.runner.layers.dense = dense


def _names_in(state: dict[str, np.ndarray], layer: int) -> list[str]:
    prefix = layer_key(layer, "")
    return [key[len(prefix):] for key in state if key.startswith(prefix)]
