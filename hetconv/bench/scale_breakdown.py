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

Per layer (the fourth table), each participant's median compute and peer wait in that
layer: where the step's waiting is, barrier by barrier. Under the sample split's step
chain every layer's waits are its own (its batch-norm barriers, forward and backward);
layer 0 also holds what no layer waited (the update's reduction at the chain's start,
the dense part's). Under the other planes the figures stay where the records put them.
Pure: records in, numbers and table lines out."""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from hetconv.metrics import participant_entries, participant_of

FIELDS = ("compute_s", "latency_s", "wait_s", "peer_wait_s")


def step_breakdown(steps: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Participant -> median per step of each of FIELDS, and its work units
    (``units``: samples under the sample split, else kernels, of its last layer)."""
    per: dict[str, dict[str, list[float]]] = {}
    for step in steps:
        totals: dict[str, dict[str, float]] = {}
        for layer in step.get("layers", []):
            for timing in participant_entries(layer):
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


def layer_breakdown(steps: Sequence[dict[str, Any]]
                    ) -> dict[int, dict[str, dict[str, float]]]:
    """Layer -> participant -> the medians over the steps of its ``compute_s`` (forward
    + backward) and ``peer_wait_s`` in that layer."""
    per: dict[int, dict[str, dict[str, list[float]]]] = {}
    for step in steps:
        for layer in step.get("layers", []):
            for timing in participant_entries(layer):
                entry = per.setdefault(int(layer.get("layer", 0)), {}).setdefault(
                    participant_of(timing), {"compute_s": [], "peer_wait_s": []})
                entry["compute_s"].append(float(timing.get("forward_s", 0.0))
                                          + float(timing.get("backward_s", 0.0)))
                entry["peer_wait_s"].append(float(timing.get("peer_wait_s", 0.0)))
    return {layer: {name: {field: statistics.median(values) for field, values in
                           fields.items()} for name, fields in names.items()}
            for layer, names in sorted(per.items())}


def merge_layer_repeats(breakdowns: Sequence[dict[int, dict[str, dict[str, float]]]]
                        ) -> dict[int, dict[str, dict[str, float]]]:
    """The median over repeats of each layer's participants' medians."""
    layers = sorted({layer for b in breakdowns for layer in b})
    return {layer: merge_repeats([b[layer] for b in breakdowns if layer in b])
            for layer in layers}


def format_layer_breakdown(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown lines: per configuration and layer, the participants' compute and peer
    wait (ms, the lowest to the highest participant; ``rows``: the summary rows with
    ``layers``, the output of :func:`merge_layer_repeats`)."""
    lines = ["", "Per layer, medians per step (then over the repeats), from the lowest to "
             "the highest participant: compute (forward + backward) and waiting for peers' "
             "pieces in that layer. Under the sample split's step chain each layer's wait is "
             "its batch-norm barriers'; layer 1 also holds what no layer waited (the "
             "update's reduction, the dense part's).", "",
             "| machines (core each) | layer | compute ms | peer wait ms | participants |",
             "|---|---|---|---|---|"]

    def span(values: list[float]) -> str:
        low, high = min(values) * 1e3, max(values) * 1e3
        return f"{low:.1f}" if f"{low:.1f}" == f"{high:.1f}" else f"{low:.1f}-{high:.1f}"

    for row in rows:
        for index, (layer, names) in enumerate((row.get("layers") or {}).items()):
            lines.append(f"| {row['machines'] if index == 0 else ''} | {int(layer) + 1} | "
                         f"{span([n['compute_s'] for n in names.values()])} | "
                         f"{span([n['peer_wait_s'] for n in names.values()])} | "
                         f"{len(names)} |")
    return lines


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


BARRIER_FIELDS = ("per_step", "wait_s", "skew_s", "delivery_s", "to_read_s")


def barrier_figures(waits: Sequence[Any]) -> dict[str, dict[str, float]]:
    """``"<layer>:<phase>"`` -> BARRIER_FIELDS of each
    :class:`hetconv.participant.samples.barrier_trace.BarrierWaits` (a run's barriers, JSON-ready; a field
    the trace could not give is left out)."""
    return {f"{w.layer}:{w.phase}": {field: float(getattr(w, field)) for field in BARRIER_FIELDS
                                     if getattr(w, field) is not None}
            for w in waits}


def merge_barrier_repeats(repeats: Sequence[dict[str, dict[str, float]]]
                          ) -> dict[str, dict[str, float]]:
    """The median over the repeats that traced a barrier of each of its figures, in
    layer then phase order (forward's moments before backward's sums)."""
    keys = sorted({key for barriers in repeats for key in barriers},
                  key=lambda key: (int(key.split(":")[0]), key.split(":")[1] != "moments"))
    return {key: {field: statistics.median(values) for field in BARRIER_FIELDS
                  if (values := [b[key][field] for b in repeats
                                 if key in b and field in b[key]])}
            for key in keys}


def format_barrier_breakdown(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown lines: per configuration and batch-norm barrier, what a participant's
    wait there is made of (``rows``: summary rows with ``barriers``, the output of
    :func:`merge_barrier_repeats`); none when no run traced a barrier."""
    if not any(row.get("barriers") for row in rows):
        return []
    lines = ["", "The batch-norm barriers of the sample split, traced "
             "(hetconv.participant.samples.barrier_trace; the lab's machines share one clock): means per "
             "participant and barrier over the measured steps, then the median over the "
             "repeats. A participant's wait runs from sharing its own piece to holding "
             "every peer's; skew is the part until the last peer shared its piece (peers "
             "still computing), delivery the rest (the pieces' way out of the last "
             "sender and into this participant: ZeroMQ's I/O threads, the wire, "
             "wake-ups), and of the delivery, the part until this participant's thread "
             "read the last peer's piece off its socket. Per step: sum over the barriers "
             "of waits per step x mean.", "",
             "| machines (core each) | layer | barrier | waits per step | wait ms | "
             "skew ms | delivery ms | delivery to the read ms |",
             "|---|---|---|---|---|---|---|---|"]

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.2f}"

    for row in rows:
        barriers = row.get("barriers") or {}
        if not barriers:
            continue
        total = {field: sum(b["per_step"] * b.get(field, 0.0) for b in barriers.values())
                 for field in ("wait_s", "skew_s", "delivery_s", "to_read_s")}
        read_known = all("to_read_s" in b for b in barriers.values())
        for index, (key, b) in enumerate(barriers.items()):
            layer, phase = key.split(":")
            barrier = {"moments": "forward (moments)", "sums": "backward (sums)"}.get(phase,
                                                                                      phase)
            lines.append(f"| {row['machines'] if index == 0 else ''} | {int(layer) + 1} | "
                         f"{barrier} | {b['per_step']:.1f} | {ms(b['wait_s'])} | "
                         f"{ms(b['skew_s'])} | {ms(b['delivery_s'])} | "
                         f"{ms(b.get('to_read_s'))} |")
        participants = max(b["per_step"] for b in barriers.values())
        to_read = f"{total['to_read_s'] / participants * 1e3:.1f}" if read_known else "-"
        lines.append(f"|  | per participant and step | all | | "
                     f"{total['wait_s'] / participants * 1e3:.1f} | "
                     f"{total['skew_s'] / participants * 1e3:.1f} | "
                     f"{total['delivery_s'] / participants * 1e3:.1f} | {to_read} |")
    return lines


def format_step_timeline(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown lines: per configuration, one typical step laid out per participant
    (``rows``: summary rows with ``timeline``, the output of
    :func:`hetconv.bench.scale_figures.typical_step_timeline`): when it shared its piece
    of each batch-norm barrier and when it held every peer's, and when its result
    reached the master; none when no run traced a step."""
    if not any(row.get("timeline") for row in rows):
        return []
    lines = ["", "One step laid out (the sample split's barriers, traced): the run's "
             "median step (of the repeat with the median step), per participant, ms "
             "since the master turned to the step (the lab's machines share one clock; "
             "with two steps in flight a participant that finished the step before "
             "starts this one earlier: a negative time): "
             "when it shared its piece of each batch-norm barrier and when it held every "
             "peer's (shared / held), and when its result reached the master. Between "
             "two barriers a participant computes; a late share is a slow participant, "
             "a late hold after the last share is delivery."]
    phases = {"moments": "forward", "sums": "backward"}
    for row in rows:
        timeline = row.get("timeline") or {}
        participants = timeline.get("participants") or {}
        if not participants:
            continue
        columns: list[tuple[int, str]] = []
        for entry in participants.values():
            for layer, phase, _, _ in entry["marks"]:
                if (layer, phase) not in columns:
                    columns.append((layer, phase))
        lines += ["", f"{row['machines']}: step {timeline['step']}, "
                      f"{timeline['step_s'] * 1e3:.1f} ms", "",
                  "| participant | " + " | ".join(
                      f"layer {layer + 1} {phases.get(phase, phase)} ms" for layer, phase
                      in columns) + " | result at the master ms |",
                  "|---|" + "---|" * (len(columns) + 1)]
        for name, entry in participants.items():
            cells = {(layer, phase): (shared, held)
                     for layer, phase, shared, held in entry["marks"]}
            text = []
            for column in columns:
                if column not in cells:
                    text.append("-")
                    continue
                shared, held = cells[column]
                text.append(f"{shared * 1e3:.1f} / "
                            + ("-" if held is None else f"{held * 1e3:.1f}"))
            result = entry.get("result_s")
            lines.append(f"| {name} | " + " | ".join(text) + " | "
                         + ("-" if result is None else f"{result * 1e3:.1f}") + " |")
    return lines
