"""The data plane as a strategy: how a layer phase's arrays travel.

The distributed stage (``master/kernels/stage.py``) runs every conv layer's forward and
backward through a :class:`DataPlane`, chosen once when the run is set up:

- :class:`StarPlane` (``--data-plane star``): every activation through the master.
  Forward: the same input x (B, C, H, W) goes to every worker with kernels, the master
  computes its own range in the helper thread meanwhile, and the pooled outputs
  (B, K_i, H', W') are concatenated in kernel order. Backward: each participant gets
  its slice of the output gradient, updates its shard and returns its partial input
  gradient; the master sums them (the first block needs none).
- :class:`hetconv.master.kernels.peer_plane.PeerPlane` (``--data-plane peer``): activations
  travel worker to worker; the master sends layer 0's input once and gets the last
  layer's output.

A plane builds the requests of a phase and reads its replies over the stage's
:class:`~hetconv.master.kernels.phases.Phases` (which hold the current shards); it knows
nothing of faults or plans. After the shards move (a re-split, a recovery, a join)
the stage calls :meth:`DataPlane.after_resplit`. The sample split is not a data plane
of this stage but a stage of its own (``master/samples/stage.py``): every participant
holds whole layers, and what travels is batch-norm statistics and weight gradients.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from hetconv.master.kernels.phases import Phases
from hetconv.master.results import checked_result
from hetconv.participant.wire_cast import to_wire
from hetconv.protocol import BackwardReply, BackwardRequest, ForwardReply, ForwardRequest


class DataPlane(Protocol):
    """How the stage's layer phases move their arrays (see the module doc)."""

    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        """Layer ``layer``'s output (B, K, H', W') for input x (B, C, H, W)."""
        ...

    def backward(self, layer: int, dy: np.ndarray, need_dx: bool, learning_rate: float,
                 step: int) -> np.ndarray | None:
        """Update every shard of ``layer`` from dy (B, K, H', W'); the summed dx
        (B, C, H, W) when ``need_dx``."""
        ...

    def after_resplit(self) -> None:
        """The shards moved (between steps): redo what depends on them."""
        ...

    def close(self) -> None:
        """Release the plane's sockets (the helper thread is already idle)."""
        ...


class StarPlane:
    """Every activation through the master (see the module doc)."""

    def __init__(self, phases: Phases):
        self.phases = phases

    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        if train:
            self.phases.step = step
        x = np.ascontiguousarray(x, dtype=np.float32)
        wire_x = to_wire(x, self.phases.wire_dtype)
        shards = [s for s in self.phases.shards[layer] if s.kernels > 0]
        requests = [(s, ForwardRequest(request_id=self.phases.cluster.request_id(), step=step,
                                       layer=layer, attempt=0, train=train, x=wire_x))
                    for s in shards if s.worker is not None]
        local_shard = self.phases.local_shards.get(layer)
        local = ((lambda: local_shard.forward_host(x, train))  # host in, host out
                 if local_shard is not None and local_shard.kernels else None)
        started = time.monotonic()
        replies, local_y, local_s, local_done, sent = self.phases.run_phase(
            layer, f"forward of layer {layer + 1} (step {step})", requests, local)
        outputs, results = [], []
        for shard in shards:
            if shard.worker is None:
                outputs.append(local_y)
                results.append((shard, local_s, local_done, 0, 0))
            else:
                reply = replies[shard.participant]
                forward = reply.message
                assert isinstance(forward, ForwardReply)
                outputs.append(checked_result(
                    shard.participant, layer, "y", forward.y, self.phases.output_shape(layer, x.shape[0], shard.kernels)))
                results.append((shard, forward.compute_s, reply.received_at,
                                sent[shard.participant], reply.payload_bytes))
        self.phases.account(layer, "forward", started, local_done, results, train)
        joined = np.concatenate(outputs, axis=1) if len(outputs) > 1 else outputs[0]
        return np.asarray(joined, dtype=np.float32)

    def backward(self, layer: int, dy: np.ndarray, need_dx: bool, learning_rate: float,
                 step: int) -> np.ndarray | None:
        shards = [s for s in self.phases.shards[layer] if s.kernels > 0]
        requests = [(s, BackwardRequest(request_id=self.phases.cluster.request_id(), step=step,
                                        layer=layer, attempt=0, learning_rate=learning_rate,
                                        dy=to_wire(dy[:, s.start:s.stop], self.phases.wire_dtype)))
                    for s in shards if s.worker is not None]
        local_shard = self.phases.local_shards.get(layer)
        local: Callable[[], Any] | None = None
        if local_shard is not None and local_shard.kernels:
            local_dy = np.ascontiguousarray(
                dy[:, local_shard.kernel_start:local_shard.kernel_stop])

            def local() -> Any:  # host in, host out
                return local_shard.backward_host(local_dy, need_dx, learning_rate)
        started = time.monotonic()
        replies, local_dx, local_s, local_done, sent = self.phases.run_phase(
            layer, f"backward of layer {layer + 1} (step {step})", requests, local)
        total: np.ndarray | None = None
        results = []
        for shard in shards:
            if shard.worker is None:
                partial = local_dx
                results.append((shard, local_s, local_done, 0, 0))
            else:
                reply = replies[shard.participant]
                backward = reply.message
                assert isinstance(backward, BackwardReply)
                partial = (None if backward.dx is None else checked_result(
                    shard.participant, layer, "dx", backward.dx, self.phases.input_shape(layer, dy.shape[0])))
                results.append((shard, backward.compute_s, reply.received_at,
                                sent[shard.participant], reply.payload_bytes))
            if need_dx and partial is not None:
                total = np.array(partial, dtype=np.float32) if total is None else total + partial
        self.phases.account(layer, "backward", started, local_done, results, True)
        return total if need_dx else None

    def after_resplit(self) -> None:
        """Nothing depends on the shards on the star."""

    def close(self) -> None:
        """No sockets of its own."""
