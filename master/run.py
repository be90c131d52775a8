"""The run's state machine: what a distributed run does after a fault, a step or a join.

:class:`RunControl` holds the failover policy of a run and nothing else: which
workers may hold kernels, which were evicted (how often, and at which good step),
which are quarantined for wrong results, the faults of each since the last good
step, whether a re-plan is being applied, and the recent good-step durations behind
the request deadline. Events come in (:class:`StepDone`, :class:`Fault`,
:class:`ReplanPoint`, :class:`ReplanDone`, :class:`SetAside`), commands go out (:class:`Evict`,
:class:`Admit`, :class:`Resplit`, :class:`FallBackLocal`, :class:`Stop`); the stage
(``master/kernels/stage.py``) carries them out over its sockets and reports back. No
sockets, no threads, no clock: time comes in with the events (monotonic seconds), so
every transition is a plain call in a test (``tests/unit/test_run.py``). The design
is in ``docs/run-control.md``.
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

EVICT_AFTER_FAULTS = 2
"""Faults in a row (no good step between) after which a live worker is evicted."""
REJOIN_BACKOFF_STEPS = 50
"""Good steps an evicted worker waits before its second return; doubled every time after."""
REQUEST_DEADLINE_MIN_S = 5.0
REQUEST_DEADLINE_FACTOR = 10.0
FIRST_REQUEST_DEADLINE_S = 120.0
"""A phase's requests may stay unanswered FIRST_REQUEST_DEADLINE_S before any step was
timed, then REQUEST_DEADLINE_FACTOR x the median recent good step (at least
REQUEST_DEADLINE_MIN_S): a request lost behind a short partition is retried."""
STEP_HISTORY = 9  # good steps the request deadline's median is taken over
MAX_REPLAN_FAULTS = 8
"""Faults in a row while re-plans are out (no re-plan done between) after which every
worker is given up: the master trains on alone (or stops, under ``--on-worker-loss
stop``) rather than re-planning for ever over workers that keep failing it."""


# --- events in -----------------------------------------------------------------------------
@dataclass(frozen=True)
class StepDone:
    """A training step went through at ``now``: faults so far were transient."""

    now: float


@dataclass(frozen=True)
class Fault:
    """A step, snapshot or re-plan failed. ``participant``: the one at fault (None:
    unknown); ``gone``: it is dead or has left; ``evict``: it answered wrongly (evict
    and quarantine it although alive); ``gone_workers``: every worker the socket layer
    knows to be gone by now."""

    reason: str
    participant: str | None = None
    gone: bool = False
    evict: bool = False
    gone_workers: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ReplanPoint:
    """A snapshot was taken (nothing to roll back): ``joinable`` workers said Hello
    since and hold no kernels (new, restarted, or back after an eviction)."""

    joinable: tuple[str, ...]


@dataclass(frozen=True)
class ReplanDone:
    """The last :class:`Resplit` was carried out."""


@dataclass(frozen=True)
class SetAside:
    """At a snapshot: run on without ``worker``, alive and well but measured or
    suspected to slow the step (``master/samples/trial_without.py``); not an eviction: it may
    be taken back as a joiner, at once."""

    worker: str
    reason: str


Event = StepDone | Fault | ReplanPoint | ReplanDone | SetAside


# --- commands out ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Evict:
    """Take ``participant`` out of the run; ``drop``: it is alive, tell it the run is
    over for it (it keeps its process and may say Hello again)."""

    participant: str
    reason: str
    drop: bool
    misbehaved: bool = False
    """Evicted alive for two faults in a row blamed on it (it answers the master but
    fails its peers: hetconv/master/blame.py): it stays out until its process restarts."""


@dataclass(frozen=True)
class Admit:
    """Calibrate and take in these workers (a join); a :class:`Resplit` follows."""

    participants: tuple[str, ...]


@dataclass(frozen=True)
class Resplit:
    """Re-plan the kernels over ``alive`` (workers; the master's own device too where it
    takes part) and give every shard the snapshot's state; ``reason`` for the record."""

    alive: frozenset[str]
    reason: str
    joined: tuple[str, ...] = ()


@dataclass(frozen=True)
class FallBackLocal:
    """No worker is left: the master trains on alone from the snapshot."""

    reason: str


@dataclass(frozen=True)
class Stop:
    """No worker is left and ``--on-worker-loss stop`` asks to end the run."""

    reason: str


Command = Evict | Admit | Resplit | FallBackLocal | Stop


class RunControl:
    """The failover policy of one distributed run (see the module doc).

    ``workers``: the workers holding kernels at the start; ``stop_on_worker_loss``:
    ``--on-worker-loss stop``."""

    def __init__(self, workers: Iterable[str], stop_on_worker_loss: bool = False) -> None:
        self.active: set[str] = set(workers)  # workers that may hold kernels
        self.known: set[str] = set(self.active)  # every worker ever in the run
        self.stop_on_worker_loss = stop_on_worker_loss
        self.quarantined: set[str] = set()  # evicted for wrong results: never taken back
        self.evictions: dict[str, int] = {}  # worker -> times evicted this run
        self.evicted_at: dict[str, int] = {}  # worker -> good steps done then
        self.faults: dict[str, int] = {}  # worker -> faults since the last good step
        self.steps_done = 0  # good steps (the clock of the rejoin back-off)
        self.replanning = False  # a Resplit is out and not yet done
        self.replan_faults = 0  # faults in a row while a Resplit was out
        self.step_seconds: deque[float] = deque(maxlen=STEP_HISTORY)
        self._last_step_end: float | None = None
        self._fault_since_step = False

    # --- queries ----------------------------------------------------------------------------
    def request_deadline_s(self) -> float:
        """How long a phase's requests may stay unanswered (see FIRST_REQUEST_DEADLINE_S)."""
        if not self.step_seconds:
            return FIRST_REQUEST_DEADLINE_S
        return max(REQUEST_DEADLINE_MIN_S,
                   REQUEST_DEADLINE_FACTOR * statistics.median(self.step_seconds))

    def may_rejoin(self, worker: str) -> bool:
        """Whether an evicted worker may come back now: at once after its first eviction
        (a restart, a healed partition), then after REJOIN_BACKOFF_STEPS good steps,
        doubling with every further eviction; never when quarantined. (One evicted alive
        for faults blamed on it stays out until its process restarts: the stage's
        ``Cluster.misbehaving``.)"""
        if worker in self.quarantined:
            return False
        count = self.evictions.get(worker, 0)
        if count <= 1:
            return True
        wait = REJOIN_BACKOFF_STEPS * (1 << (count - 2))
        return self.steps_done - self.evicted_at.get(worker, 0) >= wait

    # --- transitions ---------------------------------------------------------------------
    def handle(self, event: Event) -> list[Command]:
        match event:
            case StepDone():
                return self._step_done(event.now)
            case Fault():
                return self._fault(event)
            case ReplanPoint():
                return self._replan_point(event.joinable)
            case ReplanDone():
                self.replanning = False
                self.replan_faults = 0
                return []
            case SetAside():
                return self._set_aside(event)

    def _step_done(self, now: float) -> list[Command]:
        if not self._fault_since_step and self._last_step_end is not None:
            self.step_seconds.append(now - self._last_step_end)  # a clean step's duration
        self._last_step_end = now
        self._fault_since_step = False
        self.steps_done += 1
        self.faults.clear()
        return []

    def _fault(self, fault: Fault) -> list[Command]:
        self._fault_since_step = True
        self.replan_faults = self.replan_faults + 1 if self.replanning else 0
        if self.replan_faults >= MAX_REPLAN_FAULTS:
            return self._give_up(fault)
        culprit = fault.participant if fault.participant in self.active else None
        out: list[Command] = []
        for name in sorted(self.active & fault.gone_workers):
            out.append(self._evict(name, f"gone: {fault.reason}", drop=False))
        if culprit is not None and culprit in self.active:
            self.faults[culprit] = self.faults.get(culprit, 0) + 1
            if fault.evict:
                self.quarantined.add(culprit)
            if fault.gone or fault.evict or self.faults[culprit] >= EVICT_AFTER_FAULTS:
                out.append(self._evict(culprit, f"evicted: {fault.reason}", drop=not fault.gone,
                                       misbehaved=not (fault.gone or fault.evict)))
        if not self.active:
            self.replanning = False
            if self.stop_on_worker_loss:
                return [*out, Stop(f"every worker is lost ({fault.reason}); stopping as "
                                   "--on-worker-loss stop asks")]
            return [*out, FallBackLocal(f"every worker is lost ({fault.reason})")]
        self.replanning = True
        return [*out, Resplit(frozenset(self.active), f"recovery from: {fault.reason}")]

    def _give_up(self, fault: Fault) -> list[Command]:
        """Every re-plan of the last MAX_REPLAN_FAULTS failed: drop every worker."""
        reason = (f"{self.replan_faults} re-plans in a row failed (the last: {fault.reason})")
        out: list[Command] = [self._evict(name, f"given up: {reason}",
                                          drop=name not in fault.gone_workers)
                              for name in sorted(self.active)]
        self.replanning, self.replan_faults = False, 0
        if self.stop_on_worker_loss:
            return [*out, Stop(f"{reason}; stopping as --on-worker-loss stop asks")]
        return [*out, FallBackLocal(reason)]

    def _evict(self, worker: str, reason: str, drop: bool, misbehaved: bool = False) -> Evict:
        self.active.discard(worker)
        self.evictions[worker] = self.evictions.get(worker, 0) + 1
        self.evicted_at[worker] = self.steps_done
        return Evict(worker, reason, drop, misbehaved)

    def _set_aside(self, event: SetAside) -> list[Command]:
        if event.worker not in self.active or len(self.active) < 2:
            return []  # gone meanwhile, or the last worker: the fall-back's to decide
        self.active.discard(event.worker)
        self.replanning = True
        return [Resplit(frozenset(self.active), event.reason)]

    def _replan_point(self, joinable: tuple[str, ...]) -> list[Command]:
        joined = tuple(sorted(name for name in set(joinable) if self.may_rejoin(name)))
        if not joined:
            return []
        self.active |= set(joined)
        self.known |= set(joined)
        self.replanning = True
        return [Admit(joined), Resplit(frozenset(self.active), "join of " + ", ".join(joined),
                                       joined)]
