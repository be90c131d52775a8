"""Where a distributed step's time goes, per participant (``hetconv bench scale``'s third
table): from the ``step`` records a run wrote, the medians over its measured steps of

- ``compute_s``: the participant's forward + backward compute, every layer (seconds);
- ``latency_s``: from the master starting each phase to this participant's result in
  the master's hands, summed over the step's phases (compute, wire, message handling,
  CPU-quota throttling);
- ``wait_s``: the master waiting for this participant after its own share was done;
- ``peer_wait_s``: waiting for peers' pieces (the reduction among the peers);
- ``samples`` (sample split) or ``kernels`` (kernel split) of the last layer it held;

and per run the exposed communication: ``comm_s`` over the step (docs/metrics.md).
Pure: records in, numbers and table lines out."""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from hetconv.metrics import participant_of

FIELDS = ("compute_s", "latency_s", "wait_s", "peer_wait_s")


def step_breakdown(steps: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Participant -> median per step of each of FIELDS, and its work units
    (``units``: samples under the sample split, else kernels, of its last layer)."""
    per: dict[str, dict[str, list[float]]] = {}
    for step in steps:
        totals: dict[str, dict[str, float]] = {}
        for layer in step.get("layers", []):
            for timing in layer.get("devices", []):
                entry = totals.setdefault(participant_of(timing),
                                          {field: 0.0 for field in FIELDS})
                entry["compute_s"] += float(timing.get("forward_s", 0.0)) + float(
                    timing.get("backward_s", 0.0))
                entry["latency_s"] += float(timing.get("forward_latency_s", 0.0)) + float(
                    timing.get("backward_latency_s", 0.0))
                entry["wait_s"] += float(timing.get("wait_s", 0.0))
                entry["peer_wait_s"] += float(timing.get("peer_wait_s", 0.0))
                entry["units"] = float(timing["samples"] if "samples" in timing
                                       else timing.get("kernels", 0))
        for name, entry in totals.items():
            for field, value in entry.items():
                per.setdefault(name, {}).setdefault(field, []).append(value)
    return {name: {field: statistics.median(values) for field, values in fields.items()}
            for name, fields in per.items()}


def comm_share(steps: Sequence[dict[str, Any]]) -> float:
    """Median over the steps of ``comm_s / step_s`` (0 without steps)."""
    shares = [float(s.get("comm_s", 0.0)) / float(s["step_s"]) for s in steps
              if float(s.get("step_s", 0.0)) > 0]
    return statistics.median(shares) if shares else 0.0


def merge_repeats(breakdowns: Sequence[dict[str, dict[str, float]]]
                  ) -> dict[str, dict[str, float]]:
    """The median over repeats of each participant's medians."""
    names = [name for b in breakdowns for name in b]
    out: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(names):
        rows = [b[name] for b in breakdowns if name in b]
        out[name] = {field: statistics.median(row[field] for row in rows if field in row)
                     for field in rows[0]}
    return out


def format_breakdown(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown lines: one row per participant of each configuration (``rows``: the
    summary rows with ``breakdown`` and ``comm_share``)."""
    lines = ["", "Per participant, medians per step (then over the repeats): compute, "
             "round latency (from the master starting a phase to the result in its hands), "
             "the master waiting for it after its own share, waiting for peers' pieces; "
             "exposed communication is `comm_s` over the step.", "",
             "| machines (core each) | participant | samples or kernels | compute ms | "
             "round latency ms | master waited ms | peer wait ms | exposed comm % of step |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        breakdown = row.get("breakdown") or {}
        for index, (name, b) in enumerate(breakdown.items()):
            share = f"{100 * row.get('comm_share', 0.0):.0f}%" if index == 0 else ""
            lines.append(f"| {row['machines'] if index == 0 else ''} | {name} | "
                         f"{b.get('units', 0):.0f} | {b['compute_s'] * 1e3:.1f} | "
                         f"{b['latency_s'] * 1e3:.1f} | {b['wait_s'] * 1e3:.1f} | "
                         f"{b['peer_wait_s'] * 1e3:.1f} | {share} |")
    return lines
