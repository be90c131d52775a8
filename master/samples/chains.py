"""The sample split's step as two chains, the master's side (``--data-plane peer``).

With the weight gradients reduced among the peers, a training step is one forward
chain and one backward chain per participant (hetconv/participant/samples/chain.py: the
batch-norm statistics exchanged among the peers, each participant combining them
itself), not 2L + 2 rounds through the master. Here the master sends each chain's
requests, runs its own share (it always takes part: its replica is what a snapshot
reads), joins the output slices, and leaves the update of every layer pending, to ride
with the next forward chain (or an update-only round before a snapshot or an evaluation).

With the dense part replicated (docs/dense-replica.md) the two chains are one step
chain: the trainer hands the stage whole steps (``train_step``), each one request per
participant, and the master's replica of the dense part is the trainer's own.

Two steps in flight (docs/sample-split.md, "The step boundary"): the trainer may hand
``train_step`` the next step too (``ahead``); its requests go out, and the master's own
share of it is queued, before this step's replies are gathered, so that every
participant starts the next step the moment its chain of this one ends. Nothing in a
step chain's request depends on the replies of the step before (its update names that
step's reduction, known when it was sent). A step that fails abandons the one sent
ahead: the master's queued share is cancelled before it starts (or its peer waits end
at once), its requests are forgotten (late answers dropped quietly), and the recovery's
re-assignment ends the workers' chains of it.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hetconv.config import MASTER_PARTICIPANT
from hetconv.master.cluster import Cluster, WorkerLost
from hetconv.master.results import checked_result
from hetconv.master.samples.figures import StepState
from hetconv.master.samples.members import SampleMembers
from hetconv.master.samples.peers import SamplePeers
from hetconv.master.samples.plan import Slice
from hetconv.master.samples.replicas import MasterReplicas
from hetconv.master.samples.rounds import Rounds, SentRound
from hetconv.master.samples.settings import SampleSetup
from hetconv.master.samples.updates import PendingUpdate, Updates, update_fields
from hetconv.participant.wire_cast import to_wire
from hetconv.protocol import SampleBackwardChain, SampleForwardChain, SampleStepChain


@dataclass
class InFlightStep:
    """A step chain sent and not yet collected."""

    step: int
    x: np.ndarray  # (B, C, H, W) float32, the whole batch
    round: SentRound
    sent_ahead: bool = False  # sent before the step before it was gathered


class Chains:
    """The chains of a run whose peers reduce the weight gradients; the step sent ahead
    (``ahead``) is theirs."""

    def __init__(self, cluster: Cluster, setup: SampleSetup, members: SampleMembers,
                 replicas: MasterReplicas, rounds: Rounds, updates: Updates,
                 state: StepState, peers: SamplePeers):
        self.cluster = cluster
        self.setup = setup
        self.members = members
        self.replicas = replicas
        self.rounds = rounds
        self.updates = updates
        self.state = state
        self.peers = peers
        self.ahead: InFlightStep | None = None  # a step chain sent ahead (two in flight)

    # --- whole steps (the dense part replicated: docs/dense-replica.md) ------------------
    def train_step(self, x: np.ndarray, labels: np.ndarray, step: int, learning_rate: float,
                   ahead: tuple[np.ndarray, np.ndarray, int, float] | None,
                   raise_pending_fault: Callable[[], None]) -> dict[str, Any]:
        """One SGD step as one step chain per participant (the trainer's step record:
        the loss is the members' sums added in member order over the batch). ``ahead``
        (x, labels, step, learning rate): the next step, sent before this one's replies
        are gathered (two steps in flight); the trainer hands it only where nothing
        reads the replicas between the two (no snapshot, evaluation or epoch end)."""
        started = time.perf_counter()
        current, self.ahead = self.ahead, None
        try:
            if current is not None and current.step != step:
                raise RuntimeError(f"internal error: step {current.step} was sent ahead, "
                                   f"then step {step} was asked for")
            raise_pending_fault()  # the trainer's recovery: a re-plan that checks again
            if current is None:
                current = self._send_step(x, labels, step, learning_rate)
            if ahead is not None:
                self.ahead = replace(self._send_step(*ahead), sent_ahead=True)
            self._begin(current)
            loss_sum, correct, dense_s = self._finish_step(current)
        except BaseException:
            self._abandon([s for s in (current, self.ahead) if s is not None])
            self.ahead = None
            self.updates.pending = None  # as if no step had been sent: a recovery re-assigns
            raise
        step_s = time.perf_counter() - started
        return {"loss": loss_sum / x.shape[0], "correct": correct, "images": int(x.shape[0]),
                "step_s": step_s, "conv_s": max(0.0, step_s - dense_s), "dense_s": dense_s}

    def drain(self) -> None:
        """Nothing in flight any more (a step sent ahead that will not be asked for is
        abandoned): before the run ends."""
        if self.ahead is not None:
            self._abandon([self.ahead])
            self.ahead = None
            self.updates.pending = None

    def _abandon(self, steps: list[InFlightStep]) -> None:
        """Give up on steps sent and not collected: the master's own share of each
        cancelled (ended at once if it started: its peer waits are cancelled), their
        requests forgotten (late answers dropped quietly)."""
        jobs = [s.round.job for s in steps if s.round.job is not None]
        for job in jobs:
            job.cancelled.set()
        if not all(job.done.is_set() for job in jobs):
            self.peers.cancel.set()
        for job in jobs:
            job.done.wait()
        self.peers.cancel.clear()
        for step in steps:
            self.cluster.membership.abandon(step.round.pending)

    def _begin(self, current: InFlightStep) -> None:
        """The step state now describes ``current`` (the step collected next): its
        batch, its slices, its clock (from when the master turns to it)."""
        state = self.state
        state.step = current.step
        state.figures.sent_ahead = current.sent_ahead
        state.x = current.x
        state.slices = current.round.slices
        state.figures.started = max(current.round.started, self.rounds.collected_at)

    def _send_step(self, x: np.ndarray, labels: np.ndarray, step: int,
                   learning_rate: float) -> InFlightStep:
        """Send the whole training step in one request per participant (the dense part
        replicated: docs/dense-replica.md): the conv layers' forward, the dense part on
        each slice, the backward chain; the update pending from the step before rides
        with it, and this step's (the conv layers' and the dense part's, layer L of the
        reduction) is left pending, to ride with the next step."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        total = x.shape[0]
        slices = self.members.slices(total)
        update = self.updates.take()
        members = [p.participant for p in slices if p.samples > 0]
        sync_id = self.cluster.request_id()
        chain = self._chain_fields(sync_id, slices)
        update_lr = self.updates.learning_rate
        layers = self.setup.layers

        def make(piece: Slice) -> SampleStepChain:
            part = part_labels = None
            if piece.samples:
                part = x[piece.start:piece.stop]
                part_labels = labels[piece.start:piece.stop]
                if piece.participant != MASTER_PARTICIPANT:
                    part = to_wire(part, self.setup.wire_for(piece.participant))
                    part_labels = part_labels.astype(np.int32)
            return SampleStepChain(
                request_id=self.cluster.request_id(), step=step, attempt=0,
                total_batch=total, stop_layer=layers, learning_rate=update_lr, x=part,
                labels=part_labels, **update_fields(update), **chain)

        sent = self.rounds.send(f"step chain (step {step})", 0, "forward", make, make,
                                True, slices)
        self.updates.learning_rate = learning_rate
        self.updates.pending = PendingUpdate(0, None, None, sync_id, tuple(members),
                                             layers + 1)
        return InFlightStep(step, x, sent)

    def _finish_step(self, current: InFlightStep) -> tuple[float, int, float]:
        """Gather a step chain's replies. Returns (the loss summed over the batch, in
        member order; correct answers; the slowest member's seconds of the dense part)."""
        ahead = self.ahead
        behind = [ahead.round.job] if ahead is not None and ahead.round is not current.round \
            and ahead.round.job is not None else []
        figures = self.state.figures
        replies = self.rounds.collect(current.round, figures, behind)
        active = [p for p in current.round.slices if p.samples > 0]
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
            figures.dense[piece.participant] = min(float(reply.dense_s), float(reply.compute_s))
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
        if not isinstance(seconds, list) or len(seconds) != self.setup.layers or not all(
                isinstance(row, list) and len(row) == 4
                and all(isinstance(v, (int, float)) and 0 <= v < 1e6 for v in row)
                for row in seconds):
            return
        figures = self.state.figures
        first = self.rounds.entry(figures, 0, piece)
        first["forward_s"] = max(0.0, first["forward_s"] - float(reply.compute_s))
        waited = sum(float(row[2]) + float(row[3]) for row in seconds)
        if "peer_wait_s" in first and waited <= first["peer_wait_s"] + 1e-6:
            first["peer_wait_s"] = max(0.0, first["peer_wait_s"] - waited)
            for layer, row in enumerate(seconds):
                entry = self.rounds.entry(figures, layer, piece)
                entry["peer_wait_s"] += float(row[2]) + float(row[3])
        for layer, row in enumerate(seconds):
            entry = self.rounds.entry(figures, layer, piece)
            entry["forward_s"] += float(row[0])
            entry["backward_s"] += float(row[1])

    # --- the two chains (the dense part on the master) -------------------------------
    def _chain_fields(self, sync_id: int, slices: list[Slice]) -> dict[str, Any]:
        """A forward or step chain's fields: its ``sync_id`` (newer than the update's
        reduction), the members and their samples, each layer's output positions."""
        return {"sync_id": sync_id, "members": [p.participant for p in slices if p.samples > 0],
                "member_samples": [p.samples for p in slices if p.samples > 0],
                "positions": [s.conv_height * s.conv_width for s in self.setup.shapes],
                "slice_statistics": self.setup.slice_statistics}

    def forward(self, step: int, update: PendingUpdate | None) -> np.ndarray:
        """Every layer's forward in one request per participant, the statistics
        exchanged among the peers (hetconv/participant/samples/chain.py); the output
        joined. The step state holds the batch and its slices."""
        state = self.state
        total = state.x.shape[0]
        chain = self._chain_fields(self.cluster.request_id(), state.slices)
        layers = self.setup.layers

        def make(piece: Slice) -> SampleForwardChain:
            x = None
            if piece.samples:
                x = state.x[piece.start:piece.stop]
                x = x if piece.participant == MASTER_PARTICIPANT \
                    else to_wire(x, self.setup.wire_for(piece.participant))
            return SampleForwardChain(
                request_id=self.cluster.request_id(), step=step, attempt=0,
                total_batch=total, stop_layer=layers,
                learning_rate=self.updates.learning_rate, x=x, **update_fields(update),
                **chain)

        replies = self.rounds.run(f"forward chain (step {step})", 0, "forward", make,
                                  state.slices, state.figures, make, peer_update=True)
        last = self.setup.shapes[-1]
        outputs = [checked_result(piece.participant, layers - 1, "y",
                                  replies[piece.participant].y,
                                  (piece.samples, last.kernels, last.pooled_height,
                                   last.pooled_width))
                   for piece in state.slices if piece.samples > 0]
        return np.concatenate(outputs, axis=0) if len(outputs) > 1 else outputs[0]

    def backward(self, step: int, learning_rate: float, dy: np.ndarray) -> None:
        """Every layer's backward in one request per participant
        (hetconv/participant/samples/chain.py); the update of every layer is left
        pending, to ride with the next forward chain."""
        state = self.state
        self.updates.learning_rate = learning_rate
        reduce_id = self.cluster.request_id()
        members = state.members()
        layers = self.setup.layers

        def make(piece: Slice) -> SampleBackwardChain:
            part = None
            if piece.samples:
                part = dy[piece.start:piece.stop]
                part = np.ascontiguousarray(part, np.float32) \
                    if piece.participant == MASTER_PARTICIPANT \
                    else to_wire(part, self.setup.wire_for(piece.participant))
            return SampleBackwardChain(
                request_id=self.cluster.request_id(), step=step, attempt=0,
                learning_rate=learning_rate, start_layer=layers - 1, dy=part,
                sync_id=reduce_id, members=members,
                slice_statistics=self.setup.slice_statistics)

        self.rounds.run(f"backward chain (step {step})", layers - 1, "backward", make,
                        state.slices, state.figures, make, peer_update=True)
        self.updates.pending = PendingUpdate(0, None, None, reduce_id, tuple(members), layers)
