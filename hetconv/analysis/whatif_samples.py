"""What if, for a run split by samples: the sample split's model
(:func:`hetconv.master.samples.plan.predict_sample_step`) for clusters that were never
measured, from the run's in-place calibration (seconds per sample of the whole conv
chain, per participant: the ``plan`` record's ``seconds_per_sample``) and its probed
links. The same scenarios, table and measured-configuration check as the kernel
split's what-if (:mod:`hetconv.analysis.whatif`), with its cluster rule: the measured
participants repeated in order, or ``like`` N copies of one.

Approximations (units: seconds, bytes):

- **Batch**: a participant's seconds per sample do not change with its slice (the
  per-call cost is spread over the calibrated slice; a much smaller slice is
  predicted too fast).
- **Network** (``arch``): seconds per sample scale with the conv forward flop per
  sample of the whole chain over the measured one's; the dense part as in the kernel
  what-if.
- The master's dense part is the measured median, scaled the same way. Replicated on
  the participants (``dense_part`` "replicas", docs/dense-replica.md): the measured
  median is the slowest member's, on its slice; it scales with the largest slice, and
  the dense part's values join the weight reduction (``predict_sample_step``).
- Slices follow speed (equation 1 applied to samples), also for a run that was split
  ``--split equal``.

Pure; :func:`read_sample_plan` reads the run's ``plan`` record.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hetconv.analysis.report.records import METRICS_FILE
from hetconv.analysis.whatif import (
    MAX_MACHINES,
    MeasuredRun,
    Prediction,
    Scenario,
    cluster,
    is_measured,
    model_with_arch,
    scaled_dense_s,
)
from hetconv.errors import UserError
from hetconv.master.kernels.planner import ParticipantProfile
from hetconv.master.samples.plan import (
    conv_weights,
    predict_sample_step,
    sample_bytes,
    sample_slices,
)
from hetconv.metrics import iter_metrics
from hetconv.model import ConvLayerShape, ModelConfig, conv_layer_shapes, dense_shapes


def read_sample_plan(run_dir: str | Path) -> dict[str, float] | None:
    """Seconds per sample per participant from the run's last ``plan`` record when the
    run was split by samples; None when it was split by kernels."""
    seconds: dict[str, float] | None = None
    for record in iter_metrics(Path(run_dir) / METRICS_FILE):
        if record["type"] != "plan":
            continue
        if record.get("split_by") != "samples":
            seconds = None
            continue
        try:
            seconds = {str(k): float(v) for k, v in dict(record["seconds_per_sample"]).items()}
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{run_dir}: the sample split's plan record has no usable "
                            "seconds_per_sample (a run from an older hetconv?)") from None
    return seconds


def _chain_flops(shapes: Sequence[ConvLayerShape]) -> float:
    """Conv forward flop per sample of the whole chain."""
    return float(sum(shape.conv_flops(1) for shape in shapes))


def _master_link_bytes(slices: Sequence[tuple[str, int]], remote: dict[str, bool],
                       shapes: Sequence[ConvLayerShape], itemsize: int, data_plane: str,
                       weights: int, replicated: bool = False) -> float:
    """Bytes per step on the master's link, both directions: every worker's x and dy
    slices down and y slice up; with the star plane its weight gradient up and the sum
    down too (the peer plane reduces them worker to worker, but the master takes part:
    2·(P-1)/P of them each way). ``replicated`` (the dense part on every participant):
    only the x slices, and ``weights`` counts the dense part's values too."""
    x_bytes, y_bytes = sample_bytes(shapes, itemsize)
    if replicated:
        y_bytes = 0
    workers = [(name, n) for name, n in slices if remote.get(name)]
    total = sum(n * (x_bytes + 2 * y_bytes) for _, n in workers)
    if not workers:
        return 0.0
    if data_plane == "peer":
        participants = len(workers) + 1
        return total + 2 * 2 * (participants - 1) / participants * 4 * weights
    return total + sum(2 * 4 * weights for _, n in workers if n > 0)


def predict_sample_scenarios(run: MeasuredRun, seconds_per_sample: dict[str, float],
                             scenarios: Sequence[Scenario]) -> list[Prediction]:
    """The sample split model's estimate for every scenario (module doc)."""
    measured_shapes = conv_layer_shapes(run.model)
    missing = [p.participant for p in run.profiles if p.participant not in seconds_per_sample]
    if missing:
        raise UserError(f"{run.run_dir}: the sample split's plan record has no seconds per "
                        f"sample for {', '.join(missing)}")
    replicated = run.dense_replicas and run.data_plane == "peer"
    measured = sample_slices([p.participant for p in run.profiles],
                             [seconds_per_sample[p.participant] for p in run.profiles], run.batch)
    measured_largest = max((s.samples for s in measured), default=run.batch) or run.batch
    out = []
    for scenario in scenarios:
        if not 1 <= scenario.machines <= MAX_MACHINES:
            raise UserError(f"{scenario.machines} machines: give 1 to {MAX_MACHINES}")
        shapes = conv_layer_shapes(model_with_arch(run, scenario.arch))
        scale = _chain_flops(shapes) / _chain_flops(measured_shapes)
        machines = cluster(run, scenario)
        sources = _sources(run, scenario)
        seconds = [seconds_per_sample[source] * scale for source in sources]
        names = [m.participant for m in machines]
        slices = sample_slices(names, seconds, scenario.batch)
        per_sample = dict(zip(names, seconds))
        links = {m.participant: m.link for m in machines}
        values = dense_values(model_with_arch(run, scenario.arch)) if replicated else 0
        conv = predict_sample_step(slices, per_sample, links, shapes, conv_weights(shapes),
                                   run.wire_itemsize,
                                   "peer" if run.data_plane == "peer" else "master",
                                   slice_statistics=run.slice_statistics, dense_values=values,
                                   link_itemsizes=_link_itemsizes(run, machines, sources),
                                   ahead=run.steps_in_flight > 1)
        dense = alone_dense = scaled_dense_s(run, scenario.arch, scenario.batch)
        if replicated:  # measured on the largest slice; runs on the scenario's largest
            per_sample_dense = dense / scenario.batch * run.batch / measured_largest
            alone_dense = per_sample_dense * scenario.batch
            dense = per_sample_dense * max(s.samples for s in slices)
        single = min(seconds) * scenario.batch
        speeds = [1.0 / t for t in seconds]
        out.append(Prediction(
            scenario=scenario, step_s=conv + dense, single_step_s=single + alone_dense,
            ideal_speedup=sum(speeds) / max(speeds),
            chosen=sum(1 for s in slices if s.samples > 0),
            master_link_bytes=_master_link_bytes(
                [(s.participant, s.samples) for s in slices],
                {m.participant: m.link is not None for m in machines}, shapes,
                run.wire_itemsize, run.data_plane, conv_weights(shapes) + values, replicated),
            measured_step_s=run.measured_step_s if is_measured(run, scenario) else None))
    return out


def dense_values(model: ModelConfig) -> int:
    """Values in the dense part's arrays (N: every weight and bias)."""
    return sum(out * (features + 1) for _, features, out in dense_shapes(model))


def _link_itemsizes(run: MeasuredRun, machines: list[ParticipantProfile],
                    sources: list[str]) -> dict[str, int]:
    """Each machine's wire bytes per element: its source's link's, as the run chose."""
    chosen = dict(run.link_itemsizes)
    return {machine.participant: chosen[source]
            for machine, source in zip(machines, sources) if source in chosen}


def _sources(run: MeasuredRun, scenario: Scenario) -> list[str]:
    """The measured participant each machine of :func:`cluster` copies, in order."""
    if scenario.like is not None:
        return [scenario.like] * scenario.machines
    count = len(run.profiles)
    return [run.profiles[i % count].participant for i in range(scenario.machines)]

