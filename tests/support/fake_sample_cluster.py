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

With the peer data plane, :class:`FakeSamplePeers` stands in for
:class:`hetconv.master.samples.peers.SamplePeers`: the same plan, handed out with real
``AssignPeers`` messages, over in-memory queues instead of data sockets.

:func:`make_sample_stage` is the one place that builds the stage (as
``master/samples/setup.py``'s ``open_sample_stage`` does, minus the calibration and the
report); when the stage's constructor changes, only it changes.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import zmq

from hetconv.config import MASTER_PARTICIPANT
from hetconv.engine.shard import ConvShard, LayerSettings
from hetconv.engine.stage import ConvStage, LocalConvStage, layer_settings
from hetconv.master.assign import assign, exchange
from hetconv.master.cluster import Reply, WorkerHandle, WorkerLost, payload_bytes
from hetconv.master.membership_types import expected_reply
from hetconv.master.plan import Participant, Shard
from hetconv.master.run import RunControl
from hetconv.master.samples.balance import SampleBalance
from hetconv.master.samples.settings import SampleSetup
from hetconv.master.samples.stage import SampleConvStage
from hetconv.metrics import MetricsWriter
from hetconv.model import ModelConfig, conv_layer_shapes, layer_parameters
from hetconv.participant.samples.reduction_plan import reduce_plan
from hetconv.participant.samples.weight_reduce import GradientExchange
from hetconv.protocol import (
    ERR_BAD_PEER_DATA,
    ERR_PEER_LOST,
    AssignPeers,
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


class FakeSamplePeers:
    """:class:`hetconv.master.samples.peers.SamplePeers` over in-memory queues: the same
    reduction plan, handed to every worker in an ``AssignPeers`` (its service opens its
    port on the queues), and the master's :class:`GradientExchange`."""

    def __init__(self, cluster: FakeSampleCluster, timeout_s: float):
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.exchange: GradientExchange | None = None
        self.cancel = threading.Event()
        self.plans: list[Any] = []  # every plan handed out

    def assign(self, workers: dict[str, WorkerHandle], owners: Sequence[str],
               kernels: Sequence[int], sizes: Sequence[int] = ()) -> GradientExchange:
        live = {p: w for p, w in workers.items() if not w.gone}
        everyone = [MASTER_PARTICIPANT] + list(live)
        plan = reduce_plan(kernels, [o for o in owners if o in everyone], everyone, sizes)
        self.plans.append(plan)
        self.cluster.network = {name: queue.Queue() for name in everyone}
        endpoints = {name: f"inproc://peer-{name}" for name in everyone}
        self.exchange = None
        exchange(self.cluster, [(worker, AssignPeers(  # type: ignore[arg-type]
            request_id=self.cluster.request_id(), participant=participant,
            wire_dtype="float32", timeout_s=self.timeout_s, peers=dict(endpoints),
            peer_keys={name: "" for name in everyone}, plan=plan.to_wire()))
            for participant, worker in live.items()], "peer assignment")
        self.exchange = GradientExchange(MASTER_PARTICIPANT,
                                         plan, QueuePort(self.cluster.network,
                                                         MASTER_PARTICIPANT),
                                         self.timeout_s, cancelled=self.cancel.is_set)
        return self.exchange

    def close(self) -> None:
        self.exchange = None


class SlowLocalStage:
    """The master alone (a :class:`LocalConvStage`), ``delay_s`` slower per conv call:
    what the setup's ``local_stage`` gives where a test wants the master alone slow."""

    def __init__(self, local: LocalConvStage, delay_s: float):
        self.local, self.delay_s = local, delay_s

    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        if train:
            time.sleep(self.delay_s)
        return self.local.forward(layer, x, train, step)

    def backward(self, layer: int, dy: np.ndarray, need_dx: bool, learning_rate: float,
                 step: int) -> np.ndarray | None:
        time.sleep(self.delay_s)
        return self.local.backward(layer, dy, need_dx, learning_rate, step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)


def make_sample_stage(model: ModelConfig, params: dict[str, np.ndarray], run_dir: Path, *,
                      workers: Sequence[str] = ("w1", "w2"), data_plane: str = "star",
                      seconds: dict[str, float] | None = None, master_computes: bool = True,
                      batch: int = 8, settings: LayerSettings | None = None,
                      rebalancing: bool = False, fall_back: bool = False,
                      local_delay_s: float = 0.0,
                      faults: dict[str, FaultInjector] | None = None,
                      dense_replicas: bool = False, steps_in_flight: int = 1,
                      cluster: FakeSampleCluster | None = None,
                      report: Callable[[str], None] | None = None,
                      ) -> tuple[SampleConvStage, FakeSampleCluster]:
    """A :class:`SampleConvStage` over ``workers`` (in-process, on a fake cluster; each
    holds every layer of ``params`` when this returns) and the master (with a slice when
    ``master_computes``), as ``open_sample_stage`` builds it. ``seconds``: per-sample
    seconds per participant (the calibration's; default 1.0 each: equal slices).
    ``data_plane``: "star" (rounds through the master) or "peer" (chains, the weight
    reduction over :class:`FakeSamplePeers`). ``local_delay_s``: the master alone (the
    setup's ``local_stage``) sleeps that much per conv call. ``faults``: a worker's
    FaultInjector (tests/support/faulty_worker.py's WorkerFaults). ``dense_replicas``
    and ``steps_in_flight`` (the peer data plane only, as ``open_sample_stage`` sets
    them): the dense part on every participant, the next step sent ahead (2); the
    Trainer attaches its dense part (``attach_dense``: AssignDense to every worker, and
    the peers' plan again with the dense part's layer). ``report``: the console lines
    (default: kept in ``cluster.lines``)."""
    assert data_plane in ("star", "peer")
    assert data_plane == "peer" or not (dense_replicas or steps_in_flight > 1), \
        "the dense part is replicated, and steps run ahead, over the peer data plane only"
    settings = settings or layer_settings(model, 0.9, 0.0)
    shapes = conv_layer_shapes(model)
    cluster = cluster or FakeSampleCluster()
    cluster.layers = len(shapes)
    for name in workers:
        if name not in cluster.workers:
            cluster.add_worker(name, faults=(faults or {}).get(name))
    cluster.admit([cluster.workers[name].handle for name in workers])
    participants = ([Participant(MASTER_PARTICIPANT, None, {"device": "cpu"})]
                    if master_computes else []) + \
        [Participant(name, cluster.workers[name].handle, {"device": "cpu"}) for name in workers]
    seconds = seconds or {}
    balance = SampleBalance({p.participant: seconds.get(p.participant, 1.0)
                             for p in participants})
    members = [p for p in participants if p.worker is not None]
    rows = [[Shard(p.participant, p.worker, 0, shape.kernels) for p in members]
            for shape in shapes]
    fake: Any = cluster
    assign(fake, rows, params, settings, {}, "cpu", "first")
    local = {shape.index: ConvShard(shape.index, 0, shape.kernels, settings,
                                    layer_parameters(params, shape.index), device="cpu")
             for shape in shapes}
    alone_params = {k: v.copy() for k, v in params.items()}

    def local_stage() -> ConvStage:
        stage = LocalConvStage(model, alone_params, settings)
        return SlowLocalStage(stage, local_delay_s) if local_delay_s > 0 else stage

    metrics = MetricsWriter(run_dir / "metrics.jsonl")
    setup = SampleSetup(tuple(shapes), settings, "cpu", "float32", batch, master_computes,
                        local_stage, metrics, report or cluster.lines.append, rebalancing=rebalancing,
                        fall_back=fall_back, slice_statistics=False,
                        dense_replicas=dense_replicas and data_plane == "peer",
                        steps_in_flight=steps_in_flight)
    control = RunControl(p.participant for p in members)

    def finish() -> None:  # open_sample_stage's
        cluster.end_run("training finished")
        cluster.close()
        metrics.close()

    peers = FakeSamplePeers(cluster, cluster.peer_timeout_s) if data_plane == "peer" else None
    stage = SampleConvStage(fake, members, local, balance, control, setup, finish,
                            peers)  # type: ignore[arg-type]
    stage.assign_peers()
    return stage, cluster
