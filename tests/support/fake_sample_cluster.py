"""A real :class:`~hetconv.master.samples.stage.SampleConvStage` over a fake cluster whose
workers are computed in-process (tests/unit/test_sample_stage.py).

:class:`FakeSampleCluster` offers the part of :class:`hetconv.master.cluster.Cluster`
the sample stage uses (``request_id``, ``send``, ``gather``, ``drop``, ``pump``,
``known_workers``, ``admit``, ``membership.abandon``, ``ctx``/``extra_sockets`` for the
master's own-share thread) without a ROUTER socket: every message goes through the
codec (so nothing is shared with the master's arrays) to a real
:class:`hetconv.worker.service.WorkerService` in one thread per worker (requests served
in order, as a daemon's compute thread does), and ``gather`` hands back its replies. An
``ErrorReply`` becomes a ``WorkerLost`` as ``Membership`` makes it one. A worker can be
lost on cue, at ``send`` (its request never leaves) or at ``gather`` (it never answers),
and one reply can be made wrong on cue (``tamper``: a worker that computes wrong). A
request sent and then neither awaited by a ``gather`` nor abandoned is *stray*, as
``Membership`` keeps it: its late ErrorReply would be a fault at the master's next pump
(``stray_errors``).

The stage itself is built over it in tests/support/fake_sample_stage.py.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq

from hetconv.master.cluster import Reply, WorkerHandle, WorkerLost, payload_bytes
from hetconv.master.membership_types import expected_reply
from hetconv.protocol import (
    ERR_BAD_PEER_DATA,
    ERR_PEER_LOST,
    CalibrateReply,
    CalibrateRequest,
    EndRun,
    ErrorReply,
    Message,
    PeerPiece,
    peer_named,
)
from hetconv.protocol.codec import decode, encode
from hetconv.worker.service import ENDS_EXCHANGES, FaultInjector, WorkerService
from tests.support.queue_port import QueuePort

M = TypeVar("M", bound=Message)

GATHER_LIMIT_S = 30.0
"""A fake worker that has not answered by then is a bug in the test (never a fault)."""


def over_the_wire(message: Message) -> Message:
    """``message`` as the other side decodes it (its own copies of every array)."""
    return decode([bytes(frame) for frame in encode(message)])


class QueueDataPlane:
    """A worker's data endpoint (``hetconv.worker.service.DataPlane``) over the queues of
    the cluster's current peer assignment."""

    def __init__(self, cluster: FakeSampleCluster):
        self.cluster = cluster

    def open(self, me: str, peers: dict[str, str], peer_keys: dict[str, str],
             timeout_s: float) -> QueuePort:
        assert set(peers) == set(self.cluster.network), (peers, self.cluster.network)
        return QueuePort(self.cluster.network, me)

    def reset(self) -> None:
        pass

    def drain(self) -> int:
        return 0


@dataclass
class LossCue:
    """Lose worker ``name`` at the first request ``when`` holds for: at ``send`` (the
    send raises) or at ``gather`` (the request is never served; the gather raises)."""

    name: str
    when: Callable[[Message], bool]
    at: str = "send"
    fired: bool = False


@dataclass
class TamperCue:
    """Replace the reply of worker ``name`` to the first request ``when`` holds for by
    ``change(reply)`` (a worker that computes wrong)."""

    name: str
    when: Callable[[Message], bool]
    change: Callable[[Message], Message]
    fired: bool = False


@dataclass
class FakeWorker:
    """One in-process worker: its handle, its real service and its compute thread."""

    name: str
    handle: WorkerHandle
    service: WorkerService
    thread: ThreadPoolExecutor
    served: list[Message] = field(default_factory=list)  # every request, as decoded


class _Membership:
    """What the stage asks of ``Cluster.membership``; ``requests``: those sent and still
    awaited as ``Membership.requests`` keeps them (request id -> worker, its future or
    None when never served, the request), forgotten by a gather or ``abandon``."""

    def __init__(self) -> None:
        self.abandoned: list[int] = []
        self.requests: dict[int, tuple[FakeWorker, Future[tuple[Message, float]] | None,
                                       Message]] = {}

    def abandon(self, request_ids: Any) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)
            self.abandoned.append(request_id)


class FakeSampleCluster:
    """The cluster interface of the sample stage over in-process workers (module doc)."""

    def __init__(self, peer_timeout_s: float = 5.0) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context.instance()
        self.extra_sockets: list[Any] = []
        self.endpoint = "inproc://fake-master"
        self.curve = None
        self.membership = _Membership()
        self.workers: dict[str, FakeWorker] = {}  # every worker that said hello
        self.members: list[str] = []  # the run's (admit adds)
        self.calibrated_s: dict[str, float] = {}  # worker -> per-sample seconds it reports
        self.network: dict[str, queue.Queue[PeerPiece]] = {}  # the peers' current queues
        self.peer_timeout_s = peer_timeout_s
        self.layers = 1  # the model's conv layers (a calibration reply's share)
        self.lines: list[str] = []  # the stage's console lines (the factory's report)
        self.cues: list[LossCue] = []
        self.tampers: list[TamperCue] = []
        self.gathers: list[tuple[int, str]] = []  # (len(sent) when it began, what)
        self.dropped: list[str] = []
        self.closed = False  # close() was called (the stage's on_close)
        self.sent: list[tuple[str, Message]] = []  # (worker, message), as sent
        self._futures: dict[int, tuple[FakeWorker, Future[tuple[Message, float]], Message]] = {}
        self._answers: dict[int, Future[tuple[Message, float]]] = {}  # every request served
        self._lost_at_gather: dict[int, FakeWorker] = {}
        self._next = 0
        self._lock = threading.Lock()

    # --- workers -------------------------------------------------------------------------
    def add_worker(self, name: str, calibrated_s: float = 1.0,
                   faults: FaultInjector | None = None) -> WorkerHandle:
        """A worker says hello (not yet a member: ``admit`` or the factory makes it one).
        ``calibrated_s``: the seconds per sample its calibration replies say."""
        handle = WorkerHandle(name.encode(), name, {"device": "cpu"}, time.monotonic())
        service = WorkerService("cpu", data_plane=QueueDataPlane(self), faults=faults)
        self.workers[name] = FakeWorker(name, handle, service,
                                        ThreadPoolExecutor(1, thread_name_prefix=f"fake-{name}"))
        self.calibrated_s[name] = calibrated_s
        return handle

    def service(self, name: str) -> WorkerService:
        return self.workers[name].service

    def lose(self, name: str, when: Callable[[Message], bool], at: str = "send") -> LossCue:
        assert at in ("send", "gather")
        cue = LossCue(name, when, at)
        self.cues.append(cue)
        return cue

    def tamper(self, name: str, when: Callable[[Message], bool],
               change: Callable[[Message], Message]) -> TamperCue:
        cue = TamperCue(name, when, change)
        self.tampers.append(cue)
        return cue

    def stray_errors(self, timeout_s: float = GATHER_LIMIT_S) -> list[tuple[str, Message,
                                                                             Message]]:
        """(worker, request, ErrorReply) of every stray request (sent, never awaited nor
        abandoned) whose reply is an error, once each has answered: what ``Membership``
        turns into a fault (``Fail``) at the master's next pump. A stray request never
        served, or answered without an error, is no fault (``Completed``, kept)."""
        errors: list[tuple[str, Message, Message]] = []
        for worker, future, request in list(self.membership.requests.values()):
            if future is None:
                continue
            reply, _ = future.result(timeout=timeout_s)
            if isinstance(reply, ErrorReply):
                errors.append((worker.name, request, reply))
        return errors

    def answer(self, request_id: int, timeout_s: float = GATHER_LIMIT_S) -> Message:
        """The worker's answer to request ``request_id``, gathered or not (late), once
        it has come."""
        return self._answers[request_id].result(timeout=timeout_s)[0]

    def served(self, name: str, kind: type[M]) -> list[M]:
        """The requests of type ``kind`` worker ``name`` served, as it decoded them."""
        return [m for m in self.workers[name].served if isinstance(m, kind)]

    def sent_to(self, name: str, kind: type[M], since: int = 0) -> list[M]:
        """The messages of type ``kind`` sent to worker ``name`` (from ``sent[since]``),
        whether or not it served them."""
        return [m for who, m in self.sent[since:] if who == name and isinstance(m, kind)]

    # --- the Cluster interface -----------------------------------------------------------
    def request_id(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def known_workers(self) -> list[WorkerHandle]:
        return [w.handle for w in self.workers.values()]

    def admit(self, handles: list[WorkerHandle]) -> None:
        self.members += [h.worker_id for h in handles if h.worker_id not in self.members]

    def pump(self, timeout_s: float) -> list[Reply]:
        return []

    def send(self, handle: WorkerHandle, message: Message) -> int:
        worker = self.workers[handle.worker_id]
        assert worker.handle is handle, f"a stale handle of {handle.worker_id}"
        request_id = int(vars(message)["request_id"])  # every request has one
        cue = self._cue(worker.name, message)
        if cue is not None and cue.at == "send":
            handle.gone = True
            raise WorkerLost(f"worker {handle.name} left (at send)", handle.worker_id, True)
        if handle.gone:
            raise WorkerLost(f"worker {handle.name} is gone", handle.worker_id, True)
        self.sent.append((worker.name, message))
        if cue is not None:  # at gather: the request never reaches it
            self._lost_at_gather[request_id] = worker
            self.membership.requests[request_id] = (worker, None, message)
            return payload_bytes(message)
        decoded = over_the_wire(message)
        if isinstance(decoded, ENDS_EXCHANGES):
            worker.service.cancel_wait.set()  # as the daemon's receive loop does
        future = worker.thread.submit(self._serve, worker, decoded)
        self._futures[request_id] = (worker, future, message)
        self._answers[request_id] = future
        if expected_reply(message) is not None:  # Membership's RequestSent
            self.membership.requests[request_id] = (worker, future, message)
        return payload_bytes(message)

    def _serve(self, worker: FakeWorker, request: Message) -> tuple[Message, float]:
        worker.served.append(request)
        if isinstance(request, CalibrateRequest):  # a fixed speed, not a timing
            seconds = self.calibrated_s[worker.name] * request.batch / self.layers
            reply: Message = CalibrateReply(request_id=request.request_id, layer=request.layer,
                                            seconds=seconds)
        else:
            reply = worker.service.handle(request)
            for cue in self.tampers:
                if not cue.fired and cue.name == worker.name and cue.when(request):
                    cue.fired = True
                    reply = cue.change(reply)
                    break
        return over_the_wire(reply), time.monotonic()

    def _cue(self, name: str, message: Message) -> LossCue | None:
        for cue in self.cues:
            if not cue.fired and cue.name == name and cue.when(message):
                cue.fired = True
                return cue
        return None

    def send_beside(self, requests: Sequence[tuple[WorkerHandle, Message]], what: str,
                    timeout_s: float) -> list[int]:
        """Requests answered beside training (Cluster.send_beside): never stray."""
        ids = []
        for handle, message in requests:
            self.send(handle, message)
            request_id = int(vars(message)["request_id"])
            self.membership.requests.pop(request_id, None)
            ids.append(request_id)
        return ids

    def beside_results(self, request_ids: list[int]) -> tuple[dict[int, Reply] | None, str]:
        """As Cluster.beside_results; the in-process workers answer at once, so this waits
        for them (the tests' joins are deterministic)."""
        replies: dict[int, Reply] = {}
        for request_id in request_ids:
            worker, future, _ = self._futures[request_id]
            message, arrived = future.result(timeout=GATHER_LIMIT_S)
            if isinstance(message, ErrorReply):
                return None, f"worker {worker.name} failed a calibration: {message.message}"
            replies[request_id] = Reply(worker.handle, message, arrived, payload_bytes(message))
        return replies, ""

    def forget(self, request_ids: list[int]) -> None:
        for request_id in request_ids:
            self._futures.pop(request_id, None)

    def gather(self, pending: dict[int, WorkerHandle], what: str,
               done: Callable[[], bool] = lambda: True,
               timeout_s: float | None = None) -> dict[int, Reply]:
        self.gathers.append((len(self.sent), what))
        for request_id in pending:  # awaited now: forgotten at the end, whatever it is
            self.membership.requests.pop(request_id, None)
        for request_id in pending:
            lost = self._lost_at_gather.pop(request_id, None)
            if lost is not None:
                lost.handle.gone = True
                for other in pending:  # forgotten, as Cluster.gather forgets them
                    self._futures.pop(other, None)
                raise WorkerLost(f"worker {lost.handle.name} stopped responding during "
                                 f"{what}", lost.name, True)
        replies: dict[int, Reply] = {}
        failure: WorkerLost | None = None
        for request_id, handle in pending.items():
            worker, future, request = self._futures.pop(request_id)
            message, arrived = future.result(timeout=GATHER_LIMIT_S)
            if isinstance(message, ErrorReply):
                failure = failure or _error_to_fault(worker, what, message)
                continue
            wanted = expected_reply(request)
            assert wanted is not None and isinstance(message, wanted), (what, request, message)
            replies[request_id] = Reply(handle, message, arrived, payload_bytes(message))
        if failure is not None:
            raise failure
        limit = time.monotonic() + GATHER_LIMIT_S
        while not done():
            assert time.monotonic() < limit, f"the master's own share of {what} never ended"
            time.sleep(0.0005)
        return replies

    def drop(self, handle: WorkerHandle, reason: str, misbehaved: bool = False) -> None:
        """Evict a live worker: it is told the run is over (not waited for)."""
        self._end_run(self.workers[handle.worker_id], reason)
        handle.gone = True
        handle.misbehaved = misbehaved
        self.dropped.append(handle.worker_id)

    def misbehaving(self, worker_id: str) -> bool:
        """As the real cluster: evicted for failing its peers (a test's fake process
        never restarts under a new routing id)."""
        return any(w.misbehaved for w in self.known_workers() if w.worker_id == worker_id)

    def end_run(self, reason: str, wait_s: float = 1.0) -> None:
        """Tell every member still there that the run is over; wait for each."""
        for name in self.members:
            worker = self.workers[name]
            if not worker.handle.gone:
                self._end_run(worker, reason).result(timeout=GATHER_LIMIT_S)

    def _end_run(self, worker: FakeWorker, reason: str) -> Future[tuple[Message, float]]:
        worker.service.cancel_wait.set()  # as the daemon's receive loop does
        message = EndRun(request_id=self.request_id(), reason=reason)
        self.sent.append((worker.name, message))
        return worker.thread.submit(self._serve, worker, message)

    def close(self) -> None:
        self.closed = True
        for socket in self.extra_sockets:  # what Cluster.close does with them
            socket.close(linger=0)
        self.extra_sockets = []
        for worker in self.workers.values():
            worker.service.cancel_wait.set()
            worker.thread.shutdown(wait=True)


def _error_to_fault(worker: FakeWorker, what: str, message: ErrorReply) -> WorkerLost:
    """The fault ``Membership`` makes of an ErrorReply (a peer's named where it blames one)."""
    culprit = None
    if message.code in (ERR_PEER_LOST, ERR_BAD_PEER_DATA):
        culprit = peer_named(message.message)
    return WorkerLost(f"worker {worker.handle.name} failed {what}: {message.code}: "
                      f"{message.message}", culprit or worker.name,
                      worker.handle.gone if culprit is None else False,
                      message.code == ERR_BAD_PEER_DATA)
