"""The figures of one ``hetconv bench scale`` run, read from its ``metrics.jsonl`` (pure
but for reading that file): median step, bytes per step on the master's link and on the
busiest worker's, the model's prediction, and where the step goes
(:mod:`hetconv.bench.scale_breakdown`), all over the steady state the rebalancer
settled on (:func:`settled_split`). Seconds and bytes per step. :func:`summarize` gives
one row per configuration, medians over its repeats, and :func:`format_table` the main
table of those rows."""
from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetconv.bench.scale_breakdown import (
    barrier_figures,
    comm_share,
    layer_breakdown,
    merge_barrier_repeats,
    merge_layer_repeats,
    merge_repeats,
    step_breakdown,
)
from hetconv.bench.scale_cpu import merge_cpu_repeats, steady_window
from hetconv.bench.scale_setup import SetupFigures, merge_setup_repeats, setup_figures
from hetconv.errors import UserError
from hetconv.master.samples.fall_back import STAY_ALONE_REASON
from hetconv.master.samples.step_model import terms_from_record
from hetconv.metrics import participant_entries, participant_of, read_metrics
from hetconv.participant.samples.barrier_trace import barrier_breakdown, read_trace, step_timeline
from hetconv.planning.perf_model import ParticipantCost, ideal_speedup, star_step_seconds

SETTLED_STEPS = 8
"""Steps that must follow a re-split for the figures to be taken after it."""


@dataclass(frozen=True)
class RunFigures:
    """What one run's metrics say (seconds, bytes per step; medians over the steps after
    the settled re-split, see :func:`settled_split`, or else over all but the first)."""

    step_s: float
    dense_s: float
    master_link_bytes: float
    busiest_worker_link_bytes: float
    predicted_step_s: float | None
    breakdown: dict[str, dict[str, float]] = field(default_factory=dict)  # scale_breakdown
    layers: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    comm_share: float = 0.0  # median comm_s over step_s
    barriers: dict[str, dict[str, float]] = field(default_factory=dict)  # barrier_figures
    timeline: dict[str, Any] = field(default_factory=dict)  # typical_step_timeline
    window: tuple[float, float, int] | None = None  # scale_cpu.steady_window
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)  # scale_cpu.machine_cpu
    setup: SetupFigures | None = None  # scale_setup: set-up's prediction, the first steps


def stayed_alone(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``replan`` record by which the master-alone check left the master alone for
    the rest of the run (master/samples/fall_back.py), or None."""
    for record in reversed(records):
        if record.get("type") == "replan" and str(record.get("reason", "")).startswith(
                STAY_ALONE_REASON) and "time" in record:
            return dict(record)
    return None


def settled_split(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last ``rebalance`` record followed by at least SETTLED_STEPS steps, or None.

    A run's figures are taken from the steps after it (the first one after a re-split
    excluded), and its prediction is the model's for that split, with the rebalancer's
    measured corrections: the steady state a long run trains in, not the first steps
    on a split the calibration guessed."""
    steps = [int(r["step"]) for r in records if r.get("type") == "step"]
    for record in reversed([r for r in records if r.get("type") == "rebalance"]):
        if sum(1 for step in steps if step > int(record["step"]) + 1) >= SETTLED_STEPS:
            return dict(record)
    return None


def typical_step_timeline(steps: list[dict[str, Any]], events: list[dict[str, Any]]
                          ) -> dict[str, Any]:
    """The barriers of the run's typical step (of ``steps``, the one with the median
    ``step_s``, the lower of two), per participant, JSON-ready: ``{"step", "step_s",
    "participants": {name: {"marks": [[layer, phase, shared_s, held_s], ...],
    "result_s": its round latency}}}``, seconds since the master began the step (its
    record's time less its ``step_s``); empty when the trace has none of that step."""
    if not steps:
        return {}
    step = sorted(steps, key=lambda s: float(s["step_s"]))[(len(steps) - 1) // 2]
    started = float(step["time"]) - float(step["step_s"])
    marks = step_timeline(events, int(step["step"]), started)
    if not marks:
        return {}
    latency: dict[str, float] = {}
    for layer in step.get("layers", [])[:1]:  # a chain's round: recorded under layer 0
        for timing in participant_entries(layer):
            latency[participant_of(timing)] = float(timing.get("forward_latency_s") or 0.0)
    return {"step": int(step["step"]), "step_s": float(step["step_s"]),
            "participants": {name: {"marks": [[m.layer, m.phase, m.shared_s, m.held_s]
                                              for m in these],
                                    "result_s": latency.get(name)}
                             for name, these in marks.items()}}


def measured_slices(steps: list[dict[str, Any]]) -> dict[str, int]:
    """The samples per participant (those with any) of most of ``steps`` (step records
    of the sample split: each layer's timings carry the participant's samples)."""
    seen: dict[tuple[tuple[str, int], ...], int] = {}
    for step in steps:
        layers = step.get("layers") or [{}]
        slicing = tuple(sorted((participant_of(t), int(t.get("samples", 0)))
                               for t in participant_entries(layers[0])
                               if int(t.get("samples", 0)) > 0))
        if slicing:
            seen[slicing] = seen.get(slicing, 0) + 1
    if not seen:
        return {}
    most = max(seen.items(), key=lambda item: item[1])[0]
    return dict(most)


def model_prediction(record: dict[str, Any], slices: dict[str, int]) -> float:
    """The step model's prediction (its last ``model`` record) for the slices the
    figures were measured on: the check's own where they are the checked slices (or
    unknown), else the record's terms at ``slices`` (a re-slice after the check)."""
    checked = {str(n): int(c) for n, c in (record.get("samples") or {}).items() if int(c) > 0}
    terms = terms_from_record(record)
    if not slices or slices == checked or terms is None \
            or set(slices) - set(terms.per_sample_s):
        return float(record["predicted_step_s"])
    return terms.predict(slices)


def run_figures(run_dir: Path, link_bytes_per_s: float | None) -> RunFigures:
    """Medians from ``metrics.jsonl`` and the model's prediction from its calibration."""
    records = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in records if r.get("type") == "step"]
    settled = settled_split(records)
    alone = stayed_alone(records)
    alone_steps = [] if alone is None else [
        r for r in steps if float(r["time"]) > float(alone["time"])]
    if alone_steps:  # the master-alone check left the master alone: its steps since
        steps, settled = alone_steps, None
    elif settled is not None:  # the steady state: the split the rebalancer settled on
        steps = [r for r in steps if int(r["step"]) > int(settled["step"]) + 1]
    else:
        steps = steps[1:] if len(steps) > 1 else steps
    if not steps:
        raise UserError(f"{run_dir}: the run recorded no steps")
    events = read_trace(run_dir / "trace")
    master_bytes, busiest = [], []
    for step in steps:
        master_link: dict[str, int] = {}  # per worker: its traffic with the master
        worker_link: dict[str, int] = {}  # per worker: everything on its link
        for layer in step.get("layers", []):
            for timing in participant_entries(layer):
                name = participant_of(timing)
                if name == "master":
                    continue
                to_master = int(timing.get("bytes_sent", 0)) + int(timing.get("bytes_received", 0))
                peers = (int(timing.get("peer_bytes_sent", 0))
                         + int(timing.get("peer_bytes_received", 0)))
                master_link[name] = master_link.get(name, 0) + to_master
                worker_link[name] = worker_link.get(name, 0) + to_master + peers
        master_bytes.append(sum(master_link.values()))
        busiest.append(max(worker_link.values(), default=0))
    dense_s = statistics.median(float(s["dense_s"]) for s in steps)
    calibration = [r for r in records if r.get("type") == "calibration"]
    plans = [r for r in records if r.get("type") == "plan"]
    predicted = None
    sample_split = any(r.get("split_by") == "samples" for r in plans)
    models = [r for r in records if r.get("type") == "model"]
    if alone_steps and alone is not None and float(alone.get("alone_step_s") or 0.0) > 0:
        # the plan in force is the master alone: what the check's trial measured of it
        predicted = float(alone["alone_step_s"]) + dense_s
    elif sample_split and models:  # the step model calibrated in place (master/samples/step_model.py)
        predicted = model_prediction(models[-1], measured_slices(steps))
    elif sample_split:  # the setup's prediction (master/samples/plan.py) plus the dense part
        value = plans[-1].get("predicted_step_s")
        predicted = None if value is None else float(value) + dense_s
    elif settled is not None:  # the model's prediction of that split (measured corrections)
        predicted = float(settled["new_predicted_step_s"]) + dense_s
    elif plans:  # the planner's own prediction (conv + transfers) plus the measured dense part
        predicted = float(plans[-1]["predicted_step_s"]) + dense_s
    elif calibration and link_bytes_per_s:
        layers = [[ParticipantCost(float(d["fixed_s"]), float(d["per_kernel_s"]),
                                   int(d["kernels"])) for d in participant_entries(c)]
                  for c in sorted(calibration, key=lambda c: int(c["layer"]))]
        predicted = star_step_seconds(layers, dense_s, statistics.median(master_bytes),
                                      link_bytes_per_s)
    return RunFigures(step_s=statistics.median(float(s["step_s"]) for s in steps),
                      dense_s=dense_s, master_link_bytes=statistics.median(master_bytes),
                      busiest_worker_link_bytes=statistics.median(busiest),
                      predicted_step_s=predicted, breakdown=step_breakdown(steps),
                      layers=layer_breakdown(steps),
                      comm_share=comm_share(steps),
                      barriers=barrier_figures(barrier_breakdown(
                          events, int(steps[0]["step"]))),
                      timeline=typical_step_timeline(steps, events),
                      window=steady_window(records, steps),
                      setup=setup_figures(records, run_dir))


def summarize(configurations: list[tuple[tuple[float, ...], str]],
              results: dict[str, list[RunFigures]],
              label: Callable[[tuple[tuple[float, ...], str]], str]) -> list[dict[str, Any]]:
    """One row per configuration: medians over repeats, speedup and share of the ideal."""
    rows = []
    for configuration in configurations:
        config = configuration[0]
        runs = results[label(configuration)]
        alone = results[f"baseline-{max(config):g}"]
        baseline = statistics.median(r.step_s for r in alone)
        step_s = statistics.median(r.step_s for r in runs)
        predictions = [r.predicted_step_s for r in runs if r.predicted_step_s is not None]
        ideal = ideal_speedup(config)
        rows.append({
            "machines": label(configuration), "step_s": step_s, "baseline_step_s": baseline,
            "repeat_steps_s": [r.step_s for r in runs],
            "speedup": baseline / step_s, "ideal": ideal,
            "of_ideal": baseline / step_s / ideal,
            "master_link_bytes": statistics.median(r.master_link_bytes for r in runs),
            "busiest_worker_link_bytes": statistics.median(
                r.busiest_worker_link_bytes for r in runs),
            "predicted_step_s": statistics.median(predictions) if predictions else None,
            "breakdown": merge_repeats([r.breakdown for r in runs]),
            "layers": merge_layer_repeats([r.layers for r in runs]),
            "comm_share": statistics.median(r.comm_share for r in runs),
            "barriers": merge_barrier_repeats([r.barriers for r in runs]),
            "timeline": sorted(runs, key=lambda r: r.step_s)[(len(runs) - 1) // 2].timeline,
            "cpu": merge_cpu_repeats([r.cpu for r in runs if r.cpu]),
            "alone_cpu": merge_cpu_repeats([r.cpu for r in alone if r.cpu]),
            "setup": merge_setup_repeats([r.setup for r in runs if r.setup is not None]),
        })
    return rows


def format_table(rows: list[dict[str, Any]], rate: str) -> list[str]:
    lines = ["", "| machines (core each) | link | step ms | predicted ms | one machine ms | "
             "speedup | of ideal | master link MB/step | busiest worker link MB/step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        predicted = ("-" if row["predicted_step_s"] is None
                     else f"{row['predicted_step_s'] * 1e3:.1f}")
        lines.append(
            f"| {row['machines']} | {row.get('rate', rate)} | {row['step_s'] * 1e3:.1f} | "
            f"{predicted} | "
            f"{row['baseline_step_s'] * 1e3:.1f} | {row['speedup']:.2f}x | "
            f"{100 * row['of_ideal']:.0f}% | {row['master_link_bytes'] / 1e6:.2f} | "
            f"{row['busiest_worker_link_bytes'] / 1e6:.2f} |")
    return lines
