"""The chaos bench's assessment (pure): what each injected fault did to the chaos run,
read from its metrics records (:func:`assess`: the recoveries it caused, the time they
cost, when the worker was back), and the run summaries the bench compares (final
accuracy, median step, completion) and the ``--epochs auto`` arithmetic.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hetconv.bench.chaos_plan import RESTART, SIGKILL
from hetconv.errors import UserError
from hetconv.metrics import participant_entries, participant_of

AUTO_MARGIN = 1.25  # --epochs auto: the runs last this many times --minutes


def _takes_in(join: dict[str, Any], name: str, workers: set[str]) -> bool:
    """Whether a ``join`` re-plan takes worker ``name`` back: it names it, gives it
    kernels, or names none of ``workers`` ("join of a returning worker": one that came
    back and got no kernels)."""
    named = set(str(join.get("reason", "")).replace(",", " ").split())
    gives = any(participant_of(d) == name and int(d.get("kernels", 0)) > 0
                for layer in join.get("counts", []) for d in participant_entries(layer))
    return name in named or gives or not named & workers


@dataclass
class InjectedFault:
    """A fault as injected: Unix times of its start and of its end (the worker back,
    the link up, the quota restored; None if the run ended first)."""

    kind: str
    worker: str
    at_s: float  # seconds after the first training step
    time: float
    ended: float | None = None
    kernels: int | None = None  # the worker's kernels at the last step before it (None: unknown)


@dataclass(frozen=True)
class FaultOutcome:
    """What one fault did to the run (seconds)."""

    kind: str
    worker: str
    at_s: float
    effect: str  # "recovery" (a snapshot restored) or "none needed"
    kernels: int | None  # the worker's kernels (all layers) when the fault struck
    recoveries: int
    recovery_s: float  # the recoveries' own seconds
    detected_s: float | None  # from the fault to the start of its first recovery
    replayed_steps: int
    time_lost_s: float  # recovery_s + replayed_steps * the fault-free median step
    rejoined_s: float | None  # from the fault's end to the re-plan that took the worker in
    survived: bool


def assess(faults: Sequence[InjectedFault], records: Sequence[dict[str, Any]],
           completed: bool, median_step_s: float, window_s: float) -> list[FaultOutcome]:
    """Each fault's effect from the chaos run's metrics records: the ``recovery``
    records in [its time, its time + window_s) and before the next fault; for a worker
    that was out (killed, restarted, or named by one of those recoveries), the first
    ``join`` re-plan after the fault's end that takes it back (:func:`_takes_in`)."""
    recoveries = [r for r in records if r.get("type") == "recovery"]
    joins = [r for r in records if r.get("type") == "replan"
             and str(r.get("reason", "")).startswith("join")]
    workers = {fault.worker for fault in faults}
    outcomes = []
    for index, fault in enumerate(faults):
        until = fault.time + window_s
        if index + 1 < len(faults):
            until = min(until, faults[index + 1].time)
        mine = [r for r in recoveries if fault.time <= float(r["time"]) < until]
        seconds = sum(float(r.get("seconds") or 0.0) for r in mine)
        replayed = sum(max(0, int(r["failed_step"]) - int(r["resumed_step"])) for r in mine)
        detected = None
        if mine:  # a recovery record is written when it ends, after ``seconds`` of work
            first = min(mine, key=lambda r: float(r["time"]))
            detected = max(0.0, float(first["time"]) - float(first.get("seconds") or 0.0)
                           - fault.time)
        rejoined = None
        out = fault.kind in (SIGKILL, RESTART) or any(
            r.get("participant") == fault.worker for r in mine)  # it has to come back
        if out and fault.ended is not None:
            back = next((r for r in joins if float(r["time"]) >= fault.ended
                         and _takes_in(r, fault.worker, workers)), None)
            rejoined = None if back is None else float(back["time"]) - fault.ended
        outcomes.append(FaultOutcome(
            kind=fault.kind, worker=fault.worker, at_s=fault.at_s,
            effect="recovery" if mine else "none needed", kernels=fault.kernels,
            recoveries=len(mine),
            recovery_s=seconds, detected_s=detected, replayed_steps=replayed,
            time_lost_s=seconds + replayed * median_step_s, rejoined_s=rejoined,
            survived=completed))
    return outcomes


def final_accuracy(records: Sequence[dict[str, Any]]) -> float | None:
    """The test accuracy of the last epoch (the last record of it counts)."""
    epochs = {int(r["epoch"]): r for r in records if r.get("type") == "epoch"}
    if not epochs:
        return None
    value = epochs[max(epochs)].get("test_accuracy")
    return None if value is None else float(value)


def median_step_s(records: Sequence[dict[str, Any]]) -> float:
    """The median step time, the last record of each step counting, the first step
    (warm-up) left out when there are others."""
    by_step = {int(r["step"]): float(r["step_s"]) for r in records if r.get("type") == "step"}
    times = [by_step[s] for s in sorted(by_step)]
    times = times[1:] if len(times) > 1 else times
    return statistics.median(times) if times else 0.0


def auto_epochs(minutes: float, epoch_s: float) -> int:
    """Epochs whose wall time outlasts ``minutes`` by AUTO_MARGIN, given one epoch's."""
    return max(1, math.ceil(minutes * 60 * AUTO_MARGIN / max(epoch_s, 1e-3)))


def epoch_wall_s(records: Sequence[dict[str, Any]]) -> float:
    """The first epoch's wall time, training and evaluation (seconds)."""
    epochs = [r for r in records if r.get("type") == "epoch"]
    if not epochs:
        raise UserError("the probe run recorded no epoch")
    return float(epochs[0].get("epoch_s") or epochs[0]["train_s"])


def run_completed(records: Sequence[dict[str, Any]]) -> bool:
    ends = [r for r in records if r.get("type") == "run_end"]
    return bool(ends) and ends[-1].get("status") == "completed"
