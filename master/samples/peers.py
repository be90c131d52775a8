"""The master's side of the sample split's weight reduction among the peers.

With ``--data-plane peer`` (the default) the sample split's weight gradients are
reduced worker to worker (:mod:`hetconv.participant.samples.weight_reduce`), not through the master. Here
the master hands out the peers and the reduction plan (``AssignPeers``, after every
hand-out of the layers: the run's start, a restore, a re-plan), binds its own data
endpoint (it always takes part: it gathers every sum for its replica, and owns a
range when it computes), and keeps the :class:`GradientExchange` its helper thread
uses. A worker whose data port cannot be reached is a
:class:`~hetconv.master.data_ports.DataPortUnreachable` fault naming it, as under
the kernel split's peer plane.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

from hetconv.config import MASTER_PARTICIPANT
from hetconv.master.assign import exchange
from hetconv.master.cluster import Cluster, WorkerHandle, WorkerLost
from hetconv.master.data_ports import (
    await_data_endpoints,
    diagnosed,
    peers_seen_by,
    unreachable_fault,
)
from hetconv.participant.peer_sockets import (
    DATA_PORT_PROBE_TIMEOUT_S,
    PeerSockets,
    check_reachable,
    route_address,
)
from hetconv.participant.ports import PeerLost
from hetconv.participant.samples.reduction_plan import reduce_plan
from hetconv.participant.samples.weight_reduce import GradientExchange
from hetconv.protocol import AssignPeers


class SamplePeers:
    """The master's data endpoint and :class:`GradientExchange` for one run."""

    def __init__(self, cluster: Cluster, timeout_s: float):
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.sockets: PeerSockets | None = None
        self.exchange: GradientExchange | None = None
        # set by the main thread when a round failed: the helper's wait ends at once
        self.cancel = threading.Event()

    def assign(self, workers: dict[str, WorkerHandle], owners: Sequence[str],
               kernels: Sequence[int], sizes: Sequence[int] = ()) -> GradientExchange:
        """Hand ``workers`` (participant -> handle, in participant order) their peers
        and the plan in which ``owners`` (computing participants, the master among
        them when it computes) share every layer's kernels, with the bucket of the conv
        layers whose weight gradients have ``sizes`` elements; between steps only."""
        cluster = self.cluster
        live = {p: w for p, w in workers.items() if not w.gone}
        await_data_endpoints(cluster, list(live.values()))
        curve = cluster.curve
        if self.sockets is None:
            self.sockets = PeerSockets(
                cluster.ctx, "tcp://*:0", authenticate=False,
                curve=(curve.public_key, curve.secret_key) if curve else None)
        peers = {p: w.data_endpoint for p, w in live.items()}
        keys = {p: w.data_public_key for p, w in live.items()}
        toward = next(iter(peers.values()), cluster.endpoint)
        peers[MASTER_PARTICIPANT] = self.sockets.endpoint(route_address(toward))
        keys[MASTER_PARTICIPANT] = self.sockets.public_key
        everyone = [MASTER_PARTICIPANT] + list(live)
        plan = reduce_plan(kernels, [o for o in owners if o in everyone], everyone, sizes)
        try:
            check_reachable(MASTER_PARTICIPANT, peers,
                            min(DATA_PORT_PROBE_TIMEOUT_S, self.timeout_s))
        except PeerLost as lost:
            raise unreachable_fault(str(lost), lost.peers[0]) from None
        self.exchange = None
        try:
            exchange(cluster, [(worker, AssignPeers(
                request_id=cluster.request_id(), participant=participant, wire_dtype="float32",
                timeout_s=self.timeout_s, peers=peers_seen_by(participant, peers, self.sockets),
                peer_keys=dict(keys),
                plan=plan.to_wire())) for participant, worker in live.items()],
                "peer assignment")
        except WorkerLost as lost:
            raise diagnosed(lost) from None
        port = self.sockets.open(MASTER_PARTICIPANT, peers, keys, self.timeout_s, probe=False)
        self.exchange = GradientExchange(MASTER_PARTICIPANT, plan, port, self.timeout_s,
                                         cancelled=self.cancel.is_set,
                                         progress=cluster.own_progress)
        return self.exchange

    def close(self) -> None:
        """Close the master's data endpoint (the helper thread that used it is idle)."""
        if self.sockets is not None:
            self.sockets.close()
            self.sockets = None
        self.exchange = None
