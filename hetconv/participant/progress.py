"""What a participant's compute thread is doing, for the heartbeats that say it.

The compute thread marks its progress here (a request started or finished, a wait for
peers begun or ended, a piece kept); the socket thread reads :meth:`ComputeProgress.report`
for every heartbeat. That makes the heartbeat a liveness signal of the compute path, not
only of the socket thread: a worker whose compute thread hangs keeps heartbeating, and
its heartbeats say for how long it has made no progress (``stalled_s``); a worker that
waits for a peer's piece says whom it waits for (``waiting_for``) and since when. The
master turns those reports into blame (``hetconv.master.blame``).

One writer, one reader: every update replaces one immutable tuple, which the reader
takes whole (an attribute assignment is atomic in CPython), so no lock is needed. Times
are ``time.monotonic()`` seconds, given by the caller.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ComputeReport:
    """One participant's compute thread as of ``now`` (what a heartbeat carries).

    ``waiting_for``: the peers it waits for a piece from (empty when not waiting);
    ``waited_s``: seconds it has waited for them; ``stalled_s``: seconds since its last
    progress on a request it holds while not waiting (0 when idle or waiting)."""

    waiting_for: tuple[str, ...] = ()
    waited_s: float = 0.0
    stalled_s: float = 0.0

    @property
    def waiting(self) -> bool:
        return bool(self.waiting_for)

    def aged(self, seconds: float) -> ComputeReport:
        """The same report ``seconds`` later (nothing heard since): a wait or a stall
        goes on."""
        if seconds <= 0:
            return self
        if self.waiting:
            return ComputeReport(self.waiting_for, self.waited_s + seconds, 0.0)
        if self.stalled_s > 0:
            return ComputeReport((), 0.0, self.stalled_s + seconds)
        return self


class ComputeProgress:
    """The compute thread's marks (see the module doc); ``clock`` is for the tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        # (busy: holds a request, last progress, peers waited for, wait started)
        self._state: tuple[bool, float, tuple[str, ...], float] = (False, clock(), (), 0.0)

    def started(self) -> None:
        """A request was taken up."""
        self._state = (True, self.clock(), (), 0.0)

    def finished(self) -> None:
        """The request's reply is ready: idle."""
        self._state = (False, self.clock(), (), 0.0)

    def waiting(self, peers: Sequence[str]) -> None:
        """Waiting for a piece from ``peers`` (called again as the list shrinks: the wait
        keeps its start)."""
        busy, _, before, since = self._state
        now = self.clock()
        self._state = (busy, now, tuple(peers), since if before else now)

    def progressed(self) -> None:
        """A piece was kept, a wait ended, a layer was computed."""
        busy = self._state[0]
        self._state = (busy, self.clock(), (), 0.0)

    def report(self, now: float) -> ComputeReport:
        """What the next heartbeat says (``now``: the same clock)."""
        busy, last, peers, since = self._state
        if peers:
            return ComputeReport(peers, max(0.0, now - since), 0.0)
        if busy:
            return ComputeReport((), 0.0, max(0.0, now - last))
        return ComputeReport()
