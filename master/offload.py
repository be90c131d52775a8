"""The distributed conv stage: every conv block's kernels spread over devices.

For each block the kernels are cut into consecutive ranges, one per participant
(the master's own device first, then the workers in a fixed order). Forward: the
same input x (B, C, H, W) goes to every worker with kernels, the master computes
its own range in a helper thread meanwhile, and the pooled outputs
(B, K_i, H', W') are concatenated in kernel order. Backward: each participant gets
its slice of the output gradient, updates its shard and returns its partial input
gradient; the master sums them (the first block needs none).
"""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from hetconv.shard import STATE_NAMES, ConvShard
from master.cluster import Cluster, Reply, WorkerHandle, WorkerLost
from protocol import BackwardReply, BackwardRequest, ForwardReply, ForwardRequest, SnapshotRequest

MASTER = "master"


@dataclass(frozen=True)
class Part:
    """Kernels [start, stop) of one block on one participant (worker None = master)."""

    device: str
    worker: WorkerHandle | None
    start: int
    stop: int

    @property
    def kernels(self) -> int:
        return self.stop - self.start


@dataclass
class LocalJob:
    """The master's own share of one layer phase, computed in the helper thread."""

    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    seconds: float = 0.0
    finished_at: float = 0.0


class DistributedConvStage:
    """A :class:`hetconv.stage.ConvStage` over a :class:`Cluster` and a local shard set."""

    def __init__(self, cluster: Cluster, parts: list[list[Part]],
                 local_shards: dict[int, ConvShard], on_close: Callable[[], None],
                 wire_dtype: str = "float32"):
        self.cluster = cluster
        self.wire_dtype = np.dtype(wire_dtype)  # activations and gradients on the wire
        self.parts = parts  # parts[layer] in kernel order, empty ranges included
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
    def _entry(self, layer: int, part: Part) -> dict[str, Any]:
        devices = self._timings.setdefault(layer, {})
        return devices.setdefault(part.device, {
            "device": part.device, "kernels": part.kernels, "forward_s": 0.0, "backward_s": 0.0,
            "wait_s": 0.0, "forward_latency_s": 0.0, "backward_latency_s": 0.0,
            "bytes_sent": 0, "bytes_received": 0})

    def _account(self, layer: int, phase: str, started: float, local_done: float,
                 results: list[tuple[Part, float, float, int, int]], record: bool) -> None:
        """results: (part, compute_s, arrival monotonic, bytes_sent, bytes_received)."""
        if not record:
            return
        wall = time.monotonic() - started
        slowest = 0.0
        for part, compute_s, arrival, sent, received in results:
            entry = self._entry(layer, part)
            entry[f"{phase}_s"] += compute_s
            entry[f"{phase}_latency_s"] += arrival - started
            entry["wait_s"] += max(0.0, arrival - local_done) if part.worker else 0.0
            entry["bytes_sent"] += sent
            entry["bytes_received"] += received
            slowest = max(slowest, compute_s)
        self._comm_s += max(0.0, wall - slowest)

    def _exchange(self, layer: int, what: str, requests: list[tuple[Part, Any]],
                  local: Callable[[], Any] | None) -> tuple[dict[str, Reply], Any, float, float,
                                                           dict[str, int]]:
        """Send requests, run ``local`` meanwhile, gather; returns replies by device."""
        started = time.monotonic()
        pending: dict[int, WorkerHandle] = {}
        sent: dict[str, int] = {}
        by_rid: dict[int, Part] = {}
        for part, message in requests:
            assert part.worker is not None
            sent[part.device] = self.cluster.send(part.worker, message)
            pending[message.request_id] = part.worker
            by_rid[message.request_id] = part
        job = self._run_local(local) if local is not None else None
        try:
            replies = self.cluster.gather(pending, what,
                                          done=job.done.is_set if job else (lambda: True))
        finally:
            if job is not None:
                job.done.wait()  # never leave the helper thread running on shared state
        if job is not None and job.error is not None:
            raise job.error
        local_result, local_s = (job.result, job.seconds) if job else (None, 0.0)
        local_done = job.finished_at if job else started
        for (part, message) in requests:
            reply_message = replies[message.request_id].message
            for key in ("step", "layer", "attempt"):
                if hasattr(message, key) and getattr(reply_message, key) != getattr(message, key):
                    raise WorkerLost(f"worker {part.device} answered {what} with {key} "
                                     f"{getattr(reply_message, key)}, expected "
                                     f"{getattr(message, key)}")
        by_device = {by_rid[rid].device: reply for rid, reply in replies.items()}
        return by_device, local_result, local_s, local_done, sent

    # --- the ConvStage interface --------------------------------------------------------------
    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        wire_x = x.astype(self.wire_dtype, copy=False)
        parts = [p for p in self.parts[layer] if p.kernels > 0]
        requests = [(p, ForwardRequest(request_id=self.cluster.request_id(), step=step,
                                       layer=layer, attempt=0, train=train, x=wire_x))
                    for p in parts if p.worker is not None]
        shard = self.local_shards.get(layer)
        local = (lambda: shard.forward(x, train)) if shard is not None and shard.kernels else None
        started = time.monotonic()
        replies, local_y, local_s, local_done, sent = self._exchange(
            layer, f"forward of layer {layer + 1} (step {step})", requests, local)
        outputs, results = [], []
        for part in parts:
            if part.worker is None:
                outputs.append(local_y)
                results.append((part, local_s, local_done, 0, 0))
            else:
                reply = replies[part.device]
                forward = reply.message
                assert isinstance(forward, ForwardReply)
                outputs.append(forward.y)
                results.append((part, forward.compute_s, reply.received_at,
                                sent[part.device], reply.payload_bytes))
        self._account(layer, "forward", started, local_done, results, train)
        joined = np.concatenate(outputs, axis=1) if len(outputs) > 1 else outputs[0]
        return np.asarray(joined, dtype=np.float32)

    def backward(self, layer: int, dy: np.ndarray, need_dx: bool, learning_rate: float,
                 step: int) -> np.ndarray | None:
        parts = [p for p in self.parts[layer] if p.kernels > 0]
        requests = [(p, BackwardRequest(request_id=self.cluster.request_id(), step=step,
                                        layer=layer, attempt=0, learning_rate=learning_rate,
                                        dy=np.ascontiguousarray(dy[:, p.start:p.stop],
                                                                dtype=self.wire_dtype)))
                    for p in parts if p.worker is not None]
        shard = self.local_shards.get(layer)
        local: Callable[[], Any] | None = None
        if shard is not None and shard.kernels:
            local_dy = np.ascontiguousarray(dy[:, shard.kernel_start:shard.kernel_stop])

            def local() -> Any:
                return shard.backward(local_dy, need_dx, learning_rate)
        started = time.monotonic()
        replies, local_dx, local_s, local_done, sent = self._exchange(
            layer, f"backward of layer {layer + 1} (step {step})", requests, local)
        total: np.ndarray | None = None
        results = []
        for part in parts:
            if part.worker is None:
                partial = local_dx
                results.append((part, local_s, local_done, 0, 0))
            else:
                reply = replies[part.device]
                backward = reply.message
                assert isinstance(backward, BackwardReply)
                partial = backward.dx
                results.append((part, backward.compute_s, reply.received_at,
                                sent[part.device], reply.payload_bytes))
            if need_dx and partial is not None:
                total = np.array(partial, dtype=np.float32) if total is None else total + partial
        self._account(layer, "backward", started, local_done, results, True)
        return total if need_dx else None

    def take_step_timings(self) -> dict[str, Any]:
        layers = [{"layer": layer, "devices": list(devices.values())}
                  for layer, devices in sorted(self._timings.items())]
        comm_s, self._comm_s, self._timings = self._comm_s, 0.0, {}
        return {"layers": layers, "comm_s": comm_s}

    def snapshot(self) -> dict[str, np.ndarray]:
        """Pull every shard (parameters, statistics, velocities) and assemble whole layers."""
        out: dict[str, np.ndarray] = {}
        for layer, parts in enumerate(self.parts):
            remote = [(p, SnapshotRequest(request_id=self.cluster.request_id(), layer=layer))
                      for p in parts if p.worker is not None and p.kernels > 0]
            replies, _, _, _, _ = self._exchange(layer, f"snapshot of layer {layer + 1}",
                                                 remote, None)
            pieces: dict[str, list[np.ndarray]] = {name: [] for name in STATE_NAMES}
            for part in parts:
                if part.kernels == 0:
                    continue
                if part.worker is None:
                    state = self.local_shards[layer].snapshot()
                else:
                    state = {name: getattr(replies[part.device].message, name)
                             for name in STATE_NAMES}
                for name in STATE_NAMES:
                    pieces[name].append(np.asarray(state[name]))
            for name, arrays in pieces.items():
                out[f"conv{layer}.{name}"] = np.concatenate(arrays, axis=0)
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        if self._wake_sender is not None:  # the helper thread is gone: safe to close here
            self._wake_sender.close(linger=0)
            self._wake_sender = None
        self._on_close()
