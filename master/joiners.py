"""Joiners calibrated beside training: a worker that joins never stalls the step.

A worker that says Hello during a run is timed before it gets work (master/calibration.py).
Timed in line at a re-plan point, its calibration held every participant for as long as
it took, and a joiner that never answers held them until the request backstop. Here the
calibration requests go out at one re-plan point as *background* requests
(``Cluster.send_beside``: their failures are kept, never raised into the step being
gathered), the training goes on, and a later re-plan point collects them:

- answered: the joiner is taken in with those timings (the run's state machine decides,
  ``master/run.py``'s ``ReplanPoint``);
- failed, or unanswered within ``JOIN_CALIBRATION_DEADLINE_S``: the joiner is dropped
  and told why (``EndRun``); it stays out until its process restarts (it answered no
  calibration, so a Hello again at once would cost nothing but would never pass);
- still computing: asked again at the next point.

The point that sends the requests waits ``JOIN_SETTLE_S`` for them first: a joiner of a
small network answers within it and is taken in at once, as it was before.

Timings are (layer, batch, kernels) → seconds, one joiner at a time.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hetconv.master.calibration import CALIBRATION_REPEATS, calibrate_request
from hetconv.master.cluster import Cluster, WorkerHandle
from hetconv.model import ConvLayerShape
from hetconv.protocol import CalibrateReply

log = logging.getLogger(__name__)

JOIN_SETTLE_S = 0.5
"""How long a re-plan point waits for the calibration it has just sent to a joiner: a
small network's answer comes within it and the joiner is taken in at once; a joiner
that does not answer costs the step this much, once."""
JOIN_CALIBRATION_DEADLINE_S = 60.0
"""How long a joiner may take to answer all of its calibration (it runs beside training,
so this costs the step nothing; a joiner past it is dropped and told why)."""

Timings = dict[tuple[int, int, int], float]
"""(layer index, batch, kernels) → seconds of one block forward + backward."""


@dataclass
class _Calibrating:
    worker: WorkerHandle
    requests: dict[int, tuple[int, int, int]] = field(default_factory=dict)


class JoinCalibration:
    """The joiners being timed beside training (module doc).

    ``sizes(shape)``: the (batch, kernels) each layer is timed at (the kernel split's
    two shares, or the sample split's whole layer on a slice)."""

    def __init__(self, cluster: Cluster, shapes: Sequence[ConvLayerShape],
                 sizes: Callable[[ConvLayerShape], list[tuple[int, int]]],
                 report: Callable[[str], None] = print,
                 deadline_s: float = JOIN_CALIBRATION_DEADLINE_S,
                 repeats: int = CALIBRATION_REPEATS):
        self.cluster, self.shapes, self.sizes = cluster, list(shapes), sizes
        self.report, self.deadline_s, self.repeats = report, deadline_s, repeats
        self._calibrating: dict[str, _Calibrating] = {}

    def calibrating(self) -> list[str]:
        return sorted(self._calibrating)

    def start(self, workers: Sequence[WorkerHandle]) -> list[str]:
        """Send every calibration request of each of ``workers`` not being timed yet
        (they compute them one after the other; the deadline covers them all); the
        names started now."""
        started: list[str] = []
        for worker in workers:
            known = self._calibrating.get(worker.worker_id)
            if known is not None and known.worker is worker:
                continue
            entry = _Calibrating(worker)
            requests = []
            for shape in self.shapes:
                for batch, kernels in self.sizes(shape):
                    rid = self.cluster.request_id()
                    entry.requests[rid] = (shape.index, batch, kernels)
                    requests.append((worker, calibrate_request(rid, shape, batch, kernels,
                                                               self.repeats)))
            self.cluster.send_beside(requests, "the calibration of a joiner", self.deadline_s)
            self._calibrating[worker.worker_id] = entry
            started.append(worker.worker_id)
            self.report(f"hetconv: worker {worker.worker_id} joined: calibrating it beside "
                        f"training (up to {self.deadline_s:.0f} s)")
        return started

    def settle(self, names: Sequence[str], within_s: float = JOIN_SETTLE_S) -> None:
        """Wait up to ``within_s`` for the calibration of ``names`` (just started): a
        joiner that answers at once is taken in at this re-plan point, as before; one
        that does not costs the step this once and is collected at a later point."""
        deadline = time.monotonic() + within_s
        pending = [self._calibrating[n] for n in names if n in self._calibrating]
        while pending and time.monotonic() < deadline:
            self.cluster.pump(0.01)
            pending = [e for e in pending if not self._answered(e)]

    def _answered(self, entry: _Calibrating) -> bool:
        replies, failure = self.cluster.beside_results(list(entry.requests))
        return bool(failure) or replies is not None

    def collect(self) -> tuple[dict[str, Timings], dict[str, str]]:
        """The joiners timed since (name → timings) and those that failed (name → why,
        one line); both are forgotten here, the rest stay in flight."""
        self.cluster.pump(0.0)  # take in what arrived since the last step's gathers
        done: dict[str, Timings] = {}
        failed: dict[str, str] = {}
        for name, entry in list(self._calibrating.items()):
            replies, failure = self.cluster.beside_results(list(entry.requests))
            if failure:
                failed[name] = failure
            elif replies is not None:
                timings: Timings = {}
                for rid, reply in replies.items():
                    if not isinstance(reply.message, CalibrateReply):
                        failed[name] = f"worker {name} answered its calibration with " \
                                       f"{reply.message.TYPE}"
                        break
                    timings[entry.requests[rid]] = float(reply.message.seconds)
                else:
                    done[name] = timings
            else:
                continue
            self.cluster.forget(list(entry.requests))
            del self._calibrating[name]
        return done, failed

    def drop_failed(self, failed: dict[str, str]) -> None:
        """Tell each failed joiner why it is out (it stays out until its process restarts)."""
        for name, why in failed.items():
            worker = next((w for w in self.cluster.known_workers()
                           if w.worker_id == name and not w.gone), None)
            line = f"not taken in: {why}"
            self.report(f"hetconv: worker {name} {line}")
            if worker is not None:
                self.cluster.drop(worker, line, misbehaved=True)

    def forget_all(self) -> None:
        for entry in self._calibrating.values():
            self.cluster.forget(list(entry.requests))
        self._calibrating.clear()
