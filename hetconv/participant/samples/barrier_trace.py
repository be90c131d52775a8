"""What a batch-norm barrier's wait is made of: a trace of the sample split's barriers.

Under the sample split every batch-norm layer is two barriers a step (the moments
forward, the sums backward, ``hetconv.participant.samples.weight_reduce``): each participant shares its
piece with every peer and waits for theirs. A participant's wait at one barrier is

- **skew**: from sharing its own piece until the last peer shared its piece (the
  peers were still computing);
- **delivery**: the rest, from the last peer's share until this participant holds every
  piece (the pieces' way out of the sender's process and into this one: ZeroMQ's I/O
  threads on both sides, the wire, the wake-ups; on quota-throttled or crowded
  machines each of those waits for a CPU); **to the read**, its part until this
  participant's thread read the last peer's piece off its socket (the rest is what it
  did with the pieces after that).

When the environment names a directory in ``HETCONV_TRACE_DIR`` (``hetconv bench
scale`` sets it for its runs), every process appends its barrier events there
(``trace-<pid>.jsonl``, one JSON object per line, Unix seconds); otherwise nothing is
recorded. Skew and delivery compare times taken on different participants, so they
mean something only where all of them read one clock: the lab's machines on one host.
:func:`barrier_breakdown` is pure: events in, seconds out.
"""
from __future__ import annotations

import atexit
import json
import os
import statistics
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACE_ENV = "HETCONV_TRACE_DIR"
FLUSH_EVERY = 2048  # events kept in memory before they are appended to the file


class BarrierTrace:
    """One process's barrier events, appended to ``directory/trace-<pid>.jsonl`` (in
    batches and at exit); ``directory`` None: records nothing."""

    def __init__(self, directory: str | None):
        self.directory = Path(directory) if directory else None
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        if self.directory is not None:
            atexit.register(self.flush)

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def share(self, participant: str, sync_id: int, step: int, layer: int,
              phase: str) -> None:
        """``participant`` shares its piece of barrier (``sync_id``, ``layer``,
        ``phase``) of ``step`` now."""
        if self.directory is not None:
            self._add({"e": "share", "t": time.time(), "p": participant, "sync": sync_id,
                       "step": step, "layer": layer, "phase": phase})

    def take(self, participant: str, sync_id: int, layer: int, phase: str,
             sender: str) -> None:
        """``participant`` read ``sender``'s piece of the barrier off its socket now."""
        if self.directory is not None:
            self._add({"e": "take", "t": time.time(), "p": participant, "sync": sync_id,
                       "layer": layer, "phase": phase, "from": sender})

    def wait(self, participant: str, sync_id: int, layer: int, phase: str,
             started: float, ended: float) -> None:
        """``participant`` waited for its peers' pieces from ``started`` to ``ended``
        (Unix seconds)."""
        if self.directory is not None:
            self._add({"e": "wait", "t": started, "end": ended, "p": participant,
                       "sync": sync_id, "layer": layer, "phase": phase})

    def _add(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(event)
            full = len(self._events) >= FLUSH_EVERY
        if full:
            self.flush()

    def flush(self) -> None:
        """Append the events kept so far to this process's file (never raises: a trace
        that cannot be written is lost, the run is not)."""
        with self._lock:
            events, self._events = self._events, []
        if not events or self.directory is None:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(self.directory / f"trace-{os.getpid()}.jsonl", "a",
                      encoding="utf-8") as out:
                out.writelines(json.dumps(event) + "\n" for event in events)
        except OSError:
            pass


TRACE = BarrierTrace(os.environ.get(TRACE_ENV) or None)
"""This process's trace (enabled by ``HETCONV_TRACE_DIR``)."""


def read_trace(directory: Path) -> list[dict[str, Any]]:
    """Every event in ``directory``'s trace files (none: an empty list); lines that are
    not a JSON object (a process killed while writing) are skipped."""
    events: list[dict[str, Any]] = []
    for path in sorted(directory.glob("trace-*.jsonl")) if directory.is_dir() else []:
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                events.append(event)
    return events


@dataclass(frozen=True)
class BarrierWaits:
    """One barrier (a layer's ``moments`` or ``sums``) over a run's measured steps:
    means per participant and barrier, seconds; ``per_step``: participant waits of it
    per step (its participants)."""

    layer: int
    phase: str
    waits: int
    per_step: float
    wait_s: float
    skew_s: float
    delivery_s: float
    to_read_s: float | None = None  # None: no read of the last peer's piece in the trace


def barrier_breakdown(events: Iterable[dict[str, Any]], first_step: int = 0
                      ) -> list[BarrierWaits]:
    """Skew and delivery (module doc) of every participant's wait at every barrier of
    steps ``first_step`` and later, averaged per (layer, phase), in layer then phase
    order. A wait whose peers' shares are not all in the trace is left out."""
    shares: dict[tuple[int, int, str], dict[str, float]] = {}
    reads: dict[tuple[int, int, str, str, str], float] = {}  # key + (reader, sender)
    steps: dict[int, int] = {}  # sync id -> step
    waits = []
    for event in events:
        try:
            key = (int(event["sync"]), int(event["layer"]), str(event["phase"]))
            if event["e"] == "share":
                shares.setdefault(key, {})[str(event["p"])] = float(event["t"])
                steps[key[0]] = int(event["step"])
            elif event["e"] == "take":
                reads[(*key, str(event["p"]), str(event["from"]))] = float(event["t"])
            elif event["e"] == "wait":
                waits.append((key, str(event["p"]), float(event["t"]), float(event["end"])))
        except (KeyError, TypeError, ValueError):
            continue
    per: dict[tuple[int, str], list[tuple[float, float, float, float | None]]] = {}
    measured_steps: set[int] = set()
    for key, participant, started, ended in waits:
        step = steps.get(key[0])
        peers = {p: t for p, t in shares.get(key, {}).items() if p != participant}
        if step is None or step < first_step or not peers:
            continue
        last_peer = max(peers, key=lambda p: peers[p])
        last = peers[last_peer]
        skew = max(0.0, last - started)
        delivery = max(0.0, ended - max(started, last))
        read = reads.get((*key, participant, last_peer))
        to_read = None if read is None else min(delivery, max(0.0, read - max(started, last)))
        per.setdefault((key[1], key[2]), []).append((ended - started, skew, delivery, to_read))
        measured_steps.add(step)
    count = max(1, len(measured_steps))
    rows = []
    for (layer, phase), values in sorted(per.items()):
        reads_s = [v[3] for v in values if v[3] is not None]
        rows.append(BarrierWaits(layer, phase, len(values), len(values) / count,
                                 statistics.fmean(v[0] for v in values),
                                 statistics.fmean(v[1] for v in values),
                                 statistics.fmean(v[2] for v in values),
                                 statistics.fmean(reads_s) if reads_s else None))
    return rows


@dataclass(frozen=True)
class TimelineMark:
    """One participant at one barrier of one step, in seconds since the step began:
    when it shared its piece, and when it held every peer's (None: no wait traced)."""

    layer: int
    phase: str
    shared_s: float
    held_s: float | None


def _chain_order(mark: TimelineMark) -> tuple[int, int]:
    """The step chain's order: the forward's moments layer by layer up, then the
    backward's sums layer by layer down."""
    return (0, mark.layer) if mark.phase == "moments" else (1, -mark.layer)


def step_timeline(events: Iterable[dict[str, Any]], step: int, started: float
                  ) -> dict[str, list[TimelineMark]]:
    """Per participant, its barriers of ``step`` in chain order (:func:`_chain_order`),
    in seconds since ``started`` (Unix seconds: when the master began the step; the
    lab's machines share its clock). Malformed events are skipped; a step that left no
    share in the trace gives an empty dict."""
    shares: dict[tuple[int, int, str, str], float] = {}  # (sync, layer, phase, participant)
    held: dict[tuple[int, int, str, str], float] = {}
    for event in events:
        try:
            key = (int(event["sync"]), int(event["layer"]), str(event["phase"]),
                   str(event["p"]))
            if event["e"] == "share" and int(event["step"]) == step:
                shares[key] = float(event["t"])
            elif event["e"] == "wait":
                held[key] = float(event["end"])
        except (KeyError, TypeError, ValueError):
            continue
    timeline: dict[str, list[TimelineMark]] = {}
    for key, shared in shares.items():
        ended = held.get(key)
        timeline.setdefault(key[3], []).append(TimelineMark(
            key[1], key[2], shared - started, None if ended is None else ended - started))
    return {participant: sorted(marks, key=_chain_order)
            for participant, marks in sorted(timeline.items())}
