"""The master's membership, liveness and request matching, as a state machine without I/O.

:class:`Membership` holds what the master knows between polls: which workers said
Hello (and when each was last heard from), which of them are the run's members,
and which requests are outstanding with whom. :class:`hetconv.master.cluster.Cluster`
feeds it events (:class:`MessageReceived`, :class:`BadMessage`, :class:`Tick`,
:class:`RequestSent`, :class:`RequestsAwaited`, :class:`SendFailed`) and performs the
actions it answers with (:class:`Send`, :class:`Log`, :class:`Fail`; a
:class:`Completed` only reports a matched reply, which stays here until collected).
It never touches a socket or reads a clock: every event that needs the time carries
it, so the tests drive liveness and request deadlines without waiting (the shape of
dask/distributed's worker state machine, and of ``hetconv.worker.session``).

Replies are matched by request id, by the worker the request went to, by type
(:data:`REPLY_TYPES`, and the one reply type each request expects) and by the
``step``, ``layer`` and ``attempt`` they echo. A reply nobody waits for (stale,
duplicate, from another worker) is dropped; a reply that answers the right request
wrongly fails the run naming the worker.

With CURVE, a routing id is bound to the key (the connection's ZAP User-Id) that first
said Hello under it, for as long as the master runs: a message under that routing id
from a connection with another allowed key is refused (dropped, never answered, never
acted on: no forged reply, Goodbye or Hello can fail, evict or rebind the worker) and
logged at most once per ``ClusterSettings.forgery_log_interval_s``. The worker itself,
back with its own key, is welcome as before. (This guards the routing id while no live
connection holds it; while one does, the cluster's socket keeps it, see
:class:`hetconv.master.cluster.Cluster`.)
"""
from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from hetconv.master.membership_types import (
    ECHOED_FIELDS,
    LINK_CHECK_AFTER_S,
    LINK_RETRY_S,
    REPLY_TYPES,
    SILENT_SUSPECT_BEATS,
    Action,
    BadMessage,
    ClusterSettings,
    Completed,
    Event,
    Fail,
    KeyBinding,
    Log,
    MessageReceived,
    Reply,
    Request,
    RequestsAwaited,
    RequestSent,
    Send,
    SendFailed,
    Tick,
    WorkerHandle,
    expected_reply,
    payload_bytes,
    reply_mismatch,
)
from hetconv.master.overdue import overdue_fault, report_now
from hetconv.participant.progress import ComputeReport
from hetconv.protocol import (
    ERR_BAD_PEER_DATA,
    ERR_PEER_LOST,
    ERR_UNEXPECTED,
    ERR_UNKNOWN_WORKER,
    NO_REQUEST_ID,
    PROTOCOL_VERSION,
    DataEndpoint,
    ErrorReply,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    Refuse,
    VersionMismatch,
    Welcome,
    peer_named,
)

MAX_REPORTED_PEERS = 64
"""At most this many names of a heartbeat's ``waiting_for`` are kept."""
FIRST_STALL_LIMIT_S = 120.0
"""The compute-stall limit before the run has timed a step (the first request
deadline of hetconv/master/run.py)."""
ABANDONED_KEPT = 4096
"""How many abandoned request ids are remembered (their late errors logged quietly)."""

__all__ = [
    "REPLY_TYPES",
    "ECHOED_FIELDS",
    "LINK_RETRY_S",
    "LINK_CHECK_AFTER_S",
    "WorkerHandle",
    "ClusterSettings",
    "KeyBinding",
    "Reply",
    "payload_bytes",
    "expected_reply",
    "reply_mismatch",
    "MessageReceived",
    "BadMessage",
    "Tick",
    "RequestSent",
    "RequestsAwaited",
    "SendFailed",
    "Event",
    "Send",
    "Log",
    "Fail",
    "Completed",
    "Action",
    "Request",
    "Membership",
]


@dataclass
class Membership:
    """The master's workers and outstanding requests; :meth:`handle` turns each event
    into actions."""

    run_id: str
    settings: ClusterSettings = field(default_factory=ClusterSettings)

    def __post_init__(self) -> None:
        self.workers: dict[bytes, WorkerHandle] = {}
        self.members: list[WorkerHandle] = []
        self.requests: dict[int, Request] = {}
        self.abandoned: deque[int] = deque(maxlen=ABANDONED_KEPT)  # forgotten on purpose
        self.bindings: dict[bytes, KeyBinding] = {}  # routing id -> the key bound to it
        self._next_request_id = 1
        self._last_beat = -math.inf
        # the master's own participant, when it computes (set by the cluster before a tick)
        self.own_compute: ComputeReport | None = None
        # a worker whose compute thread made no progress this long on a request the master
        # awaits is hung (the run's request deadline, kept current by the stages)
        self.compute_stall_limit_s = FIRST_STALL_LIMIT_S

    # --- queries and bookkeeping ---------------------------------------------------------
    def next_request_id(self) -> int:
        request_id = self._next_request_id
        self._next_request_id += 1
        return request_id

    def live_workers(self, now: float) -> list[WorkerHandle]:
        """Workers not gone and heard from within the liveness timeout."""
        return [w for w in self.workers.values()
                if not w.gone and now - w.last_seen < self.settings.liveness_timeout_s]

    def link_suspects(self, now: float) -> bool:
        """Whether a tick now needs the TCP tables (``Tick.stalled_peers``,
        master/liveness.py): some member with a known address has been silent for more
        than ``link_check_after_s`` and at most ``link_retry_s``."""
        return any(self._link_suspect(worker, now) for worker in self._heartbeated())

    def _heartbeated(self) -> list[WorkerHandle]:
        """The workers the master heartbeats: the members, or before the run all."""
        return self.members or list(self.workers.values())

    def _link_suspect(self, worker: WorkerHandle, now: float) -> bool:
        silent_s = now - worker.last_seen
        return (not worker.gone and bool(worker.peer_address)
                and self.settings.link_check_after_s < silent_s <= self.settings.link_retry_s)

    def fix_members(self, workers: Iterable[WorkerHandle]) -> list[WorkerHandle]:
        """Make ``workers`` the run's members (sorted by id); heartbeats go to them only."""
        self.members = sorted(workers, key=lambda w: w.worker_id)
        return self.members

    def replies_for(self, pending: Iterable[int]) -> dict[int, Reply] | None:
        """The replies to all of ``pending``, or None while one is still missing."""
        replies: dict[int, Reply] = {}
        for request_id in pending:
            request = self.requests.get(request_id)
            if request is None or request.reply is None:
                return None
            replies[request_id] = request.reply
        return replies

    def connection_lost(self, identity: bytes) -> None:
        """The socket has no connection for ``identity`` any more: that worker counts
        as gone (a request waiting on it fails at the next tick)."""
        worker = self.workers.get(identity)
        if worker is not None and not worker.gone:
            worker.gone = True
            worker.connection_lost = True

    def forget(self, request_ids: Iterable[int]) -> None:
        """Stop tracking these requests; late replies to them are dropped."""
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def abandon(self, request_ids: Iterable[int]) -> None:
        """Forget these requests because the master gave up on them (a step sent ahead
        of one that failed): their late replies, errors included, are dropped quietly."""
        for request_id in request_ids:
            self.requests.pop(request_id, None)
            self.abandoned.append(request_id)

    def forget_all(self) -> None:
        self.requests.clear()

    # --- events ----------------------------------------------------------------------
    def handle(self, event: Event) -> list[Action]:
        """The actions ``event`` calls for, in order."""
        match event:
            case MessageReceived():
                refused = self._refused(event.identity, event.message.TYPE, event.user_id,
                                        event.now)
                if refused is not None:
                    return refused
                return self._received(event.identity, event.message, event.now,
                                      event.user_id, event.peer_address)
            case BadMessage():
                identity, user_id = event.error.identity, event.user_id
                if identity and user_id is not None:
                    refused = self._refused(identity, "bad message", user_id, event.now or 0.0)
                    if refused is not None:
                        return refused
                return self._bad_message(event.error)
            case Tick():
                return self._tick(event.now, event.wall_time, event.stalled_peers)
            case RequestSent():
                return self._request_sent(event.worker, event.request, event.now)
            case RequestsAwaited():
                return self._awaited(event.pending, event.what, event.now, event.timeout_s,
                                     event.background)
            case SendFailed():
                event.worker.gone = True
                return [Fail(event.worker,
                             f"worker {event.worker.name} is unreachable: {event.detail}")]

    def _refused(self, identity: bytes, what: str, user_id: str,
                 now: float) -> list[Action] | None:
        """None if a message from ``user_id``'s connection may use routing id ``identity``;
        else the actions for refusing it (a warning, at most one per
        ``forgery_log_interval_s`` for this routing id; none when it is due later).

        A routing id is bound to the CURVE key that first said Hello under it
        (:attr:`bindings`), even after that worker left: another allowed key using it
        is a forgery (taking over a worker's routing id), and is dropped unanswered.

        It also proves the bound worker's own connection no longer holds that id (the
        master's ROUTER leaves a second connection under a held id unread): that worker
        counts as having lost its connection, so nothing more is sent to the id, which
        would reach the forger."""
        binding = self.bindings.get(identity)
        if binding is None or binding.key == user_id:
            return None
        binding.refused += 1
        worker = self.workers.get(identity)
        if worker is not None:
            worker.forgeries += 1
            self.connection_lost(identity)
        if now - binding.logged_at < self.settings.forgery_log_interval_s:
            binding.unlogged += 1
            return []
        earlier, binding.unlogged, binding.logged_at = binding.unlogged, 0, now
        name = worker.name if worker is not None else repr(identity)
        text = (f"refused a {what} under the routing id of worker {name}: it came from "
                f"another CURVE key ({user_id[:8] or 'none'}...) than the one bound to it "
                f"({binding.key[:8] or 'none'}...)")
        if earlier:
            text += f"; {earlier} more refused since the last warning"
        return [Log(logging.WARNING, text)]

    def _received(self, identity: bytes, message: Message, now: float,
                  user_id: str = "", peer_address: str = "") -> list[Action]:
        if isinstance(message, Hello):
            actions = self._hello(identity, message, now, user_id)
            if peer_address and identity in self.workers:
                self.workers[identity].peer_address = peer_address
            return actions
        worker = self.workers.get(identity)
        if worker is None or worker.gone:
            return [Send(identity, ErrorReply(request_id=NO_REQUEST_ID, code=ERR_UNKNOWN_WORKER,
                                              message="say hello first"))]
        worker.last_seen = now
        worker.peer_address = peer_address or worker.peer_address
        worker.link_down = False
        if isinstance(message, Heartbeat):
            worker.compute = ComputeReport(tuple(message.waiting_for[:MAX_REPORTED_PEERS]),
                                           max(0.0, message.waited_s),
                                           max(0.0, message.stalled_s))
            worker.compute_at = now
            return []
        if isinstance(message, DataEndpoint):
            worker.data_endpoint, worker.data_public_key = message.endpoint, message.public_key
            return []
        if isinstance(message, Goodbye):
            worker.gone = True
            return [Log(logging.WARNING, f"worker {worker.name} left: {message.reason}"),
                    *self._fail_requests_of(worker, "left during", message.reason)]
        if isinstance(message, REPLY_TYPES):
            return self._reply(worker, message, now)
        request_id = int(getattr(message, "request_id", NO_REQUEST_ID))
        return [Send(identity, ErrorReply(request_id=request_id, code=ERR_UNEXPECTED,
                                          message=f"the master does not serve {message.TYPE}"))]

    def _hello(self, identity: bytes, hello: Hello, now: float,
               user_id: str = "") -> list[Action]:
        if hello.protocol_version != PROTOCOL_VERSION:
            reason = (f"protocol version mismatch: master speaks {PROTOCOL_VERSION}, worker "
                      f"{hello.worker_id} speaks {hello.protocol_version}; install the same "
                      "hetconv version on both")
            return [Log(logging.WARNING, f"refused worker {hello.worker_id}: {reason}"),
                    Send(identity, Refuse(reason=reason, protocol_version=PROTOCOL_VERSION))]
        actions: list[Action] = []
        self.bindings.setdefault(identity, KeyBinding(user_id))  # _refused checked the key
        known = self.workers.get(identity)
        if known is None or known.gone:
            worker = WorkerHandle(identity, hello.worker_id, dict(hello.device), now,
                                  curve_key=user_id,
                                  misbehaved=known is not None and known.misbehaved)
            self.workers[identity] = worker
            actions.append(Log(logging.INFO,
                               f"worker {worker.name} joined: {hello.device.get('name')}"))
        else:  # a repeated Hello (its Welcome was lost, or it restarted): refresh
            known.last_seen = now
            known.device = dict(hello.device)
        actions.append(Send(identity, Welcome(
            worker_id=hello.worker_id, run_id=self.run_id,
            heartbeat_interval_s=self.settings.heartbeat_interval_s,
            protocol_version=PROTOCOL_VERSION)))
        return actions

    def _reply(self, worker: WorkerHandle, message: Message, now: float) -> list[Action]:
        request_id = int(getattr(message, "request_id", NO_REQUEST_ID))
        request = self.requests.get(request_id)
        if request is None or request.worker is not worker or request.reply is not None:
            text = f"dropped a stale or duplicate {message.TYPE} from {worker.name}"
            if isinstance(message, ErrorReply) and request_id not in self.abandoned:  # an error nobody waits for is still news
                return [Log(logging.WARNING, f"{text}: {message.code}: {message.message}")]
            return [Log(logging.DEBUG, text)]
        if isinstance(message, ErrorReply):
            culprit = (peer_named(message.message)
                       if message.code in (ERR_PEER_LOST, ERR_BAD_PEER_DATA) else None)
            return self._failed(request, Fail(worker, f"worker {worker.name} failed "
                                                       f"{request.what}: {message.code}: "
                                                       f"{message.message}", culprit,
                                               evict=message.code == ERR_BAD_PEER_DATA))
        if request.message is not None:
            expected = expected_reply(request.message)
            if expected is not None and not isinstance(message, expected):
                return self._failed(request, Fail(
                    worker, f"worker {worker.name} answered {request.what} with "
                            f"{message.TYPE}, expected {expected.TYPE}"))
            mismatch = reply_mismatch(request.message, message)
            if mismatch is not None:
                return self._failed(request, Fail(
                    worker, f"worker {worker.name} answered {request.what} with {mismatch}"))
        request.reply = Reply(worker, message, now, payload_bytes(message))
        return [Completed(request_id, request.reply)]

    def _bad_message(self, error: ProtocolError) -> list[Action]:
        identity = error.identity
        sender = f" from {identity!r}" if identity else ""
        if isinstance(error, VersionMismatch):
            actions: list[Action] = [Log(logging.WARNING, f"refused a peer{sender}: {error}")]
            if not identity:
                return actions
            actions.append(Send(identity, Refuse(reason=str(error),
                                                 protocol_version=PROTOCOL_VERSION)))
            worker = self.workers.get(identity)
            if worker is not None and not worker.gone:  # refused: it will exit
                worker.gone = True
                actions += self._fail_requests_of(worker, "was refused during", str(error))
            return actions
        actions = [Log(logging.WARNING, f"bad message{sender}: {error}")]
        if not identity:
            return actions
        request_id = error.request_id if error.request_id is not None else NO_REQUEST_ID
        actions.append(Send(identity, ErrorReply(request_id=request_id, code=error.code,
                                                 message=str(error))))
        worker = self.workers.get(identity)
        request = self.requests.get(request_id)
        if (worker is not None and request is not None and request.worker is worker
                and request.reply is None):  # the reply we wait for is lost
            actions += self._failed(request, Fail(
                worker, f"worker {worker.name} sent an undecodable reply to "
                        f"{request.what}: {error}"))
        return actions

    @staticmethod
    def _failed(request: Request, fail: Fail) -> list[Action]:
        """``fail``, or none for a request answered beside training (its failure is kept
        on it, for :meth:`background_failure`)."""
        if not request.background:
            return [fail]
        request.failure = request.failure or fail.reason
        return []

    def background_failure(self, request_id: int) -> str:
        """Why a request answered beside training failed ("": it did not, or is unknown)."""
        request = self.requests.get(request_id)
        return request.failure if request is not None else ""

    def _tick(self, now: float, wall_time: float,
              stalled_peers: frozenset[str] = frozenset()) -> list[Action]:
        actions: list[Action] = []
        if now - self._last_beat >= self.settings.heartbeat_interval_s:
            self._last_beat = now
            for worker in self._heartbeated():
                if not worker.gone:
                    actions.append(Send(worker.identity, Heartbeat(sent_at=wall_time)))
        # members behind a dead link (their connection retransmits: not a stopped peer)
        links_down = {worker.identity for worker in self._heartbeated()
                      if self._link_suspect(worker, now)
                      and worker.peer_address in stalled_peers}
        for identity in links_down:
            self.workers[identity].link_down = True
        # a late answer from a worker that is heard from, while another awaited worker is
        # silent, is most likely waiting on the silent one (a peer's piece, a reduction):
        # the deadline defers to the liveness limit, which names the silent one
        silent_awaited = any(
            r.reply is None and not r.worker.gone and not r.background
            and now - r.worker.last_seen > SILENT_SUSPECT_BEATS * self.settings.heartbeat_interval_s
            for r in self.requests.values())
        for request in self.requests.values():
            if request.reply is not None or request.failure:
                continue
            request.link_down_seen = request.link_down_seen or bool(links_down)
            fault = self._request_fault(request, now, silent_awaited)
            if fault is not None:
                actions += self._failed(request, fault)
        return actions

    def _request_fault(self, request: Request, now: float, silent_awaited: bool) -> Fail | None:
        """Why ``request`` has failed by ``now``, or None while it may still be answered."""
        worker = request.worker
        silent_s = now - worker.last_seen
        if worker.gone:
            how = "lost its connection" if worker.connection_lost else "left"
            return Fail(worker, f"worker {worker.name} {how} during {request.what}")
        if worker.link_down and silent_s <= self.settings.link_retry_s:
            # seen behind a dead link since last heard: wait up to link_retry_s for TCP
            # to deliver, also once the master's own segments are acknowledged again
            # (the worker's side retransmits on its own back-off, up to seconds later)
            return None
        if silent_s > self.settings.liveness_timeout_s:
            worker.gone = True
            behind = " behind a link that does not acknowledge" if worker.link_down else ""
            return Fail(worker, f"worker {worker.name} stopped responding during "
                                f"{request.what} (silent for {silent_s:.1f} s{behind})")
        stalled = report_now(worker, now).stalled_s
        heard = silent_s <= SILENT_SUSPECT_BEATS * self.settings.heartbeat_interval_s
        if stalled > self.compute_stall_limit_s and heard and not request.background:
            # its socket thread says so: a silent worker is the liveness limit's to name
            return Fail(worker, f"worker {worker.name}'s compute thread has made no progress "
                                f"for {stalled:.1f} s (during {request.what}): hung")
        timeout = self._deadline_s(request)
        if now - request.sent_at > timeout and not (
                silent_awaited and not request.background
                and now - request.sent_at <= timeout + self.settings.liveness_timeout_s):
            if request.background:
                return Fail(worker, f"worker {worker.name} did not answer {request.what} "
                                    f"within {timeout:.0f} s")
            in_grace = now - request.sent_at <= timeout + self.settings.liveness_timeout_s
            return overdue_fault(
                worker, request.what, timeout, self._heartbeated(), self.own_compute, now,
                SILENT_SUSPECT_BEATS * self.settings.heartbeat_interval_s if in_grace else None)
        return None

    def _deadline_s(self, request: Request) -> float:
        """A request's deadline: its own or the backstop, ``link_retry_s`` longer when a
        member's link was down while it waited (its answer may wait on that member)."""
        timeout = request.timeout_s or self.settings.request_timeout_s
        return timeout + self.settings.link_retry_s if request.link_down_seen else timeout

    def _request_sent(self, worker: WorkerHandle, request: Message, now: float) -> list[Action]:
        request_id = getattr(request, "request_id", None)
        if expected_reply(request) is not None and isinstance(request_id, int):
            self.requests[request_id] = Request(worker, now, request)
        return []

    def _awaited(self, pending: Mapping[int, WorkerHandle], what: str,
                 now: float, timeout_s: float | None = None,
                 background: bool = False) -> list[Action]:
        for request_id, worker in pending.items():
            request = self.requests.get(request_id)
            if request is None or request.worker is not worker:
                request = self.requests[request_id] = Request(worker, now, None)
            request.what = what
            request.timeout_s = timeout_s
            request.background = background
        return []

    def _fail_requests_of(self, worker: WorkerHandle, verb: str, detail: str) -> list[Action]:
        """One Fail per unanswered request of ``worker``: "worker W <verb> <what>: <detail>"."""
        return [action for request in self.requests.values()
                if request.worker is worker and request.reply is None
                for action in self._failed(request, Fail(
                    worker, f"worker {worker.name} {verb} {request.what}: {detail}"))]
