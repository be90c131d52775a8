"""The master's side of the wire: membership, heartbeats and request/reply matching.

One ROUTER socket, used only from the thread that owns the :class:`Cluster`.
Workers say Hello (version-checked: a mismatch gets a Refuse naming both
versions), then heartbeat. :meth:`Cluster.gather` waits for the replies to a set
of requests with two deadlines: a worker silent for ``liveness_timeout_s`` (no
heartbeat, no reply) is reported dead by name, and no request waits longer than
``request_timeout_s``. Garbage and stale replies are answered or dropped and never
disturb the run.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from hetconv.errors import UserError
from hetconv.protocol import (
    PROTOCOL_VERSION,
    Ack,
    EndRun,
    ErrorReply,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    Refuse,
    VersionMismatch,
    Welcome,
    limits,
    transport,
)

log = logging.getLogger("hetconv.master")

REPLY_TYPES = ("ForwardReply", "BackwardReply", "CalibrateReply", "SnapshotReply", "Ack",
               "ErrorReply")


class WorkerLost(UserError):
    """A worker died, went silent or answered with an error during a run."""


@dataclass
class WorkerHandle:
    """What the master knows of one connected worker."""

    identity: bytes
    worker_id: str
    device: dict[str, Any]
    last_seen: float
    gone: bool = False

    @property
    def name(self) -> str:
        return f"{self.worker_id} ({self.device.get('device', '?')})"


@dataclass(frozen=True)
class ClusterSettings:
    """Deadlines of the master's side (defaults from ``protocol.limits``)."""

    heartbeat_interval_s: float = limits.DEFAULT_HEARTBEAT_INTERVAL_S
    liveness_timeout_s: float = (limits.DEFAULT_HEARTBEAT_INTERVAL_S
                                 * limits.DEFAULT_HEARTBEAT_LIVENESS)
    request_timeout_s: float = limits.DEFAULT_REQUEST_TIMEOUT_S


@dataclass
class Reply:
    worker: WorkerHandle
    message: Message
    received_at: float
    payload_bytes: int


def payload_bytes(message: Message) -> int:
    """Bytes of array payload a message carries (what crosses the network, roughly)."""
    return sum(value.nbytes for value in vars(message).values() if isinstance(value, np.ndarray))


@dataclass
class Cluster:
    endpoint: str
    settings: ClusterSettings = field(default_factory=ClusterSettings)
    curve: transport.CurveServerKeys | None = None  # None: plain ZMTP (trusted LAN)

    def __post_init__(self) -> None:
        self.run_id = uuid.uuid4().hex[:12]
        self.ctx = transport.make_context()
        self._authenticator: Any = None
        if self.curve is not None:  # the ZAP handler must run before the socket binds
            self._authenticator = transport.start_curve_authenticator(
                self.ctx, self.curve.allowed_client_keys)
        try:
            self.sock = transport.master_socket(self.ctx, self.endpoint, curve=self.curve)
        except zmq.ZMQError as error:
            if self._authenticator is not None:
                self._authenticator.stop()
            self.ctx.term()
            raise UserError(f"cannot listen on {self.endpoint}: {error.strerror}; use another "
                            "port or address (e.g. --listen tcp://*:5556)") from None
        self.workers: dict[bytes, WorkerHandle] = {}
        self.members: list[WorkerHandle] = []
        self._next_request_id = 1
        self._last_beat = 0.0
        self._inbox: list[Reply] = []
        self.extra_sockets: list[zmq.Socket[Any]] = []

    # --- ids and sending ----------------------------------------------------------
    def request_id(self) -> int:
        rid = self._next_request_id
        self._next_request_id += 1
        return rid

    def send(self, worker: WorkerHandle, message: Message) -> int:
        """Send to a worker; returns the array payload bytes. A vanished worker raises."""
        try:
            transport.send_message(self.sock, message, identity=worker.identity)
        except transport.TransportError as error:
            worker.gone = True
            raise WorkerLost(f"worker {worker.name} is unreachable: {error}") from None
        return payload_bytes(message)

    def alive_workers(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if not w.gone]

    # --- receiving -----------------------------------------------------------------
    def pump(self, timeout_s: float) -> list[Reply]:
        """Handle what arrives within ``timeout_s`` (handshakes, heartbeats, garbage);
        return the replies. Wakes early for any socket in ``extra_sockets``."""
        self._heartbeat_if_due()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        for extra in self.extra_sockets:
            poller.register(extra, zmq.POLLIN)
        events = dict(poller.poll(int(max(0.0, timeout_s) * 1000)))
        for extra in self.extra_sockets:
            if extra in events:
                while extra.poll(0):
                    extra.recv()
        replies: list[Reply] = []
        while self.sock.poll(0):
            try:
                received = transport.recv_message(self.sock, 0, with_identity=True)
            except VersionMismatch as error:
                self._refuse(error)
                continue
            except ProtocolError as error:
                self._bad_message(error)
                continue
            if received is None:
                break
            identity, message = received
            reply = self._handle(identity, message)
            if reply is not None:
                replies.append(reply)
        return replies

    def _refuse(self, error: VersionMismatch) -> None:
        identity = getattr(error, "identity", None)
        log.warning("refused a peer: %s", error)
        if identity:
            self._safe_send(identity, Refuse(reason=str(error), protocol_version=PROTOCOL_VERSION))

    def _bad_message(self, error: ProtocolError) -> None:
        identity = getattr(error, "identity", None)
        log.warning("bad message%s: %s", f" from {identity!r}" if identity else "", error)
        if identity:
            self._safe_send(identity, ErrorReply(
                request_id=getattr(error, "request_id", None) or 0, code=error.code,
                message=str(error)))

    def _safe_send(self, identity: bytes, message: Message) -> None:
        try:
            transport.send_message(self.sock, message, identity=identity)
        except transport.TransportError:
            pass

    def _handle(self, identity: bytes, message: Message) -> Reply | None:
        now = time.monotonic()
        worker = self.workers.get(identity)
        if isinstance(message, Hello):
            self._hello(identity, message, now)
            return None
        if worker is None or worker.gone:
            self._safe_send(identity, ErrorReply(request_id=0, code="unknown_worker",
                                                 message="say hello first"))
            return None
        worker.last_seen = now
        if isinstance(message, Heartbeat):
            return None
        if isinstance(message, Goodbye):
            log.warning("worker %s left: %s", worker.name, message.reason)
            worker.gone = True
            return None
        if type(message).__name__ in REPLY_TYPES:
            return Reply(worker, message, now, payload_bytes(message))
        self._safe_send(identity, ErrorReply(request_id=int(getattr(message, "request_id", 0)),
                                             code="bad_request",
                                             message=f"the master does not serve {message.TYPE}"))
        return None

    def _hello(self, identity: bytes, hello: Hello, now: float) -> None:
        if hello.protocol_version != PROTOCOL_VERSION:
            reason = (f"protocol version mismatch: master speaks {PROTOCOL_VERSION}, worker "
                      f"{hello.worker_id} speaks {hello.protocol_version}; install the same "
                      "hetconv version on both")
            log.warning("refused worker %s: %s", hello.worker_id, reason)
            self._safe_send(identity, Refuse(reason=reason, protocol_version=PROTOCOL_VERSION))
            return
        known = self.workers.get(identity)
        if known is None or known.gone:
            worker = WorkerHandle(identity, hello.worker_id, dict(hello.device), now)
            self.workers[identity] = worker
            log.info("worker %s joined: %s", worker.name, hello.device.get("name"))
        else:
            known.last_seen = now
        self._safe_send(identity, Welcome(worker_id=hello.worker_id, run_id=self.run_id,
                                          heartbeat_interval_s=self.settings.heartbeat_interval_s,
                                          protocol_version=PROTOCOL_VERSION))

    def _heartbeat_if_due(self) -> None:
        now = time.monotonic()
        if now - self._last_beat < self.settings.heartbeat_interval_s:
            return
        self._last_beat = now
        for worker in self.members or self.alive_workers():
            if not worker.gone:
                self._safe_send(worker.identity, Heartbeat(sent_at=time.time()))

    # --- membership ------------------------------------------------------------------
    def wait_for_workers(self, count: int, wait_s: float,
                         report: Callable[[str], None] = print) -> list[WorkerHandle]:
        """Block until ``count`` workers said hello (at most ``wait_s``), fix the members."""
        deadline = time.monotonic() + wait_s
        seen = 0
        report(f"hetconv: listening on {self.endpoint}, waiting for {count} worker(s) "
               f"(up to {wait_s:.0f} s)")
        while True:
            self.pump(0.1)
            alive = [w for w in self.alive_workers()
                     if time.monotonic() - w.last_seen < self.settings.liveness_timeout_s]
            if len(alive) != seen:
                seen = len(alive)
                report(f"hetconv: {seen}/{count} worker(s): "
                       + ", ".join(w.name for w in alive))
            if len(alive) >= count:
                self.members = sorted(alive, key=lambda w: w.worker_id)
                return self.members
            if time.monotonic() >= deadline:
                raise UserError(f"only {len(alive)} of {count} worker(s) connected to "
                                f"{self.endpoint} within {wait_s:.0f} s; start workers with "
                                f"'hetconv worker --master tcp://<this-host>:<port>' or lower "
                                "--min-workers")

    # --- request / reply ---------------------------------------------------------------
    def gather(self, pending: dict[int, WorkerHandle], what: str,
               done: Callable[[], bool] = lambda: True) -> dict[int, Reply]:
        """Replies to ``pending`` request ids; also waits until ``done()`` is true.

        Raises :class:`WorkerLost` naming the worker when one goes silent for
        ``liveness_timeout_s``, answers with an ErrorReply, or leaves.
        """
        results: dict[int, Reply] = {}
        start = time.monotonic()
        while len(results) < len(pending) or not done():
            for reply in self.pump(0.5 if len(results) < len(pending) else 0.05):
                rid = getattr(reply.message, "request_id", None)
                if rid not in pending or pending[rid] is not reply.worker or rid in results:
                    log.debug("dropped a stale or unexpected %s from %s",
                              reply.message.TYPE, reply.worker.name)
                    continue
                if isinstance(reply.message, ErrorReply):
                    raise WorkerLost(f"worker {reply.worker.name} failed {what}: "
                                     f"{reply.message.code}: {reply.message.message}")
                results[rid] = reply
            now = time.monotonic()
            for rid, worker in pending.items():
                if rid in results:
                    continue
                if worker.gone:
                    raise WorkerLost(f"worker {worker.name} left during {what}")
                if now - worker.last_seen > self.settings.liveness_timeout_s:
                    worker.gone = True
                    raise WorkerLost(f"worker {worker.name} stopped responding during {what} "
                                     f"(silent for {now - worker.last_seen:.1f} s)")
            if now - start > self.settings.request_timeout_s:
                raise WorkerLost(f"{what} took longer than {self.settings.request_timeout_s:.0f} s")
        return results

    def end_run(self, reason: str, wait_s: float = 1.0) -> None:
        """Tell every member the run is over (they drop shards and stay up)."""
        pending: dict[int, WorkerHandle] = {}
        for worker in self.members:
            if worker.gone:
                continue
            rid = self.request_id()
            try:
                self.send(worker, EndRun(request_id=rid, reason=reason))
                pending[rid] = worker
            except WorkerLost:
                continue
        deadline = time.monotonic() + wait_s
        acked: set[int] = set()
        while len(acked) < len(pending) and time.monotonic() < deadline:
            for reply in self.pump(0.05):
                if isinstance(reply.message, Ack):
                    acked.add(reply.message.request_id)

    def close(self) -> None:
        self.sock.close(linger=200)
        for extra in self.extra_sockets:
            extra.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self.ctx.term()
