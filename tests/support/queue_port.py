"""An in-memory :class:`~hetconv.participant.ports.PiecePort` for tests: one thread-safe
queue per participant, so peers in threads exchange pieces without sockets."""
from __future__ import annotations

import queue

from hetconv.protocol import PeerPiece


class QueuePort:
    """A participant's in-memory data port: one queue per participant of the plan."""

    def __init__(self, queues: dict[str, queue.Queue[PeerPiece]], me: str):
        self.queues, self.me = queues, me

    def send(self, participant: str, piece: PeerPiece) -> int:
        self.queues[participant].put(piece)
        return int(piece.data.nbytes)

    def receive(self, timeout_s: float) -> PeerPiece | None:
        try:
            return self.queues[self.me].get(timeout=timeout_s)
        except queue.Empty:
            return None
