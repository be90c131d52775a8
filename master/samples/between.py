"""The sample-split stage between steps: snapshots, audits, faults, joins, restores.

:class:`BetweenSteps` is the part of :class:`~hetconv.master.samples.stage.SampleConvStage`
that runs between training steps: a snapshot is the master's own replicas (every
update is applied to them too), audited against every worker; a restore hands every
participant every whole layer of a state; faults and the re-plan point go to the run's
state machine (``master/run.py``) and its commands are carried out here (evict,
re-slice over the survivors, fall back to the master alone, stop, admit joiners);
after every step, the step's record, the re-slicing from measured compute and the
measures behind ``--fall-back`` (``master/samples/fall_back.py``: a trial of the master alone,
``master/samples/trial_alone.py``, then alone or back to the workers).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from hetconv.config import MASTER_PARTICIPANT
from hetconv.engine.shard import ConvShard, LayerSettings
from hetconv.engine.stage import ConvStage, StageFault
from hetconv.master.assign import assign, exchange
from hetconv.master.audit import audit_input, audit_workers, dense_audit_input
from hetconv.master.calibration import calibrate_samples
from hetconv.master.cluster import Cluster, WorkerHandle, WorkerLost
from hetconv.master.commands import carry_out
from hetconv.master.plan import Participant, Shard
from hetconv.master.run import (
    Command,
    Fault,
    ReplanDone,
    ReplanPoint,
    Resplit,
    RunControl,
    StepDone,
)
from hetconv.master.samples.balance import SampleBalance
from hetconv.master.samples.fall_back import (
    ALONE_WINDOW,
    EARLY_STEPS,
    STAY_ALONE_REASON,
    AloneCheck,
    GoBack,
    StayAlone,
    TryAlone,
)
from hetconv.master.samples.peers import SamplePeers
from hetconv.master.samples.plan import Slice
from hetconv.master.samples.step_model import InPlaceModel, StepSample
from hetconv.master.samples.trial_alone import TrialAloneStage
from hetconv.master.samples.trial_without import WithoutCheck
from hetconv.metrics import MetricsWriter
from hetconv.model import ConvLayerShape
from hetconv.names import layer_key
from hetconv.participant.samples.dense_replica import DenseReplica
from hetconv.participant.samples.runner import SampleRunner
from hetconv.participant.wire_cast import to_wire
from hetconv.protocol.samples import NO_LAYER

log = logging.getLogger("hetconv.master")


@dataclass(frozen=True)
class PendingUpdate:
    """A layer's SGD step still to apply: the whole batch's ``dweight`` (summed by the
    master: ``--data-plane star``), or None when the peers reduce it as reduction
    ``reduce_id`` of the ``contributors``' gradients (hetconv/participant/samples/weight_reduce.py); its
    batch-norm ``sums`` (2, K) float32. After a backward chain (hetconv/participant/samples/chain.py)
    it covers layers [``layer``, ``stop``) and every participant kept their sums."""

    layer: int
    dweight: np.ndarray | None
    sums: np.ndarray | None  # None: each participant kept them (the chain)
    reduce_id: int = 0
    contributors: tuple[str, ...] = ()
    stop: int = NO_LAYER  # > layer: layers [layer, stop) of one backward chain


def update_fields(update: PendingUpdate | None) -> dict[str, Any]:
    """A round request's fields of the update it carries (none: NO_LAYER)."""
    if update is None:
        return {"update_layer": NO_LAYER, "dweight": None, "update_sums": None,
                "update_id": 0, "contributors": [], "update_stop": NO_LAYER}
    return {"update_layer": update.layer, "dweight": update.dweight,
            "update_sums": update.sums, "update_id": update.reduce_id,
            "contributors": list(update.contributors), "update_stop": update.stop}


@dataclass(frozen=True)
class SampleSetup:
    """What the sample stage needs besides its cluster and members."""

    shapes: tuple[ConvLayerShape, ...]
    settings: LayerSettings
    device: str  # the master's own device (its replicas)
    wire_dtype: str  # activations (x, y, dy) on the wire; statistics and gradients float32
    batch: int  # the training batch (calibrating joiners)
    master_computes: bool  # the master's own device takes a slice
    local_stage: Callable[[], ConvStage]  # the master alone (no worker left)
    metrics: MetricsWriter
    report: Callable[[str], None]
    rebalancing: bool = True  # re-slice from measured compute (``--rebalance``)
    fall_back: bool = True  # train alone when measured slower than alone (``--fall-back``)
    predicted_s: float | None = None  # the setup's prediction of the conv part (the plan's)
    slice_statistics: bool = False  # batch norm per slice (``--bn-statistics slice``)
    dense_replicas: bool = False  # the dense part on every participant (``--dense-part``)
    steps_in_flight: int = 1  # step chains sent before the last one's replies (2: ahead)
    link_wires: Mapping[str, str] = field(default_factory=dict)  # worker -> its link's dtype
    left_out: frozenset[str] = frozenset()  # workers the plan does not use (their links)

    def wire_for(self, participant: str) -> str:
        """The wire dtype of ``participant``'s activations: its link's
        (``choose_link_wires``), else ``wire_dtype`` (a worker that joined later)."""
        return self.link_wires.get(participant, self.wire_dtype)


def sample_counts(shapes: Sequence[ConvLayerShape], counts: Mapping[str, int]
                  ) -> list[dict[str, Any]]:
    """A ``rebalance``/``replan`` record's ``counts`` under the sample split: per layer,
    every participant of ``counts`` (in its order) with its samples and the whole
    layer's kernels (docs/metrics.md)."""
    return [{"layer": shape.index, "devices": [
        {"participant": name, "kernels": shape.kernels, "samples": samples}
        for name, samples in counts.items()]} for shape in shapes]


class StepFigures:
    """The step's figures as the rounds fill them and ``take_step_timings`` reads them
    (attributes of the stage, set in its ``__init__``; declared once for its mixins)."""

    _timings: dict[int, dict[str, dict[str, Any]]]  # layer -> participant -> its entry
    _comm_s: float
    _step_compute: dict[str, float]  # participant -> its compute this step
    _step_latency: dict[str, float]  # participant -> its rounds this step
    _step_waits: dict[str, float]  # participant -> its waits for peers' pieces this step
    _step_wall: float
    _step_rounds: int


class BetweenSteps(StepFigures):
    """Snapshots, audits, restores and the run state machine's commands (the module
    doc); the step's rounds are the subclass's."""

    cluster: Cluster
    workers: dict[str, Participant]
    local: dict[int, ConvShard]
    balance: SampleBalance
    control: RunControl
    setup: SampleSetup
    runner: SampleRunner
    step: int
    step_model: InPlaceModel
    _step_started: float | None
    _last_step_end: float | None  # when the last step's figures were taken (monotonic s)
    _step_sent_ahead: bool
    _sums: dict[int, tuple[np.ndarray, np.ndarray]]
    _dweight: PendingUpdate | None
    peers: SamplePeers | None  # the weight reduction among the peers; None: via the master
    dense: DenseReplica | None  # the master's replica of the dense part, when replicated
    alone_check: AloneCheck  # never slower than the master alone (``--fall-back``)
    without_check: WithoutCheck  # ... nor than with one worker fewer (trial_without.py)
    slices: list[Slice]
    _step_dense: dict[str, float]  # participant -> its dense part's seconds (step chain)

    @property
    def layers(self) -> int:
        return len(self.setup.shapes)

    def flush(self) -> None:
        """Apply a pending update everywhere now (the subclass's rounds)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _names(self) -> list[str]:
        raise NotImplementedError

    def _slice_batch(self, batch: int) -> list[Slice]:
        raise NotImplementedError

    def snapshot(self) -> dict[str, np.ndarray]:
        """The master's replicas (every update applied to them too), audited against
        every worker."""
        self.flush()
        out: dict[str, np.ndarray] = {}
        for layer in range(self.layers):
            for name, value in self.local[layer].snapshot().items():
                out[layer_key(layer, name)] = value
        self.audit()
        return out

    def audit(self) -> None:
        """Every worker's evaluation-mode output of a few seeded images per layer
        against the master's replica (master/audit.py); a worker answering
        differently is evicted (WorkerLost) before the snapshot is kept."""
        asked: list[tuple[Shard, int, np.ndarray]] = []
        for layer, shape in enumerate(self.setup.shapes):
            x = audit_input(shape, self.step, layer)
            asked += [(Shard(name, member.worker, 0, shape.kernels), layer,
                       to_wire(x, self.setup.wire_for(name)))
                      for name, member in self.workers.items()
                      if name in self.balance.seconds and member.worker is not None]
        dense = self.dense
        if dense is not None:  # the dense part too: the master's arrays are the reference
            x = dense_audit_input(self.setup.shapes[-1], self.step, dense.layer)
            asked += [(Shard(name, member.worker, 0, dense.classes()), dense.layer, x)
                      for name, member in self.workers.items()
                      if name in self.balance.seconds and member.worker is not None]

        def reference(_shard: Shard, layer: int, x: np.ndarray) -> np.ndarray:
            if dense is not None and layer == dense.layer:
                return dense.evaluate(x)
            return self.local[layer].forward_host(x, False)

        audit_workers(self.cluster, self.step, asked, self.control.request_deadline_s(),
                      reference)

    def restore(self, state: dict[str, np.ndarray]) -> None:
        """Every participant's layers back to ``state``, between steps."""
        self._hand_out(state, "restore")

    def _hand_out(self, state: dict[str, np.ndarray], why: str) -> None:
        """Give every worker in the run, and the master, every whole layer of ``state``."""
        rows = [[Shard(name, self.workers[name].worker, 0, shape.kernels)
                 for name in self.workers if name in self.balance.seconds]
                for shape in self.setup.shapes]
        assign(self.cluster, rows, state, self.setup.settings, {}, self.setup.device, why)
        self.local = {shape.index: ConvShard(shape.index, 0, shape.kernels, self.setup.settings,
                                             {n: state[layer_key(shape.index, n)]
                                              for n in _names_in(state, shape.index)},
                                             device=self.setup.device)
                      for shape in self.setup.shapes}
        self.runner.layers.reset()
        self.runner.layers.dense = self.dense
        self._sums.clear()
        self._dweight = None
        self.assign_dense()
        self.assign_peers()

    def _run_workers(self) -> dict[str, WorkerHandle]:
        return {name: member.worker for name, member in self.workers.items()
                if name in self.balance.seconds and member.worker is not None}

    def assign_dense(self) -> None:
        """Hand every worker in the run the dense part (the master's replica: the
        trainer's arrays), when it is replicated."""
        if self.dense is None:
            return
        replica = self.dense
        exchange(self.cluster, [(worker, replica.message(self.cluster.request_id()))
                                for worker in self._run_workers().values() if not worker.gone],
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
        if self.dense is not None:
            kernels.append(self.dense.part.size())
        self.runner.layers.exchange = self.peers.assign(self._run_workers(), self._names(), kernels,
                                                 sizes)

    def recover(self, fault: StageFault, state: dict[str, np.ndarray]) -> ConvStage:
        self.without_check.reset()  # other participants: a trial under way is over
        return self._carry_out(self.control.handle(self.fault_event(fault)), state)

    def fault_event(self, fault: StageFault) -> Fault:
        gone = frozenset(n for n, p in self.workers.items()
                         if p.worker is not None and p.worker.gone)
        return Fault(str(fault), fault.participant, fault.gone, fault.evict, gone)

    def replan_point(self, state: dict[str, np.ndarray]) -> ConvStage:
        self._last_step_end = None  # the next step's period would hold the snapshot's
        if self.setup.fall_back:
            # the master alone first: where the run is slower than it, its trial decides
            # in one interval (a small network on slow workers); then a worker too slow
            # for its slice (master/samples/trial_without.py), where the run beats the master
            verdict = self.alone_check.at_snapshot()
            if isinstance(verdict, TryAlone):
                return self._try_alone(verdict, state)
            changed = self.without_verdict(state)
            if changed is not None:
                return changed
        return self._take_in_joiners(state)

    def without_verdict(self, state: dict[str, np.ndarray]) -> ConvStage | None:
        raise NotImplementedError  # master/samples/without.py

    def kept_out(self) -> set[str]:
        raise NotImplementedError  # master/samples/without.py

    def _take_in_joiners(self, state: dict[str, np.ndarray]) -> ConvStage:
        self.cluster.pump(0.0)  # take in any Hello waiting on the socket
        holding = {id(p.worker) for n, p in self.workers.items() if n in self.balance.seconds}
        joinable = sorted(w.worker_id for w in self.cluster.known_workers()
                          if not w.gone and id(w) not in holding
                          and w.worker_id not in self.kept_out()
                          and self.control.may_rejoin(w.worker_id))
        if not joinable:
            return cast(ConvStage, self)  # the subclass is the whole stage
        return self._carry_out(self.control.handle(ReplanPoint(tuple(joinable))), state)

    # --- never slower than the master alone (master/samples/fall_back.py) -------------------------
    def _try_alone(self, verdict: TryAlone, state: dict[str, np.ndarray]) -> ConvStage:
        """The plan measured slower than the estimate of the master alone: train alone
        until the trial can decide (the workers wait; it asks the trainer for a snapshot
        then: ``AloneCheck.verdict_ready``), then let it decide."""
        reason = (f"trying the master alone: the conv part took {verdict.measured_s * 1e3:.1f} "
                  f"ms per step over the last {ALONE_WINDOW} steps, the master alone is "
                  f"estimated at {verdict.alone_s * 1e3:.1f} ms")
        self.setup.report(f"hetconv: {reason}; the workers wait for {EARLY_STEPS}-"
                          f"{ALONE_WINDOW} steps")
        self._record_replan(reason, verdict.measured_s, verdict.alone_s, alone=True)
        local = self.setup.local_stage()
        local.restore(state)
        return TrialAloneStage(local, self, self.alone_check)

    def keep_alive(self) -> None:
        self.cluster.pump(0.0)

    def stay_alone(self, verdict: StayAlone) -> None:
        reason = (f"{STAY_ALONE_REASON}: the conv part took "
                  f"{verdict.measured_s * 1e3:.1f} ms per step with the workers, "
                  f"{verdict.alone_s * 1e3:.1f} ms alone (medians of {ALONE_WINDOW} steps "
                  f"with them, {verdict.trial_steps} alone)")
        self.setup.report(f"hetconv: {reason}: training on alone (the workers stay up for "
                          "the next run)")
        self._record_replan(reason, verdict.measured_s, verdict.alone_s, alone=True)
        log.warning("%s: training on alone", reason)

    def go_back(self, verdict: GoBack, state: dict[str, np.ndarray]) -> ConvStage:
        reason = (f"the master alone was slower: {verdict.alone_s * 1e3:.1f} ms per step "
                  f"alone, {verdict.measured_s * 1e3:.1f} ms with the workers (medians of "
                  f"{verdict.trial_steps} steps alone, {ALONE_WINDOW} with them)")
        self.setup.report(f"hetconv: {reason}: back to the workers")
        self._record_replan(reason, verdict.measured_s, verdict.alone_s, alone=False)
        self.without_check.reset()
        self._last_step_end = None  # the trial's steps were the master's alone
        try:
            self.restore(state)
        except WorkerLost as lost:  # one left while it waited
            return self._carry_out(self.control.handle(self.fault_event(lost)), state)
        return self._take_in_joiners(state)

    def _record_replan(self, reason: str, measured: float, alone_s: float,
                       alone: bool) -> None:
        """A ``replan`` record (a report event): the master alone, or the slices."""
        counts = ({MASTER_PARTICIPANT: self.setup.batch} if alone
                  else {p.participant: p.samples for p in self.slices})
        self.setup.metrics.write("replan", reason=reason, split_by="samples",
                                 measured_step_s=measured, alone_step_s=alone_s,
                                 counts=sample_counts(self.setup.shapes, counts))

    def take_step_timings(self) -> dict[str, Any]:
        """The step's timing record; a good step for the state machine, a sample of the
        master alone, and the re-slicing from measured compute."""
        self.control.handle(StepDone(time.monotonic()))
        layers = [{"layer": layer, "devices": list(devices.values())}
                  for layer, devices in sorted(self._timings.items())]
        comm_s = self._comm_s
        samples = {p.participant: p.samples for p in self.slices}
        own = samples.get(MASTER_PARTICIPANT, 0)
        if own > 0 and MASTER_PARTICIPANT in self._step_compute:
            # the conv part on both sides (the trial of the master alone times its conv
            # calls only): a step chain's dense part taken out of its wall and compute
            dense = self._step_dense
            self.alone_check.distributed_step(
                max(0.0, self._step_wall - max(dense.values(), default=0.0)),
                max(0.0, self._step_compute[MASTER_PARTICIPANT]
                    - dense.get(MASTER_PARTICIPANT, 0.0)) / own * sum(samples.values()))
        self._step_dense = {}
        now = time.monotonic()  # the step's period, from the last step's end to this one's
        if self._last_step_end is not None:
            self.without_check.step(now - self._last_step_end)
        self._last_step_end = now
        self._check_step_model(samples)
        if self.setup.rebalancing and self.balance.observe(
                self._step_compute, self._step_latency, samples, self._step_waits):
            names = self._names()
            self.slices = self._slice_batch(sum(samples.values()))
            counts = {p.participant: p.samples for p in self.slices}
            self.setup.report("hetconv: re-sliced the batch from measured compute: " + ", ".join(
                f"{n} {counts.get(n, 0)}" for n in names))
            self.setup.metrics.write("rebalance", split_by="samples", step=self.step,
                                     reason="measured compute per sample",
                                     counts=sample_counts(self.setup.shapes,
                                                          {n: counts.get(n, 0) for n in names}))
        self._timings, self._comm_s, self._step_compute, self._step_latency = {}, 0.0, {}, {}
        self._step_waits = {}
        self._step_wall, self._step_rounds, self._step_started = 0.0, 0, None
        sent_ahead, self._step_sent_ahead = self._step_sent_ahead, False
        return {"layers": layers, "comm_s": comm_s, "sent_ahead": sent_ahead}

    def _check_step_model(self, samples: dict[str, int]) -> None:
        """Feed the step to the model calibrated in place (``master/samples/step_model.py``);
        its check, once, as a console line and a ``model`` record."""
        if self._step_started is None or not self._step_rounds:
            return
        check = self.step_model.observe(StepSample(
            time.monotonic() - self._step_started, self._step_wall, self._step_rounds,
            dict(self._step_compute), {n: c for n, c in samples.items() if c > 0}))
        if check is not None:
            self.setup.report(check.line())
            self.setup.metrics.write("model", split_by="samples", step=self.step,
                                     **check.as_record())

    # --- carrying out the state machine's commands ------------------------------------
    def _carry_out(self, commands: list[Command], state: dict[str, np.ndarray]) -> ConvStage:
        """Perform the state machine's commands (master/commands.py)."""
        return carry_out(self, commands, state, self.setup.local_stage) \
            or cast(ConvStage, self)  # the subclass is the whole stage

    def drop_worker(self, participant: str, reason: str) -> None:
        member = self.workers.get(participant)
        if member is not None and member.worker is not None and not member.worker.gone:
            self.cluster.drop(member.worker, reason)

    def resplit_to(self, command: Resplit, state: dict[str, np.ndarray]) -> None:
        self._resplit(set(command.alive), command.reason, state)

    def admit(self, names: list[str]) -> None:
        """Calibrate the joiners; they get their samples at the re-slice that follows."""
        found = {w.worker_id: w for w in self.cluster.known_workers() if not w.gone}
        joiners = [Participant(n, found[n], found[n].device) for n in names if n in found]
        self.without_check.reset()  # other participants: measure them afresh
        self.setup.report(f"hetconv: worker(s) {', '.join(names)} joined: calibrating")
        self.cluster.admit([p.worker for p in joiners if p.worker is not None])
        members = len(self._names()) + len(joiners)
        per_sample = calibrate_samples(
            self.cluster, joiners, list(self.setup.shapes), self.setup.batch,
            report=self.setup.report,
            slice_samples=max(1, -(-self.setup.batch // max(members, 1))))
        for joiner, seconds in zip(joiners, per_sample):
            self.workers[joiner.participant] = joiner
            self.balance.add(joiner.participant, seconds)

    def _resplit(self, alive: set[str], reason: str, state: dict[str, np.ndarray]) -> None:
        """Slice the batch over the master and ``alive`` only; every one of them gets
        the layers of ``state`` (the snapshot the trainer goes on from)."""
        keep = [n for n in self.workers if n in alive]
        self.balance.restrict(keep + [MASTER_PARTICIPANT])
        self.step_model.reset()  # other participants: fit and check again
        self._hand_out(state, reason)
        self.control.handle(ReplanDone())
        names = self._names()
        self.setup.report(f"hetconv: re-plan ({reason}): the batch split by samples over "
                          + ", ".join(names))
        slices = {p.participant: p.samples for p in self._slice_batch(self.setup.batch)}
        self.setup.metrics.write("replan", reason=reason, split_by="samples",
                                 counts=sample_counts(self.setup.shapes,
                                                      {n: slices.get(n, 0) for n in names}))


def _names_in(state: dict[str, np.ndarray], layer: int) -> list[str]:
    prefix = layer_key(layer, "")
    return [key[len(prefix):] for key in state if key.startswith(prefix)]
