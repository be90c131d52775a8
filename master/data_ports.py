"""The workers' data ports, as the master sees them on either split (``--data-plane peer``).

Every worker announces a data endpoint after its Welcome; the master waits for them
(:func:`await_data_endpoints`), and a participant that cannot reach a worker's data port
is a fault of that worker (:class:`DataPortUnreachable`), or stops the run when it is the
master's own port (:func:`unreachable_fault`). Both the kernel split's peer plane
(:mod:`hetconv.master.kernels.peer_plane`) and the sample split's reduction
(:mod:`hetconv.master.samples.peers`) hand out peers through these.
"""
from __future__ import annotations

import logging
import time

from hetconv.config import MASTER_PARTICIPANT
from hetconv.errors import UserError
from hetconv.master.cluster import Cluster, WorkerHandle, WorkerLost
from hetconv.participant.peer_sockets import PeerSockets, is_unreachable_line, route_address
from hetconv.protocol import peer_error_message

log = logging.getLogger("hetconv.master")

ENDPOINT_WAIT_S = 5.0
"""How long the master waits for a worker's DataEndpoint after setup (it comes right
after the Welcome, so normally long before)."""

def peers_seen_by(worker: str, peers: dict[str, str], master_port: PeerSockets | None
                  ) -> dict[str, str]:
    """The peers (participant -> data endpoint) handed to ``worker``: ``peers`` with the
    master's data endpoint at the master's own address on the route to that worker.

    A master with more than one interface (two NICs; the lab's host, one veth per
    machine) reaches each worker from the address of the interface toward it, and its
    pieces come from there; a worker accepts a piece only from its sender's address
    without CURVE (:mod:`hetconv.participant.piece_sources`), so one address for all
    would make the master's pieces to the workers on its other interfaces be dropped."""
    seen = dict(peers)
    if master_port is not None and worker in peers:
        seen[MASTER_PARTICIPANT] = master_port.endpoint(route_address(peers[worker]))
    return seen


class DataPortUnreachable(WorkerLost):
    """A participant cannot reach worker ``participant``'s data port (one line saying
    who, whose port and why): a fault of that worker, alive or not (a dead worker's
    port refuses too), so the normal policy counts it and evicts at the second."""

    def __init__(self, line: str, participant: str):
        super().__init__(line, participant, gone=False, evict=False)


def unreachable_fault(line: str, culprit: str) -> WorkerLost | UserError:
    """The fault for ``line`` (:func:`hetconv.participant.peer_sockets.unreachable_line`) blaming
    ``culprit``: a :class:`DataPortUnreachable`, or a UserError that stops the run when
    the culprit is the master's own data port."""
    if culprit == MASTER_PARTICIPANT:
        return UserError(f"{line}; the master picks a free port every run: let the workers "
                         "reach this host's TCP ports, or train with --no-local or "
                         "--data-plane star")
    return DataPortUnreachable(line, culprit)


def diagnosed(lost: WorkerLost) -> WorkerLost | UserError:
    """``lost`` itself, or, when a worker's error reply says it cannot reach a peer's
    data port, :func:`unreachable_fault` of the line it sent."""
    culprit = lost.participant or ""
    line = str(lost).partition(peer_error_message(culprit, ""))[2]
    if not culprit or not is_unreachable_line(line):
        return lost
    log.error("%s", line)  # the worker's own line, said on the master too
    return unreachable_fault(line, culprit)

# --- setting the plane up ----------------------------------------------------------------
def await_data_endpoints(cluster: Cluster, workers: list[WorkerHandle]) -> None:
    """Every worker's announced data endpoint, and under CURVE an allowed data key
    (UserError naming the worker otherwise)."""
    _await_endpoints(cluster, workers)
    curve = cluster.curve
    for worker in workers:
        if curve is not None and \
                worker.data_public_key.encode() not in curve.allowed_client_keys:
            raise UserError(f"worker {worker.name} announced a data-plane key that is not "
                            "in --curve-allow; give it its allowed key (--curve-secret)")


def _await_endpoints(cluster: Cluster, workers: list[WorkerHandle]) -> None:
    deadline = time.monotonic() + ENDPOINT_WAIT_S
    while True:
        missing = [w for w in workers if not w.data_endpoint]
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise UserError(f"worker {missing[0].name} announced no data endpoint within "
                            f"{ENDPOINT_WAIT_S:.0f} s; it needs a hetconv with the peer data "
                            "plane (or use --data-plane star)")
        cluster.pump(0.1)
