"""Per-sender budgets of a socket reader: who may be decoded, answered, logged (no I/O).

A listening socket's reader (the master's loop) asks :class:`SenderBudget` before it
decodes a message, before it answers a bad one with an error reply and before it logs
a warning about a peer. Each sender (ROUTER identity) gets
``limits.MAX_MESSAGES_PER_SENDER`` decoded messages (``MAX_MESSAGES_PER_STRANGER``
before it is a known worker) and
``limits.MAX_ERROR_REPLIES_PER_SENDER`` error replies and warnings per
``limits.SENDER_WINDOW_S``; what is over is dropped and counted, and the count is
reported once in the next window that allows a warning. So a flooding or garbage-
sending peer costs the reader a bounded amount of work and log lines per second,
whatever it sends. A sender that is not a known worker (a stranger) may also send
only small messages (``MAX_STRANGER_MESSAGE_BYTES``, enforced by the transport while
it reads). :class:`WarningBudget` is the same idea for one stream of warnings (a
worker's about its master, a data endpoint's about its peers). Pure counting: the
caller passes the time (monotonic seconds).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import limits

MAX_TRACKED_SENDERS = 4096
"""Most senders with live counters; past it all counters restart (a flood of fresh
identities cannot grow this table without bound)."""
MAX_STRANGER_MESSAGE_BYTES = limits.MAX_HEADER_BYTES
"""Most bytes (all frames) of one message from a sender that has not said Hello: what
it may say (Hello, Heartbeat, Goodbye) is a header alone. A bigger one is dropped
while it is read (``transport.recv_frames``), never decoded."""
WARNING_WINDOW_S = 10.0
"""The window of a :class:`WarningBudget`."""
MAX_WARNINGS_PER_WINDOW = 3
"""Warnings of one :class:`WarningBudget` logged per window; the rest are counted and
summed up in one line once the window is over."""


@dataclass
class _Window:
    start: float
    messages: int = 0
    errors: int = 0
    dropped: int = 0  # messages dropped undecoded since the last reported warning
    suppressed: int = 0  # error replies and warnings not given since the last one


class SenderBudget:
    """Counters per sender over fixed windows of ``window_s`` seconds."""

    def __init__(self, window_s: float = limits.SENDER_WINDOW_S,
                 max_messages: int = limits.MAX_MESSAGES_PER_SENDER,
                 max_errors: int = limits.MAX_ERROR_REPLIES_PER_SENDER,
                 max_stranger_messages: int = limits.MAX_MESSAGES_PER_STRANGER,
                 max_joiner_messages: int = limits.MAX_MESSAGES_PER_JOINER) -> None:
        self.window_s = window_s
        self.max_messages = max_messages
        self.max_errors = max_errors
        self.max_stranger_messages = max_stranger_messages
        self.max_joiner_messages = max_joiner_messages
        self._windows: dict[bytes, _Window] = {}

    def _window(self, sender: bytes, now: float) -> _Window:
        window = self._windows.get(sender)
        if window is None:
            if len(self._windows) >= MAX_TRACKED_SENDERS:
                self._windows.clear()
            window = self._windows[sender] = _Window(now)
        elif now - window.start >= self.window_s:
            window.start, window.messages, window.errors = now, 0, 0
        return window

    def admit(self, sender: bytes, now: float, known: bool = True, joiner: bool = False) -> bool:
        """Whether to decode the next message of ``sender`` (False: drop it unread);
        ``known``: it is a worker that said Hello (else the stranger's budget holds);
        ``joiner``: a known worker not in the run (yet): the joiner's budget."""
        window = self._window(sender, now)
        window.messages += 1
        limit = (self.max_stranger_messages if not known
                 else self.max_joiner_messages if joiner else self.max_messages)
        if window.messages <= limit:
            return True
        window.dropped += 1
        return False

    def may_complain(self, sender: bytes, now: float) -> bool:
        """Whether to send ``sender`` an error reply and log a warning about it now."""
        window = self._window(sender, now)
        window.errors += 1
        if window.errors <= self.max_errors:
            return True
        window.suppressed += 1
        return False

    def take_counts(self, sender: bytes) -> tuple[int, int]:
        """(messages dropped undecoded, complaints suppressed) since the last call for
        ``sender``; both restart at 0. For the summary in the next warning."""
        window = self._windows.get(sender)
        if window is None:
            return 0, 0
        counts = window.dropped, window.suppressed
        window.dropped = window.suppressed = 0
        return counts


class WarningBudget:
    """At most ``max_lines`` warnings per window of ``window_s`` seconds; the rest are
    counted. Call :meth:`take_suppressed` often (each tick, and before :meth:`admit`)
    and log one summary line when it returns more than 0."""

    def __init__(self, window_s: float = WARNING_WINDOW_S,
                 max_lines: int = MAX_WARNINGS_PER_WINDOW) -> None:
        self.window_s = window_s
        self.max_lines = max_lines
        self._start: float | None = None
        self._lines = 0
        self._suppressed = 0

    def admit(self, now: float) -> bool:
        """Whether to log the next warning now (False: it is counted instead)."""
        if self._start is None or now - self._start >= self.window_s:
            self._start, self._lines = now, 0
        self._lines += 1
        if self._lines <= self.max_lines:
            return True
        self._suppressed += 1
        return False

    def take_suppressed(self, now: float) -> int:
        """Warnings not logged in a window that is over by ``now`` (then 0 again); 0
        while the window that suppressed them is still open."""
        if not self._suppressed or (self._start is not None
                                    and now - self._start < self.window_s):
            return 0
        count, self._suppressed = self._suppressed, 0
        return count
