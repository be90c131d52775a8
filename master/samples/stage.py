"""The distributed conv stage under the sample split (``--split-by samples``).

Every participant (the master's own device and each worker) holds every conv layer
whole and computes a slice of the batch, sized in proportion to its speed
(``master/samples/plan.py``); between layers only per-channel vectors and weight
gradients travel (docs/sample-split.md). :class:`SampleConvStage` is the trainer's
:class:`~hetconv.engine.stage.ConvStage` over parts that each own their state:

- :class:`~hetconv.master.samples.members.SampleMembers`: who takes part, their slices;
- :class:`~hetconv.master.samples.replicas.MasterReplicas`: the master's whole layers
  (every update applied to them too: a snapshot is its own state) and its runner;
- :class:`~hetconv.master.samples.rounds.Rounds`: a round sent and collected, the
  master's own share in its helper thread meanwhile;
- :class:`~hetconv.master.samples.layer_rounds.LayerRounds`: training layer by layer
  through the master (``--data-plane star``), evaluation, update-only rounds;
- :class:`~hetconv.master.samples.chains.Chains`: a step as two chains, or one step
  chain, the statistics exchanged among the peers (``--data-plane peer``, the default);
- :class:`~hetconv.master.samples.between.BetweenSteps`: snapshots and their audit,
  hand-outs, joiners' calibration;
- :class:`~hetconv.master.samples.policy.SamplePolicy`: the decisions from measured
  steps (re-slicing, the step model, the master-alone and without-one trials), sans-IO;
- one :class:`~hetconv.master.samples.figures.StepState` (the step's number, batch,
  slices and figures) and one :class:`~hetconv.master.samples.updates.Updates` (the
  pending update), shared by the parts that read them.

Faults go to the run's state machine (``master/run.py``) as under the kernel split,
and its commands are carried out here (``master/commands.py``): evict, re-slice over the
survivors (every survivor gets the snapshot's layers), fall back to the master alone,
stop; joiners are calibrated and get the layers at the next snapshot. The policy's
verdicts are carried out here too, each said on the console and recorded.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hetconv.config import MASTER_PARTICIPANT
from hetconv.engine.dense_part import DensePart
from hetconv.engine.optim import OptimizerConfig
from hetconv.engine.shard import ConvShard
from hetconv.engine.stage import ConvStage, StageFault
from hetconv.master.cluster import Cluster, WorkerLost
from hetconv.master.commands import carry_out
from hetconv.master.plan import Participant
from hetconv.master.run import (
    Command,
    Fault,
    ReplanDone,
    ReplanPoint,
    Resplit,
    RunControl,
    SetAside,
    StepDone,
)
from hetconv.master.samples.balance import SampleBalance
from hetconv.master.samples.between import BetweenSteps
from hetconv.master.samples.chains import Chains
from hetconv.master.samples.fall_back import (
    ALONE_WINDOW,
    EARLY_STEPS,
    STAY_ALONE_REASON,
    GoBack,
    StayAlone,
    TryAlone,
)
from hetconv.master.samples.figures import NO_BATCH, StepState, sample_counts
from hetconv.master.samples.layer_rounds import LayerRounds
from hetconv.master.samples.members import SampleMembers
from hetconv.master.samples.peers import SamplePeers
from hetconv.master.samples.policy import ModelChecked, Reslice, SamplePolicy, step_sample
from hetconv.master.samples.replicas import MasterReplicas
from hetconv.master.samples.rounds import Rounds
from hetconv.master.samples.settings import SampleSetup
from hetconv.master.samples.step_model import StepSample
from hetconv.master.samples.trial_alone import TrialAloneStage
from hetconv.master.samples.trial_without import (
    WITHOUT_GAIN,
    WITHOUT_WINDOW,
    KeepWithout,
    TakeBack,
    TryWithout,
)
from hetconv.master.samples.updates import Updates
from hetconv.participant.samples.dense_replica import DenseReplica

log = logging.getLogger("hetconv.master")


class SampleConvStage:
    """A :class:`hetconv.engine.stage.ConvStage` that splits every conv layer by samples."""

    def __init__(self, cluster: Cluster, workers: list[Participant], local: dict[int, ConvShard],
                 balance: SampleBalance, control: RunControl, setup: SampleSetup,
                 on_close: Callable[[], None], peers: SamplePeers | None = None):
        self.cluster = cluster
        self.control = control
        self.setup = setup
        self.peers = peers  # the weight reduction among the peers; None: via the master
        self._on_close = on_close
        self.members = SampleMembers(workers, balance, setup.master_computes, setup.left_out)
        self.replicas = MasterReplicas(local, setup)
        self.state = StepState()
        self.updates = Updates()
        self.rounds = Rounds(cluster, control, self.members, self.replicas, setup, peers)
        self.layer_rounds = LayerRounds(cluster, setup, self.members, self.replicas,
                                        self.rounds, self.updates, self.state, peers)
        self.chains = (Chains(cluster, setup, self.members, self.replicas, self.rounds,
                              self.updates, self.state, peers) if peers is not None else None)
        self.between = BetweenSteps(cluster, control, setup, self.members, self.replicas,
                                    self.updates, self.state, peers)
        self.policy = SamplePolicy(balance, setup.predicted_s, setup.rebalancing,
                                   setup.fall_back, setup.alone_conv_s)
        self.pending_fault: StageFault | None = None  # found while the run was set up
        self._chain_output = NO_BATCH  # the forward chain's joined output
        self._closed = False

    # --- what the stage runs ------------------------------------------------------------
    @property
    def routes_shortcuts(self) -> bool:
        """The participants' chains join a residual network's shortcuts (RoutingStage)."""
        return True

    @property
    def layers(self) -> int:
        return self.setup.layers

    @property
    def chained(self) -> bool:
        """Whether a step is two chains (hetconv/participant/samples/chain.py): the
        statistics exchanged among the peers; else 2L + 2 rounds through the master."""
        return self.chains is not None

    @property
    def replicates_dense(self) -> bool:
        """Whether a training step is one step chain (the dense part on every
        participant's slice) rather than the trainer's conv calls."""
        return self.chained and self.replicas.dense is not None

    @property
    def runs_ahead(self) -> bool:
        """Whether the trainer may hand ``train_step`` the next step too (two steps in
        flight: step chains, ``--steps-in-flight 2``)."""
        return self.replicates_dense and self.setup.steps_in_flight > 1

    def local_replica(self, layer: int) -> Any:
        return self.replicas.replica(layer)

    def _raise_pending_fault(self) -> None:
        """A fault found while the run was set up, raised at the first step: the
        trainer's recovery, a re-plan that checks again."""
        if self.pending_fault is not None:
            fault, self.pending_fault = self.pending_fault, None
            raise fault

    # --- a training step ------------------------------------------------------------------
    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        if not train:
            output = self.layer_rounds.evaluate(layer, x)
            return NO_BATCH if output is None else output
        update = None
        if layer == 0:
            self._raise_pending_fault()
            update = self._begin_step(x, step)
            if self.chains is not None:
                self._chain_output = self.chains.forward(step, update)
        if self.chains is not None:
            return self._chain_output if layer == self.layers - 1 else NO_BATCH
        output = self.layer_rounds.forward(layer, step, update)
        return NO_BATCH if output is None else output

    def _begin_step(self, x: np.ndarray, step: int) -> Any:
        """A training step's start: its batch x (B, C, H, W) sliced over the
        participants; the previous step's pending update, which rides along."""
        state = self.state
        state.step = step
        state.figures.started = time.monotonic()
        state.x = np.ascontiguousarray(x, dtype=np.float32)
        state.slices = self.members.slices(x.shape[0])
        return self.layer_rounds.take_update()

    def backward(self, layer: int, dy: np.ndarray, need_dx: bool, learning_rate: float,
                 step: int) -> np.ndarray | None:
        if self.chains is not None:
            if layer == self.layers - 1:
                self.chains.backward(step, learning_rate, dy)
            return None
        self.layer_rounds.backward(layer, dy, learning_rate, step)
        return None

    def attach_dense(self, part: DensePart, optimizer: OptimizerConfig) -> None:
        """Replicate the trainer's dense part (``--dense-part replicas``, chains only):
        the master's replica is ``part`` itself; every worker gets it now and at every
        hand-out of the layers. Between steps only."""
        if not self.chained or not self.setup.dense_replicas:
            return
        self.flush()
        self.replicas.attach_dense(DenseReplica(part, self.layers, optimizer.momentum,
                                                optimizer.weight_decay))
        try:
            self.between.assign_dense()
            self.between.assign_peers()
        except WorkerLost as fault:  # as at setup: the first step raises it (a recovery)
            self.pending_fault = self.pending_fault or fault

    def train_step(self, x: np.ndarray, labels: np.ndarray, step: int, learning_rate: float,
                   ahead: tuple[np.ndarray, np.ndarray, int, float] | None = None
                   ) -> dict[str, Any]:
        """One SGD step as one step chain per participant (``Chains.train_step``)."""
        assert self.chains is not None, "train_step needs the dense part replicated"
        return self.chains.train_step(x, labels, step, learning_rate, ahead,
                                      self._raise_pending_fault)

    def end_step(self) -> dict[str, Any]:
        """The step's record, after the run state machine heard of a good step and the
        policy of its figures (re-slicing from measured compute, the step model's check,
        the measures behind the trials)."""
        self.control.handle(StepDone(time.monotonic()))
        samples = self.state.samples()
        figures = self.state.end()
        for command in self.policy.step_ended(figures, samples, time.monotonic()):
            if isinstance(command, ModelChecked):
                self.setup.report(command.check.line())
                self.setup.metrics.write("model", split_by="samples", step=self.state.step,
                                         **command.check.as_record())
            elif isinstance(command, Reslice):
                self._reslice(sum(samples.values()))
        return figures.record()

    def end_rehearsal_step(self) -> StepSample | None:
        """A set-up rehearsal's step ended (master/samples/rehearsal.py): its figures as
        the step model takes them; none of the run's decisions hears of it."""
        self.control.handle(StepDone(time.monotonic()))
        samples = self.state.samples()
        return step_sample(self.state.end(), samples, time.monotonic())

    def release(self) -> None:
        """Close the stage's own sockets and threads, not the cluster: set-up hands the
        run to the master alone (master/setup.py ``train_alone`` ends it)."""
        self._on_close = lambda: None
        self.close()

    def _reslice(self, batch: int) -> None:
        names = self.members.names()
        self.state.slices = self.members.slices(batch)
        counts = self.state.samples()
        self.setup.report("hetconv: re-sliced the batch from measured compute: " + ", ".join(
            f"{n} {counts.get(n, 0)}" for n in names))
        self.setup.metrics.write("rebalance", split_by="samples", step=self.state.step,
                                 reason="measured compute per sample",
                                 counts=sample_counts(self.setup.shapes,
                                                      {n: counts.get(n, 0) for n in names}))

    def flush(self) -> None:
        """Apply a pending update everywhere now (before a snapshot or an evaluation)."""
        if self.chains is not None and self.chains.ahead is not None:
            # the trainer drains before reading the replicas
            raise RuntimeError(f"internal error: step {self.chains.ahead.step} is in flight "
                               "where the replicas are read")
        self.layer_rounds.flush()

    def drain(self) -> None:
        if self.chains is not None:
            self.chains.drain()

    # --- between steps ------------------------------------------------------------------
    def snapshot(self) -> dict[str, np.ndarray]:
        """The master's replicas (every update applied to them too), audited against
        every worker."""
        self.flush()
        return self.between.snapshot()

    def restore(self, state: dict[str, np.ndarray]) -> None:
        """Every participant's layers back to ``state``, between steps."""
        self.between.hand_out(state, "restore")

    def assign_peers(self) -> None:
        self.between.assign_peers()

    def recover(self, fault: StageFault, state: dict[str, np.ndarray]) -> ConvStage:
        self.policy.fault()  # other participants: a trial under way is over
        return self._carry_out(self.control.handle(self.fault_event(fault)), state)

    def fault_event(self, fault: StageFault) -> Fault:
        return Fault(str(fault), fault.participant, fault.gone, fault.evict,
                     self.members.gone())

    def replan_point(self, state: dict[str, np.ndarray]) -> ConvStage:
        # the slices the next step takes (``state.slices`` may hold an evaluation's)
        next_samples = {p.participant: p.samples for p in self.members.slices(self.setup.batch)}
        verdict = self.policy.at_snapshot(next_samples)
        if isinstance(verdict, TryAlone):
            return self._try_alone(verdict, state)
        if isinstance(verdict, TryWithout):
            reason = (f"trying without {verdict.worker}: {verdict.why()}; the step "
                      f"measured {verdict.with_s * 1e3:.1f} ms with it (median of "
                      f"{WITHOUT_WINDOW} steps)")
            self.setup.report(f"hetconv: {reason}; until the next snapshot it waits")
            return self._carry_out(self.control.handle(SetAside(verdict.worker, reason)),
                                   state)
        if isinstance(verdict, KeepWithout):
            self.members.set_aside.add(verdict.worker)
            reason = (f"not used from now on: {verdict.worker} (the step measured "
                      f"{verdict.without_s * 1e3:.1f} ms without it, "
                      f"{verdict.with_s * 1e3:.1f} ms with it, medians of {WITHOUT_WINDOW} "
                      "steps; it stays connected until the run ends)")
            self.setup.report(f"hetconv: {reason}")
            log.warning("%s", reason)
            self.setup.metrics.write(
                "replan", reason=reason, split_by="samples", left_out=[verdict.worker],
                measured_step_s=verdict.without_s, with_step_s=verdict.with_s,
                counts=sample_counts(self.setup.shapes, next_samples))
        if isinstance(verdict, TakeBack):
            self.setup.report(
                f"hetconv: taking {verdict.worker} back: without it the step measured "
                f"{verdict.without_s * 1e3:.1f} ms, with it {verdict.with_s * 1e3:.1f} ms "
                f"(not {WITHOUT_GAIN:.0%} shorter); it joins again")
        return self._take_in_joiners(state)

    def _take_in_joiners(self, state: dict[str, np.ndarray]) -> ConvStage:
        self.cluster.pump(0.0)  # take in any Hello waiting on the socket
        kept_out = self.members.kept_out(self.policy.on_trial())
        waiting = [w for w in self.cluster.known_workers()
                   if not w.gone and not self.members.holds(w) and w.worker_id not in kept_out
                   and self.control.may_rejoin(w.worker_id)
                   and not self.cluster.misbehaving(w.worker_id)]
        joinable = self.between.joiners_ready(waiting)  # timed beside training
        if not joinable:
            return self
        return self._carry_out(self.control.handle(ReplanPoint(tuple(joinable))), state)

    # --- never slower than the master alone (master/samples/fall_back.py) ----------------
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
        return TrialAloneStage(local, self, self.policy.alone)

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
        self.policy.back_from_alone()
        try:
            self.restore(state)
        except WorkerLost as lost:  # one left while it waited
            return self._carry_out(self.control.handle(self.fault_event(lost)), state)
        return self._take_in_joiners(state)

    def _record_replan(self, reason: str, measured: float, alone_s: float,
                       alone: bool) -> None:
        """A ``replan`` record (a report event): the master alone, or the slices."""
        counts = ({MASTER_PARTICIPANT: self.setup.batch} if alone else self.state.samples())
        self.setup.metrics.write("replan", reason=reason, split_by="samples",
                                 measured_step_s=measured, alone_step_s=alone_s,
                                 counts=sample_counts(self.setup.shapes, counts))

    # --- carrying out the state machine's commands (master/commands.py) ----------------
    def _carry_out(self, commands: list[Command], state: dict[str, np.ndarray]) -> ConvStage:
        return carry_out(self, commands, state, self.setup.local_stage) or self

    def drop_worker(self, participant: str, reason: str, misbehaved: bool = False) -> None:
        member = self.members.workers.get(participant)
        if member is not None and member.worker is not None and not member.worker.gone:
            self.cluster.drop(member.worker, reason, misbehaved)

    def resplit_to(self, command: Resplit, state: dict[str, np.ndarray]) -> None:
        """Slice the batch over the master and the alive only; every one of them gets
        the layers of ``state`` (the snapshot the trainer goes on from)."""
        reason = command.reason
        self.members.restrict(set(command.alive))
        self.policy.resplit()  # other participants: fit and check again
        self.between.hand_out(state, reason)
        self.control.handle(ReplanDone())
        names = self.members.names()
        self.setup.report(f"hetconv: re-plan ({reason}): the batch split by samples over "
                          + ", ".join(names))
        slices = {p.participant: p.samples for p in self.members.slices(self.setup.batch)}
        self.setup.metrics.write("replan", reason=reason, split_by="samples",
                                 counts=sample_counts(self.setup.shapes,
                                                      {n: slices.get(n, 0) for n in names}))

    def admit(self, names: list[str]) -> None:
        """Calibrate the joiners; they get their samples at the re-slice that follows."""
        self.policy.joined()  # other participants: measure them afresh
        self.between.calibrate(names)

    # --- the end ----------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:  # a fall-back closed it; the trainer's end closes what it holds
            return
        self._closed = True
        self.drain()  # a step sent ahead that the trainer will not ask for
        self.rounds.close()  # first: the helper thread's wake-up socket
        if self.peers is not None:
            self.peers.close()
        self._on_close()
