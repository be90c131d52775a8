"""A sample-split round trip, the master's side: every worker's request sent and the
master's own share queued (:meth:`Rounds.send`), then the replies gathered and recorded
(:meth:`Rounds.collect`). Apart, so that a step chain can be sent before the one before
it is gathered (two steps in flight, master/samples/chains.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hetconv.config import MASTER_PARTICIPANT
from hetconv.master.cluster import Cluster, WorkerHandle, WorkerLost
from hetconv.master.own_share import OwnJob, OwnShare
from hetconv.master.run import RunControl
from hetconv.master.samples.figures import StepFigures
from hetconv.master.samples.members import SampleMembers
from hetconv.master.samples.peers import SamplePeers
from hetconv.master.samples.plan import Slice
from hetconv.master.samples.replicas import MasterReplicas
from hetconv.master.samples.settings import SampleSetup
from hetconv.participant.ports import PeerLost

MakeRequest = Callable[[Slice], Any]


@dataclass
class SentRound:
    """A round sent and not yet collected: every worker's request out, the master's
    own share queued (``job``; None when it has nothing to do)."""

    what: str
    layer: int
    phase: str
    started: float  # when it was sent (monotonic s)
    pending: dict[int, WorkerHandle]  # request id -> worker
    names: dict[int, str]  # request id -> participant
    sent: dict[str, int]  # participant -> payload bytes sent
    own: Slice  # the master's slice
    job: OwnJob | None
    slices: list[Slice]  # the slices it was sent for


class Rounds:
    """Sends rounds and collects them; the master's own share runs in its helper thread
    (``own_share``) meanwhile, over its replicas."""

    def __init__(self, cluster: Cluster, control: RunControl, members: SampleMembers,
                 replicas: MasterReplicas, setup: SampleSetup, peers: SamplePeers | None):
        self.cluster = cluster
        self.control = control
        self.members = members
        self.replicas = replicas
        self.setup = setup
        self.peers = peers
        self.own_share = OwnShare(cluster)
        self.collected_at = 0.0  # when the last round was collected (monotonic s)

    def run(self, what: str, layer: int, phase: str, make: MakeRequest,
            slices: list[Slice], figures: StepFigures | None,
            idle: MakeRequest | None = None, peer_update: bool = False) -> dict[str, Any]:
        """Send ``make(slice)`` to every worker with samples (and ``idle(slice)``, when
        not None, to those without), serve the master's own slice meanwhile (or, with
        ``peer_update``, its part of the weight reduction even without samples), gather;
        the replies of the slices with samples by participant, in slice order. With
        ``figures``, the round is recorded in them."""
        return self.collect(self.send(what, layer, phase, make, idle, peer_update, slices),
                            figures)

    def send(self, what: str, layer: int, phase: str, make: MakeRequest,
             idle: MakeRequest | None, peer_update: bool, slices: list[Slice]) -> SentRound:
        """The first half of a round: every worker's request sent and the master's own
        share queued (behind any job still queued: a step sent ahead runs after the one
        before it)."""
        started = time.monotonic()
        pending: dict[int, WorkerHandle] = {}
        names: dict[int, str] = {}
        sent: dict[str, int] = {}
        try:
            for piece in slices:
                if piece.participant == MASTER_PARTICIPANT:
                    continue
                message = make(piece) if piece.samples else (idle(piece) if idle else None)
                if message is None:
                    continue
                worker = self.members.workers[piece.participant].worker
                assert worker is not None
                sent[piece.participant] = self.cluster.send(worker, message)
                pending[message.request_id] = worker
                names[message.request_id] = piece.participant
        except BaseException:
            # a later send failed: the requests already out are forgotten, so that their
            # late answers (a peer_lost error among them) are dropped, not taken as faults
            self.cluster.membership.abandon(pending)
            raise
        own = next((s for s in slices if s.participant == MASTER_PARTICIPANT),
                   Slice(MASTER_PARTICIPANT, 0, 0))
        job = None
        own_message = make(own) if own.samples > 0 else (
            idle(own) if idle is not None and peer_update else None)
        if own_message is not None:
            message = own_message
            runner, replicas = self.replicas.runner, self.replicas
            job = self.own_share.submit(lambda: runner.serve(message, replicas.local))
        return SentRound(what, layer, phase, started, pending, names, sent, own, job,
                         list(slices))

    def collect(self, sent: SentRound, figures: StepFigures | None,
                behind: Sequence[OwnJob] = ()) -> dict[str, Any]:
        """The second half: gather the workers' replies and the master's own share.
        The round's clock starts when it was sent or when the round before it was
        collected, whichever is later (a round sent ahead waits in the queues first).
        ``behind``: the master's jobs queued behind this round's (a step sent ahead),
        cancelled when the round fails."""
        started = max(sent.started, self.collected_at)
        what, layer, phase, own, job = sent.what, sent.layer, sent.phase, sent.own, sent.job
        local_reply, local_done = None, started
        failed = True
        try:
            gathered = self.cluster.gather(sent.pending, what,
                                           done=(lambda: job is None or job.done.is_set()),
                                           timeout_s=self.control.request_deadline_s())
            failed = False
        finally:
            cancelled = list(behind) if failed else []
            for queued in cancelled:
                queued.cancelled.set()  # a step sent ahead: it never starts
            if failed and self.peers is not None and (job is not None or cancelled):
                self.peers.cancel.set()  # its wait for a lost peer ends at once
            for waited in ([job] if job is not None else []) + cancelled:
                waited.done.wait()  # never leave the helper thread on the replicas
            if self.peers is not None:
                self.peers.cancel.clear()
            self.collected_at = time.monotonic()
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
            if figures is not None:
                entry = self.entry(figures, layer, piece)
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
                figures.add_reply(piece.participant, reply.compute_s,
                                  max(0.0, arrival - started), reply.peer_wait_s)
        if figures is not None:
            figures.add_round(time.monotonic() - started, slowest)
        return replies

    def entry(self, figures: StepFigures, layer: int, piece: Slice) -> dict[str, Any]:
        """``piece``'s timing entry of ``layer`` in ``figures``."""
        return figures.entry(layer, piece.participant, self.setup.shapes[layer].kernels,
                             piece.samples, self.peers is not None)

    def close(self) -> None:
        self.own_share.close()
