"""The peer data plane's logic: which piece goes where, and what a participant does with it.

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
layer: it waits (with a deadline) for its pieces through a :class:`PiecePort`,
computes its :class:`~hetconv.shard.ConvShard` and sends its pieces on. The worker
service and the master's own share both use it; the sockets behind the port are in
:mod:`hetconv.peer_sockets`.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from hetconv.config import MASTER_PARTICIPANT
from hetconv.protocol import PeerPiece
from hetconv.shard import ConvShard
from hetconv.wire_cast import to_wire

PHASE_INPUT = "input"
PHASE_FORWARD = "forward"
PHASE_BACKWARD = "backward"
PHASES = (PHASE_INPUT, PHASE_FORWARD, PHASE_BACKWARD)
PASSES_AHEAD = 1
"""How many forward passes beyond its current one a participant keeps pieces for (a
fast peer may start the next pass while this one is being answered); older and
farther pieces are dropped."""
RECEIVE_SLICE_S = 0.05
"""Longest single wait on the port, so that a cancelled wait ends promptly."""
PIECE_BYTES = 128 << 10
"""About how many array bytes one piece carries: an exchange travels in pieces of
consecutive samples so that the receiver computes on the first while the rest is on
the wire (at 1 Gbit/s 128 KiB take about 1 ms)."""
MAX_PIECES = 8
"""At most this many pieces per exchange and peer (each costs a message)."""


@dataclass(frozen=True)
class KernelRange:
    """Kernels [start, stop) of one layer held by ``participant`` (may be empty)."""

    participant: str
    start: int
    stop: int

    @property
    def kernels(self) -> int:
        return self.stop - self.start


class PeerPlan:
    """Every layer's kernel ranges, one per participant in kernel order, and the routes
    that follow from them. ``layers[l]`` lists ranges that tile [0, K_l)."""

    def __init__(self, layers: Sequence[Sequence[KernelRange]],
                 input_sizes: Sequence[tuple[int, int]] = ()):
        self.layers = [list(ranges) for ranges in layers]
        # (H, W) of every layer's input, when known: a piece of another size is bad data
        self.input_sizes = [tuple(size) for size in input_sizes]
        if self.input_sizes and len(self.input_sizes) != len(self.layers):
            raise ValueError("plan: input sizes must give one (H, W) per layer")
        for index, ranges in enumerate(self.layers):
            position = 0
            for kernel_range in ranges:
                if kernel_range.start != position or kernel_range.stop < kernel_range.start:
                    raise ValueError(f"layer {index}: ranges do not tile the kernels in order")
                position = kernel_range.stop
            if position == 0:
                raise ValueError(f"layer {index}: no kernels")

    # --- wire form (AssignPeers.plan) --------------------------------------------------
    @classmethod
    def from_wire(cls, plan: list[Any]) -> PeerPlan:
        """From ``[[[participant, start, stop], ...] per layer]``, optionally followed by
        ``{"input_sizes": [[H, W], ...]}``; ValueError if malformed."""
        layers: list[list[KernelRange]] = []
        sizes: list[tuple[int, int]] = []
        if plan and isinstance(plan[-1], dict):
            extra, plan = plan[-1], plan[:-1]
            raw = extra.get("input_sizes", [])
            if not (isinstance(raw, list) and all(
                    isinstance(hw, list) and len(hw) == 2
                    and all(type(v) is int and 0 < v <= 1 << 16 for v in hw) for hw in raw)):
                raise ValueError("plan: input_sizes must be [[H, W], ...] of positive ints")
            sizes = [(hw[0], hw[1]) for hw in raw]
        for ranges in plan:
            if not isinstance(ranges, list):
                raise ValueError("plan: every layer must be a list of ranges")
            layer = []
            for item in ranges:
                if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                        and all(type(v) is int for v in item[1:])):
                    raise ValueError("plan: a range must be [participant, start, stop]")
                layer.append(KernelRange(item[0], item[1], item[2]))
            layers.append(layer)
        return cls(layers, sizes)

    def to_wire(self) -> list[Any]:
        ranges: list[Any] = [[[r.participant, r.start, r.stop] for r in layer]
                             for layer in self.layers]
        if self.input_sizes:
            ranges.append({"input_sizes": [list(size) for size in self.input_sizes]})
        return ranges

    def input_size(self, layer: int) -> tuple[int, ...] | None:
        """(H, W) of ``layer``'s input, if known (None past the last layer)."""
        return self.input_sizes[layer] if 0 <= layer < len(self.input_sizes) else None

    # --- queries -------------------------------------------------------------------------
    @property
    def last_layer(self) -> int:
        return len(self.layers) - 1

    def holders(self, layer: int) -> list[KernelRange]:
        """The non-empty ranges of ``layer``, in kernel order."""
        return [r for r in self.layers[layer] if r.kernels > 0]

    def range_of(self, layer: int, participant: str) -> KernelRange | None:
        """``participant``'s non-empty range of ``layer``, or None."""
        return next((r for r in self.holders(layer) if r.participant == participant), None)

    def holds(self, layer: int, participant: str) -> bool:
        return self.range_of(layer, participant) is not None

    # --- routes (``me`` included where it sends to or receives from itself) -------------
    def input_relay(self) -> str | None:
        """The worker that gets layer 0's input from the master and passes it on."""
        return next((r.participant for r in self.holders(0)
                     if r.participant != MASTER_PARTICIPANT), None)

    def input_targets(self, me: str) -> list[str]:
        """Who gets layer 0's input from ``me`` (the relay: the other workers of layer 0)."""
        if me != self.input_relay():
            return []
        return [r.participant for r in self.holders(0)
                if r.participant not in (me, MASTER_PARTICIPANT)]

    def forward_sources(self, layer: int, me: str) -> list[KernelRange]:
        """Output pieces of layer-1 that ``me`` assembles into layer's input."""
        if layer == 0 or not self.holds(layer, me):
            return []
        return self.holders(layer - 1)

    def forward_targets(self, layer: int, me: str) -> list[str]:
        """Who gets ``me``'s output piece of ``layer`` (the holders of layer+1)."""
        if layer == self.last_layer or not self.holds(layer, me):
            return []
        return [r.participant for r in self.holders(layer + 1)]

    def backward_sources(self, layer: int, me: str) -> list[KernelRange]:
        """Whose partial gradients ``me`` sums into its output gradient of ``layer``
        (the holders of layer+1, in kernel order)."""
        if layer == self.last_layer or not self.holds(layer, me):
            return []
        return self.holders(layer + 1)

    def backward_targets(self, layer: int, me: str) -> list[KernelRange]:
        """Slices of ``me``'s partial input gradient of ``layer`` and who gets each
        (the holders of layer-1 and their ranges)."""
        if layer == 0 or not self.holds(layer, me):
            return []
        return self.holders(layer - 1)

    def expected_range(self, layer: int, phase: str, sender: str,
                       receiver: str) -> KernelRange | None:
        """The channels a ``phase`` piece of ``layer`` from ``sender`` to ``receiver`` must
        carry, or None when no such piece belongs in the plan."""
        if not 0 <= layer <= self.last_layer or layer == self.last_layer:
            return None
        if phase == PHASE_FORWARD:
            if self.holds(layer + 1, receiver):
                return self.range_of(layer, sender)
        elif phase == PHASE_BACKWARD:
            if self.holds(layer + 1, sender):
                return self.range_of(layer, receiver)
        return None


@dataclass(frozen=True)
class PieceKey:
    """What identifies one exchange: a layer's phase in one forward pass."""

    pass_id: int
    step: int
    layer: int
    phase: str
    attempt: int


def piece_key(piece: PeerPiece) -> PieceKey:
    return PieceKey(piece.pass_id, piece.step, piece.layer, piece.phase, piece.attempt)


def _overlaps(ranges: Sequence[tuple[int, int]], start: int, stop: int) -> bool:
    return any(start < b and a < stop for a, b in ranges)


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


@dataclass
class Inbox:
    """The pieces a participant has received and not used yet (pure state).

    :meth:`offer` checks each piece against the plan (sender, receiver, channel
    range, array shape), its sample range against the pieces already seen for the same
    exchange (batch size, overlap) and the current pass; stale, duplicate and
    unexpected pieces are refused with the reason, never stored.
    """

    participant: str
    plan: PeerPlan
    current_pass: int = 0
    pieces: dict[PieceKey, dict[str, list[PeerPiece]]] = field(default_factory=dict)
    seen: dict[PieceKey, dict[str, list[tuple[int, int]]]] = field(default_factory=dict)
    batch_sizes: dict[PieceKey, int] = field(default_factory=dict)

    def begin_pass(self, pass_id: int) -> None:
        """A request of ``pass_id`` arrived: forget every piece of an older pass."""
        if pass_id > self.current_pass:
            self.current_pass = pass_id
            self.pieces = {k: v for k, v in self.pieces.items() if k.pass_id >= pass_id}
            self.seen = {k: v for k, v in self.seen.items() if k.pass_id >= pass_id}
            self.batch_sizes = {k: v for k, v in self.batch_sizes.items()
                                if k.pass_id >= pass_id}

    def offer(self, piece: PeerPiece) -> str | None:
        """Store ``piece``; the reason it was dropped, or None when stored."""
        if piece.pass_id < self.current_pass:
            return f"stale piece of pass {piece.pass_id} (now at pass {self.current_pass})"
        if piece.pass_id > self.current_pass + PASSES_AHEAD:
            return f"piece of pass {piece.pass_id} too far ahead of pass {self.current_pass}"
        if piece.phase not in PHASES:
            return f"unknown phase {piece.phase!r}"
        if piece.sender == self.participant:
            return "a piece that claims to come from this participant"
        if piece.data.ndim != 4:
            return f"piece from {piece.sender!r} has shape {tuple(piece.data.shape)}"
        if piece.phase == PHASE_INPUT:
            if piece.layer != 0 or self.participant not in self.plan.input_targets(piece.sender):
                return f"unexpected input piece of layer {piece.layer} from {piece.sender!r}"
            if piece.kernel_start != 0 or piece.kernel_stop != piece.data.shape[1]:
                return f"input piece from {piece.sender!r} does not hold its channels [0, C)"
        else:
            expected = self.plan.expected_range(piece.layer, piece.phase, piece.sender,
                                                self.participant)
            if expected is None:
                return (f"unexpected {piece.phase} piece of layer {piece.layer} "
                        f"from {piece.sender!r}")
            if (piece.kernel_start, piece.kernel_stop) != (expected.start, expected.stop):
                return (f"{piece.phase} piece of layer {piece.layer} from {piece.sender!r} "
                        f"carries kernels [{piece.kernel_start}, {piece.kernel_stop}), "
                        f"expected [{expected.start}, {expected.stop})")
            if piece.data.shape[1] != expected.kernels:
                return f"piece from {piece.sender!r} has shape {tuple(piece.data.shape)}"
        return self._keep_rows(piece)

    def _keep_rows(self, piece: PeerPiece) -> str | None:
        """The sample-range checks, then store."""
        start, stop, size = piece.batch_start, piece.batch_stop, piece.batch_size
        if not (0 <= start < stop <= size) or piece.data.shape[0] != stop - start:
            return (f"{piece.phase} piece from {piece.sender!r} holds samples [{start}, {stop}) "
                    f"of {size} in an array of shape {tuple(piece.data.shape)}")
        key = piece_key(piece)
        if self.batch_sizes.setdefault(key, size) != size:
            return (f"{piece.phase} piece from {piece.sender!r} says the batch has {size} "
                    f"samples, earlier pieces said {self.batch_sizes[key]}")
        seen = self.seen.setdefault(key, {}).setdefault(piece.sender, [])
        if _overlaps(seen, start, stop):
            return (f"duplicate {piece.phase} piece of layer {piece.layer} from "
                    f"{piece.sender!r} (samples [{start}, {stop}))")
        seen.append((start, stop))
        self.pieces.setdefault(key, {}).setdefault(piece.sender, []).append(piece)
        return None

    def put_own(self, key: PieceKey, data: np.ndarray, start: int = 0,
                batch_size: int | None = None) -> None:
        """This participant's own piece (it never travels): samples [start, start + len)."""
        size = data.shape[0] if batch_size is None else batch_size
        piece = PeerPiece(pass_id=key.pass_id, step=key.step, layer=key.layer, phase=key.phase,
                          attempt=key.attempt, sender=self.participant, kernel_start=0,
                          kernel_stop=data.shape[1], batch_start=start,
                          batch_stop=start + data.shape[0], batch_size=size, data=data)
        self.pieces.setdefault(key, {}).setdefault(self.participant, []).append(piece)

    def missing(self, key: PieceKey, sources: Sequence[KernelRange]) -> list[str]:
        """Sources none of whose pieces of ``key`` are waiting."""
        held = self.pieces.get(key, {})
        return [r.participant for r in sources if r.participant not in held]

    def take(self, key: PieceKey) -> dict[str, list[PeerPiece]]:
        """The waiting pieces of ``key``, by sender (they are handed over once)."""
        return self.pieces.pop(key, {})


class RowGather:
    """One exchange's pieces from several sources, written into host buffers as they
    come (pure state, float32).

    ``concat``: the pieces form one array (B, C, H, W), each source's channels at its
    kernel range (all-gather; layer 0's input from the relay). Otherwise every source
    fills its own (B, K, H, W) array (reduce-scatter: summed once all are in). The
    buffers are made when the first piece shows the batch size and the shape.
    """

    def __init__(self, sources: Sequence[KernelRange], concat: bool,
                 spatial: tuple[int, ...] | None = None):
        self.sources = list(sources)
        self.concat = concat
        self.spatial = spatial  # (H, W) every piece must have, when known
        self.buffers: dict[str, np.ndarray] = {}
        self.buffer: np.ndarray | None = None  # the concatenated array (concat only)
        self.rows: dict[str, list[tuple[int, int]]] = {r.participant: [] for r in sources}
        self.batch_size = 0

    @property
    def allocated(self) -> bool:
        return self.batch_size > 0

    def _allocate(self, piece: PeerPiece) -> None:
        size, rest = piece.batch_size, tuple(piece.data.shape[2:])
        self.batch_size = size
        if self.concat:
            channels = self.sources[-1].stop - self.sources[0].start
            if channels == 0:  # layer 0's input: one source, its channels as they come
                channels = piece.data.shape[1]
            self.buffer = np.empty((size, channels) + rest, np.float32)
            base = self.sources[0].start
            for r in self.sources:
                stop = r.stop if r.stop > r.start else channels
                self.buffers[r.participant] = self.buffer[:, r.start - base:stop - base]
        else:
            for r in self.sources:
                self.buffers[r.participant] = np.empty((size, piece.data.shape[1]) + rest,
                                                       np.float32)

    def misfit(self, sender: str, piece: PeerPiece) -> str | None:
        """Why a source's ``piece`` cannot be right (bad data: its sender computed the
        wrong shape), or None. Only what is known before any piece came is checked."""
        if sender not in self.rows:
            return None
        shape = tuple(piece.data.shape)
        if self.spatial is not None and shape[2:] != tuple(self.spatial):
            return (f"peer {sender} sent a {piece.phase} piece of shape {shape}, expected "
                    f"H, W = {tuple(self.spatial)}")
        source = next(r for r in self.sources if r.participant == sender)
        if self.concat and source.stop > source.start and shape[1] != source.kernels:
            return (f"peer {sender} sent a {piece.phase} piece of {shape[1]} channels, "
                    f"expected {source.kernels}")
        return None

    def add(self, sender: str, piece: PeerPiece) -> str | None:
        """Write ``piece`` into place; the reason it does not fit, or None."""
        if sender not in self.rows:
            return f"a piece from {sender!r}, who is not a source of this exchange"
        if not self.allocated:
            self._allocate(piece)
        target = self.buffers[sender]
        if piece.batch_size != self.batch_size or piece.data.shape[1:] != target.shape[1:]:
            return (f"{piece.phase} piece from {sender!r} of shape {tuple(piece.data.shape)} "
                    f"(batch {piece.batch_size}) does not fit {tuple(target.shape)}")
        if _overlaps(self.rows[sender], piece.batch_start, piece.batch_stop):
            return f"duplicate samples from {sender!r}"
        target[piece.batch_start:piece.batch_stop] = piece.data
        self.rows[sender].append((piece.batch_start, piece.batch_stop))
        return None

    def ready_rows(self) -> int:
        """Samples [0, n) that every source has delivered."""
        if not self.allocated:
            return 0
        ready = self.batch_size
        for ranges in self.rows.values():
            prefix = 0
            for start, stop in sorted(ranges):
                if start > prefix:
                    break
                prefix = max(prefix, stop)
            ready = min(ready, prefix)
        return ready

    @property
    def complete(self) -> bool:
        return self.allocated and self.ready_rows() == self.batch_size


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
class PiecePort(Protocol):
    """How a participant moves pieces; implemented over sockets by hetconv.peer_sockets."""

    def send(self, participant: str, piece: PeerPiece) -> int:
        """Send to ``participant``; the array bytes sent. Raises PeerLost on failure."""
        ...

    def receive(self, timeout_s: float) -> PeerPiece | None:
        """The next piece that arrives within ``timeout_s`` seconds, or None."""
        ...


class PeerLost(Exception):
    """A peer's piece did not come within the deadline, or could not be sent to it
    (``bad_data``: it came, holding NaN or Inf)."""

    def __init__(self, peers: Sequence[str], message: str, bad_data: bool = False):
        super().__init__(message)
        self.peers = list(peers)
        self.bad_data = bad_data


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
                 streaming: bool = True):
        self.participant = participant
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
        start = time.monotonic()
        deadline = start + self.timeout_s
        try:
            while True:
                for sender, waiting in self.inbox.take(key).items():
                    for held in waiting:
                        wrong = gather.misfit(sender, held)
                        if wrong is not None:  # a peer computing the wrong shape
                            raise PeerLost([sender], wrong, bad_data=True)
                        refused = gather.add(sender, held)
                        if refused is not None:
                            self.on_drop(refused)
                if done():
                    return
                now = time.monotonic()
                if self.cancelled() or now >= deadline:
                    owing = [r.participant for r in gather.sources
                             if not gather.allocated
                             or sum(b - a for a, b in gather.rows[r.participant])
                             < gather.batch_size]
                    if self.cancelled():
                        raise PeerLost(owing, f"cancelled while waiting for {', '.join(owing)}")
                    raise PeerLost(owing, f"no {key.phase} data of layer {key.layer + 1} "
                                          f"from peer {', '.join(owing)} within "
                                          f"{self.timeout_s:.1f} s")
                piece = self.port.receive(min(RECEIVE_SLICE_S, deadline - now))
                if piece is None:
                    continue
                reason = self.inbox.offer(piece)
                if reason is not None:
                    self.on_drop(reason)
                    continue
                if not np.isfinite(piece.data).all():  # a peer computing garbage
                    raise PeerLost([piece.sender], f"peer {piece.sender} sent {piece.phase} "
                                   f"data of layer {piece.layer + 1} holding NaN or Inf",
                                   bad_data=True)
                where = (piece.sender, piece.layer, piece.phase)
                stats.received[where] = stats.received.get(where, 0) + piece.data.nbytes
                deadline = time.monotonic() + self.timeout_s
        finally:
            stats.wait_s += time.monotonic() - start
