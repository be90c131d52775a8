"""The distributed conv stage: every conv layer's kernels spread over participants.

For each conv layer the kernels are cut into consecutive ranges, one per participant
(the master's own device first, then the workers in a fixed order). The stage is the
socket-side loop of a run and moves messages only: its data plane
(``master/kernels/planes.py``) runs each layer's forward and backward over its
:class:`~hetconv.master.kernels.phases.Phases`; snapshots pull every shard and audit the
workers' results; every fault, step and re-plan point goes to the run's state machine
(``master/run.py``) as an event, and the stage carries out the commands it gets back
(evict, admit, re-split, fall back to the master alone, stop). The planning behind a
re-split (the split rule, calibrating joiners, rebalancing from measured steps, the
records of each) is the run set-up's :class:`Planning` (``master/setup.py``). Built
complete: nothing is filled in after construction.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hetconv.engine.shard import ConvShard, LayerSettings
from hetconv.engine.stage import ConvStage, StageFault
from hetconv.master.assign import assign, shard_state
from hetconv.master.audit import audit_input, audit_workers
from hetconv.master.cluster import WorkerHandle
from hetconv.master.commands import carry_out
from hetconv.master.kernels.phases import Phases
from hetconv.master.kernels.planes import DataPlane
from hetconv.master.kernels.rebalance import RebalanceDecision
from hetconv.master.plan import Shard, reshard
from hetconv.master.run import (
    Command,
    Fault,
    ReplanDone,
    ReplanPoint,
    Resplit,
    RunControl,
    StepDone,
)
from hetconv.names import STATE_NAMES, layer_key
from hetconv.participant.wire_cast import to_wire
from hetconv.protocol import SnapshotRequest

log = logging.getLogger("hetconv.master")


class Planning(Protocol):
    """What the stage asks of the run's planning (``master/setup.py``)."""

    def split(self, alive: set[str]) -> list[list[int]]:
        """Kernel counts per layer per participant (plan order) over ``alive`` only."""
        ...

    def replanned(self, counts: list[list[int]], names: list[str], reason: str) -> None:
        """The split changed (a recovery, a join): adopt and record it."""
        ...

    def rebalance(self, timings: dict[str, Any]) -> RebalanceDecision | None:
        """A re-split from a step's measured timings, or None."""
        ...

    def rebalanced(self, decision: RebalanceDecision, apply_s: float) -> None:
        """A rebalancing re-split was applied: record it."""
        ...

    def joinable(self, shards: list[list[Shard]], may_rejoin: Callable[[str], bool]
                 ) -> list[str]:
        """Workers that said Hello, hold no column of ``shards`` and may come back."""
        ...

    def admit(self, shards: list[list[Shard]], names: list[str]) -> list[list[Shard]]:
        """Calibrate ``names`` (from :meth:`joinable`) and add their columns."""
        ...


@dataclass(frozen=True)
class StageSetup:
    """What the stage needs besides its sockets: the layers' settings and shapes, the
    master's own device, the planning, and how to go on alone."""

    settings: LayerSettings
    device: str  # the master's own device, for shards it newly holds
    planning: Planning
    local_stage: Callable[[], ConvStage]  # the master alone (no worker left)


class DistributedConvStage:
    """A :class:`hetconv.engine.stage.ConvStage` over a cluster (see the module doc)."""

    def __init__(self, phases: Phases, plane: DataPlane, control: RunControl,
                 setup: StageSetup, on_close: Callable[[], None]):
        self.phases = phases
        self.plane = plane
        self.control = control  # the failover policy (master/run.py)
        self.setup = setup
        self._on_close = on_close

    @property
    def shards(self) -> list[list[Shard]]:
        """shards[layer] in kernel order, one per participant, empty ranges included."""
        return self.phases.shards

    # --- the ConvStage interface --------------------------------------------------------
    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        return self.plane.forward(layer, x, train, step)

    def backward(self, layer: int, dy: np.ndarray, need_dx: bool, learning_rate: float,
                 step: int) -> np.ndarray | None:
        return self.plane.backward(layer, dy, need_dx, learning_rate, step)

    def end_step(self) -> dict[str, Any]:
        """The step's timings; between steps, a rebalancing re-split where one is due."""
        self.control.handle(StepDone(time.monotonic()))  # faults so far were transient
        timings = self.phases.take_timings()
        decision = self.setup.planning.rebalance(timings)
        if decision is not None:
            started = time.perf_counter()
            self.resplit(decision.counts)
            self.setup.planning.rebalanced(decision, time.perf_counter() - started)
        return timings

    def end_rehearsal_step(self) -> None:
        """A set-up rehearsal's step ended (master/kernels/rehearsal.py): faults so far
        were transient; its timings are dropped, and the rebalancer hears none of it."""
        self.control.handle(StepDone(time.monotonic()))
        self.phases.take_timings()

    def release(self) -> None:
        """Close the stage's own planes and threads, not the cluster: set-up hands the
        run to the master alone (master/setup_alone.py ``train_alone`` ends it)."""
        self._on_close = lambda: None
        self.close()

    def snapshot(self) -> dict[str, np.ndarray]:
        """Pull every shard (parameters, statistics, velocities) and assemble whole layers."""
        out: dict[str, np.ndarray] = {}
        cluster = self.phases.cluster
        for layer, shards in enumerate(self.shards):
            remote = [(s, SnapshotRequest(request_id=cluster.request_id(), layer=layer))
                      for s in shards if s.worker is not None and s.kernels > 0]
            replies, _, _, _, _ = self.phases.run_phase(
                layer, f"snapshot of layer {layer + 1}", remote, None)
            pieces: dict[str, list[np.ndarray]] = {name: [] for name in STATE_NAMES}
            for shard in shards:
                if shard.kernels == 0:
                    continue
                if shard.worker is None:
                    state = self.phases.local_shards[layer].snapshot()
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
        phases = self.phases
        asked: list[tuple[Shard, int, np.ndarray]] = []
        for layer, row in enumerate(self.shards):
            if layer >= len(phases.layer_shapes):
                continue
            x = to_wire(audit_input(phases.layer_shapes[layer], phases.step, layer),
                        phases.wire_dtype)
            asked += [(shard, layer, x) for shard in row
                      if shard.worker is not None and shard.kernels > 0]

        def reference(shard: Shard, layer: int, x: np.ndarray) -> np.ndarray:
            return ConvShard(layer, shard.start, shard.stop, self.setup.settings,
                             shard_state(state, layer, shard.start, shard.stop),
                             device="cpu").forward_host(x, False)
        audit_workers(phases.cluster, phases.step, asked, self.control.request_deadline_s(),
                      reference)

    def restore(self, state: dict[str, np.ndarray]) -> None:
        """Roll every shard (same split) back to ``state``, between steps."""
        self._assign(self.shards, state, "restore")

    def recover(self, fault: StageFault, state: dict[str, np.ndarray]) -> ConvStage:
        """Hand the fault to the run's state machine and carry out what it decides:
        evict, re-plan over the rest and restore every shard to ``state``; with no
        worker left a local stage from ``state`` (or UserError under
        ``--on-worker-loss stop``)."""
        return self._carry_out(self.control.handle(self.fault_event(fault)), state)

    def replan_point(self, state: dict[str, np.ndarray]) -> ConvStage:
        """Right after a snapshot: take in the workers that joined since the last one,
        re-planning over everyone and restoring every shard from ``state`` (which is
        the current state, so nothing is rolled back)."""
        cluster = self.phases.cluster
        joinable = self.setup.planning.joinable(
            self.shards, lambda name: (self.control.may_rejoin(name)
                                       and not cluster.misbehaving(name)))
        if not joinable:
            return self
        return self._carry_out(self.control.handle(ReplanPoint(tuple(joinable))), state)

    def close(self) -> None:
        self.phases.close()  # first: the helper thread may use the plane's sockets
        self.plane.close()
        self._on_close()

    # --- moving shards between steps --------------------------------------------------
    def resplit(self, counts: Sequence[Sequence[int]]) -> None:
        """Move to new kernel counts per layer per participant (participant order),
        between steps and without changing results: pull every shard's exact state and
        hand out only the shards that changed."""
        state = self.snapshot()
        self._assign(reshard(self.shards, counts), state, "re-split", changed_only=True)

    def _assign(self, shards: list[list[Shard]], state: dict[str, np.ndarray], why: str,
                changed_only: bool = False) -> None:
        phases = self.phases
        phases.local_shards = assign(phases.cluster, shards, state, self.setup.settings,
                                     phases.local_shards, self.setup.device, why,
                                     previous=phases.shards, changed_only=changed_only)
        phases.shards = shards
        self.plane.after_resplit()

    # --- carrying out the state machine's commands ------------------------------------
    def fault_event(self, fault: StageFault) -> Fault:
        self.phases.quiesce()
        gone = frozenset(s.participant for row in self.shards for s in row
                         if s.worker is not None and s.worker.gone)
        return Fault(str(fault), fault.participant, fault.gone, fault.evict, gone)

    def _carry_out(self, commands: list[Command], state: dict[str, np.ndarray]) -> ConvStage:
        """Perform the state machine's commands (master/commands.py)."""
        return carry_out(self, commands, state, self.setup.local_stage) or self

    def drop_worker(self, participant: str, reason: str, misbehaved: bool = False) -> None:
        worker = self._worker_of(participant)
        if worker is not None and not worker.gone:
            self.phases.cluster.drop(worker, reason, misbehaved)

    def admit(self, participants: list[str]) -> None:
        self.phases.shards = self.setup.planning.admit(self.shards, participants)

    def resplit_to(self, command: Resplit, state: dict[str, np.ndarray]) -> None:
        """Re-plan over ``command.alive`` (and the master's own device) and restore
        every shard from ``state``."""
        own = {s.participant for s in self.shards[0] if s.worker is None}
        counts = self.setup.planning.split(set(command.alive) | own)
        self._assign(reshard(self.shards, counts), state,
                     "join" if command.joined else "recovery")
        self.control.handle(ReplanDone())
        self.setup.planning.replanned([[s.kernels for s in row] for row in self.shards],
                                      [s.participant for s in self.shards[0]], command.reason)

    def _worker_of(self, participant: str) -> WorkerHandle | None:
        return next((s.worker for s in self.shards[0] if s.participant == participant), None)
