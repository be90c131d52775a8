"""The worker daemon: connect to a master, serve it, survive across runs.

The main thread owns the ZeroMQ DEALER socket: it says Hello (retrying with
back-off until a master answers), sends heartbeats, and passes compute requests
to one compute thread, whose replies come back through an inproc socket. So the
worker keeps heartbeating while it computes, and the master can tell a busy
worker from a dead one. After a run ends, or when the master goes silent, the
daemon drops its shards and waits for the next master. SIGTERM/SIGINT stop it
within a second or two.
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
from hetconv.protocol import (
    PROTOCOL_VERSION,
    EndRun,
    ErrorReply,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    Refuse,
    Welcome,
    limits,
    transport,
)
from hetconv.worker.service import WorkerService

log = logging.getLogger("hetconv.worker")

WAITING_LOG_INTERVAL_S = 30.0  # how often a worker without a master says it is still trying


class WorkerDaemon:
    """One worker process: a socket loop around a :class:`WorkerService`."""

    def __init__(self, config: WorkerConfig):
        self.config = config
        set_blas_threads(config.threads)
        self.service = WorkerService(config.device)
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
        try:
            while True:
                request = self._requests.get()
                if request is None:
                    return
                self._replies.put(self.service.handle(request))
                wake.send(b"", zmq.NOBLOCK)
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
        compute.start()
        sock = transport.worker_socket(ctx, self.config.master, self.identity,
                                       curve=self.config.curve)
        log.info("worker %s (%s: %s) connecting to %s", self.worker_id, self.config.device,
                 self.device.get("name"), self.config.master)
        try:
            return self._serve(sock, wake)
        finally:
            self._requests.put(None)
            self._send(sock, Goodbye(worker_id=self.worker_id, reason="stopping"))
            sock.close(linger=200)
            wake.close()
            compute.join(timeout=1.0)
            ctx.term() if not compute.is_alive() else None

    def _serve(self, sock: zmq.Socket[Any], wake: zmq.Socket[Any]) -> int:
        cfg = self.config
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        in_session = False
        hello_delay = cfg.hello_backoff_s[0]
        next_hello = 0.0
        last_heard = last_beat = time.monotonic()
        busy = 0  # requests handed to the compute thread and not yet answered
        beat_interval = cfg.heartbeat_interval_s
        last_waiting_log = 0.0
        while not self.stop_event.is_set():
            now = time.monotonic()
            if not in_session and now >= next_hello:
                if now - last_waiting_log >= WAITING_LOG_INTERVAL_S:
                    if last_waiting_log:
                        log.info("no master at %s yet; still trying%s", cfg.master,
                                 " (with CURVE: check that the master allows this "
                                 "worker's key and that --master-key is the master's)"
                                 if cfg.curve else "")
                    last_waiting_log = now
                self._send(sock, Hello(worker_id=self.worker_id, device=self.device,
                                       protocol_version=PROTOCOL_VERSION))
                next_hello = now + hello_delay
                hello_delay = min(hello_delay * 2, cfg.hello_backoff_s[1])
            if in_session and now - last_beat >= beat_interval:
                self._send(sock, Heartbeat(sent_at=time.time()))
                last_beat = now
            if in_session and busy == 0 and now - last_heard > cfg.master_timeout_s:
                log.warning("master silent for %.0f s; dropping shards, waiting for a master",
                            now - last_heard)
                in_session, hello_delay, next_hello = False, cfg.hello_backoff_s[0], 0.0
                self._requests.put(EndRun(request_id=0, reason="master silent"))
                busy += 1
            events = dict(poller.poll(timeout=int(cfg.poll_interval_s * 1000)))
            if wake in events:
                while wake.poll(0):
                    wake.recv()
                while not self._replies.empty():
                    reply = self._replies.get()
                    busy -= 1
                    self._send(sock, reply)
            if sock not in events:
                continue
            while sock.poll(0):
                try:
                    message = transport.recv_message(sock, 0)
                except ProtocolError as error:
                    log.warning("bad message from the master: %s", error)
                    self._send(sock, ErrorReply(request_id=0, code=error.code,
                                                message=str(error)))
                    continue
                if message is None:
                    break
                last_heard = time.monotonic()
                match message:
                    case Welcome():
                        if message.protocol_version != PROTOCOL_VERSION:
                            log.error("master speaks protocol %d, this worker %d; upgrade one",
                                      message.protocol_version, PROTOCOL_VERSION)
                            return 3
                        if not in_session:
                            log.info("joined run %s", message.run_id)
                            last_waiting_log = 0.0
                        in_session = True
                        last_beat = 0.0
                        beat_interval = min(5.0, max(0.05, message.heartbeat_interval_s))
                    case Refuse():
                        log.error("the master refused this worker: %s", message.reason)
                        return 3
                    case Heartbeat():
                        pass
                    case ErrorReply() if message.code == "unknown_worker":
                        if in_session:
                            log.info("the master does not know this worker; saying hello again")
                        in_session, hello_delay, next_hello = False, cfg.hello_backoff_s[0], 0.0
                    case ErrorReply():
                        log.warning("master reports an error: %s: %s", message.code,
                                    message.message)
                    case EndRun():
                        log.info("run over: %s", message.reason)
                        self._requests.put(message)
                        busy += 1
                        if cfg.once:
                            self.stop_event.set()
                    case _ if in_session:
                        self._requests.put(message)
                        busy += 1
                    case _:
                        self._send(sock, ErrorReply(
                            request_id=int(getattr(message, "request_id", 0)),
                            code="bad_request", message="no session: say hello first"))
        if cfg.once:  # flush the last replies
            deadline = time.monotonic() + 1.0
            while busy > 0 and time.monotonic() < deadline:
                try:
                    self._send(sock, self._replies.get(timeout=0.1))
                    busy -= 1
                except queue.Empty:
                    pass
        return 0

    def _send(self, sock: zmq.Socket[Any], message: Message) -> None:
        """Send; hellos, heartbeats and goodbyes are dropped rather than queued behind a
        missing master (SNDTIMEO 0), replies may wait for ``DEFAULT_SEND_TIMEOUT_MS``."""
        control = isinstance(message, (Hello, Heartbeat, Goodbye))
        sock.setsockopt(zmq.SNDTIMEO, 0 if control else limits.DEFAULT_SEND_TIMEOUT_MS)
        try:
            transport.send_message(sock, message)
        except transport.TransportError as error:
            log.debug("%s not sent: %s", type(message).__name__, error)
        except zmq.ZMQError as error:
            log.warning("send failed: %s", error)


def run_worker(config: WorkerConfig) -> int:
    """Run a daemon in this process until SIGTERM/SIGINT; returns the exit status."""
    daemon = WorkerDaemon(config)

    def _stop(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        daemon.stop_event.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    return daemon.run()
