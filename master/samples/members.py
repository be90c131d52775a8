"""Who takes part in a run split by samples, and which slice of a batch each gets.

The master (when it computes) and every worker the balance holds a speed for, in
participant order; a worker set aside by a trial or left out by the plan is not
taken in again as a joiner.
"""
from __future__ import annotations

from hetconv.config import MASTER_PARTICIPANT
from hetconv.master.cluster import WorkerHandle
from hetconv.master.plan import Participant
from hetconv.master.samples.balance import SampleBalance
from hetconv.master.samples.plan import Slice


class SampleMembers:
    """The run's participants and their slices (``balance``: seconds per sample)."""

    def __init__(self, workers: list[Participant], balance: SampleBalance,
                 master_computes: bool, left_out: frozenset[str] = frozenset()):
        self.workers = {p.participant: p for p in workers}  # in participant order
        self.balance = balance
        self.master_computes = master_computes
        self.left_out = left_out  # workers the plan does not use (their links)
        self.set_aside: set[str] = set()  # workers a trial left out for the run

    def names(self) -> list[str]:
        """The participants with a slice, the master first."""
        own = [MASTER_PARTICIPANT] if self.master_computes else []
        return own + [n for n in self.workers if n in self.balance.seconds]

    def slices(self, batch: int) -> list[Slice]:
        """The slices of a batch of ``batch`` samples, in participant order."""
        return self.balance.slices(self.names(), batch)

    def in_run(self) -> dict[str, WorkerHandle]:
        """Every worker in the run, by name."""
        return {name: member.worker for name, member in self.workers.items()
                if name in self.balance.seconds and member.worker is not None}

    def gone(self) -> frozenset[str]:
        """The workers whose connection is gone."""
        return frozenset(n for n, p in self.workers.items()
                         if p.worker is not None and p.worker.gone)

    def kept_out(self, on_trial: str | None) -> set[str]:
        """Workers not to take in as joiners now: left out by the plan for their links,
        by a trial, or out on trial (``on_trial``)."""
        return set(self.left_out) | self.set_aside | ({on_trial} if on_trial else set())

    def holds(self, worker: WorkerHandle) -> bool:
        """Whether ``worker`` is one of the run's participants now."""
        return any(p.worker is worker for n, p in self.workers.items()
                   if n in self.balance.seconds)

    def add(self, joiner: Participant, seconds_per_sample: float) -> None:
        self.workers[joiner.participant] = joiner
        self.balance.add(joiner.participant, seconds_per_sample)

    def restrict(self, alive: set[str]) -> None:
        """Slice over the master and ``alive`` only."""
        self.balance.restrict([n for n in self.workers if n in alive] + [MASTER_PARTICIPANT])
