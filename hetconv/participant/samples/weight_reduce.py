"""The sample split's weight-gradient reduction among the peers (``--data-plane peer``).

Under the sample split every participant ends a layer's backward with the weight
gradient of its own samples, dW_i (K, C, k, k) float32, and every replica must apply
the sum over the batch. Through the master (``--data-plane star``) that costs its
link (N-1)·W each way. Here the participants reduce it among themselves, as a
reduce-scatter then an all-gather over their data endpoints
(:mod:`hetconv.participant.peer_sockets`):

1. *scatter*: each participant with samples (a *contributor*) sends kernels
   [start_j, stop_j) of its dW_i to the *owner* j of that range (phase ``reduce``);
2. *reduce*: owner j adds the pieces of its range in contributor order (its own
   piece in its place), so the sum has the same bits as the master's ``add_in_order``
   of the whole arrays, and sends it to every other participant (phase ``gather``);
3. *gather*: each participant joins the owners' sums into ΣdW in kernel order.

Every link carries about 2·(P-1)/P·W each way instead of the master's 2·(N-1)·W.

Small layers go *directly* (phase ``whole``): when a layer's whole gradient is under
:data:`hetconv.participant.samples.reduction_plan.DIRECT_BYTES` (the first conv layer of every network we
measure: 3.2 KB for 32:64), each contributor sends its whole dW_i to every other participant at the
scatter, and every participant adds the contributors' arrays in contributor order
itself (:func:`add_chunks`, the same bits as an owner's sum of its range). That is one
hop instead of two for bytes that cost nothing on the link: the reduction of the last
layer of the backward (layer 0, the one the next step's first update waits for) no
longer needs the owners to have started the next step before anyone can gather it; its
pieces are in before the next step begins. (P-1)·W per participant instead of
2·(P-1)/P·W: a few KB more.

The first layers go *together*: the plan's bucket
(:func:`hetconv.participant.samples.reduction_plan.bucket_sizes`, the longest run of layers from layer 0
whose float32 weight gradients add up to at most ``BUCKET_BYTES``: layers 1-3 of the
VGG-style network, 114 KB) is reduced directly as *one* vector. A contributor keeps those layers' dW_i as the backward
computes them and, with layer 0's (the last), sends their concatenation in layer order
as one ``whole`` piece of layer 0 to every other participant; the first gather of a
bucket layer adds the contributors' vectors in contributor order and splits the sum
back into the layers (elementwise, so every layer's sum has the bits of its own
``add_chunks``). That is one piece per peer a step where each of those layers sent its
own (two for a layer reduced in two hops, each way): every piece costs the computing
thread about 100 us of CPU with cold caches, and ZeroMQ's threads more
(docs/sample-split.md). The bytes are (P-1)·W of the bucket instead of 2·(P-1)/P·W
for its two-hop layers: the same at two participants, 1.5 times at four.

Owners are the participants that compute (the master too when it does); a
participant without a range (the master under ``--no-local``) only gathers. The
ranges are :func:`hetconv.participant.samples.reduction_plan.reduce_ranges` (even split in participant order); they travel in
``AssignPeers.plan`` as a :class:`~hetconv.participant.peer_plan.PeerPlan`.

The same exchange carries the chain's batch-norm statistics (hetconv/participant/samples/chain.py):
:meth:`GradientExchange.share` sends a participant's (2, K) moments or sums of a layer
to every other participant of the plan, :meth:`~GradientExchange.collect` waits for
every member's (phases ``moments`` and ``sums``, keyed by the chain's ``sync_id``).

Bulk pieces wait their turn. A participant's link has one queue: a reduction piece
sent just before a batch-norm barrier's (2, K) message delays it by the piece's whole
transfer (2.4 MB of the VGG-style network's dense gradient: 19 ms at 1 Gbit), and
every peer waits at that barrier. So reduction pieces of at least :data:`BULK_BYTES`
are queued (:meth:`GradientExchange._send`) and go out right *after* this
participant's next barrier message (:meth:`~GradientExchange.share`), where they
drain while it waits and computes; a wait for reduction pieces first sends what a peer
may be waiting for (every ``reduce`` piece; before a ``gather`` wait also the
``gather`` pieces of layers up to the one awaited), and :meth:`~GradientExchange.flush` (at the end of every request, via
the runner's figures) sends the rest. Every queued piece goes out before its sender
waits for anything a peer could only send after receiving it, so nothing deadlocks;
the values and the order of the sums are unchanged.

Pieces are :class:`~hetconv.protocol.PeerPiece` messages keyed by the master's
``reduce_id`` (unique in a run), the layer, the phase and the sender;
``batch_start``/``batch_stop``/``batch_size`` are 0/1/1. :class:`GradientExchange`
checks every piece (sender, phase, kernel range, shape, finite values) and waits with
a deadline that every arrival restarts; a peer that does not deliver is a
:class:`~hetconv.participant.ports.PeerLost` naming it, one that sends NaN or a wrong shape
one with ``bad_data``.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from hetconv.participant.peer_plan import KernelRange, PeerPlan
from hetconv.participant.ports import PeerLost, PiecePort, wait_for_pieces
from hetconv.participant.progress import ComputeProgress
from hetconv.participant.samples.barrier_trace import TRACE
from hetconv.participant.samples.reduction_plan import reduced_directly
from hetconv.protocol import PeerPiece

PHASE_REDUCE = "reduce"
PHASE_GATHER = "gather"
PHASE_WHOLE = "whole"
"""A small layer's whole dW_i, from a contributor to every other participant (the
module doc: reduced directly)."""
PHASE_MOMENTS = "moments"
PHASE_SUMS = "sums"
SYNC_PHASES = (PHASE_MOMENTS, PHASE_SUMS)
"""The chain's batch-norm exchanges: every member's (2, K) float32 to every participant
(moments: the sum and M2 of its slice's conv output; sums: its dgamma_i, dbeta_i)."""
REDUCE_PHASES = (PHASE_REDUCE, PHASE_GATHER, PHASE_WHOLE) + SYNC_PHASES
BULK_BYTES = 16 * 1024
"""Reduction pieces of at least this many bytes wait for this participant's next barrier
message (the module doc); a barrier's own (2, K) pieces are far smaller."""
MAX_HELD_REDUCTIONS = 4
"""Reductions (``reduce_id``s) whose pieces a participant holds at once: the one it works
on, the previous step's gather, the next step's (a fast peer's) and one spare. A piece
of a farther one is dropped, or the farthest held makes room for a nearer one: forged
far-ahead pieces are purged, never kept."""
MAX_HELD_PIECES = 512
"""At most this many pieces wait in a participant's inbox (a run needs at most a few
layers' worth per peer): beyond it, pieces are dropped as a stranger's would be."""


def add_chunks(pieces: dict[str, np.ndarray], order: Sequence[str]) -> np.ndarray:
    """The float32 sum of ``pieces`` added left to right in ``order`` (the same bits as
    ``hetconv.participant.samples.replica.add_in_order`` over the whole arrays)."""
    total = np.array(pieces[order[0]], dtype=np.float32, copy=True)
    for participant in order[1:]:
        total += pieces[participant]
    return total


class GradientExchange:
    """One participant's side of the reduction (see the module doc) over a port.

    ``plan``: the owners' kernel ranges per layer (every participant of the run is in
    it, possibly with an empty range). Used by one thread: the worker's compute
    thread, or the master's helper thread. Counters (bytes, seconds waited) accumulate
    until :meth:`take_stats`.
    """

    def __init__(self, participant: str, plan: PeerPlan, port: PiecePort, timeout_s: float,
                 cancelled: Callable[[], bool] = lambda: False,
                 progress: ComputeProgress | None = None):
        self.participant = participant
        self.progress = progress  # hears whom a wait is for (the heartbeats say it)
        self.plan = plan
        self.port = port
        self.timeout_s = timeout_s
        self.cancelled = cancelled
        self._own: dict[tuple[int, int], np.ndarray] = {}  # (reduce id, layer) -> own dW
        self._direct: dict[tuple[int, int], list[str]] = {}  # (reduce id, layer) -> contributors
        self._bucket_sums: dict[tuple[int, int], np.ndarray] = {}  # (reduce id, layer) -> ΣdW
        self._inbox: dict[tuple[int, int, str, str], np.ndarray] = {}
        self._floor = 0  # pieces of older reduce ids are stale
        self._bulk: list[tuple[str, PeerPiece]] = []  # (target, piece) not sent yet
        self.bytes_sent = 0
        self.bytes_received = 0
        self.wait_s = 0.0
        self.dropped: list[str] = []  # reasons, for the log

    # --- what the plan says ----------------------------------------------------------
    def _ranges(self, layer: int) -> list[KernelRange]:
        if not 0 <= layer < len(self.plan.layers):
            raise PeerLost([], f"layer {layer + 1} is not in the reduction plan")
        return self.plan.layers[layer]

    def own_range(self, layer: int) -> KernelRange | None:
        return next((r for r in self._ranges(layer) if r.participant == self.participant),
                    None)

    def take_stats(self) -> tuple[int, int, float]:
        """(bytes sent, bytes received, seconds waited) since the last call."""
        stats = (self.bytes_sent, self.bytes_received, self.wait_s)
        self.bytes_sent = self.bytes_received = 0
        self.wait_s = 0.0
        return stats

    # --- 1: scatter --------------------------------------------------------------------
    def scatter(self, reduce_id: int, step: int, layer: int, dweight: np.ndarray) -> None:
        """Keep this participant's dW of ``layer`` and send each owner its range."""
        dweight = np.ascontiguousarray(dweight, dtype=np.float32)
        self._own[(reduce_id, layer)] = dweight
        if self.plan.in_bucket(layer):
            self._scatter_bucket(reduce_id, step, layer, dweight)
            return
        if reduced_directly(dweight.shape):  # the whole of it to everyone else
            whole = KernelRange(self.participant, 0, self._kernels(layer))
            for target in self._ranges(layer):
                if target.participant != self.participant:
                    self._send(target.participant, reduce_id, step, layer, PHASE_WHOLE, whole,
                               dweight)
            return
        for target in self._ranges(layer):
            if target.participant == self.participant or target.kernels == 0:
                continue
            self._send(target.participant, reduce_id, step, layer, PHASE_REDUCE, target,
                       dweight[target.start:target.stop])

    def _scatter_bucket(self, reduce_id: int, step: int, layer: int,
                        dweight: np.ndarray) -> None:
        """Keep a bucket layer's dW; with layer 0's (the backward's last), send the
        bucket's vector to every other participant."""
        if dweight.size != self.plan.bucket[layer]:
            raise PeerLost([], f"layer {layer + 1}'s weight gradient has {dweight.size} "
                               f"elements, the plan's bucket {self.plan.bucket[layer]}")
        if layer > 0:
            return
        parts = [self._own.pop((reduce_id, index), None)
                 for index in range(len(self.plan.bucket))]
        missing = [index + 1 for index, part in enumerate(parts) if part is None]
        if missing:
            raise PeerLost([], f"no weight gradient of layer(s) {missing} kept for "
                               f"reduction {reduce_id}'s bucket")
        vector = np.concatenate([part.reshape(-1) for part in parts if part is not None])
        self._own[(reduce_id, 0)] = vector
        whole = KernelRange(self.participant, 0, self._kernels(0))
        for target in self._ranges(0):
            if target.participant != self.participant:
                self._send(target.participant, reduce_id, step, 0, PHASE_WHOLE, whole, vector)

    # --- 2 and 3: reduce, share, gather ----------------------------------------------
    def reduce(self, reduce_id: int, step: int, layer: int, contributors: Sequence[str],
               shape: tuple[int, ...]) -> np.ndarray | None:
        """Sum this participant's range over ``contributors`` (in their order) and send
        the sum to every other participant; the sum, or None without a range."""
        self._forget_before(reduce_id)
        if self.plan.in_bucket(layer) or reduced_directly(shape):  # added in gather
            self._direct[(reduce_id, layer)] = list(contributors)
            return None
        mine = self.own_range(layer)
        if mine is None or mine.kernels == 0:
            self._own.pop((reduce_id, layer), None)
            return None
        wanted = [c for c in contributors if c != self.participant]
        pieces = self._wait(reduce_id, layer, PHASE_REDUCE,
                            {c: (mine.kernels,) + tuple(shape[1:]) for c in wanted})
        own = self._own.pop((reduce_id, layer), None)
        if self.participant in contributors:
            if own is None:
                raise PeerLost([], f"no weight gradient of layer {layer + 1} kept for "
                                   f"reduction {reduce_id}")
            pieces[self.participant] = own[mine.start:mine.stop]
        total = add_chunks(pieces, list(contributors))
        for target in self._ranges(layer):
            if target.participant != self.participant:
                self._send(target.participant, reduce_id, step, layer, PHASE_GATHER, mine,
                           total)
        return total

    def gather(self, reduce_id: int, layer: int, own_sum: np.ndarray | None,
               shape: tuple[int, ...]) -> np.ndarray:
        """ΣdW (``shape``) from every owner's sum (this participant's ``own_sum``), or,
        for a layer reduced directly, from every contributor's whole dW_i."""
        if self.plan.in_bucket(layer):
            return self._gather_bucket(reduce_id, layer, shape)
        if reduced_directly(shape):
            return self._gather_whole(reduce_id, layer, shape)
        owners = [r for r in self._ranges(layer) if r.kernels > 0]
        if owners and owners[-1].stop != shape[0]:
            raise PeerLost([], f"the reduction plan covers {owners[-1].stop} kernels of "
                               f"layer {layer + 1}, the layer has {shape[0]}")
        pieces = self._wait(reduce_id, layer, PHASE_GATHER, {
            r.participant: (r.kernels,) + tuple(shape[1:]) for r in owners
            if r.participant != self.participant})
        total = np.empty(shape, np.float32)
        for owner in owners:
            part = own_sum if owner.participant == self.participant else \
                pieces[owner.participant]
            if part is None:
                raise PeerLost([], f"no sum of layer {layer + 1} for this participant's range")
            total[owner.start:owner.stop] = part
        return total

    def _gather_bucket(self, reduce_id: int, layer: int, shape: tuple[int, ...]
                       ) -> np.ndarray:
        """ΣdW of a bucket layer: on the first gather of the bucket, every contributor's
        vector added in contributor order and split into the layers."""
        size = int(np.prod(shape, dtype=np.int64))
        if size != self.plan.bucket[layer]:
            raise PeerLost([], f"layer {layer + 1}'s weight gradient has {size} elements, "
                               f"the plan's bucket {self.plan.bucket[layer]}")
        if (reduce_id, layer) not in self._bucket_sums:
            total = self._gather_whole(reduce_id, layer, (sum(self.plan.bucket),), key=0)
            position = 0
            for index, elements in enumerate(self.plan.bucket):
                self._bucket_sums[(reduce_id, index)] = total[position:position + elements]
                position += elements
            for index in range(len(self.plan.bucket)):
                self._direct.pop((reduce_id, index), None)
        return self._bucket_sums.pop((reduce_id, layer)).reshape(shape)

    def _gather_whole(self, reduce_id: int, layer: int, shape: tuple[int, ...],
                      key: int | None = None) -> np.ndarray:
        """ΣdW of a layer reduced directly: every contributor's whole dW_i (this
        participant's own kept at the scatter) added in contributor order. The pieces and
        the own array are those of layer ``key`` (default ``layer``; the bucket's: 0)."""
        contributors = self._direct.pop((reduce_id, layer), None)
        if contributors is None:
            raise PeerLost([], f"a gather of layer {layer + 1} before its reduction "
                               f"{reduce_id} began")
        key = layer if key is None else key
        pieces = self._wait(reduce_id, key, PHASE_WHOLE, {
            c: tuple(shape) for c in contributors if c != self.participant})
        own = self._own.pop((reduce_id, key), None)
        if self.participant in contributors:
            if own is None or tuple(own.shape) != tuple(shape):
                raise PeerLost([], f"no weight gradient of layer {layer + 1} kept for "
                                   f"reduction {reduce_id}")
            pieces[self.participant] = own
        return add_chunks(pieces, contributors)

    # --- the chain's batch-norm exchanges ---------------------------------------------
    def _kernels(self, layer: int) -> int:
        return max((r.stop for r in self._ranges(layer)), default=0)

    def share(self, sync_id: int, step: int, layer: int, phase: str, data: np.ndarray) -> None:
        """Send this participant's (2, K) ``data`` of ``layer`` (phase ``moments`` or
        ``sums``) to every other participant of the plan."""
        TRACE.share(self.participant, sync_id, step, layer, phase)
        kernels = self._kernels(layer)
        whole = KernelRange(self.participant, 0, kernels)
        for target in self._ranges(layer):
            if target.participant != self.participant:
                self._send(target.participant, sync_id, step, layer, phase, whole, data)
        self.release()  # the queued bulk after the barrier's message, not before it

    def collect(self, sync_id: int, layer: int, phase: str, members: Sequence[str]
                ) -> dict[str, np.ndarray]:
        """Every other member's (2, K) piece of ``layer`` in exchange ``sync_id``."""
        shape = (2, self._kernels(layer))
        senders: dict[str, tuple[int, ...]] = {m: shape for m in members
                                               if m != self.participant}
        if not TRACE.enabled:  # the usual case: no clock reads on the barrier's path
            return self._wait(sync_id, layer, phase, senders)
        started = time.time()
        try:
            return self._wait(sync_id, layer, phase, senders)
        finally:
            TRACE.wait(self.participant, sync_id, layer, phase, started, time.time())

    def ready_to_gather(self, reduce_id: int, layer: int) -> bool:
        """Whether :meth:`gather` of ``layer`` would find every piece it needs in (as
        of the last receive; it does not wait)."""
        if self.plan.in_bucket(layer):
            if (reduce_id, layer) in self._bucket_sums:
                return True
            layer, phase = 0, PHASE_WHOLE
            senders = self._direct.get((reduce_id, layer))
        elif (reduce_id, layer) in self._direct:
            phase, senders = PHASE_WHOLE, self._direct[(reduce_id, layer)]
        else:
            phase = PHASE_GATHER
            senders = [r.participant for r in self._ranges(layer) if r.kernels > 0]
        if senders is None:
            return False
        return all((reduce_id, layer, phase, s) in self._inbox for s in senders
                   if s != self.participant)

    def arrived(self, sync_id: int, layer: int, phase: str, members: Sequence[str]) -> bool:
        """Whether every other member's ``phase`` piece of ``layer`` in exchange
        ``sync_id`` is in, after keeping what the port holds now (it does not wait)."""
        for _ in range(MAX_HELD_PIECES):
            piece = self.port.receive(0.0)
            if piece is None:
                break
            self._keep(piece)
        return all((sync_id, layer, phase, m) in self._inbox for m in members
                   if m != self.participant)

    # --- moving and keeping pieces ---------------------------------------------------
    def _send(self, target: str, reduce_id: int, step: int, layer: int, phase: str,
              kernels: KernelRange, data: np.ndarray) -> None:
        piece = PeerPiece(pass_id=reduce_id, step=step, layer=layer, phase=phase, attempt=0,
                          sender=self.participant, kernel_start=kernels.start,
                          kernel_stop=kernels.stop, batch_start=0, batch_stop=1, batch_size=1,
                          data=np.ascontiguousarray(data, dtype=np.float32))
        if phase in (PHASE_REDUCE, PHASE_GATHER) and piece.data.nbytes >= BULK_BYTES:
            self._bulk.append((target, piece))
            return
        self.bytes_sent += self.port.send(target, piece)

    def release(self, awaited_phase: str | None = None, awaited_layer: int = -1) -> None:
        """Send the queued bulk pieces: all of them, or, before a wait for
        ``awaited_phase`` pieces of ``awaited_layer``, those a peer may be waiting for by
        then: every ``reduce`` piece, and before a ``gather`` wait the ``gather`` pieces
        of layers up to ``awaited_layer``."""
        kept: list[tuple[str, PeerPiece]] = []
        for target, piece in self._bulk:
            if awaited_phase is None or piece.phase == PHASE_REDUCE or (
                    awaited_phase == PHASE_GATHER and piece.layer <= awaited_layer):
                self.bytes_sent += self.port.send(target, piece)
            else:
                kept.append((target, piece))
        self._bulk = kept

    def flush(self) -> None:
        """Send every queued bulk piece (the end of a request)."""
        self.release()

    def _forget_before(self, reduce_id: int) -> None:
        """Pieces and kept gradients of older reductions are stale (a retried step)."""
        if reduce_id <= self._floor:
            return
        self._floor = reduce_id
        self._inbox = {k: v for k, v in self._inbox.items() if k[0] >= reduce_id}
        self._bulk = [(t, p) for t, p in self._bulk if p.pass_id >= reduce_id]
        self._own = {k: v for k, v in self._own.items() if k[0] >= reduce_id}
        self._direct = {k: v for k, v in self._direct.items() if k[0] >= reduce_id}
        self._bucket_sums = {k: v for k, v in self._bucket_sums.items() if k[0] >= reduce_id}

    def _keep(self, piece: PeerPiece) -> bool:
        """:meth:`offer` ``piece``, the reason noted (the last 8) when it is dropped."""
        reason = self.offer(piece)
        if reason is not None:
            self.dropped.append(reason)
            del self.dropped[:-8]
        return reason is None

    def offer(self, piece: PeerPiece) -> str | None:
        """Keep ``piece``; the reason it was dropped, or None."""
        if piece.phase in SYNC_PHASES:
            TRACE.take(self.participant, piece.pass_id, piece.layer, piece.phase, piece.sender)
        if piece.phase not in REDUCE_PHASES:
            return f"a {piece.phase!r} piece during a weight reduction"
        if piece.pass_id < self._floor:
            return f"stale reduction piece {piece.pass_id} (now at {self._floor})"
        if piece.sender == self.participant:
            return "a piece that claims to come from this participant"
        if not 0 <= piece.layer < len(self.plan.layers):
            return f"a reduction piece of layer {piece.layer}, not in the plan"
        ranges = self.plan.layers[piece.layer]
        sender = next((r for r in ranges if r.participant == piece.sender), None)
        if sender is None:
            return f"a reduction piece from {piece.sender!r}, not a participant"
        if piece.phase in SYNC_PHASES + (PHASE_WHOLE,):  # a whole layer's, from anyone
            sender = KernelRange(piece.sender, 0, self._kernels(piece.layer))
        expected = self.own_range(piece.layer) if piece.phase == PHASE_REDUCE else sender
        if expected is None or (piece.kernel_start, piece.kernel_stop) != \
                (expected.start, expected.stop) or expected.kernels == 0:
            return (f"{piece.phase} piece of layer {piece.layer + 1} from {piece.sender!r} "
                    f"for kernels [{piece.kernel_start}, {piece.kernel_stop})")
        key = (piece.pass_id, piece.layer, piece.phase, piece.sender)
        if key in self._inbox:
            return f"duplicate {piece.phase} piece of layer {piece.layer + 1} from {piece.sender!r}"
        held = sorted({k[0] for k in self._inbox} | {piece.pass_id})
        if len(held) > MAX_HELD_REDUCTIONS or len(self._inbox) >= MAX_HELD_PIECES:
            farthest = held[-1]
            if piece.pass_id == farthest:  # nearer ones first: this one is never needed soon
                return f"reduction piece {piece.pass_id} too far ahead (now at {self._floor})"
            self._inbox = {k: v for k, v in self._inbox.items() if k[0] != farthest}
        self._inbox[key] = piece.data
        self.bytes_received += int(piece.data.nbytes)
        return None

    def _wait(self, reduce_id: int, layer: int, phase: str,
              senders: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """Each sender's piece of (``reduce_id``, ``layer``, ``phase``), checked against
        the shape given for it; PeerLost naming the senders still owing when nothing arrives for
        ``timeout_s`` (every arrival restarts the clock) or when cancelled."""
        got: dict[str, np.ndarray] = {}
        if phase in (PHASE_REDUCE, PHASE_GATHER):
            self.release(phase, layer)

        def taken() -> bool:
            for sender, shape in senders.items():
                data = self._inbox.pop((reduce_id, layer, phase, sender), None)
                if data is None:
                    continue
                if tuple(data.shape) != shape:
                    raise PeerLost([sender], f"peer {sender} sent a {phase} piece of layer "
                                   f"{layer + 1} of shape {tuple(data.shape)}, expected "
                                   f"{shape}", bad_data=True)
                if data.dtype != np.float32 or not np.isfinite(data).all():
                    raise PeerLost([sender], f"peer {sender} sent a {phase} piece of layer "
                                   f"{layer + 1} holding NaN, Inf or not float32",
                                   bad_data=True)
                got[sender] = data
            return all(sender in got for sender in senders)

        start = time.monotonic()
        try:
            wait_for_pieces(self.port, self.timeout_s, self.cancelled, taken,
                            lambda: [s for s in senders if s not in got], self._keep,
                            lambda owing: f"no {phase} piece of layer {layer + 1}'s weight "
                                          f"gradient from peer {', '.join(owing)} within "
                                          f"{self.timeout_s:.1f} s", self.progress)
        finally:
            self.wait_s += time.monotonic() - start
        return got
