"""The distributed conv stage: every conv layer's kernels spread over devices.

For each block the kernels are cut into consecutive ranges, one per participant
(the master's own device first, then the workers in a fixed order). Forward: the
same input x (B, C, H, W) goes to every worker with kernels, the master computes
its own range in a helper thread meanwhile, and the pooled outputs
(B, K_i, H', W') are concatenated in kernel order. Backward: each participant gets
its slice of the output gradient, updates its shard and returns its partial input
gradient; the master sums them (the first block needs none). Everything here is host
numpy: the master's own shard may live on a GPU (``--device gpu:N``), and its
``forward_host`` / ``backward_host`` / ``snapshot`` make that device current in the
helper thread and copy to and from it.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import zmq

from hetconv.dataplane import PeerLost
from hetconv.errors import UserError
from hetconv.master.assign import assign, exchange, shard_state
from hetconv.master.audit import audit_input, audit_mismatch
from hetconv.master.cluster import Cluster, Reply, WorkerHandle, WorkerLost
from hetconv.master.plan import Shard, reshard
from hetconv.master.run import (
    Admit,
    Command,
    Evict,
    FallBackLocal,
    Fault,
    ReplanDone,
    ReplanPoint,
    Resplit,
    RunControl,
    StepDone,
    Stop,
)
from hetconv.model import ConvLayerShape
from hetconv.names import STATE_NAMES, layer_key
from hetconv.protocol import (
    BackwardReply,
    BackwardRequest,
    ForwardReply,
    ForwardRequest,
    SnapshotRequest,
)
from hetconv.shard import ConvShard, LayerSettings
from hetconv.stage import ConvStage, StageFault
from hetconv.wire_cast import to_wire

AfterStep = Callable[[dict[str, Any]], None]
log = logging.getLogger("hetconv.master")


def checked_result(shard: Shard, name: str, array: np.ndarray,
                   expected: Sequence[int | None]) -> np.ndarray:
    """A worker's result array if its shape is ``expected`` (batch, channels, H, W;
    None: any size on that axis) and it is finite; otherwise WorkerLost that evicts
    the worker (its work is recomputed from the snapshot)."""
    problem = None
    if array.ndim != len(expected) or any(
            want is not None and got != want for got, want in zip(array.shape, expected)):
        wanted = ", ".join("?" if want is None else str(want) for want in expected)
        problem = f"{name} of shape {tuple(array.shape)}, expected ({wanted})"
    elif array.dtype.kind != "f":
        problem = f"{name} of dtype {array.dtype}"
    elif not np.isfinite(array).all():
        problem = f"{name} holding NaN or Inf"
    if problem is not None:
        raise WorkerLost(f"worker {shard.participant} answered with {problem}; evicting it",
                         shard.participant, evict=True)
    return array


class Joins(Protocol):
    """Who may join at a re-plan point, and taking them in (master/session.py)."""

    def joinable(self, stage: DistributedConvStage) -> list[str]: ...

    def admit(self, stage: DistributedConvStage, names: list[str]) -> list[list[Shard]]: ...


@dataclass
class LocalJob:
    """The master's own share of one layer phase, computed in the helper thread."""

    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    seconds: float = 0.0
    finished_at: float = 0.0


@dataclass
class OpenPhase:
    """One layer phase whose requests are out: what it awaits and, once gathered, its
    replies by participant."""

    what: str
    requests: list[tuple[Shard, Any]]
    started: float  # monotonic, when its first request went out
    pending: dict[int, WorkerHandle] = field(default_factory=dict)
    by_rid: dict[int, Shard] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)
    job: LocalJob | None = None
    replies: dict[str, Reply] = field(default_factory=dict)


class DistributedConvStage:
    """A :class:`hetconv.stage.ConvStage` over a :class:`Cluster` and a local shard set."""

    def __init__(self, cluster: Cluster, shards: list[list[Shard]],
                 local_shards: dict[int, ConvShard], on_close: Callable[[], None],
                 wire_dtype: str = "float32", layer_shapes: Sequence[ConvLayerShape] = ()):
        self.cluster = cluster
        # every conv layer's shapes: results are checked against them, snapshots audited
        self.layer_shapes = tuple(layer_shapes)
        self._step = 0  # the last step a forward request was sent for
        self.wire_dtype = np.dtype(wire_dtype)  # activations and gradients on the wire
        self.shards = shards  # shards[layer] in kernel order, empty ranges included
        self.local_shards = local_shards
        self._on_close = on_close
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetconv-local")
        self._wake_endpoint = f"inproc://local-done-{uuid.uuid4().hex}"
        wake = cluster.ctx.socket(zmq.PAIR)
        wake.bind(self._wake_endpoint)
        cluster.extra_sockets.append(wake)
        self._wake_sender: Any = None
        self._timings: dict[int, dict[str, dict[str, Any]]] = {}
        self._comm_s = 0.0
        self._cancel_local = threading.Event()  # set when a phase fails: stop local waits
        self.after_step: AfterStep | None = None  # called with each step's timings
        # --- set by the session for recovery (docs/resilience.md)
        self.settings: LayerSettings | None = None
        self.device = "cpu"  # the master's own device, for shards it newly holds
        self.replan: Callable[[set[str]], list[list[int]]] | None = None
        self.on_replan: Callable[[list[list[int]], str], None] | None = None
        self.local_stage_factory: Callable[[], ConvStage] | None = None
        self.join: Joins | None = None
        # the failover policy: faults, evictions, quarantine, rejoin back-off (master/run.py)
        self.control = RunControl(s.participant for row in shards for s in row
                                  if s.worker is not None)

    # --- local share in a helper thread ------------------------------------------------
    def _notify(self) -> None:
        if self._wake_sender is None:  # created in, and only used by, the helper thread
            self._wake_sender = self.cluster.ctx.socket(zmq.PAIR)
            self._wake_sender.setsockopt(zmq.LINGER, 0)
            self._wake_sender.connect(self._wake_endpoint)
        self._wake_sender.send(b"")

    def _run_local(self, work: Callable[[], Any]) -> LocalJob:
        """Run ``work`` in the helper thread; the job's ``done`` is set *before* the
        main thread is woken, so the gather loop never sleeps on a finished job."""
        job = LocalJob()

        def timed() -> None:
            start = time.perf_counter()
            try:
                job.result = work()
            except BaseException as error:  # re-raised in the main thread
                job.error = error
            finally:
                job.seconds = time.perf_counter() - start
                job.finished_at = time.monotonic()
                job.done.set()
                self._notify()

        self._executor.submit(timed)
        return job

    # --- bookkeeping -------------------------------------------------------------------
    def _entry(self, layer: int, shard: Shard) -> dict[str, Any]:
        devices = self._timings.setdefault(layer, {})
        return devices.setdefault(shard.participant, {
            "device": shard.participant, "kernels": shard.kernels, "forward_s": 0.0,
            "backward_s": 0.0,
            "wait_s": 0.0, "forward_latency_s": 0.0, "backward_latency_s": 0.0,
            "bytes_sent": 0, "bytes_received": 0})

    def _account(self, layer: int, phase: str, started: float, local_done: float,
                 results: list[tuple[Shard, float, float, int, int]], record: bool,
                 ended: float | None = None) -> None:
        """results: (shard, compute_s, arrival monotonic, bytes_sent, bytes_received);
        the phase ran from ``started`` to ``ended`` (default now)."""
        if not record:
            return
        wall = (time.monotonic() if ended is None else ended) - started
        slowest = 0.0
        for shard, compute_s, arrival, sent, received in results:
            entry = self._entry(layer, shard)
            entry[f"{phase}_s"] += compute_s
            entry[f"{phase}_latency_s"] += arrival - started
            entry["wait_s"] += max(0.0, arrival - local_done) if shard.worker else 0.0
            entry["bytes_sent"] += sent
            entry["bytes_received"] += received
            slowest = max(slowest, compute_s)
        self._comm_s += max(0.0, wall - slowest)

    def _start_phase(self, what: str, requests: list[tuple[Shard, Any]],
                     local: Callable[[], Any] | None) -> OpenPhase:
        """Send ``requests`` and queue ``local`` on the helper thread; gather with
        :meth:`_await_phases`."""
        phase = OpenPhase(what, requests, time.monotonic())
        for shard, message in requests:
            assert shard.worker is not None
            phase.sent[shard.participant] = self.cluster.send(shard.worker, message)
            phase.pending[message.request_id] = shard.worker
            phase.by_rid[message.request_id] = shard
        phase.job = self._run_local(local) if local is not None else None
        return phase

    def _await_phases(self, phases: Sequence[OpenPhase]) -> None:
        """Gather the replies of every phase at once (and wait for their local jobs);
        fills each phase's ``replies`` by participant. On failure every local job is
        cancelled and waited for before the error goes up."""
        pending = {rid: worker for phase in phases for rid, worker in phase.pending.items()}
        jobs = [phase.job for phase in phases if phase.job is not None]
        what = phases[-1].what if len(phases) == 1 else \
            f"{phases[0].what} to {phases[-1].what}"
        try:
            replies = self.cluster.gather(pending, what,
                                          done=lambda: all(job.done.is_set() for job in jobs),
                                          timeout_s=self.request_deadline_s())
        finally:
            if not all(job.done.is_set() for job in jobs):  # failed: end local peer waits
                self._cancel_local.set()
            for job in jobs:
                job.done.wait()  # never leave the helper thread running on shared state
            self._cancel_local.clear()
        for job in jobs:
            if isinstance(job.error, PeerLost):  # the master's own share lost a peer
                error = job.error
                raise WorkerLost(f"the master's share failed {what}: {error}",
                                 error.peers[0] if error.peers else None, evict=error.bad_data)
            if job.error is not None:
                raise job.error
        for phase in phases:  # each reply's type and echo were checked by Membership
            phase.replies = {phase.by_rid[rid].participant: replies[rid]
                             for rid in phase.pending}

    def _exchange(self, layer: int, what: str, requests: list[tuple[Shard, Any]],
                  local: Callable[[], Any] | None) -> tuple[dict[str, Reply], Any, float, float,
                                                           dict[str, int]]:
        """Send requests, run ``local`` meanwhile, gather; returns replies by device."""
        phase = self._start_phase(what, requests, local)
        self._await_phases([phase])
        job = phase.job
        local_result, local_s = (job.result, job.seconds) if job else (None, 0.0)
        local_done = job.finished_at if job else phase.started
        return phase.replies, local_result, local_s, local_done, phase.sent

    # --- the ConvStage interface --------------------------------------------------------------
    def output_shape(self, layer: int, batch: int, kernels: int) -> tuple[int | None, ...]:
        """What a participant's y of ``layer`` must be: (batch, kernels, H', W')."""
        if layer >= len(self.layer_shapes):
            return (batch, kernels, None, None)
        shape = self.layer_shapes[layer]
        return (batch, kernels, shape.pooled_height, shape.pooled_width)

    def input_shape(self, layer: int, batch: int) -> tuple[int | None, ...]:
        """What a participant's partial dx of ``layer`` must be: (batch, C, H, W)."""
        if layer >= len(self.layer_shapes):
            return (batch, None, None, None)
        return self.layer_shapes[layer].input_shape(batch)

    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        if train:
            self._step = step
        x = np.ascontiguousarray(x, dtype=np.float32)
        wire_x = to_wire(x, self.wire_dtype)
        shards = [s for s in self.shards[layer] if s.kernels > 0]
        requests = [(s, ForwardRequest(request_id=self.cluster.request_id(), step=step,
                                       layer=layer, attempt=0, train=train, x=wire_x))
                    for s in shards if s.worker is not None]
        local_shard = self.local_shards.get(layer)
        local = ((lambda: local_shard.forward_host(x, train))  # host in, host out
                 if local_shard is not None and local_shard.kernels else None)
        started = time.monotonic()
        replies, local_y, local_s, local_done, sent = self._exchange(
            layer, f"forward of layer {layer + 1} (step {step})", requests, local)
        outputs, results = [], []
        for shard in shards:
            if shard.worker is None:
                outputs.append(local_y)
                results.append((shard, local_s, local_done, 0, 0))
            else:
                reply = replies[shard.participant]
                forward = reply.message
                assert isinstance(forward, ForwardReply)
                outputs.append(checked_result(
                    shard, "y", forward.y, self.output_shape(layer, x.shape[0], shard.kernels)))
                results.append((shard, forward.compute_s, reply.received_at,
                                sent[shard.participant], reply.payload_bytes))
        self._account(layer, "forward", started, local_done, results, train)
        joined = np.concatenate(outputs, axis=1) if len(outputs) > 1 else outputs[0]
        return np.asarray(joined, dtype=np.float32)

    def backward(self, layer: int, dy: np.ndarray, need_dx: bool, learning_rate: float,
                 step: int) -> np.ndarray | None:
        shards = [s for s in self.shards[layer] if s.kernels > 0]
        requests = [(s, BackwardRequest(request_id=self.cluster.request_id(), step=step,
                                        layer=layer, attempt=0, learning_rate=learning_rate,
                                        dy=to_wire(dy[:, s.start:s.stop], self.wire_dtype)))
                    for s in shards if s.worker is not None]
        local_shard = self.local_shards.get(layer)
        local: Callable[[], Any] | None = None
        if local_shard is not None and local_shard.kernels:
            local_dy = np.ascontiguousarray(
                dy[:, local_shard.kernel_start:local_shard.kernel_stop])

            def local() -> Any:  # host in, host out
                return local_shard.backward_host(local_dy, need_dx, learning_rate)
        started = time.monotonic()
        replies, local_dx, local_s, local_done, sent = self._exchange(
            layer, f"backward of layer {layer + 1} (step {step})", requests, local)
        total: np.ndarray | None = None
        results = []
        for shard in shards:
            if shard.worker is None:
                partial = local_dx
                results.append((shard, local_s, local_done, 0, 0))
            else:
                reply = replies[shard.participant]
                backward = reply.message
                assert isinstance(backward, BackwardReply)
                partial = (None if backward.dx is None else checked_result(
                    shard, "dx", backward.dx, self.input_shape(layer, dy.shape[0])))
                results.append((shard, backward.compute_s, reply.received_at,
                                sent[shard.participant], reply.payload_bytes))
            if need_dx and partial is not None:
                total = np.array(partial, dtype=np.float32) if total is None else total + partial
        self._account(layer, "backward", started, local_done, results, True)
        return total if need_dx else None

    def request_deadline_s(self) -> float:
        """How long a training phase's requests may stay unanswered before the phase is
        retried (master/run.py decides)."""
        return self.control.request_deadline_s()

    def take_step_timings(self) -> dict[str, Any]:
        self.control.handle(StepDone(time.monotonic()))  # faults so far were transient
        layers = [{"layer": layer, "devices": list(devices.values())}
                  for layer, devices in sorted(self._timings.items())]
        comm_s, self._comm_s, self._timings = self._comm_s, 0.0, {}
        timings = {"layers": layers, "comm_s": comm_s}
        if self.after_step is not None:  # between steps: may re-split (see resplit)
            self.after_step(timings)
        return timings

    def snapshot(self) -> dict[str, np.ndarray]:
        """Pull every shard (parameters, statistics, velocities) and assemble whole layers."""
        out: dict[str, np.ndarray] = {}
        for layer, shards in enumerate(self.shards):
            remote = [(s, SnapshotRequest(request_id=self.cluster.request_id(), layer=layer))
                      for s in shards if s.worker is not None and s.kernels > 0]
            replies, _, _, _, _ = self._exchange(layer, f"snapshot of layer {layer + 1}",
                                                 remote, None)
            pieces: dict[str, list[np.ndarray]] = {name: [] for name in STATE_NAMES}
            for shard in shards:
                if shard.kernels == 0:
                    continue
                if shard.worker is None:
                    state = self.local_shards[layer].snapshot()
                else:
                    state = {name: getattr(replies[shard.participant].message, name)
                             for name in STATE_NAMES}
                for name in STATE_NAMES:
                    pieces[name].append(np.asarray(state[name]))
            for name, arrays in pieces.items():
                out[layer_key(layer, name)] = np.concatenate(arrays, axis=0)
        self.audit(out)
        return out

    def audit(self, state: dict[str, np.ndarray]) -> None:
        """Check every worker's forward computation against the master's own, from the
        shard state it has just sent (``state``, whole layers): an evaluation-mode
        request of a few seeded images per layer it holds (master/audit.py). A worker
        answering differently is evicted (WorkerLost), before this snapshot is kept."""
        if not self.layer_shapes or self.settings is None:
            return
        asked: list[tuple[Shard, int, np.ndarray]] = []
        requests: list[tuple[WorkerHandle, ForwardRequest]] = []
        for layer, row in enumerate(self.shards):
            if layer >= len(self.layer_shapes):
                continue
            x = to_wire(audit_input(self.layer_shapes[layer], self._step, layer),
                        self.wire_dtype)
            for shard in row:
                if shard.worker is not None and shard.kernels > 0:
                    asked.append((shard, layer, x))
                    requests.append((shard.worker, ForwardRequest(
                        request_id=self.cluster.request_id(), step=self._step, layer=layer,
                        attempt=0, train=False, x=x)))
        replies = exchange(self.cluster, requests, "result audit",
                           timeout_s=self.request_deadline_s())
        for (shard, layer, x), reply in zip(asked, replies):
            message = reply.message  # a ForwardReply of this layer (Membership checked)
            assert isinstance(message, ForwardReply)
            reference = ConvShard(layer, shard.start, shard.stop, self.settings,
                                  shard_state(state, layer, shard.start, shard.stop),
                                  device="cpu").forward_host(x.astype(np.float32), False)
            problem = audit_mismatch(np.asarray(message.y), np.asarray(reference))
            if problem is not None:
                raise WorkerLost(f"worker {shard.participant} failed the result audit of layer "
                                 f"{layer + 1}: {problem}; evicting it", shard.participant,
                                 evict=True)

    # --- re-splitting between steps -----------------------------------------------------
    def resplit(self, counts: Sequence[Sequence[int]], settings: LayerSettings) -> None:
        """Move to new kernel counts per layer per participant (participant order),
        between steps and without changing results: pull every shard's exact state,
        cut the whole layers into the new shards, send ``AssignShard`` to every worker
        whose shard changed (an empty one where it lost the layer, so no stale shard
        stays) and rebuild the master's own shards on its device."""
        state = self.snapshot()
        shards = reshard(self.shards, counts)
        self.local_shards = assign(self.cluster, shards, state, settings, self.local_shards,
                                   self.device, "re-split", previous=self.shards,
                                   changed_only=True)
        self.shards = shards
        self._after_resplit()

    # --- faults -------------------------------------------------------------------------
    def restore(self, state: dict[str, np.ndarray]) -> None:
        """Roll every shard (same split) back to ``state``, between steps."""
        self._assign_from(self.shards, state, "restore")

    def recover(self, fault: StageFault, state: dict[str, np.ndarray]) -> ConvStage:
        """Hand the fault to the run's state machine and carry out what it decides:
        evict, re-plan over the rest and restore every shard to ``state``; with no
        worker left a local stage from ``state`` (or UserError under
        ``--on-worker-loss stop``)."""
        self._quiesce_local()
        return self._carry_out(self.control.handle(self._fault_event(fault)), state)

    def replan_point(self, state: dict[str, np.ndarray]) -> ConvStage:
        """Right after a snapshot: take in the workers that joined since the last one,
        re-planning over everyone and restoring every shard from ``state`` (which is
        the current state, so nothing is rolled back)."""
        if self.join is None:
            return self
        joinable = self.join.joinable(self)
        if not joinable:
            return self
        return self._carry_out(self.control.handle(ReplanPoint(tuple(joinable))), state)

    def _fault_event(self, fault: StageFault) -> Fault:
        gone = frozenset(s.participant for row in self.shards for s in row
                         if s.worker is not None and s.worker.gone)
        return Fault(str(fault), fault.participant, fault.gone, fault.evict, gone)

    def _carry_out(self, commands: list[Command], state: dict[str, np.ndarray]) -> ConvStage:
        """Perform the state machine's commands; a fault while doing so (a worker lost
        during a re-plan) goes back to it, and its new commands are carried out."""
        try:
            for command in commands:
                match command:
                    case Evict():
                        worker = self._worker_of(command.participant)
                        if command.drop and worker is not None and not worker.gone:
                            self.cluster.drop(worker, command.reason)
                    case Stop():
                        raise UserError(command.reason)
                    case FallBackLocal():
                        if self.local_stage_factory is None:
                            raise UserError(command.reason)
                        local = self.local_stage_factory()
                        local.restore(state)
                        self.close()
                        log.warning("%s: training on alone", command.reason)
                        return local
                    case Admit():
                        assert self.join is not None
                        self.shards = self.join.admit(self, list(command.participants))
                    case Resplit():
                        self._resplit_to(command, state)
        except WorkerLost as lost:
            self._quiesce_local()
            return self._carry_out(self.control.handle(self._fault_event(lost)), state)
        return self

    def _resplit_to(self, command: Resplit, state: dict[str, np.ndarray]) -> None:
        """Re-plan over ``command.alive`` (and the master's own device) and restore
        every shard from ``state``."""
        if self.replan is None:
            raise RuntimeError("the stage has no split rule to re-plan with")
        own = {s.participant for s in self.shards[0] if s.worker is None}
        counts = self.replan(set(command.alive) | own)
        self._assign_from(reshard(self.shards, counts), state,
                          "join" if command.joined else "recovery")
        self.control.handle(ReplanDone())
        if self.on_replan is not None:
            self.on_replan([[s.kernels for s in row] for row in self.shards], command.reason)

    def _worker_of(self, participant: str) -> WorkerHandle | None:
        return next((s.worker for s in self.shards[0] if s.participant == participant), None)

    def _quiesce_local(self) -> None:
        """End every local job still queued or waiting for peers (a phase whose
        requests failed may have left some), and wait until the helper thread is idle."""
        self._cancel_local.set()
        try:
            self._executor.submit(lambda: None).result()
        finally:
            self._cancel_local.clear()

    def _assign_from(self, shards: list[list[Shard]], state: dict[str, np.ndarray],
                     why: str) -> None:
        """Give every live participant its shard of ``shards`` with ``state``'s arrays
        (workers that are gone get nothing); the master's own shards are rebuilt."""
        if self.settings is None:
            raise RuntimeError("the stage has no layer settings to restore shards with")
        self.local_shards = assign(self.cluster, shards, state, self.settings,
                                   self.local_shards, self.device, why, previous=self.shards)
        self.shards = shards
        self._after_resplit()

    def _after_resplit(self) -> None:
        """What a data plane must redo once the shards moved (nothing on the star)."""

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        if self._wake_sender is not None:  # the helper thread is gone: safe to close here
            self._wake_sender.close(linger=0)
            self._wake_sender = None
        self._on_close()


