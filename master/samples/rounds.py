"""A sample-split round trip, the master's side: every worker's request sent and the
master's own share queued (:meth:`RoundTrips._send_round`), then the replies gathered
and recorded (:meth:`RoundTrips._collect_round`). Apart, so that a step chain can be
sent before the one before it is gathered (two steps in flight, master/samples/chains.py).
Mixed into :class:`~hetconv.master.samples.stage.SampleConvStage`, which holds the state.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hetconv.config import MASTER_PARTICIPANT
from hetconv.engine.shard import ConvShard
from hetconv.master.cluster import Cluster, WorkerHandle, WorkerLost
from hetconv.master.own_share import OwnJob, OwnShare
from hetconv.master.plan import Participant
from hetconv.master.run import RunControl
from hetconv.master.samples.between import SampleSetup, StepFigures
from hetconv.master.samples.chains import InFlightStep, SentRound
from hetconv.master.samples.plan import Slice
from hetconv.master.timing import timing_entry
from hetconv.participant.dataplane import PeerLost
from hetconv.participant.samples.runner import SampleRunner
from hetconv.protocol import SampleForwardRequest


class RoundTrips(StepFigures):
    """Send a round, collect it; the step's timing entries it fills."""

    cluster: Cluster
    workers: dict[str, Participant]
    local: dict[int, ConvShard]
    control: RunControl
    setup: SampleSetup
    peers: Any
    runner: SampleRunner
    own_share: OwnShare
    slices: list[Slice]
    _collected_at: float
    _ahead: InFlightStep | None

    # --- one round ---------------------------------------------------------------------
    def _round(self, what: str, layer: int, phase: str, make: Callable[[Slice], Any],
               record: bool, idle: Callable[[Slice], Any] | None = None,
               peer_update: bool = False) -> dict[str, Any]:
        """Send ``make(slice)`` to every worker with samples (and ``idle(slice)``, when
        not None, to those without), serve the master's own slice meanwhile (or, with
        ``peer_update``, its part of the weight reduction even without samples), gather;
        the replies of the slices with samples by participant, in slice order."""
        return self._collect_round(self._send_round(what, layer, phase, make, idle,
                                                    peer_update, self.slices), record)

    def _send_round(self, what: str, layer: int, phase: str, make: Callable[[Slice], Any],
                    idle: Callable[[Slice], Any] | None, peer_update: bool,
                    slices: list[Slice]) -> SentRound:
        """The first half of a round: every worker's request sent and the master's own
        share queued (behind any job still queued: a step sent ahead runs after the one
        before it)."""
        started = time.monotonic()
        pending: dict[int, WorkerHandle] = {}
        names: dict[int, str] = {}
        sent: dict[str, int] = {}
        for piece in slices:
            if piece.participant == MASTER_PARTICIPANT:
                continue
            message = make(piece) if piece.samples else (idle(piece) if idle else None)
            if message is None:
                continue
            worker = self.workers[piece.participant].worker
            assert worker is not None
            sent[piece.participant] = self.cluster.send(worker, message)
            pending[message.request_id] = worker
            names[message.request_id] = piece.participant
        own = next((s for s in slices if s.participant == MASTER_PARTICIPANT),
                   Slice(MASTER_PARTICIPANT, 0, 0))
        job = None
        own_message = make(own) if own.samples > 0 else (
            idle(own) if idle is not None and peer_update else None)
        if own_message is not None:
            message = own_message
            serve = (self.runner.forward if isinstance(message, SampleForwardRequest)
                     else self.runner.backward)
            job = self.own_share.submit(lambda: serve(message, self.local))
        return SentRound(what, layer, phase, started, pending, names, sent, own, job,
                         list(slices))

    def _collect_round(self, sent: SentRound, record: bool) -> dict[str, Any]:
        """The second half: gather the workers' replies and the master's own share.
        The round's clock starts when it was sent or when the round before it was
        collected, whichever is later (a round sent ahead waits in the queues first)."""
        started = max(sent.started, self._collected_at)
        what, layer, phase, own, job = sent.what, sent.layer, sent.phase, sent.own, sent.job
        local_reply, local_done = None, started
        failed = True
        try:
            gathered = self.cluster.gather(sent.pending, what,
                                           done=(lambda: job is None or job.done.is_set()),
                                           timeout_s=self.control.request_deadline_s())
            failed = False
        finally:
            behind = [queued for queued in self._queued_jobs(sent) if failed]
            for queued in behind:
                queued.cancelled.set()  # a step sent ahead: it never starts
            if failed and self.peers is not None and (job is not None or behind):
                self.peers.cancel.set()  # its wait for a lost peer ends at once
            for waited in ([job] if job is not None else []) + behind:
                waited.done.wait()  # never leave the helper thread on the replicas
            if self.peers is not None:
                self.peers.cancel.clear()
            self._collected_at = time.monotonic()
        if job is not None:
            try:
                local_reply, local_done = self.own_share.wait(job), job.finished_at
            except PeerLost as lost:  # the master's share waited for a peer in vain
                culprit = lost.peers[0] if lost.peers else None
                raise WorkerLost(f"the master's share of {what}: {lost}", culprit,
                                 evict=lost.bad_data) from None
            if own.samples == 0:
                local_reply = None
        replies: dict[str, Any] = {}
        slowest = 0.0
        reply: Any
        for piece in sent.slices:
            if piece.samples == 0:
                continue
            if piece.participant == MASTER_PARTICIPANT:
                reply, arrival, received = local_reply, local_done, 0
            else:
                rid = next(r for r, n in sent.names.items() if n == piece.participant)
                got = gathered[rid]
                reply, arrival, received = got.message, got.received_at, got.payload_bytes
            replies[piece.participant] = reply
            slowest = max(slowest, reply.compute_s)
            if record:
                entry = self._entry(layer, piece)
                entry[f"{phase}_s"] += reply.compute_s
                entry[f"{phase}_latency_s"] += max(0.0, arrival - started)
                if piece.participant != MASTER_PARTICIPANT:
                    entry["wait_s"] += max(0.0, arrival - local_done)
                entry["bytes_sent"] += sent.sent.get(piece.participant, 0)
                entry["bytes_received"] += received
                if self.peers is not None:
                    entry["peer_bytes_sent"] += reply.peer_bytes_sent
                    entry["peer_bytes_received"] += reply.peer_bytes_received
                    entry["peer_wait_s"] += reply.peer_wait_s
                # its compute, and what the barrier waits for: its whole round (compute,
                # its share of the wire and its message handling, throttling included)
                self._step_compute[piece.participant] = \
                    self._step_compute.get(piece.participant, 0.0) + reply.compute_s
                self._step_latency[piece.participant] = \
                    self._step_latency.get(piece.participant, 0.0) + max(0.0, arrival - started)
                self._step_waits[piece.participant] = \
                    self._step_waits.get(piece.participant, 0.0) + reply.peer_wait_s
        if record:
            self._comm_s += max(0.0, time.monotonic() - started - slowest)
            self._step_wall += time.monotonic() - started
            self._step_rounds += 1
        return replies

    def _queued_jobs(self, sent: SentRound) -> list[OwnJob]:
        """The master's own jobs queued behind ``sent``'s (a step sent ahead)."""
        ahead = self._ahead
        if ahead is None or ahead.round is sent or ahead.round.job is None:
            return []
        return [ahead.round.job]

    def _entry(self, layer: int, piece: Slice) -> dict[str, Any]:
        devices = self._timings.setdefault(layer, {})
        if piece.participant not in devices:
            devices[piece.participant] = timing_entry(
                piece.participant, self.setup.shapes[layer].kernels, piece.samples,
                self.peers is not None)
        return devices[piece.participant]
