"""The sample split's step as two chains, the master's side (``--data-plane peer``).

With the weight gradients reduced among the peers, a training step is one forward
chain and one backward chain per participant (hetconv/sample_chain.py: the batch-norm
statistics exchanged among the peers, each participant combining them itself), not
2L + 2 rounds through the master. Here the master sends each chain's requests, runs
its own share (it always takes part: its replica is what a snapshot reads), joins the
output slices, and leaves the update of every layer pending, to ride with the next
forward chain (or an update-only round before a snapshot or an evaluation).

With the dense part replicated (docs/dense-replica.md) the two chains are one step
chain: the trainer hands the stage whole steps (``train_step``), each one request per
participant, and the master's replica of the dense part is the trainer's own
(``attach_dense``).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hetconv.config import MASTER_PARTICIPANT
from hetconv.dense_part import DensePart
from hetconv.dense_replica import DenseReplica
from hetconv.master.cluster import Cluster, WorkerLost
from hetconv.master.sample_between import PendingUpdate, SampleSetup, checked_result
from hetconv.master.sample_between import update_fields as _update_fields
from hetconv.master.sample_plan import Slice
from hetconv.optim import OptimizerConfig
from hetconv.protocol import SampleBackwardRequest, SampleForwardRequest
from hetconv.protocol.sample_messages import NO_LAYER
from hetconv.sample_runner import SampleRunner
from hetconv.wire_cast import to_wire


class ChainedSteps:
    """The chains of a :class:`~hetconv.master.sample_stage.SampleConvStage`."""

    cluster: Cluster
    setup: SampleSetup
    slices: list[Slice]
    _x: np.ndarray
    _learning_rate: float
    _dweight: PendingUpdate | None
    _round: Callable[..., dict[str, Any]]
    _entry: Callable[[int, Slice], dict[str, Any]]
    _step_dense: dict[str, float]
    dense: DenseReplica | None
    runner: SampleRunner
    pending_fault: WorkerLost | None
    flush: Callable[[], None]
    assign_dense: Callable[[], None]
    assign_peers: Callable[[], None]
    _begin_step: Callable[[np.ndarray, int], PendingUpdate | None]

    @property
    def layers(self) -> int:
        return len(self.setup.shapes)

    @property
    def chained(self) -> bool:
        """Whether steps are chains (the subclass's: the peers reduce the gradients)."""
        raise NotImplementedError

    def _members(self) -> list[str]:
        return [p.participant for p in self.slices if p.samples > 0]

    # --- the dense part replicated (docs/dense-replica.md) -----------------------------
    @property
    def replicates_dense(self) -> bool:
        """Whether a training step is one step chain (the dense part on every
        participant's slice) rather than the trainer's conv calls."""
        return self.chained and self.dense is not None

    def attach_dense(self, part: DensePart, optimizer: OptimizerConfig) -> None:
        """Replicate the trainer's dense part (``--dense-part replicas``, chains only):
        the master's replica is ``part`` itself; every worker gets it now and at every
        hand-out of the layers. Between steps only."""
        if not self.chained or not self.setup.dense_replicas:
            return
        self.dense = DenseReplica(part, self.layers, optimizer.momentum,
                                  optimizer.weight_decay)
        self.flush()
        self.runner.dense = self.dense
        try:
            self.assign_dense()
            self.assign_peers()
        except WorkerLost as fault:  # as at setup: the first step raises it (a recovery)
            self.pending_fault = self.pending_fault or fault

    def train_step(self, x: np.ndarray, labels: np.ndarray, step: int,
                   learning_rate: float) -> dict[str, Any]:
        """One SGD step as one step chain per participant (the trainer's step record:
        the loss is the members' sums added in member order over the batch)."""
        started = time.perf_counter()
        if self.pending_fault is not None:
            fault, self.pending_fault = self.pending_fault, None
            raise fault  # the trainer's recovery: a re-plan that checks again
        update = self._begin_step(x, step)
        loss_sum, correct, dense_s = self._step_chain(step, learning_rate, labels, update)
        step_s = time.perf_counter() - started
        return {"loss": loss_sum / x.shape[0], "correct": correct, "images": int(x.shape[0]),
                "step_s": step_s, "conv_s": max(0.0, step_s - dense_s), "dense_s": dense_s}

    def _chain_fields(self, step_chain: bool = False) -> dict[str, Any]:
        """A forward chain's fields: a new ``sync_id`` (newer than the update's
        reduction), the members and their samples, each layer's output positions."""
        return {"sync_id": self.cluster.request_id(), "members": self._members(),
                "member_samples": [p.samples for p in self.slices if p.samples > 0],
                "positions": [s.conv_height * s.conv_width for s in self.setup.shapes],
                "slice_statistics": self.setup.slice_statistics, "step_chain": step_chain}

    def _forward_chain(self, step: int, update: PendingUpdate | None) -> np.ndarray:
        """Every layer's forward in one request per participant, the statistics
        exchanged among the peers (hetconv/sample_chain.py); the output joined."""
        wire = self.setup.wire_dtype
        total = self._x.shape[0]
        chain = self._chain_fields()

        def make(piece: Slice) -> SampleForwardRequest:
            x = None
            if piece.samples:
                x = self._x[piece.start:piece.stop]
                x = x if piece.participant == MASTER_PARTICIPANT else to_wire(x, wire)
            return SampleForwardRequest(
                request_id=self.cluster.request_id(), step=step, attempt=0, train=True,
                total_batch=total, finish_layer=NO_LAYER, start_layer=0,
                stop_layer=self.layers, return_output=True,
                learning_rate=self._learning_rate, total_count=0, mean=None, var=None, x=x,
                **_update_fields(update), **chain)

        replies = self._round(f"forward chain (step {step})", 0, "forward", make, True, make,
                              peer_update=True)
        last = self.setup.shapes[-1]
        outputs = [checked_result(piece.participant, self.layers - 1, "y",
                                  replies[piece.participant].y,
                                  (piece.samples, last.kernels, last.pooled_height,
                                   last.pooled_width))
                   for piece in self.slices if piece.samples > 0]
        return np.concatenate(outputs, axis=0) if len(outputs) > 1 else outputs[0]

    def _step_chain(self, step: int, learning_rate: float, labels: np.ndarray,
                    update: PendingUpdate | None) -> tuple[float, int, float]:
        """The whole training step in one request per participant (the dense part
        replicated: docs/dense-replica.md): the conv layers' forward, the dense part on
        each slice, the backward chain; every update (the conv layers' and the dense
        part's, layer L of the reduction) left pending, to ride with the next step.
        Returns (the loss summed over the batch, in member order; correct answers; the
        slowest member's seconds of the dense part)."""
        wire = self.setup.wire_dtype
        total = self._x.shape[0]
        chain = self._chain_fields(step_chain=True)
        members, sync_id = chain["members"], chain["sync_id"]

        def make(piece: Slice) -> SampleForwardRequest:
            x = part_labels = None
            if piece.samples:
                x = self._x[piece.start:piece.stop]
                part_labels = labels[piece.start:piece.stop]
                if piece.participant != MASTER_PARTICIPANT:
                    x = to_wire(x, wire)
                    part_labels = part_labels.astype(np.int32)
            return SampleForwardRequest(
                request_id=self.cluster.request_id(), step=step, attempt=0, train=True,
                total_batch=total, finish_layer=NO_LAYER, start_layer=0,
                stop_layer=self.layers, return_output=False,
                learning_rate=self._learning_rate, total_count=0, mean=None, var=None, x=x,
                labels=part_labels, **_update_fields(update), **chain)

        replies = self._round(f"step chain (step {step})", 0, "forward", make, True, make,
                              peer_update=True)
        self._learning_rate = learning_rate
        self._dweight = PendingUpdate(0, None, None, sync_id, tuple(members), self.layers + 1)
        active = [p for p in self.slices if p.samples > 0]
        values = {p.participant: float(replies[p.participant].loss_sum) for p in active}
        finite = [n for n, v in values.items() if np.isfinite(v)]
        loss_sum, correct, dense_s = 0.0, 0, 0.0
        for piece in active:
            reply = replies[piece.participant]
            value, right = values[piece.participant], int(reply.correct)
            # a diverged model's loss is not finite anywhere (the trainer stops the run);
            # alone among finite ones, or negative, or more right than samples: wrong
            lone = not np.isfinite(value) and len(finite) == len(active) - 1 and finite
            if piece.participant != MASTER_PARTICIPANT and (
                    lone or value < 0 or not 0 <= right <= piece.samples):
                raise WorkerLost(f"worker {piece.participant} sent a loss of {value} and "
                                 f"{right} correct answers for {piece.samples} samples; "
                                 "evicting it", piece.participant, evict=True)
            loss_sum += value
            correct += right
            dense_s = max(dense_s, float(reply.dense_s))
            self._step_dense[piece.participant] = min(float(reply.dense_s),
                                                      float(reply.compute_s))
            self._spread_over_layers(piece, reply)
        return loss_sum, correct, dense_s

    def _spread_over_layers(self, piece: Slice, reply: Any) -> None:
        """The step record's per-layer figures of a step chain: the round recorded the
        whole chain's compute and peer wait under layer 0; the reply's ``layer_seconds``
        (per layer [forward_s, backward_s, forward_wait_s, backward_wait_s]) move each
        layer's share to its layer where they are well formed (figures only: a malformed
        list leaves the totals under layer 0; what no layer waited, the update's
        reduction at the chain's start and the dense part's, stays there)."""
        seconds = reply.layer_seconds
        if not isinstance(seconds, list) or len(seconds) != self.layers or not all(
                isinstance(row, list) and len(row) == 4
                and all(isinstance(v, (int, float)) and 0 <= v < 1e6 for v in row)
                for row in seconds):
            return
        first = self._entry(0, piece)
        first["forward_s"] = max(0.0, first["forward_s"] - float(reply.compute_s))
        waited = sum(float(row[2]) + float(row[3]) for row in seconds)
        if "peer_wait_s" in first and waited <= first["peer_wait_s"] + 1e-6:
            first["peer_wait_s"] = max(0.0, first["peer_wait_s"] - waited)
            for layer, row in enumerate(seconds):
                entry = self._entry(layer, piece)
                entry["peer_wait_s"] += float(row[2]) + float(row[3])
        for layer, row in enumerate(seconds):
            entry = self._entry(layer, piece)
            entry["forward_s"] += float(row[0])
            entry["backward_s"] += float(row[1])

    def _backward_chain(self, step: int, learning_rate: float, dy: np.ndarray) -> None:
        """Every layer's backward in one request per participant (hetconv/sample_chain.py);
        the update of every layer is left pending, to ride with the next forward chain."""
        self._learning_rate = learning_rate
        wire = self.setup.wire_dtype
        reduce_id = self.cluster.request_id()
        members = self._members()

        def make(piece: Slice) -> SampleBackwardRequest:
            part = None
            if piece.samples:
                part = dy[piece.start:piece.stop]
                part = np.ascontiguousarray(part, np.float32) \
                    if piece.participant == MASTER_PARTICIPANT else to_wire(part, wire)
            return SampleBackwardRequest(
                request_id=self.cluster.request_id(), step=step, attempt=0,
                learning_rate=learning_rate, finish_layer=NO_LAYER,
                start_layer=self.layers - 1, dgamma=None, dbeta=None, dy=part,
                reduce_id=reduce_id, sync_id=reduce_id, members=members,
                slice_statistics=self.setup.slice_statistics, **_update_fields(None))

        self._round(f"backward chain (step {step})", self.layers - 1, "backward", make, True,
                    make, peer_update=True)
        self._dweight = PendingUpdate(0, None, None, reduce_id, tuple(members), self.layers)

