"""The sample split between steps: snapshots and their audit, the layers handed out,
the dense part and the peers assigned, joiners calibrated, the batch re-split.

A snapshot is the master's own replicas (every update is applied to them too), audited
against every worker; a hand-out (a restore, a re-split over the survivors, workers
back from a trial) gives every participant every whole layer of a state.
"""
from __future__ import annotations

import numpy as np

from hetconv.master.assign import assign, exchange
from hetconv.master.audit import audit_input, audit_workers, dense_audit_input
from hetconv.master.cluster import Cluster, WorkerHandle
from hetconv.master.joiners import JoinCalibration, Timings
from hetconv.master.plan import Participant, Shard
from hetconv.master.run import RunControl
from hetconv.master.samples.figures import StepState
from hetconv.master.samples.members import SampleMembers
from hetconv.master.samples.peers import SamplePeers
from hetconv.master.samples.replicas import MasterReplicas
from hetconv.master.samples.settings import SampleSetup
from hetconv.master.samples.updates import Updates
from hetconv.participant.wire_cast import to_wire


class BetweenSteps:
    """What the sample stage does between training steps (module doc)."""

    def __init__(self, cluster: Cluster, control: RunControl, setup: SampleSetup,
                 members: SampleMembers, replicas: MasterReplicas, updates: Updates,
                 state: StepState, peers: SamplePeers | None):
        self.cluster = cluster
        self.control = control
        self.setup = setup
        self.members = members
        self.replicas = replicas
        self.updates = updates
        self.state = state
        self.peers = peers
        self.joining = JoinCalibration(cluster, setup.shapes,
                                       lambda shape: [(self._joiner_slice(), shape.kernels)],
                                       report=setup.report)
        self._timed: dict[str, Timings] = {}  # joiners timed, not taken in yet

    def snapshot(self) -> dict[str, np.ndarray]:
        """The master's replicas, audited against every worker (the pending update
        applied first: the stage's ``flush``)."""
        out = self.replicas.state()
        self.audit()
        return out

    def audit(self) -> None:
        """Every worker's evaluation-mode output of a few seeded images per layer
        against the master's replica (master/audit.py); a worker answering
        differently is evicted (WorkerLost) before the snapshot is kept."""
        step = self.state.step
        workers = self.members.in_run()
        asked: list[tuple[Shard, int, np.ndarray]] = []
        for layer, shape in enumerate(self.setup.shapes):
            x = audit_input(shape, step, layer)
            asked += [(Shard(name, worker, 0, shape.kernels), layer,
                       to_wire(x, self.setup.wire_for(name)))
                      for name, worker in workers.items()]
        dense = self.replicas.dense
        if dense is not None:  # the dense part too: the master's arrays are the reference
            x = dense_audit_input(self.setup.shapes[-1], step, dense.layer)
            asked += [(Shard(name, worker, 0, dense.classes()), dense.layer, x)
                      for name, worker in workers.items()]
        local = self.replicas.local

        def reference(_shard: Shard, layer: int, x: np.ndarray) -> np.ndarray:
            if dense is not None and layer == dense.layer:
                return dense.evaluate(x)
            return local[layer].forward_host(x, False)

        audit_workers(self.cluster, step, asked, self.control.request_deadline_s(),
                      reference)

    def hand_out(self, state: dict[str, np.ndarray], why: str) -> None:
        """Give every worker in the run, and the master, every whole layer of ``state``;
        then the dense part and the peers."""
        workers = self.members.in_run()
        rows = [[Shard(name, worker, 0, shape.kernels) for name, worker in workers.items()]
                for shape in self.setup.shapes]
        assign(self.cluster, rows, state, self.setup.settings, {}, self.setup.device, why)
        self.replicas.load(state)
        self.updates.forget()
        self.assign_dense()
        self.assign_peers()

    def assign_dense(self) -> None:
        """Hand every worker in the run the dense part (the master's replica: the
        trainer's arrays), when it is replicated."""
        replica = self.replicas.dense
        if replica is None:
            return
        exchange(self.cluster, [(worker, replica.message(self.cluster.request_id()))
                                for worker in self.members.in_run().values() if not worker.gone],
                 "dense part assignment")

    def assign_peers(self) -> None:
        """Hand every worker in the run its peers and the reduction plan (the master's
        own exchange is its runner's); nothing under ``--data-plane star``. With the
        dense part replicated, the plan's last layer is the dense part's (N,) vector; the
        first conv layers' weight gradients go in the plan's bucket when small."""
        if self.peers is None:
            return
        kernels = [shape.kernels for shape in self.setup.shapes]
        sizes = [s.weight_values for s in self.setup.shapes]
        if self.replicas.dense is not None:
            kernels.append(self.replicas.dense.part.size())
        self.replicas.runner.layers.exchange = self.peers.assign(
            self.members.in_run(), self.members.names(), kernels, sizes)

    def joiners_ready(self, workers: list[WorkerHandle]) -> list[str]:
        """The joiners among ``workers`` whose calibration, run beside training
        (master/joiners.py), is in: the others are started or still computing; one that
        failed is dropped and told why."""
        self.joining.settle(self.joining.start(workers))
        done, failed = self.joining.collect()
        self.joining.drop_failed(failed)
        self._timed.update(done)
        return sorted(done)

    def _joiner_slice(self) -> int:
        """The slice a joiner is timed on: the batch over the run's participants and it."""
        return max(1, -(-self.setup.batch // (len(self.members.names()) + 1)))

    def calibrate(self, names: list[str]) -> None:
        """Take in the joiners ``names`` with their calibration (timed beside training:
        :meth:`joiners_ready`); they get their samples at the re-slice that follows."""
        found = {w.worker_id: w for w in self.cluster.known_workers() if not w.gone}
        joiners = [Participant(n, found[n], found[n].device) for n in names
                   if n in found and n in self._timed]
        self.cluster.admit([p.worker for p in joiners if p.worker is not None])
        lines = []
        for joiner in joiners:
            timings = self._timed.pop(joiner.participant)
            size = next(iter(timings))[1]
            total = sum(timings.values())
            lines.append(f"{joiner.participant} {total * 1e3:.1f} ms")
            self.members.add(joiner, max(total, 1e-9) / size)
        self.setup.report(f"hetconv: worker(s) {', '.join(names)} joined, calibrated beside "
                          f"training (every layer whole, one slice): {', '.join(lines)}")
