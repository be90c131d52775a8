"""Membership events and snapshot costs from a run's raw records (pure, no I/O).

A run's membership changes are spread over four record types (docs/metrics.md):
``recovery`` (a fault cost a step: the snapshot of ``resumed_step`` was restored),
``replan`` (the split changed after a recovery or a join), ``rebalance`` (a re-split
from measured times) and a ``run_start`` with ``resumed_from`` (``--resume``). This
module turns them into one list of :class:`MembershipEvent`, in the order they were
written (time order; a resumed run appends), with the worker joins and losses they
imply as events of their own. The master writes a recovery's ``replan`` before its
``recovery`` record; it is listed after it, drawn at the step the run went on from:

* a **loss** is a ``recovery`` whose participant was gone (dead, cut off), at the
  failed step;
* a **join** is a worker named by a ``replan`` of reason ``join of ...`` (or, for
  "a returning worker", every participant that holds kernels after it and did not
  before);
* a participant that held kernels before a recovery's re-plan and holds none after
  it is named in that re-plan's detail as ``left the split`` (evicted, or left out by
  the planner: the records do not say which).

Every event has the step it is drawn at on the report's per-step plots (``step``):
the failed step for a recovery or a loss, the first step under the new split for a
re-plan, a re-split or a join, the step the run went on from for a resume. Records
carry no step for a ``replan``; it is the next step to run at that point of the file
(after a ``step`` record ``s``: ``s + 1``; after a ``checkpoint``: its ``step``;
after a ``recovery``: its ``resumed_step``).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hetconv.master.samples.fall_back import STAY_ALONE_REASON
from hetconv.metrics import participant_entries, participant_of

RESUME, RECOVERY, LOSS, JOIN, REPLAN, RESPLIT = (
    "resume", "recovery", "loss", "join", "re-plan", "re-split")
EVENT_KINDS = (RESUME, RECOVERY, LOSS, JOIN, REPLAN, RESPLIT)
JOIN_PREFIX = "join of "
RECOVERY_PREFIX = "recovery from"


@dataclass(frozen=True)
class MembershipEvent:
    """One change of who trains or how the kernels are split (times in seconds)."""

    kind: str  # one of EVENT_KINDS
    time: float  # Unix time of the record
    step: int | None  # the step it is drawn at (see the module docstring)
    participant: str | None = None  # the worker it concerns (loss, join, recovery)
    reason: str = ""  # the record's one-line reason, or what happened
    seconds: float | None = None  # recovery: the recovery itself; re-split: applying it
    failed_step: int | None = None  # recovery only
    resumed_step: int | None = None  # recovery: the snapshot's step; resume: resumed_from
    split: str = ""  # re-plan / re-split: kernels (or samples) per participant afterwards


@dataclass(frozen=True)
class CheckpointRecord:
    """One training snapshot: pulling the shards, checking them, writing the file."""

    time: float
    step: int
    epoch: int
    state_bytes: int  # array bytes pulled and kept in memory
    file_bytes: int  # bytes written to checkpoint.npz (0 when not written)
    seconds: float


def _holders(counts: Sequence[dict[str, Any]]) -> dict[str, int]:
    """participant -> kernels summed over the layers of a ``counts`` list."""
    total: dict[str, int] = {}
    for layer in counts:
        for entry in participant_entries(layer):
            name = participant_of(entry)
            total[name] = total.get(name, 0) + int(entry["kernels"])
    return total


def split_text(counts: Sequence[dict[str, Any]]) -> str:
    """``"layer 1: master 1, w1 3; layer 2: ..."`` (kernels, layers numbered from 1), zeros
    left out; a sample split's record (every entry has ``samples``: every participant
    holds every layer whole, the slices are the same on every layer) is
    ``"samples of every batch: master 30, w1 34"``."""
    entries = [entry for layer in counts for entry in participant_entries(layer)]
    if entries and all("samples" in entry for entry in entries):
        return "samples of every batch: " + ", ".join(
            f"{participant_of(entry)} {int(entry['samples'])}"
            for entry in participant_entries(counts[0]) if int(entry["samples"]) > 0)
    return "; ".join(
        f"layer {int(layer['layer']) + 1}: " + ", ".join(
            f"{participant_of(entry)} {int(entry['kernels'])}" for entry in participant_entries(layer)
            if int(entry["kernels"]) > 0)
        for layer in counts)


def _initial_holders(records: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Kernels per participant as calibrated (the split training started with)."""
    total: dict[str, int] = {}
    for record in records:
        if record.get("type") == "calibration":
            for entry in participant_entries(record):
                name = participant_of(entry)
                total[name] = total.get(name, 0) + int(entry["kernels"])
    return total


class _Builder:
    """Walks the records in file order, keeping the next step to run and who holds
    kernels, and collects the events."""

    def __init__(self, holders: dict[str, int]) -> None:
        self.next_step = 0
        self.holders = holders
        self.events: list[MembershipEvent] = []
        self.checkpoints: list[CheckpointRecord] = []
        self.held: tuple[dict[str, Any], float] | None = None  # a recovery's re-plan

    def take(self, record: dict[str, Any]) -> None:
        kind, time = record.get("type"), float(record.get("time") or 0.0)
        if kind == "replan" and str(record.get("reason", "")).startswith(RECOVERY_PREFIX):
            self.flush()
            self.held = (record, time)  # written before its recovery record: listed after it
            return
        if kind != "recovery":
            self.flush()
        if kind == "step":
            self.next_step = int(record["step"]) + 1
        elif kind == "checkpoint":
            self.next_step = int(record["step"])
            self.checkpoints.append(CheckpointRecord(
                time=time, step=int(record["step"]), epoch=int(record.get("epoch") or 0),
                state_bytes=int(record.get("state_bytes") or 0),
                file_bytes=int(record.get("file_bytes") or 0),
                seconds=float(record["seconds"])))
        elif kind == "run_start" and record.get("resumed_from") is not None:
            self.next_step = int(record["resumed_from"])
            self.events.append(MembershipEvent(
                RESUME, time, self.next_step, reason=f"--resume from step {self.next_step}",
                resumed_step=self.next_step))
        elif kind == "recovery":
            self._recovery(record, time)
        elif kind == "replan":
            self._replan(record, time)
        elif kind == "rebalance":
            counts = record.get("counts") or []
            self.events.append(MembershipEvent(
                RESPLIT, time, int(record["step"]) + 1, reason=str(record.get("reason") or ""),
                seconds=_opt_float(record.get("apply_s")), split=split_text(counts)))
            if counts:
                self.holders = _holders(counts)

    def _recovery(self, record: dict[str, Any], time: float) -> None:
        failed, resumed = int(record["failed_step"]), int(record["resumed_step"])
        participant = record.get("participant")
        name = None if participant is None else str(participant)
        reason = str(record.get("reason") or "")
        if record.get("gone") and name is not None:
            self.events.append(MembershipEvent(LOSS, time, failed, name,
                                               reason=f"lost in step {failed}: {reason}"))
        self.events.append(MembershipEvent(
            RECOVERY, time, failed, name, reason=reason,
            seconds=_opt_float(record.get("seconds")), failed_step=failed,
            resumed_step=resumed))
        self.next_step = resumed
        self.flush()

    def flush(self) -> None:
        """List a held re-plan (its recovery has come, or will not)."""
        if self.held is not None:
            record, time = self.held
            self.held = None
            self._replan(record, time)

    def _replan(self, record: dict[str, Any], time: float) -> None:
        counts = record.get("counts") or []
        reason = str(record.get("reason") or "")
        after = _holders(counts)
        had = {name for name, kernels in self.holders.items() if kernels > 0}
        has = {name for name, kernels in after.items() if kernels > 0}
        if reason.startswith(JOIN_PREFIX):
            named = [part.strip() for part in reason[len(JOIN_PREFIX):].split(",")]
            joined = ([name for name in named if name in after]
                      or sorted(has - had))
            for name in joined:
                self.events.append(MembershipEvent(JOIN, time, self.next_step, name,
                                                   reason=f"joined before step {self.next_step}"))
        detail = reason
        left = sorted(had - has)
        if left and reason.startswith(RECOVERY_PREFIX):
            detail += f" ({', '.join(left)} left the split)"
        self.events.append(MembershipEvent(REPLAN, time, self.next_step, reason=detail,
                                           split=split_text(counts)))
        self.holders = after


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def membership_events(records: Sequence[dict[str, Any]],
                      warnings: list[str] | None = None
                      ) -> tuple[tuple[MembershipEvent, ...], tuple[CheckpointRecord, ...]]:
    """The events (in record order, which is time order, a recovery's re-plan after the
    recovery) and the checkpoints of a run's
    raw records; a malformed record is skipped, with a line added to ``warnings``."""
    builder = _Builder(_initial_holders(records))
    for number, record in enumerate([*records, {"type": "end of file"}], start=1):
        try:
            builder.take(record)
        except (KeyError, TypeError, ValueError) as error:
            if warnings is not None and record.get("type") != "step":  # records.py tells
                warnings.append(f"record {number} ({record.get('type')}) is malformed "
                                f"({error!r}); skipped")
    return tuple(builder.events), tuple(builder.checkpoints)


def ended_alone(events: Sequence[MembershipEvent]) -> tuple[int, str] | None:
    """(the first step trained alone, why) when the master-alone check's trial left the
    master alone for the rest of the run (a ``replan`` starting with
    ``STAY_ALONE_REASON``, no join or re-plan after it); else None."""
    for index in range(len(events) - 1, -1, -1):
        event = events[index]
        if event.kind == REPLAN and event.reason.startswith(STAY_ALONE_REASON):
            later = events[index + 1:]
            if event.step is None or any(e.kind in (JOIN, REPLAN) for e in later):
                return None
            return event.step, event.reason
    return None
