"""The worker's side of a session with a master, as a state machine without I/O.

:class:`WorkerSession` holds everything the daemon must remember between polls:
whether a master has welcomed it, when to say Hello next (exponential back-off),
when it last heard from the master and last sent a heartbeat, and how many
requests the compute thread still owes a reply for. The daemon feeds it events
(:class:`Tick`, :class:`MessageReceived`, :class:`BadMessage`,
:class:`ReplyReady`, :class:`StopRequested`) and performs the actions it answers
with (:class:`Send`, :class:`Compute`, :class:`Log`, :class:`Exit`), in order. It
never touches a socket or reads a clock: every event that needs the time carries
it, so the tests drive it through hours of back-off in microseconds (the shape of
dask/distributed's worker state machine). After every ``Welcome`` it announces the
worker's data endpoint (``DataEndpoint``), where the peer data plane reaches it.
Requests are checked (worker/validation.py) before they reach the compute thread: a
nonsensical one is answered ``bad_request`` at once. Warnings about bad messages
are rate-limited: a few per window, then one line counting the rest.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetconv.config import WorkerConfig
from hetconv.participant.progress import ComputeProgress
from hetconv.protocol import (
    ERR_BAD_REQUEST,
    ERR_UNKNOWN_WORKER,
    NO_REQUEST_ID,
    PROTOCOL_VERSION,
    DataEndpoint,
    EndRun,
    ErrorReply,
    Heartbeat,
    Hello,
    LinkProbeReply,
    LinkProbeRequest,
    Message,
    ProtocolError,
    Refuse,
    Welcome,
    admission,
    limits,
)
from hetconv.session_events import BadMessage as BadMessage  # re-exported: shared vocabulary
from hetconv.session_events import Log as Log  # re-exported
from hetconv.session_events import Tick as Tick  # re-exported
from hetconv.worker.validation import refusal

WAITING_LOG_INTERVAL_S = 30.0
"""How often a worker without a master says that it is still trying."""
MIN_HEARTBEAT_INTERVAL_S = 0.05
"""The shortest heartbeat interval a Welcome may ask for (it is clamped to this)."""
MAX_HEARTBEAT_INTERVAL_S = 5.0
"""The longest heartbeat interval a Welcome may ask for (it is clamped to this)."""
REPLY_FLUSH_TIMEOUT_S = 1.0
"""How long a ``--once`` worker that is stopping waits for its last replies."""
EXIT_OK = 0
EXIT_REFUSED = 3
"""Exit status when the master refuses this worker or speaks another version."""


# --- events in ---------------------------------------------------------------------
@dataclass(frozen=True)
class MessageReceived:
    """A message from the master decoded at ``now``."""

    message: Message
    now: float


@dataclass(frozen=True)
class ReplyReady:
    """The compute thread answered the oldest request handed to it."""

    reply: Message


@dataclass(frozen=True)
class StopRequested:
    """A signal asked the worker to stop at ``now``."""

    now: float


Event = Tick | MessageReceived | BadMessage | ReplyReady | StopRequested


# --- actions out -------------------------------------------------------------------
@dataclass(frozen=True)
class Send:
    """Send ``message`` to the master."""

    message: Message


@dataclass(frozen=True)
class Compute:
    """Hand ``request`` to the compute thread; its reply comes back as
    :class:`ReplyReady`, in the order the requests were handed over."""

    request: Message


@dataclass(frozen=True)
class Exit:
    """Stop serving; the process exits with ``status``. Always the last action."""

    status: int


Action = Send | Compute | Log | Exit


class WorkerSession:
    """One worker's session state; :meth:`handle` turns each event into actions."""

    def __init__(self, config: WorkerConfig, worker_id: str, device: dict[str, Any],
                 data_endpoint: str = "", data_public_key: str = "",
                 compute: ComputeProgress | None = None):
        self.config = config
        # what the compute thread is doing, said in every heartbeat (read, never written)
        self.compute = compute
        self.worker_id = worker_id
        self.device = device
        self.data_endpoint = data_endpoint  # "" when this worker has no data endpoint
        self.data_public_key = data_public_key
        self.in_session = False
        self.hello_delay_s = config.hello_backoff_s[0]
        self.next_hello: float | None = None  # None: say Hello at the next tick
        self.last_waiting_log: float | None = None  # None: not waiting yet
        self.last_heard: float | None = None
        self.last_beat: float | None = None  # None: beat at the next tick
        self.heartbeat_interval_s = config.heartbeat_interval_s
        # one entry per request handed to the compute thread and not answered yet:
        # True when the reply goes to the master, False for our own EndRun
        self._in_flight: deque[bool] = deque()
        self.flush_deadline: float | None = None  # set while stopping
        self.exited = False
        self.warnings = admission.WarningBudget()  # bad messages and refused requests
        self.clock = 0.0  # the latest time an event carried

    @property
    def busy(self) -> int:
        """Requests handed to the compute thread and not answered yet."""
        return len(self._in_flight)

    def handle(self, event: Event) -> list[Action]:
        """The actions ``event`` calls for; none once :class:`Exit` was returned."""
        if self.exited:
            return []
        now = getattr(event, "now", None)
        if now is not None:
            self.clock = now
        match event:
            case Tick():
                actions = self._tick(event.now, event.wall_time)
            case MessageReceived():
                actions = self._received(event.message, event.now)
            case BadMessage():
                actions = self._bad_message(event.error, self.clock)
            case ReplyReady():
                actions = self._reply_ready(event.reply)
            case StopRequested():
                actions = self._stop(event.now)
        if actions and isinstance(actions[-1], Exit):
            self.exited = True
        return actions

    # --- events ----------------------------------------------------------------------
    def _tick(self, now: float, wall_time: float) -> list[Action]:
        if self.flush_deadline is not None:
            if now < self.flush_deadline:
                return []
            return [Log(logging.WARNING, f"stopping without {self.busy} last replies"),
                    Exit(EXIT_OK)]
        actions: list[Action] = self._summary(now)
        if (self.in_session and self.busy == 0 and self.last_heard is not None
                and now - self.last_heard > self.config.master_timeout_s):
            actions.append(Log(logging.WARNING, f"master silent for {now - self.last_heard:.0f}"
                               " s; dropping shards, waiting for a master"))
            self._leave_session()
            actions.append(self._compute(EndRun(request_id=NO_REQUEST_ID,
                                                reason="master silent"), reply=False))
        if not self.in_session and (self.next_hello is None or now >= self.next_hello):
            actions += self._hello(now)
        if self.in_session and (self.last_beat is None
                                or now - self.last_beat >= self.heartbeat_interval_s):
            actions.append(Send(self._heartbeat(now, wall_time)))
            self.last_beat = now
        return actions

    def _received(self, message: Message, now: float) -> list[Action]:
        if self.flush_deadline is not None:
            return []  # stopping: only the last replies still go out
        self.last_heard = now
        match message:
            case Welcome():
                return self._welcome(message)
            case Refuse():
                return [Log(logging.ERROR, f"the master refused this worker: {message.reason}"),
                        Exit(EXIT_REFUSED)]
            case Heartbeat():
                return []
            case ErrorReply() if message.code == ERR_UNKNOWN_WORKER:
                actions: list[Action] = []
                if self.in_session:
                    actions.append(Log(logging.INFO, "the master does not know this worker; "
                                       "saying hello again"))
                self._leave_session()
                return actions
            case ErrorReply():
                return [Log(logging.WARNING,
                            f"master reports an error: {message.code}: {message.message}")]
            case EndRun():
                actions = [Log(logging.INFO, f"run over: {message.reason}"),
                           self._compute(message)]
                if self.config.once:
                    actions += self._stop(now)
                return actions
            case LinkProbeRequest() if self.in_session:
                return [Send(link_probe_reply(message))]
            case _ if self.in_session:
                reason = refusal(message)
                if reason is not None:
                    return self._refuse(message, reason, now)
                return [self._compute(message)]
            case _:
                request_id = int(getattr(message, "request_id", NO_REQUEST_ID))
                return [Send(ErrorReply(request_id=request_id, code=ERR_BAD_REQUEST,
                                        message="no session: say hello first"))]

    def _bad_message(self, error: ProtocolError, now: float) -> list[Action]:
        """A warning and an error reply, both within the warning budget; a reply to a
        request the master is waiting for (its id was read) goes out regardless."""
        actions = self._summary(now)
        logged = self.warnings.admit(now)
        if logged:
            actions.append(Log(logging.WARNING, f"bad message from the master: {error}"))
        if logged or error.request_id is not None:
            request_id = error.request_id if error.request_id is not None else NO_REQUEST_ID
            actions.append(Send(ErrorReply(request_id=request_id, code=error.code,
                                           message=str(error))))
        return actions

    def _refuse(self, request: Message, reason: str, now: float) -> list[Action]:
        """Answer ``bad_request`` without computing (and warn, within the budget)."""
        request_id = int(getattr(request, "request_id", NO_REQUEST_ID))
        actions = self._summary(now)
        if self.warnings.admit(now):
            actions.append(Log(logging.WARNING, f"refused a request from the master: {reason}"))
        actions.append(Send(ErrorReply(request_id=request_id, code=ERR_BAD_REQUEST,
                                       message=reason)))
        return actions

    def _summary(self, now: float) -> list[Action]:
        """One line counting the warnings held back in a window now over, if any."""
        suppressed = self.warnings.take_suppressed(now)
        if not suppressed:
            return []
        return [Log(logging.WARNING, f"{suppressed} more bad message(s) or refused request(s)"
                    f" from the master not logged in the last "
                    f"{self.warnings.window_s:.0f} s")]

    def _reply_ready(self, reply: Message) -> list[Action]:
        to_master = self._in_flight.popleft() if self._in_flight else True
        actions: list[Action] = [Send(reply)] if to_master else []
        if self.flush_deadline is not None and self.busy == 0:
            actions.append(Exit(EXIT_OK))
        return actions

    def _stop(self, now: float) -> list[Action]:
        if self.flush_deadline is not None:
            return []
        if not self.config.once or self.busy == 0:
            return [Exit(EXIT_OK)]
        self.flush_deadline = now + REPLY_FLUSH_TIMEOUT_S
        return []

    # --- helpers ---------------------------------------------------------------------
    def _hello(self, now: float) -> list[Action]:
        actions: list[Action] = []
        if self.last_waiting_log is None:
            self.last_waiting_log = now
        elif now - self.last_waiting_log >= WAITING_LOG_INTERVAL_S:
            hint = (" (with CURVE: check that the master allows this worker's key and "
                    "that --master-key is the master's)" if self.config.curve else "")
            actions.append(Log(logging.INFO,
                               f"no master at {self.config.master} yet; still trying{hint}"))
            self.last_waiting_log = now
        # PROTOCOL_VERSION is read from this module at call time, so that a test can
        # impersonate an older worker by patching it
        actions.append(Send(Hello(worker_id=self.worker_id, device=self.device,
                                  protocol_version=PROTOCOL_VERSION)))
        self.next_hello = now + self.hello_delay_s
        self.hello_delay_s = min(self.hello_delay_s * 2, self.config.hello_backoff_s[1])
        return actions

    def _welcome(self, welcome: Welcome) -> list[Action]:
        if welcome.protocol_version != PROTOCOL_VERSION:
            return [Log(logging.ERROR, f"master speaks protocol {welcome.protocol_version}, "
                        f"this worker {PROTOCOL_VERSION}; upgrade one"),
                    Exit(EXIT_REFUSED)]
        actions: list[Action] = []
        if not self.in_session:
            actions.append(Log(logging.INFO, f"joined run {welcome.run_id}"))
            self.last_waiting_log = None
        self.in_session = True
        self.last_beat = None
        self.heartbeat_interval_s = min(MAX_HEARTBEAT_INTERVAL_S,
                                        max(MIN_HEARTBEAT_INTERVAL_S,
                                            welcome.heartbeat_interval_s))
        if self.data_endpoint:
            actions.append(Send(DataEndpoint(worker_id=self.worker_id,
                                             endpoint=self.data_endpoint,
                                             public_key=self.data_public_key)))
        return actions

    def _heartbeat(self, now: float, wall_time: float) -> Heartbeat:
        """A heartbeat that says what the compute thread is doing (the master blames the
        one at fault from these: hetconv/master/blame.py)."""
        if self.compute is None:
            return Heartbeat(sent_at=wall_time)
        report = self.compute.report(now)
        return Heartbeat(sent_at=wall_time, waiting_for=list(report.waiting_for),
                         waited_s=report.waited_s, stalled_s=report.stalled_s)

    def _leave_session(self) -> None:
        """Back to saying Hello, at once and with the back-off restarted."""
        self.in_session = False
        self.hello_delay_s = self.config.hello_backoff_s[0]
        self.next_hello = None

    def _compute(self, request: Message, reply: bool = True) -> Compute:
        self._in_flight.append(reply)
        return Compute(request)


def link_probe_reply(request: LinkProbeRequest) -> Message:
    """The immediate answer to a link probe: ``reply_bytes`` zero bytes back (or a refusal)."""
    if not 0 <= request.reply_bytes <= limits.MAX_LINK_PROBE_BYTES:
        return ErrorReply(request_id=request.request_id, code=ERR_BAD_REQUEST,
                          message=f"reply_bytes must be within 0..{limits.MAX_LINK_PROBE_BYTES}")
    received = 0 if request.payload is None else int(request.payload.nbytes)
    payload = np.zeros(request.reply_bytes, np.uint8) if request.reply_bytes else None
    return LinkProbeReply(request_id=request.request_id, received_bytes=received,
                          payload=payload)
