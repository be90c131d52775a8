"""The peer data plane (``--data-plane peer``): activations worker to worker.

The participants exchange activations among themselves (:mod:`hetconv.participant.kernels.exchange`):
the master sends layer 0's input once, with the ``PeerForwardRequest`` of layer 0 to
the relay worker (which passes it on to the other workers of layer 0), gets the
last layer's output slices back in the ``PeerForwardReply`` of the last layer, and
sends the last layer's output-gradient slices with its ``PeerBackwardRequest``s;
every other request carries no array. Each layer phase is still one request per
worker with kernels in it, answered when that worker's part (waiting for its pieces,
computing, sending its pieces on) is done, so the master's liveness and request
deadlines cover every phase exactly as with the star plane. The master's own share
is a participant too (its :class:`~hetconv.participant.kernels.exchange.PeerParticipant` runs in the
helper thread over the master's own data endpoint).

The stage returns the real output only for the last layer, and ``None`` from
``backward``: the trainer chains them but only looks at the last output.

When the peers are handed out, every participant first checks that each peer's data
port answers, every worker of the run's, kernels or none
(:func:`hetconv.participant.peer_sockets.check_reachable`; the master before it sends anything,
when it holds kernels). A worker whose data port cannot be reached
(a firewall) is a :class:`~hetconv.master.data_ports.DataPortUnreachable` fault naming it, with the one line that
says who cannot reach whose port, a fault of that worker under the normal failover
policy (docs/run-control.md: evicted at its second fault in a row, told why in
``EndRun``, let back in after the rejoin back-off, and checked again then); one found
while the run is set up is raised by the first forward, so that the trainer's recovery
handles it. Workers that cannot reach the master's own data port stop the run with
that line (the master cannot be evicted).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hetconv.config import MASTER_PARTICIPANT
from hetconv.master.assign import exchange
from hetconv.master.cluster import WorkerHandle, WorkerLost
from hetconv.master.data_ports import (
    DataPortUnreachable,
    await_data_endpoints,
    diagnosed,
    peers_seen_by,
    unreachable_fault,
)
from hetconv.master.kernels.phases import OpenPhase, Phases
from hetconv.master.plan import Shard
from hetconv.master.results import checked_result
from hetconv.model import ConvLayerShape
from hetconv.participant.kernels.exchange import ExchangeStats, PeerParticipant
from hetconv.participant.peer_plan import PHASE_FORWARD, KernelRange, PeerPlan
from hetconv.participant.peer_sockets import (
    DATA_PORT_PROBE_TIMEOUT_S,
    PeerSockets,
    check_reachable,
    route_address,
)
from hetconv.participant.ports import PeerLost
from hetconv.participant.wire_cast import to_wire
from hetconv.protocol import (
    AssignPeers,
    PeerBackwardReply,
    PeerBackwardRequest,
    PeerForwardReply,
    PeerForwardRequest,
    limits,
)

log = logging.getLogger("hetconv.master")


NO_OUTPUT = np.empty((0,), dtype=np.float32)
"""What ``forward`` returns for every layer but the last (its output stays with the peers)."""


class PeerPlane:
    """A :class:`hetconv.master.kernels.planes.DataPlane` whose activations travel worker to worker."""

    def __init__(self, phases: Phases, plan: PeerPlan, sockets: PeerSockets | None,
                 peer_timeout_s: float = limits.DEFAULT_PEER_TIMEOUT_S):
        self.phases = phases
        self.plan = plan
        self.sockets = sockets
        self.peer_timeout_s = peer_timeout_s
        self.participant: PeerParticipant | None = None  # the master's own share, if any
        self._pass_id = 0
        self._told: set[str] = set()  # workers that were sent an AssignPeers this run
        self._open: list[tuple[int, OpenPhase]] = []  # this pass's phases awaiting replies
        self._batch = 0  # samples in this pass
        self.pending_fault: WorkerLost | None = None  # found while the run was set up

    def _shard_of(self, layer: int, participant: str) -> Shard | None:
        return next((s for s in self.phases.shards[layer]
                     if s.participant == participant and s.kernels > 0), None)

    def _account_peers(self, layer: int, replies: dict[str, Any],
                       local: ExchangeStats | None) -> None:
        """Peer-plane figures: each worker's own report, and the master's share's pieces
        counted on the master ↔ worker link of the layer where that worker consumed
        (bytes_sent) or produced (bytes_received) them."""
        for participant, reply in replies.items():
            message = reply.message
            shard = self._shard_of(layer, participant)
            if shard is None:
                continue
            entry = self.phases.entry(layer, shard)
            entry["peer_bytes_sent"] += message.peer_bytes_sent
            entry["peer_bytes_received"] += message.peer_bytes_received
            entry["peer_wait_s"] += message.peer_wait_s
        if local is None:
            return
        own = self._shard_of(layer, MASTER_PARTICIPANT)
        if own is not None:
            self.phases.entry(layer, own)["peer_wait_s"] += local.wait_s
        for (peer, piece_layer, phase), count in local.sent.items():
            consumer = piece_layer + 1 if phase == PHASE_FORWARD else piece_layer
            shard = self._shard_of(consumer, peer)
            if shard is not None:
                self.phases.entry(consumer, shard)["bytes_sent"] += count
        for (peer, piece_layer, phase), count in local.received.items():
            producer = piece_layer if phase == PHASE_FORWARD else piece_layer + 1
            shard = self._shard_of(producer, peer)
            if shard is not None:
                self.phases.entry(producer, shard)["bytes_received"] += count

    # --- the ConvStage interface ---------------------------------------------------------
    # The layer phases of a pass are pipelined: forward requests for every layer go out
    # without waiting for the previous layer's replies, so a worker starts computing
    # layer l+1 on the first samples its peers send while they still send the rest (the
    # overlap of hetconv.participant.kernels.exchange). The last layer's forward gathers every forward
    # reply of the pass; layer 0's backward gathers every backward reply.
    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        if train:
            self.phases.step = step
        if layer == 0 and self.pending_fault is not None:
            fault, self.pending_fault = self.pending_fault, None
            raise fault  # the trainer's recovery: a re-plan that checks again
        if layer == 0:
            self._pass_id += 1
            self._open = []
            self._batch = int(x.shape[0])
        pass_id = self._pass_id
        first = np.ascontiguousarray(x, dtype=np.float32) if layer == 0 else None
        wire_x = None if first is None else to_wire(first, self.phases.wire_dtype)
        relay = self.plan.input_relay()  # layer 0's input goes once, to the relay
        requests = [(s, PeerForwardRequest(request_id=self.phases.cluster.request_id(), pass_id=pass_id,
                                           step=step, layer=layer, attempt=0, train=train,
                                           x=wire_x if s.participant == relay else None))
                    for s in self.phases.shards[layer] if s.worker is not None and s.kernels > 0]
        participant = self.participant
        local: Callable[[], Any] | None = None
        if participant is not None and self.plan.holds(layer, MASTER_PARTICIPANT):
            def local() -> Any:
                return participant.forward(pass_id, step, layer, train, first)
        self._open.append((layer, self.phases.start(
            f"forward of layer {layer + 1} (step {step})", requests, local)))
        if layer != self.plan.last_layer:
            return NO_OUTPUT
        outputs = self._finish_pass("forward", train)
        joined = np.concatenate(outputs, axis=1) if len(outputs) > 1 else outputs[0]
        return np.asarray(joined, dtype=np.float32)

    def backward(self, layer: int, dy: np.ndarray, need_dx: bool, learning_rate: float,
                 step: int) -> np.ndarray | None:
        pass_id = self._pass_id
        last = layer == self.plan.last_layer
        if last:
            self._open = []
        requests = [(s, PeerBackwardRequest(
            request_id=self.phases.cluster.request_id(), pass_id=pass_id, step=step, layer=layer,
            attempt=0, learning_rate=learning_rate,
            dy=to_wire(dy[:, s.start:s.stop], self.phases.wire_dtype) if last
            else None)) for s in self.phases.shards[layer] if s.worker is not None and s.kernels > 0]
        participant = self.participant
        local: Callable[[], Any] | None = None
        own = self.plan.range_of(layer, MASTER_PARTICIPANT)
        if participant is not None and own is not None:
            own_dy = (np.ascontiguousarray(dy[:, own.start:own.stop], dtype=np.float32)
                      if last else None)

            def local() -> Any:
                return participant.backward(pass_id, step, layer, learning_rate, own_dy)
        self._open.append((layer, self.phases.start(
            f"backward of layer {layer + 1} (step {step})", requests, local)))
        if layer == 0:
            self._finish_pass("backward", True)
        return None

    def _finish_pass(self, phase_name: str, record: bool) -> list[np.ndarray]:
        """Gather every open phase of the pass, account each from the moment the one
        before it was done, and return the last phase's outputs in kernel order
        (forward only)."""
        opened, self._open = self._open, []
        self.phases.await_all([phase for _, phase in opened])
        previous_done = opened[0][1].started
        outputs: list[np.ndarray] = []
        for layer, phase in opened:
            job = phase.job
            local_done = job.finished_at if job is not None else phase.started
            local_stats: ExchangeStats | None = None
            results = []
            last_output: list[np.ndarray] = []
            for shard in (s for s in self.phases.shards[layer] if s.kernels > 0):
                if shard.worker is None:
                    assert job is not None
                    if phase_name == "forward":
                        y, local_stats = job.result
                        if y is not None:
                            last_output.append(y)
                    else:
                        local_stats = job.result
                    assert local_stats is not None
                    results.append((shard, local_stats.compute_s, local_done, 0, 0))
                else:
                    reply = phase.replies[shard.participant]
                    message = reply.message
                    if phase_name == "forward":
                        assert isinstance(message, PeerForwardReply)
                        if message.y is not None:
                            last_output.append(checked_result(
                    shard.participant, layer, "y", message.y,
                                self.phases.output_shape(layer, self._batch, shard.kernels)))
                    else:
                        assert isinstance(message, PeerBackwardReply)
                    results.append((shard, message.compute_s, reply.received_at,
                                    phase.sent[shard.participant], reply.payload_bytes))
            started = max(phase.started, previous_done)
            ended = max([started] + [arrival for _, _, arrival, _, _ in results])
            self.phases.account(layer, phase_name, started, local_done, results, record, ended=ended)
            if record:
                self._account_peers(layer, phase.replies, local_stats)
            previous_done = ended
            outputs = last_output
        return outputs

    # --- handing out the peers -----------------------------------------------------------
    def assign_peers(self) -> None:
        """Send ``AssignPeers`` (the peers and :attr:`plan`) to every worker holding
        kernels, and to every worker told before (so one that lost all its kernels
        drops the old plan); bind or reopen the master's own data endpoint when it
        holds kernels. Between steps only: the helper thread is idle.

        The peers are every worker of the run, kernels or none, so every participant's
        check covers the data ports of workers the plan leaves out as well: a blocked
        one is found when the run starts, not at the re-split or failover that first
        hands that worker kernels."""
        cluster, plan = self.phases.cluster, self.plan
        workers: dict[str, WorkerHandle] = {}
        everyone: dict[str, WorkerHandle] = {}
        for layer in self.phases.shards:
            for shard in layer:
                if shard.worker is None or shard.worker.gone:
                    continue
                everyone[shard.participant] = shard.worker
                if shard.kernels > 0:
                    workers[shard.participant] = shard.worker
        await_data_endpoints(cluster, list(everyone.values()))
        curve = cluster.curve
        peers = {p: w.data_endpoint for p, w in everyone.items()}
        keys = {p: w.data_public_key for p, w in everyone.items()}
        master_holds = any(plan.holds(layer, MASTER_PARTICIPANT)
                           for layer in range(len(self.phases.shards)))
        if master_holds:
            if self.sockets is None:
                self.sockets = PeerSockets(
                    cluster.ctx, "tcp://*:0", authenticate=False,
                    curve=(curve.public_key, curve.secret_key) if curve else None)
            toward = next(iter(peers.values()), cluster.endpoint)
            peers[MASTER_PARTICIPANT] = self.sockets.endpoint(route_address(toward))
            keys[MASTER_PARTICIPANT] = self.sockets.public_key
            try:  # before anything is sent
                check_reachable(MASTER_PARTICIPANT, peers,
                                min(DATA_PORT_PROBE_TIMEOUT_S, self.peer_timeout_s))
            except PeerLost as lost:
                raise unreachable_fault(str(lost), lost.peers[0]) from None
        told = {p: everyone[p] for p in sorted(set(workers) | self._told) if p in everyone}
        self.participant = None
        try:
            exchange(cluster, [(worker, AssignPeers(
                request_id=cluster.request_id(), participant=participant,
                wire_dtype=self.phases.wire_dtype.name, timeout_s=self.peer_timeout_s,
                peers=peers_seen_by(participant, peers, self.sockets if master_holds else None),
                peer_keys=dict(keys), plan=plan.to_wire()))
                for participant, worker in told.items()], "peer assignment")
        except WorkerLost as lost:
            raise diagnosed(lost) from None
        finally:
            self._told |= set(told)
        if master_holds:
            assert self.sockets is not None
            port = self.sockets.open(MASTER_PARTICIPANT, peers, keys, self.peer_timeout_s,
                                     probe=False)  # checked above
            self.participant = PeerParticipant(
                MASTER_PARTICIPANT, plan, self.phases.local_shards, port, self.phases.wire_dtype.name,
                self.peer_timeout_s, cancelled=self.phases.cancel_local.is_set,
                on_drop=lambda reason: log.debug("data plane: dropped %s", reason),
                progress=self.phases.cluster.own_progress)

    def after_resplit(self) -> None:
        """A new peer plan from the moved shards, handed to every worker."""
        self.plan = plan_of(self.phases.shards, self.phases.layer_shapes)
        self.assign_peers()

    def close(self) -> None:
        """Close the master's data endpoint (the helper thread that used it is idle)."""
        if self.sockets is not None:
            self.sockets.close()
            self.sockets = None



def plan_of(shards: list[list[Shard]], layer_shapes: Sequence[ConvLayerShape] = ()) -> PeerPlan:
    """The data plane's view of the shards: every layer's kernel ranges (and, with
    ``layer_shapes``, every layer's input H and W, so a misshapen piece is bad data)."""
    sizes = [(shape.height, shape.width) for shape in layer_shapes]
    return PeerPlan([[KernelRange(s.participant, s.start, s.stop) for s in layer]
                     for layer in shards], sizes if len(sizes) == len(shards) else ())


def open_peer_plane(phases: Phases, peer_timeout_s: float) -> PeerPlane:
    """Hand every participating worker its peers and plan, bind the master's own data
    endpoint when it holds kernels, and return the plane."""
    plane = PeerPlane(phases, plan_of(phases.shards, phases.layer_shapes), None, peer_timeout_s)
    try:
        plane.assign_peers()
    except DataPortUnreachable as fault:
        plane.pending_fault = fault  # the first forward raises it (a recovery)
    except BaseException:
        plane.close()
        raise
    return plane
