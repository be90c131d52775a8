"""The kernel split's peer data plane, a participant's side: which piece goes where, and
what a participant does with it.

With ``--data-plane peer`` the participants of a run (the master's own device and the
workers) exchange activations among themselves instead of through the master.
Between conv layers l and l+1 every holder of kernels of l sends its pooled output
slice to every holder of l+1 (all-gather: each ends with l+1's whole input,
assembled in kernel order). Backward, every holder of l+1 sends to each holder k of
l the channels [start_k, stop_k) of its partial input gradient (reduce-scatter);
k sums what it receives, its own piece included, in the kernel order of l+1, and
that sum is its output gradient of layer l. A participant with no kernels in a
layer neither sends nor receives for it. The master sends layer 0's input once, to
one worker holding kernels of layer 0 (the *relay*, the first in kernel order), which
passes it on to the other workers of layer 0 (phase ``input``); it sends the last
layer's output-gradient slices and receives only the last layer's output.

Everything here but :class:`PeerParticipant` is pure (plain data in, plain data out,
tested without sockets). :class:`PeerParticipant` runs one participant's side of a
layer: it waits (with a deadline) for its pieces through a
:class:`~hetconv.participant.ports.PiecePort` (shared with the sample split's reduction),
computes its :class:`~hetconv.engine.shard.ConvShard` and sends its pieces on. The worker
service and the master's own share both use it; the sockets behind the port are in
:mod:`hetconv.participant.peer_sockets`.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hetconv.engine.shard import ConvShard
from hetconv.participant.peer_pieces import Inbox, PieceKey, RowGather
from hetconv.participant.peer_plan import (
    PHASE_BACKWARD,
    PHASE_FORWARD,
    PHASE_INPUT,
    KernelRange,
    PeerPlan,
)
from hetconv.participant.ports import PeerLost, PiecePort, wait_for_pieces
from hetconv.participant.progress import ComputeProgress
from hetconv.participant.wire_cast import to_wire
from hetconv.protocol import PeerPiece

PIECE_BYTES = 128 << 10
"""About how many array bytes one piece carries: an exchange travels in pieces of
consecutive samples so that the receiver computes on the first while the rest is on
the wire (at 1 Gbit/s 128 KiB take about 1 ms)."""
MAX_PIECES = 8
"""At most this many pieces per exchange and peer (each costs a message)."""


def rows_per_piece(batch: int, bytes_per_sample: int, piece_bytes: int | None = None,
                   max_pieces: int | None = None) -> int:
    """Samples per piece when ``batch`` samples of ``bytes_per_sample`` bytes go to one
    peer: pieces of about ``piece_bytes`` (PIECE_BYTES), at most ``max_pieces``
    (MAX_PIECES) of them, at least one sample each."""
    piece_bytes = PIECE_BYTES if piece_bytes is None else piece_bytes
    max_pieces = MAX_PIECES if max_pieces is None else max_pieces
    if batch < 1:
        return 1
    pieces = max(1, min(max_pieces, batch, -(-batch * max(0, bytes_per_sample) // piece_bytes)))
    return -(-batch // pieces)


def row_chunks(batch: int, rows: int) -> list[tuple[int, int]]:
    """[start, stop) sample ranges of ``rows`` samples (the last may be shorter)."""
    return [(start, min(start + rows, batch)) for start in range(0, batch, max(1, rows))]


def assemble_input(pieces: dict[str, np.ndarray], sources: Sequence[KernelRange]) -> np.ndarray:
    """The whole layer input (B, C, H, W), float32: the pieces concatenated along
    channels in kernel order."""
    parts = [np.asarray(pieces[r.participant], dtype=np.float32) for r in sources]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)


def reduce_gradient(pieces: dict[str, np.ndarray], sources: Sequence[KernelRange]) -> np.ndarray:
    """The sum of the partial gradients, float32, added in the order of ``sources``."""
    total = np.array(pieces[sources[0].participant], dtype=np.float32)
    for source in sources[1:]:
        total += pieces[source.participant]
    return total


def split_gradient(dx: np.ndarray, targets: Sequence[KernelRange]
                   ) -> list[tuple[KernelRange, np.ndarray]]:
    """The channel slices of a partial input gradient (B, C, H, W), one per target."""
    return [(r, dx[:, r.start:r.stop]) for r in targets]


# --- one participant over a port -----------------------------------------------------
@dataclass
class ExchangeStats:
    """One participant's layer phase: compute and wait seconds, and array bytes per
    (peer, piece layer, phase) sent and received."""

    compute_s: float = 0.0
    wait_s: float = 0.0
    sent: dict[tuple[str, int, str], int] = field(default_factory=dict)
    received: dict[tuple[str, int, str], int] = field(default_factory=dict)

    def bytes_with(self, keep: Callable[[str], bool]) -> tuple[int, int]:
        """(sent, received) bytes with the peers for which ``keep(peer)`` is true."""
        return (sum(n for (peer, _, _), n in self.sent.items() if keep(peer)),
                sum(n for (peer, _, _), n in self.received.items() if keep(peer)))


class PeerParticipant:
    """One participant's side of the exchange: its shards, its inbox and its port.

    Overlap: pieces travel in a few consecutive-sample chunks (:func:`rows_per_piece`).
    Forward, the convolution reads each chunk of its input as soon as every source has
    delivered it (:meth:`ConvShard.forward_host_streamed`), and the output goes out
    chunk by chunk; backward, the partial input gradient goes out chunk by chunk while
    the rest is computed (:meth:`ConvShard.backward_host_streamed`). Batch norm needs
    the whole batch, so the output gradient is summed only once complete.
    ``streaming=False`` waits for whole inputs (the reference the tests compare with).
    """

    def __init__(self, participant: str, plan: PeerPlan, shards: dict[int, ConvShard],
                 port: PiecePort, wire_dtype: str = "float32", timeout_s: float = 5.0,
                 cancelled: Callable[[], bool] = lambda: False,
                 on_drop: Callable[[str], None] = lambda reason: None,
                 streaming: bool = True, progress: ComputeProgress | None = None):
        self.participant = participant
        self.progress = progress  # hears whom a wait is for (the heartbeats say it)
        self.plan = plan
        self.shards = shards
        self.port = port
        self.wire_dtype = np.dtype(wire_dtype)
        self.timeout_s = timeout_s
        self.cancelled = cancelled
        self.on_drop = on_drop
        self.streaming = streaming
        self.inbox = Inbox(participant, plan)

    def _shard(self, layer: int) -> ConvShard:
        shard = self.shards.get(layer)
        expected = self.plan.range_of(layer, self.participant)
        if shard is None or expected is None:
            raise ValueError(f"{self.participant} holds no kernels of layer {layer}")
        if (shard.kernel_start, shard.kernel_stop) != (expected.start, expected.stop):
            raise ValueError(f"layer {layer}: the shard holds kernels [{shard.kernel_start}, "
                             f"{shard.kernel_stop}), the plan says [{expected.start}, "
                             f"{expected.stop})")
        return shard

    def _rows(self, batch: int, sample_bytes: int) -> int:
        return rows_per_piece(batch, sample_bytes) if self.streaming else max(1, batch)

    def forward(self, pass_id: int, step: int, layer: int, train: bool,
                x: np.ndarray | None) -> tuple[np.ndarray | None, ExchangeStats]:
        """Gather the input (``x`` for layer 0), compute, send the output piece on.
        Returns the output (B, K, H', W') for the last layer (None otherwise)."""
        stats = ExchangeStats()
        shard = self._shard(layer)
        self.inbox.begin_pass(pass_id)
        gather: RowGather | None = None
        if layer == 0:
            relay = self.plan.input_relay()
            if x is None:
                if relay is None or relay == self.participant:
                    raise ValueError("layer 0 needs its input x")
                key = PieceKey(pass_id, step, 0, PHASE_INPUT, 0)
                gather = RowGather([KernelRange(relay, 0, 0)], concat=True,
                                   spatial=self.plan.input_size(0))
            else:
                targets = self.plan.input_targets(self.participant)
                if targets:
                    wire = np.ascontiguousarray(x)
                    channels = KernelRange(self.participant, 0, x.shape[1])
                    rows = self._rows(x.shape[0], wire[:1].nbytes)
                    for start, stop in row_chunks(x.shape[0], rows):
                        for target in targets:
                            self._send(target, PieceKey(pass_id, step, 0, PHASE_INPUT, 0),
                                       channels, wire[start:stop], start, x.shape[0], stats)
        else:
            key = PieceKey(pass_id, step, layer - 1, PHASE_FORWARD, 0)
            gather = RowGather(self.plan.forward_sources(layer, self.participant), concat=True,
                               spatial=self.plan.input_size(layer))
        start_time = time.perf_counter()
        waited = stats.wait_s
        if gather is None:
            assert x is not None
            y = shard.forward_host(x, train)
        else:
            incoming = gather
            if self.streaming:
                self._wait(key, incoming, lambda: incoming.allocated, stats)
                assert incoming.buffer is not None
                y = shard.forward_host_streamed(
                    incoming.buffer,
                    lambda rows: self._wait(key, incoming,
                                            lambda: incoming.ready_rows() >= rows, stats),
                    train)
            else:
                self._wait(key, incoming, lambda: incoming.complete, stats)
                assert incoming.buffer is not None
                y = shard.forward_host(incoming.buffer, train)
        stats.compute_s = time.perf_counter() - start_time - (stats.wait_s - waited)
        own = self.plan.range_of(layer, self.participant)
        assert own is not None
        key = PieceKey(pass_id, step, layer, PHASE_FORWARD, 0)
        targets = self.plan.forward_targets(layer, self.participant)
        if self.participant in targets:
            self.inbox.put_own(key, y)
        remote = [t for t in targets if t != self.participant]
        if remote:
            wire = to_wire(y, self.wire_dtype)
            for start, stop in row_chunks(y.shape[0], self._rows(y.shape[0], wire[:1].nbytes)):
                for target in remote:
                    self._send(target, key, own, wire[start:stop], start, y.shape[0], stats)
        return (y if layer == self.plan.last_layer else None), stats

    def backward(self, pass_id: int, step: int, layer: int, learning_rate: float,
                 dy: np.ndarray | None) -> ExchangeStats:
        """Reduce the output gradient (``dy`` for the last layer), back-propagate and
        update the shard, and scatter the partial input gradient (none for layer 0)."""
        stats = ExchangeStats()
        shard = self._shard(layer)
        self.inbox.begin_pass(pass_id)
        if layer == self.plan.last_layer:
            if dy is None:
                raise ValueError("the last layer needs its output gradient dy")
            gradient = dy
        else:
            sources = self.plan.backward_sources(layer, self.participant)
            key = PieceKey(pass_id, step, layer, PHASE_BACKWARD, 0)
            gather = RowGather(sources, concat=False, spatial=self.plan.input_size(layer + 1))
            self._wait(key, gather, lambda: gather.complete, stats)
            gradient = reduce_gradient(gather.buffers, sources)
        targets = self.plan.backward_targets(layer, self.participant) if layer > 0 else []
        key = PieceKey(pass_id, step, layer - 1, PHASE_BACKWARD, 0)
        sent_upto = 0

        def scatter(dx: np.ndarray, start: int, stop: int) -> None:
            """Send dx's samples [sent_upto, stop) on once there are enough of them."""
            nonlocal sent_upto
            batch = dx.shape[0]
            widest = max((r.kernels for r in targets if r.participant != self.participant),
                         default=0)
            rows = self._rows(batch, widest * dx.shape[2] * dx.shape[3]
                              * self.wire_dtype.itemsize)
            if stop - sent_upto < rows and stop < batch:
                return
            part = dx[sent_upto:stop]
            for target, channels in split_gradient(part, targets):
                if target.participant == self.participant:
                    self.inbox.put_own(key, channels, sent_upto, batch)
                else:
                    self._send(target.participant, key, target,
                               to_wire(channels, self.wire_dtype),
                               sent_upto, batch, stats)
            sent_upto = stop

        start_time = time.perf_counter()
        shard.backward_host_streamed(gradient, layer > 0, learning_rate, scatter)
        stats.compute_s = time.perf_counter() - start_time
        return stats

    # --- moving pieces -------------------------------------------------------------------
    def _send(self, target: str, key: PieceKey, kernels: KernelRange, data: np.ndarray,
              batch_start: int, batch_size: int, stats: ExchangeStats) -> None:
        piece = PeerPiece(pass_id=key.pass_id, step=key.step, layer=key.layer, phase=key.phase,
                          attempt=key.attempt, sender=self.participant,
                          kernel_start=kernels.start, kernel_stop=kernels.stop,
                          batch_start=batch_start, batch_stop=batch_start + data.shape[0],
                          batch_size=batch_size, data=data)
        sent = self.port.send(target, piece)
        where = (target, key.layer, key.phase)
        stats.sent[where] = stats.sent.get(where, 0) + sent

    def _wait(self, key: PieceKey, gather: RowGather, done: Callable[[], bool],
              stats: ExchangeStats) -> None:
        """Feed ``key``'s pieces into ``gather`` until ``done()``; PeerLost naming the
        peers still owing samples when nothing arrives for ``timeout_s`` (every arrival
        restarts the clock)."""
        def taken() -> bool:
            for sender, waiting in self.inbox.take(key).items():
                for held in waiting:
                    wrong = gather.misfit(sender, held)
                    if wrong is not None:  # a peer computing the wrong shape
                        raise PeerLost([sender], wrong, bad_data=True)
                    refused = gather.add(sender, held)
                    if refused is not None:
                        self.on_drop(refused)
            return done()

        def owing() -> list[str]:
            return [r.participant for r in gather.sources
                    if not gather.allocated
                    or sum(b - a for a, b in gather.rows[r.participant]) < gather.batch_size]

        def keep(piece: PeerPiece) -> bool:
            reason = self.inbox.offer(piece)
            if reason is not None:
                self.on_drop(reason)
                return False
            if not np.isfinite(piece.data).all():  # a peer computing garbage
                raise PeerLost([piece.sender], f"peer {piece.sender} sent {piece.phase} "
                               f"data of layer {piece.layer + 1} holding NaN or Inf",
                               bad_data=True)
            where = (piece.sender, piece.layer, piece.phase)
            stats.received[where] = stats.received.get(where, 0) + piece.data.nbytes
            return True

        start = time.monotonic()
        try:
            wait_for_pieces(self.port, self.timeout_s, self.cancelled, taken, owing, keep,
                            lambda peers: f"no {key.phase} data of layer {key.layer + 1} from "
                                          f"peer {', '.join(peers)} within "
                                          f"{self.timeout_s:.1f} s", self.progress)
        finally:
            stats.wait_s += time.monotonic() - start
