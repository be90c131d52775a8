"""Layer phases: a phase's requests out, the master's own share in a helper thread,
the replies gathered and accounted.

A *phase* is one layer's forward, backward or snapshot on every participant that
holds kernels: one request per worker with kernels (sent at once) and the master's
own share computed meanwhile in a helper thread. :class:`Phases` holds what every
data plane needs for that: the cluster, the current shards (``shards[layer]`` in
kernel order, empty ranges included) and the master's own :class:`ConvShard` per
layer, the helper thread, and the step's per-participant timings and bytes. A data
plane (``master/kernels/planes.py``) builds the requests and reads the replies; the stage
(``master/kernels/stage.py``) owns the phases object and replaces its shards on a re-split.
Everything here is host numpy: the master's own shard may live on a GPU
(``--device gpu:N``), and its ``forward_host`` / ``backward_host`` / ``snapshot`` make
that device current in the helper thread and copy to and from it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetconv.engine.shard import ConvShard
from hetconv.master.cluster import Cluster, Reply, WorkerHandle, WorkerLost
from hetconv.master.own_share import OwnJob, OwnShare
from hetconv.master.plan import Shard
from hetconv.master.timing import timing_entry
from hetconv.model import ConvLayerShape
from hetconv.participant.ports import PeerLost


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
    job: OwnJob | None = None
    replies: dict[str, Reply] = field(default_factory=dict)


class Phases:
    """Runs layer phases over a cluster and the master's own shards (see the module doc).

    ``deadline_s``: how long a phase's requests may stay unanswered (the run's state
    machine says); ``peers``: the timing entries carry the peer plane's fields."""

    def __init__(self, cluster: Cluster, shards: list[list[Shard]],
                 local_shards: dict[int, ConvShard], wire_dtype: str,
                 layer_shapes: Sequence[ConvLayerShape], deadline_s: Callable[[], float],
                 peers: bool = False):
        self.cluster = cluster
        self.shards = shards  # shards[layer] in kernel order, empty ranges included
        self.local_shards = local_shards
        self.wire_dtype = np.dtype(wire_dtype)  # activations and gradients on the wire
        # every conv layer's shapes: results are checked against them, snapshots audited
        self.layer_shapes = tuple(layer_shapes)
        self.step = 0  # the last step a training forward request was sent for
        self.deadline_s = deadline_s
        self._peers = peers
        self._own = OwnShare(cluster, "hetconv-local")  # the master's share, one at a time
        self._timings: dict[int, dict[str, dict[str, Any]]] = {}
        self._comm_s = 0.0
        self.cancel_local = threading.Event()  # set when a phase fails: stop local waits

    # --- local share in a helper thread ------------------------------------------------
    def run_local(self, work: Callable[[], Any]) -> OwnJob:
        """Run ``work`` in the helper thread (:class:`~hetconv.master.own_share.OwnShare`:
        the job's ``done`` is set before the gather loop is woken)."""
        return self._own.submit(work)

    # --- bookkeeping -------------------------------------------------------------------
    def entry(self, layer: int, shard: Shard) -> dict[str, Any]:
        devices = self._timings.setdefault(layer, {})
        if shard.participant not in devices:
            devices[shard.participant] = timing_entry(shard.participant, shard.kernels,
                                                      peers=self._peers)
        return devices[shard.participant]

    def account(self, layer: int, phase: str, started: float, local_done: float,
                 results: list[tuple[Shard, float, float, int, int]], record: bool,
                 ended: float | None = None) -> None:
        """results: (shard, compute_s, arrival monotonic, bytes_sent, bytes_received);
        the phase ran from ``started`` to ``ended`` (default now)."""
        if not record:
            return
        wall = (time.monotonic() if ended is None else ended) - started
        slowest = 0.0
        for shard, compute_s, arrival, sent, received in results:
            entry = self.entry(layer, shard)
            entry[f"{phase}_s"] += compute_s
            entry[f"{phase}_latency_s"] += arrival - started
            entry["wait_s"] += max(0.0, arrival - local_done) if shard.worker else 0.0
            entry["bytes_sent"] += sent
            entry["bytes_received"] += received
            slowest = max(slowest, compute_s)
        self._comm_s += max(0.0, wall - slowest)

    def start(self, what: str, requests: list[tuple[Shard, Any]],
                     local: Callable[[], Any] | None) -> OpenPhase:
        """Send ``requests`` and queue ``local`` on the helper thread; gather with
        :meth:`await_all`."""
        phase = OpenPhase(what, requests, time.monotonic())
        try:
            for shard, message in requests:
                assert shard.worker is not None
                phase.sent[shard.participant] = self.cluster.send(shard.worker, message)
                phase.pending[message.request_id] = shard.worker
                phase.by_rid[message.request_id] = shard
        except BaseException:  # the requests already out: their late answers dropped
            self.cluster.membership.abandon(phase.pending)
            raise
        phase.job = self.run_local(local) if local is not None else None
        return phase

    def await_all(self, phases: Sequence[OpenPhase]) -> None:
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
                                          timeout_s=self.deadline_s())
        finally:
            if not all(job.done.is_set() for job in jobs):  # failed: end local peer waits
                self.cancel_local.set()
            for job in jobs:
                job.done.wait()  # never leave the helper thread running on shared state
            self.cancel_local.clear()
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

    def run_phase(self, layer: int, what: str, requests: list[tuple[Shard, Any]],
                  local: Callable[[], Any] | None) -> tuple[dict[str, Reply], Any, float, float,
                                                           dict[str, int]]:
        """Send requests, run ``local`` meanwhile, gather; returns replies by participant."""
        phase = self.start(what, requests, local)
        self.await_all([phase])
        job = phase.job
        local_result, local_s = (job.result, job.seconds) if job else (None, 0.0)
        local_done = job.finished_at if job else phase.started
        return phase.replies, local_result, local_s, local_done, phase.sent

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

    def take_timings(self) -> dict[str, Any]:
        """The step's timings by layer and participant, and its communication seconds;
        starts the next step's."""
        layers = [{"layer": layer, "participants": list(devices.values())}
                  for layer, devices in sorted(self._timings.items())]
        comm_s, self._comm_s, self._timings = self._comm_s, 0.0, {}
        return {"layers": layers, "comm_s": comm_s}

    def quiesce(self) -> None:
        """End every local job still queued or waiting for peers (a phase whose
        requests failed may have left some), and wait until the helper thread is idle."""
        self.cancel_local.set()
        try:
            self._own.wait_idle()
        finally:
            self.cancel_local.clear()

    def close(self) -> None:
        """End the helper thread (after its last job) and its wake-up socket."""
        self._own.close()
