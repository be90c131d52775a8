"""What both session state machines share: the master's membership
(:mod:`hetconv.master.membership`) and the worker's session (:mod:`hetconv.worker.session`).

Events in (:class:`Tick`, :class:`BadMessage`) and one action out (:class:`Log`); each
machine adds its own. Pure data: no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass

from hetconv.protocol import ProtocolError


@dataclass(frozen=True)
class Tick:
    """Time passed. ``now`` is monotonic seconds; ``wall_time`` is ``time.time()``,
    only stamped on heartbeats; ``stalled_peers`` (the master's): the addresses whose TCP
    connection is retransmitting unacknowledged bytes (a dead link, master/liveness.py)."""

    now: float
    wall_time: float
    stalled_peers: frozenset[str] = frozenset()


@dataclass(frozen=True)
class BadMessage:
    """A message that did not decode, or was too big (``error.identity`` says from whom,
    if known); a :class:`~hetconv.protocol.VersionMismatch` for another protocol version.
    ``user_id``: the ZAP User-Id of its connection, None where unknown; ``now``: when
    (monotonic s; None: the time of the last event that carried one)."""

    error: ProtocolError
    user_id: str | None = None
    now: float | None = None


@dataclass(frozen=True)
class Log:
    """Write one log line at ``level`` (a ``logging`` level)."""

    level: int
    text: str
