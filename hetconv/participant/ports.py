"""How a participant of either split moves peer pieces, and how it waits for them.

A :class:`PiecePort` sends and receives :class:`~hetconv.protocol.PeerPiece` messages
(over sockets: :mod:`hetconv.participant.peer_sockets`); :func:`wait_for_pieces` is the
one wait of both exchanges, the kernel split's activations
(:mod:`hetconv.participant.kernels.exchange`) and the sample split's weight reduction
(:mod:`hetconv.participant.samples.weight_reduce`); :class:`PeerLost` is how either says
that a peer failed it.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from hetconv.participant.progress import ComputeProgress
from hetconv.protocol import PeerPiece

RECEIVE_SLICE_S = 0.05
"""Longest single wait on the port, so that a cancelled wait ends promptly."""


class PiecePort(Protocol):
    """How a participant moves pieces; implemented over sockets by hetconv.participant.peer_sockets."""

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


def wait_for_pieces(port: PiecePort, timeout_s: float, cancelled: Callable[[], bool],
                    done: Callable[[], bool], owing: Callable[[], list[str]],
                    keep: Callable[[PeerPiece], bool], late: Callable[[list[str]], str],
                    progress: ComputeProgress | None = None) -> None:
    """The wait of both peer exchanges (the kernel split's activations and
    :mod:`hetconv.participant.samples.weight_reduce`'s reductions and barriers):
    until ``done()`` (checked after each piece; the caller takes what arrived), receive
    pieces from ``port`` :data:`RECEIVE_SLICE_S` at a time and hand each to ``keep``,
    which says whether it kept it. Every piece kept restarts the clock; PeerLost naming
    the peers still ``owing()`` when ``cancelled()``, or with ``late(owing)`` when
    nothing is kept for ``timeout_s``. ``progress`` hears whom it waits for, for the
    heartbeats (:mod:`hetconv.participant.progress`)."""
    if done():
        return
    if progress is not None:
        progress.waiting(owing())
    deadline = time.monotonic() + timeout_s
    try:
        while not done():
            now = time.monotonic()
            if cancelled():
                peers = owing()
                raise PeerLost(peers, f"cancelled while waiting for {', '.join(peers)}")
            if now >= deadline:
                peers = owing()
                raise PeerLost(peers, late(peers))
            piece = port.receive(min(RECEIVE_SLICE_S, deadline - now))
            if piece is not None and keep(piece):
                deadline = time.monotonic() + timeout_s
                if progress is not None and not done():
                    progress.waiting(owing())
    finally:
        if progress is not None:
            progress.progressed()
