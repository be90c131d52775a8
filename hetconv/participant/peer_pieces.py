"""The peer data plane's pieces as they arrive: kept by exchange, gathered into arrays.

Pure state, no sockets: :class:`Inbox` holds the pieces a participant received
before it waits for them (keyed by :class:`PieceKey`, bounded, duplicates and
strangers refused); :class:`RowGather` writes one exchange's pieces into host
buffers as they come and says which samples are complete, and which piece cannot be
right (the wrong size: bad data from its sender). :mod:`hetconv.participant.kernels.exchange` drives them.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hetconv.participant.peer_plan import PHASE_INPUT, PHASES, KernelRange, PeerPlan
from hetconv.protocol import PeerPiece

PASSES_AHEAD = 1
"""How many forward passes beyond its current one a participant keeps pieces for (a
fast peer may start the next pass while this one is being answered); older and
farther pieces are dropped."""

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
