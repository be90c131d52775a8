"""The worker daemon: connect to a master, serve it, survive across runs.

The main thread owns the ZeroMQ DEALER socket: it says Hello (retrying with
back-off until a master answers), sends heartbeats, and passes compute requests
to one compute thread, whose replies come back through an inproc socket. So the
worker keeps heartbeating while it computes, and the master can tell a busy
worker from a dead one. After a run ends, or when the master goes silent, the
daemon drops its shards and waits for the next master. SIGTERM/SIGINT stop it
within a second or two. What to do when is decided by :class:`WorkerSession`
(worker/session.py, no I/O); this module only polls, decodes, feeds it events
and carries out its actions. It also binds the worker's data endpoint (the peer
data plane, :mod:`hetconv.participant.peer_sockets`), which only the compute thread uses after
start-up, and announces it to the master after every Welcome; while the compute
thread has nothing to do outside a run it drains that endpoint, so nothing a
stranger sends there stays in memory.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import threading
import time
import uuid
from typing import Any

import zmq

from hetconv.backend import set_blas_threads
from hetconv.config import WorkerConfig
from hetconv.device_info import describe_device
from hetconv.participant.peer_sockets import PeerSockets, route_address
from hetconv.prometheus import Exporter, WorkerTotals
from hetconv.protocol import (
    ERR_INTERNAL,
    ERR_UNKNOWN_WORKER,
    ErrorReply,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    limits,
    transport,
)
from hetconv.worker.service import ENDS_EXCHANGES, FaultInjector, WorkerService
from hetconv.worker.session import (
    BadMessage,
    Compute,
    Event,
    Exit,
    Log,
    MessageReceived,
    ReplyReady,
    Send,
    StopRequested,
    Tick,
    WorkerSession,
)

log = logging.getLogger("hetconv.worker")

IDLE_DRAIN_INTERVAL_S = 0.5
"""How often an idle compute thread drains the data endpoint outside a run."""


class WorkerDaemon:
    """One worker process: a socket loop around a :class:`WorkerService`."""

    def __init__(self, config: WorkerConfig, exporter: Exporter | None = None,
                 faults: FaultInjector | None = None):
        self.config = config
        self.exporter = exporter  # --metrics-port: what this worker served, for /metrics
        self.joined_line = ""  # said once per session (master, data endpoint, CURVE)
        set_blas_threads(config.threads)
        self.service = WorkerService(config.device, faults=faults)  # faults: tests only
        self.device = describe_device(config.device, threads=config.threads)
        host = socket.gethostname()
        self.worker_id = config.name or f"{host}-{os.getpid()}-{config.device}"
        self.identity = f"{self.worker_id}-{uuid.uuid4().hex[:6]}".encode()
        self.stop_event = threading.Event()
        self._requests: queue.Queue[Message | None] = queue.Queue()
        self._replies: queue.Queue[Message] = queue.Queue()

    # --- compute thread ----------------------------------------------------------
    def _compute_loop(self, ctx: zmq.Context[Any], wake_endpoint: str) -> None:
        wake = ctx.socket(zmq.PAIR)
        wake.setsockopt(zmq.LINGER, 0)
        wake.connect(wake_endpoint)
        wait_s = IDLE_DRAIN_INTERVAL_S
        try:
            while True:
                try:
                    request = self._requests.get(timeout=wait_s)
                except queue.Empty:
                    # while something floods the idle data port, release it as fast as it
                    # comes (a request is still taken up first): memory stays flat
                    wait_s = 0.0 if self.service.drain_idle_data_plane() else \
                        IDLE_DRAIN_INTERVAL_S
                    continue
                wait_s = IDLE_DRAIN_INTERVAL_S
                if request is None:
                    return
                started = time.perf_counter()
                reply = self.service.handle(request)
                if self.exporter is not None:
                    seconds = time.perf_counter() - started
                    self.exporter.observe_served(request, reply, seconds)
                self._replies.put(reply)
                try:
                    wake.send(b"", zmq.NOBLOCK)
                except zmq.ZMQError:  # the main loop is gone (stopping): nobody to wake
                    return
        finally:
            wake.close()

    # --- main loop ---------------------------------------------------------------
    def run(self) -> int:
        """Serve until stopped; the exit status (0 clean, 3 refused by the master)."""
        ctx = transport.make_context()
        wake_endpoint = f"inproc://wake-{uuid.uuid4().hex}"
        wake = ctx.socket(zmq.PAIR)
        wake.setsockopt(zmq.LINGER, 0)
        wake.bind(wake_endpoint)
        compute = threading.Thread(target=self._compute_loop, args=(ctx, wake_endpoint),
                                   name="hetconv-compute", daemon=True)
        curve = self.config.curve
        try:
            data = PeerSockets(ctx, f"tcp://*:{self.config.data_port}",
                               curve=(curve.public_key, curve.secret_key) if curve else None)
        except BaseException:
            wake.close()
            ctx.term()
            raise
        self.service.data_plane = data  # from now on only the compute thread touches it
        compute.start()
        sock = transport.worker_socket(ctx, self.config.master, self.identity,
                                       curve=self.config.curve)
        address = self.config.advertise or route_address(self.config.master)
        self.joined_line = (f"serving master {self.config.master}; data endpoint "
                            f"{data.endpoint(address)} (peers connect here); CURVE "
                            f"{'on' if curve else 'off (plain TCP: a trusted LAN only)'}")
        log.info("worker %s (%s: %s) connecting to %s; data endpoint %s", self.worker_id,
                 self.config.device, self.device.get("name"), self.config.master,
                 data.endpoint(address))
        try:
            return self._serve(sock, wake, data.endpoint(address), data.public_key)
        finally:
            self._requests.put(None)
            self._send(sock, Goodbye(worker_id=self.worker_id, reason="stopping"))
            sock.close(linger=200)
            wake.close()
            compute.join(timeout=1.0)
            if not compute.is_alive():
                data.close()
                ctx.term()

    def _serve(self, sock: zmq.Socket[Any], wake: zmq.Socket[Any], data_endpoint: str = "",
               data_public_key: str = "") -> int:
        """Poll, decode, feed the session, perform its actions; the exit status."""
        session = WorkerSession(self.config, self.worker_id, self.device, data_endpoint,
                                data_public_key, compute=self.service.progress)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        poll_timeout_ms = int(self.config.poll_interval_s * 1000)
        stop_fed = False
        while True:
            now = time.monotonic()
            events: list[Event] = []
            if self.stop_event.is_set() and not stop_fed:
                events.append(StopRequested(now))
                stop_fed = True
            events.append(Tick(now, time.time()))
            status = self._feed(session, sock, events)
            if status is not None:
                return status
            ready = dict(poller.poll(timeout=poll_timeout_ms))
            events = []
            if wake in ready:
                while wake.poll(0):
                    wake.recv()
                while not self._replies.empty():
                    events.append(ReplyReady(self._replies.get()))
            if sock in ready:
                events += self._receive(sock)
            status = self._feed(session, sock, events)
            if status is not None:
                return status

    def _feed(self, session: WorkerSession, sock: zmq.Socket[Any],
              events: list[Event]) -> int | None:
        """Feed ``events`` to the session and carry out its actions in order; the exit
        status once an action says to exit."""
        for event in events:
            was_in = session.in_session
            for action in session.handle(event):
                match action:
                    case Send():
                        self._send(sock, action.message)
                    case Compute():
                        if isinstance(action.request, ENDS_EXCHANGES):
                            self.service.cancel_wait.set()  # a peer wait ends at once
                        self._requests.put(action.request)
                    case Log():
                        log.log(action.level, "%s", action.text)
                    case Exit():
                        return action.status
            if was_in != session.in_session:
                self._session_changed(session.in_session, event)
        return None

    def _session_changed(self, joined: bool, event: Event) -> None:
        """Say once that the worker is in (with what peers and the master must reach);
        count sessions and evictions for /metrics."""
        if joined:
            log.info("%s", self.joined_line)
        else:  # out of the run: a wait for its peers' pieces (a chain) waits for nobody
            self.service.cancel_wait.set()
        evicted = (not joined and isinstance(event, MessageReceived)
                   and isinstance(event.message, ErrorReply)
                   and event.message.code == ERR_UNKNOWN_WORKER)
        if self.exporter is not None:
            def change(totals: WorkerTotals) -> None:
                totals.in_run = int(joined)
                totals.runs_joined += int(joined)
                totals.evictions_seen += int(evicted)
            self.exporter.update(change)

    def _receive(self, sock: zmq.Socket[Any]) -> list[Event]:
        """Every message waiting on ``sock``, decoded, as session events (a message
        over ``MAX_TOTAL_BYTES`` is released while it is read: ``transport.recv_frames``)."""
        events: list[Event] = []
        for _ in range(limits.MAX_MESSAGES_PER_POLL):  # a flood cannot starve the loop
            if not sock.poll(0):
                break
            try:
                message = transport.recv_message(sock, 0)
            except ProtocolError as error:
                events.append(BadMessage(error, now=time.monotonic()))
                continue
            if message is None:
                break
            events.append(MessageReceived(message, time.monotonic()))
        return events

    def _send(self, sock: zmq.Socket[Any], message: Message) -> None:
        """Send; hellos, heartbeats and goodbyes are dropped rather than queued behind a
        missing master (SNDTIMEO 0), replies may wait for ``DEFAULT_SEND_TIMEOUT_MS``."""
        control = isinstance(message, (Hello, Heartbeat, Goodbye))
        sock.setsockopt(zmq.SNDTIMEO, 0 if control else limits.DEFAULT_SEND_TIMEOUT_MS)
        try:
            transport.send_message(sock, message)
        except transport.TransportError as error:
            log.debug("%s not sent: %s", type(message).__name__, error)
        except ProtocolError as error:  # a reply the codec will not encode (too big)
            log.warning("%s not sent: %s", type(message).__name__, error)
            request_id = getattr(message, "request_id", None)
            if isinstance(request_id, int) and not isinstance(message, ErrorReply):
                self._send(sock, ErrorReply(request_id=request_id, code=ERR_INTERNAL,
                                            message=f"{message.TYPE} not sent: {error}"))
        except zmq.ZMQError as error:
            log.warning("send failed: %s", error)


def run_worker(config: WorkerConfig, exporter: Exporter | None = None,
               faults: FaultInjector | None = None) -> int:
    """Run a daemon in this process until SIGTERM/SIGINT; returns the exit status.
    ``exporter``: count what it serves for /metrics (``hetconv.prometheus``);
    ``faults``: a test's :class:`~hetconv.worker.service.FaultInjector`."""
    daemon = WorkerDaemon(config, exporter, faults)

    def _stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        daemon.stop_event.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    return daemon.run()
