"""The master's socket loop: one ROUTER socket feeding :class:`Membership`.

A :class:`Cluster` binds the master's ROUTER socket (used only from the thread that
owns it), polls it, decodes what arrives and hands every message, undecodable
message and timer tick to :class:`hetconv.master.membership.Membership`, which
decides everything: Welcome or Refuse a Hello, answer strangers, heartbeat the
members, match replies to requests, and when a worker is lost. The cluster
performs what it decides: it sends its messages, logs its lines and raises
:class:`WorkerLost` (one line naming the worker) on its first failure.
:meth:`Cluster.gather` waits for the replies to a set of requests under two
deadlines: a worker silent for ``liveness_timeout_s`` and a request older than
``request_timeout_s``. Garbage and stale replies are answered or dropped and
never disturb the run; with CURVE, a message under a worker's routing id from another
key is refused (``Membership`` binds each routing id to its key).
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import zmq

from hetconv.engine.stage import StageFault
from hetconv.errors import UserError
from hetconv.master.liveness import canonical_address, read_stalled_peers
from hetconv.master.membership import (
    Action,
    BadMessage,
    ClusterSettings,
    Completed,
    Fail,
    Log,
    Membership,
    MessageReceived,
    Reply,
    RequestsAwaited,
    RequestSent,
    Send,
    SendFailed,
    Tick,
    WorkerHandle,
    payload_bytes,
)
from hetconv.participant.progress import ComputeProgress
from hetconv.protocol import (
    EndRun,
    ErrorReply,
    Message,
    ProtocolError,
    Refuse,
    admission,
    limits,
    transport,
)

__all__ = ["Cluster", "ClusterSettings", "Reply", "WorkerHandle", "WorkerLost",
           "payload_bytes"]

log = logging.getLogger("hetconv.master")

END_RUN_POLL_S = 0.05
"""Poll interval while collecting the Acks to EndRun."""


class WorkerLost(StageFault):
    """A worker died, went silent or answered with an error during a run.

    ``participant``: the worker at fault; ``gone``: it is dead, silent past the
    liveness timeout or has left (not merely late or wrong)."""


class Cluster:
    """The master's ROUTER socket and the :class:`Membership` it feeds.

    ``curve``: the server keys for CURVE encryption, or None for plain ZMTP on a
    trusted LAN.
    """

    def __init__(self, endpoint: str, settings: ClusterSettings | None = None,
                 curve: transport.CurveServerKeys | None = None) -> None:
        self.endpoint = endpoint
        self.settings = settings if settings is not None else ClusterSettings()
        self.curve = curve
        # the master's own peer waits (its participant's exchanges mark it): the blame of an
        # overdue request follows waits through the master too (hetconv/master/blame.py)
        self.own_progress = ComputeProgress()
        self.membership = Membership(uuid.uuid4().hex[:12], self.settings)
        self.ctx = transport.make_context()
        self._authenticator: Any = None
        if curve is not None:  # the ZAP handler must run before the socket binds
            self._authenticator = transport.start_curve_authenticator(
                self.ctx, curve.allowed_client_keys)
        try:
            self.sock = transport.master_socket(self.ctx, endpoint, curve=curve)
        except zmq.ZMQError as error:
            if self._authenticator is not None:
                self._authenticator.stop()
            self.ctx.term()
            raise UserError(f"cannot listen on {endpoint}: {error.strerror}; use another "
                            "port or address (e.g. --listen tcp://*:5556)") from None
        if curve is not None:
            # With CURVE a routing id belongs to the first connection that holds it: with
            # ROUTER_HANDOVER any allowed key could take over a live worker's routing id
            # (libzmq hands the id to the newest connection before any message says
            # whose key it is), receive its traffic and leave its connection mute until
            # it is evicted. A duplicate connection now stays mute instead. The cost: a
            # worker's own reconnect that arrives while this socket still holds its old
            # connection is mute too (libzmq never reads its routing id again) until the
            # worker opens another connection.
            self.sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        self.extra_sockets: list[zmq.Socket[Any]] = []  # polled too: they wake pump early
        bound = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp://host:port
        self.port = int(bound.rsplit(":", 1)[1]) if bound.startswith("tcp://") else 0
        self.budget = admission.SenderBudget()  # per-sender reads, error replies, warnings

    @property
    def run_id(self) -> str:
        return self.membership.run_id

    @property
    def members(self) -> list[WorkerHandle]:
        return self.membership.members

    def known_workers(self) -> list[WorkerHandle]:
        """Every worker that said Hello to this master (members or not), gone ones too."""
        return list(self.membership.workers.values())

    def misbehaving(self, worker_id: str) -> bool:
        """Whether ``worker_id``'s process was evicted for failing its peers (Hello again
        from the same process keeps the mark; a restarted one has a new routing id)."""
        return any(w.misbehaved for w in self.membership.workers.values()
                   if w.worker_id == worker_id)

    def admit(self, workers: list[WorkerHandle]) -> None:
        """Make ``workers`` members of the run too (a join): heartbeats go to them."""
        self.membership.fix_members([w for w in self.membership.members if not w.gone]
                                    + workers)

    # --- sending -------------------------------------------------------------------------
    def request_id(self) -> int:
        return self.membership.next_request_id()

    def send(self, worker: WorkerHandle, message: Message) -> int:
        """Send to a worker; returns the array payload bytes. A vanished worker raises."""
        try:
            transport.send_message(self.sock, message, identity=worker.identity)
        except transport.TransportError as error:
            self._perform(self.membership.handle(SendFailed(worker, str(error))))
            raise  # not reached: SendFailed always answers with a Fail
        self.membership.handle(RequestSent(worker, message, time.monotonic()))
        return payload_bytes(message)

    def _perform(self, actions: Iterable[Action]) -> list[Reply]:
        """Send, log; raise :class:`WorkerLost` for the first failure once the rest is
        done. Returns the replies completed."""
        replies: list[Reply] = []
        failure: Fail | None = None
        for action in actions:
            match action:
                case Send():
                    try:  # never blocks: a peer that does not read cannot hold us
                        transport.send_message(self.sock, action.message,
                                               identity=action.identity, block=False)
                    except transport.PeerUnreachable as error:
                        # no connection with this identity any more: its process died
                        # (the kernel closed its socket) or the link was silent past
                        # ZMTP's heartbeat timeout. A live worker behind a short cut
                        # keeps its connection, so this does not fire for it.
                        self.membership.connection_lost(action.identity)
                        log.debug("%s to %r not sent: %s", action.message.TYPE,
                                  action.identity, error)
                    except transport.TransportError as error:
                        log.debug("%s to %r not sent: %s", action.message.TYPE,
                                  action.identity, error)
                case Log():
                    log.log(action.level, "%s", action.text)
                case Fail():
                    failure = failure or action
                case Completed():
                    replies.append(action.reply)
        if failure is not None:
            culprit = failure.culprit or failure.worker.worker_id
            gone = failure.worker.gone if failure.culprit is None else False
            raise WorkerLost(failure.reason, culprit, gone, failure.evict)
        return replies

    # --- receiving -----------------------------------------------------------------------
    def pump(self, timeout_s: float) -> list[Reply]:
        """Handle what arrives within ``timeout_s`` (handshakes, heartbeats, replies,
        garbage), then a timer tick; return the replies matched. Raises
        :class:`WorkerLost`. Wakes early for any socket in ``extra_sockets``."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        for extra in self.extra_sockets:
            poller.register(extra, zmq.POLLIN)
        events = dict(poller.poll(int(max(0.0, timeout_s) * 1000)))
        for extra in self.extra_sockets:
            if extra in events:
                while extra.poll(0):
                    extra.recv()
        actions: list[Action] = []
        now = time.monotonic()
        # Read what is waiting before the tick judges liveness, but at most
        # MAX_MESSAGES_PER_POLL messages: a flood waits, fair-queued with the workers'
        # replies, instead of holding the training thread; a sender over its budget
        # is dropped undecoded.
        members = {w.identity for w in self.membership.members}  # empty: before the run

        def admit(identity: bytes) -> bool:
            return self.budget.admit(identity, now, identity in self.membership.workers,
                                     joiner=bool(members) and identity not in members)

        for _ in range(limits.MAX_MESSAGES_PER_POLL):
            try:
                received = transport.recv_routed(self.sock, admit,
                                                 admitted=self.membership.workers)
            except ProtocolError as error:
                # the connection's User-Id, where the transport read it (None: unknown)
                user_id: str | None = getattr(error, "user_id", None)
                actions += self._complaints(error.identity, now, self.membership.handle(
                    BadMessage(error, user_id, now)))
                continue
            if received is None:
                break
            if isinstance(received, bytes):  # over its budget: dropped unread
                continue
            actions += self._complaints(received.identity, now, self.membership.handle(
                MessageReceived(received.identity, received.message, now, received.user_id,
                                canonical_address(received.peer_address))))
        now = time.monotonic()
        self.membership.own_compute = self.own_progress.report(now)
        actions += self.membership.handle(Tick(now, time.time(), self._stalled_peers(now)))
        return self._perform(actions)

    def _complaints(self, identity: bytes | None, now: float,
                    actions: list[Action]) -> list[Action]:
        """``actions`` with the error replies and warnings about ``identity`` kept to
        MAX_ERROR_REPLIES_PER_SENDER per window; the next warning says how many
        messages were dropped or not answered since."""
        if not identity:
            return actions
        complaints = [a for a in actions
                      if (isinstance(a, Send) and a.identity == identity
                          and isinstance(a.message, (ErrorReply, Refuse)))
                      or (isinstance(a, Log) and a.level >= logging.WARNING)]
        if not complaints:
            return actions
        if not self.budget.may_complain(identity, now):
            left_out = {id(a) for a in complaints}
            return [a for a in actions if id(a) not in left_out]
        dropped, suppressed = self.budget.take_counts(identity)
        if not dropped and not suppressed:
            return actions
        note = Log(logging.WARNING, f"from {identity!r} since the last warning: "
                                    f"{dropped} message(s) dropped over its budget, "
                                    f"{suppressed} bad message(s) not answered")
        return [*actions, note]

    def _stalled_peers(self, now: float) -> frozenset[str]:
        """The addresses behind a dead link (master/liveness.py), read only while a
        member with a known address is silent (``Membership.link_suspects``)."""
        if self.port and self.membership.link_suspects(now):
            return read_stalled_peers(self.port)
        return frozenset()

    # --- membership ------------------------------------------------------------------------
    def wait_for_workers(self, count: int, wait_s: float,
                         report: Callable[[str], None] = print) -> list[WorkerHandle]:
        """Block until ``count`` live workers said hello (at most ``wait_s``), fix the members."""
        deadline = time.monotonic() + wait_s
        seen = 0
        report(f"hetconv: listening on {self.endpoint}, waiting for {count} worker(s) "
               f"(up to {wait_s:.0f} s)")
        while True:
            self.pump(0.1)
            alive = self.membership.live_workers(time.monotonic())
            if len(alive) != seen:
                seen = len(alive)
                report(f"hetconv: {seen}/{count} worker(s): "
                       + ", ".join(w.name for w in alive))
            if len(alive) >= count:
                return self.membership.fix_members(alive)
            if time.monotonic() >= deadline:
                raise UserError(f"only {len(alive)} of {count} worker(s) connected to "
                                f"{self.endpoint} within {wait_s:.0f} s; start workers with "
                                f"'hetconv worker --master tcp://<this-host>:<port>' or lower "
                                "--min-workers")

    # --- request / reply -------------------------------------------------------------------
    def gather(self, pending: dict[int, WorkerHandle], what: str,
               done: Callable[[], bool] = lambda: True,
               timeout_s: float | None = None) -> dict[int, Reply]:
        """Replies to ``pending`` request ids; also waits until ``done()`` is true.

        Raises :class:`WorkerLost` naming the worker when one goes silent for
        ``liveness_timeout_s``, answers with an ErrorReply or wrongly, leaves, or
        leaves a request unanswered for ``request_timeout_s``.
        """
        self.membership.handle(RequestsAwaited(pending, what, time.monotonic(), timeout_s))
        if timeout_s is not None:  # a hung compute thread is one stalled longer than this
            self.membership.compute_stall_limit_s = timeout_s
        try:
            while True:
                replies = self.membership.replies_for(pending)
                if replies is not None and done():
                    return replies
                self.pump(0.5 if replies is None else 0.05)
        finally:
            self.membership.forget(pending)

    def send_beside(self, requests: Sequence[tuple[WorkerHandle, Message]], what: str,
                    timeout_s: float) -> list[int]:
        """Send requests answered beside training (a joiner's calibration): their replies
        and failures are kept for :meth:`beside_results`, never raised into a gather;
        ``timeout_s`` from now. A worker that cannot be sent to fails its requests."""
        pending: dict[int, WorkerHandle] = {}
        failed: list[int] = []
        for worker, message in requests:
            request_id = int(getattr(message, "request_id", -1))
            try:
                self.send(worker, message)
            except WorkerLost:
                failed.append(request_id)
            pending[request_id] = worker
        self.membership.handle(RequestsAwaited(pending, what, time.monotonic(), timeout_s,
                                               background=True))
        for request_id in failed:
            self.membership.requests[request_id].failure = (
                f"worker {pending[request_id].name} could not be sent {what}")
        return list(pending)

    def beside_results(self, request_ids: list[int]) -> tuple[dict[int, Reply] | None, str]:
        """The replies to requests sent with :meth:`send_beside` (None while one is still
        out) and the first failure among them ("" if none)."""
        failure = next((f for f in map(self.membership.background_failure, request_ids) if f),
                       "")
        return self.membership.replies_for(request_ids), failure

    def forget(self, request_ids: list[int]) -> None:
        """Stop tracking these requests (late replies are dropped)."""
        self.membership.forget(request_ids)

    def drop(self, worker: WorkerHandle, reason: str, misbehaved: bool = False) -> None:
        """Evict a live worker from the run: tell it the run is over (it drops its
        shards and stays up, so it may say Hello again), without waiting; from now on
        it counts as gone and its late replies are dropped. ``misbehaved``: it failed its
        peers while answering the master; it stays out until its process restarts
        (:meth:`misbehaving`)."""
        try:
            transport.send_message(self.sock, EndRun(request_id=self.request_id(),
                                                     reason=reason), identity=worker.identity)
        except transport.TransportError as error:
            log.debug("EndRun to %s not sent: %s", worker.name, error)
        worker.gone = True
        worker.misbehaved = misbehaved
        log.warning("worker %s evicted: %s%s", worker.name, reason,
                    "; it stays out of this run until its process restarts" if misbehaved
                    else "")

    def end_run(self, reason: str, wait_s: float = 1.0) -> None:
        """Tell every member the run is over (they drop shards and stay up); waits up to
        ``wait_s`` for their Acks and never raises for a lost worker."""
        self.membership.forget_all()  # nothing sent before is awaited any more
        pending: dict[int, WorkerHandle] = {}
        for worker in self.members:
            if worker.gone:
                continue
            request_id = self.request_id()
            try:
                self.send(worker, EndRun(request_id=request_id, reason=reason))
            except WorkerLost:
                continue
            pending[request_id] = worker
        self.membership.handle(RequestsAwaited(pending, "the end of the run",
                                               time.monotonic()))
        deadline = time.monotonic() + wait_s
        try:
            while (self.membership.replies_for(pending) is None
                   and time.monotonic() < deadline):
                self.pump(END_RUN_POLL_S)
        except WorkerLost as error:
            log.debug("not waiting for the other Acks: %s", error)
        finally:
            self.membership.forget_all()

    def close(self) -> None:
        self.sock.close(linger=200)
        for extra in self.extra_sockets:
            extra.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self.ctx.term()
