"""The report's figures: pure functions from parsed records to a :class:`RunSummary`.

No I/O here. Every per-step figure is a median over the *used* steps: all steps
but the first of the run (warm-up: first-touch allocations, BLAS start-up) when
more than one step exists. Notation used in the docstrings below:

* ``K_l`` kernels of conv layer ``l``; ``k_dl`` kernels participant ``d`` owns in it;
* ``t_dlp`` participant ``d``'s compute seconds in layer ``l``, phase ``p`` (forward or
  backward, as measured by the participant), ``t~_dlp`` its median over used steps;
* ``c_dl = forward + backward`` seconds, ``c~_dl`` its median;
* ``v_dlp = k_dl / t~_dlp`` the participant's measured speed in kernels per second.

Speeds are assumed linear in kernels (a participant's time grows in proportion to the
kernels it owns), the same model the calibrated split itself uses.
"""
from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Sequence

from hetconv.analysis.report.events import RECOVERY, ended_alone
from hetconv.analysis.report.records import ParticipantTiming, RunRecords, StepRecord
from hetconv.analysis.report.summary import (
    DeviceLayer,
    DeviceSummary,
    LayerBalance,
    Resilience,
    RunSummary,
    SnapshotCost,
    TimeSplit,
    WhatIf,
)

PHASES = ("forward", "backward")
_TINY_S = 1e-9  # floor for a measured time, so a speed is never infinite


def median(values: Iterable[float]) -> float | None:
    """The median, or None for no values."""
    data = list(values)
    return float(statistics.median(data)) if data else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def used_steps(steps: Sequence[StepRecord]) -> tuple[StepRecord, ...]:
    """All steps but the run's first (warm-up) when more than one exists."""
    return tuple(steps[1:]) if len(steps) > 1 else tuple(steps)


def _timings(steps: Sequence[StepRecord]) -> dict[tuple[str, int], list[ParticipantTiming]]:
    """(participant, layer) -> its timings over the steps, participants with kernels only."""
    out: dict[tuple[str, int], list[ParticipantTiming]] = {}
    for step in steps:
        for layer in step.layers:
            for timing in layer.devices:
                if timing.kernels > 0:
                    out.setdefault((timing.participant, layer.layer), []).append(timing)
    return out


def _participant_order(records: RunRecords) -> list[str]:
    order = [d.id for d in records.devices]
    seen = set(order)
    extra = [d.participant for c in records.calibration for d in c.devices]
    extra += [t.participant for s in records.steps for layer in s.layers for t in layer.devices]
    for participant in extra:
        if participant not in seen:
            seen.add(participant)
            order.append(participant)
    return order


def _typical_step(steps: Sequence[StepRecord]) -> StepRecord:
    """The last step whose first layer's work (kernels, or samples under the sample
    split) adds up to the most common total: not an epoch's short last batch."""
    def total(step: StepRecord) -> int:
        return sum(t.kernels for t in step.layers[0].devices) if step.layers else 0

    common = Counter(total(step) for step in steps).most_common(1)[0][0]
    return next(step for step in reversed(steps) if total(step) == common)


def _kernel_counts(records: RunRecords, steps: Sequence[StepRecord]) -> dict[tuple[str, int], int]:
    """Kernels (or samples) per (participant, layer): as in the last used step of the
    run's usual size (:func:`_typical_step`), else the calibration split."""
    if steps:
        return {(t.participant, layer.layer): t.kernels for layer in _typical_step(steps).layers
                for t in layer.devices}
    return {(d.participant, c.layer): d.kernels for c in records.calibration for d in c.devices}


def _layer_kernels(records: RunRecords, counts: dict[tuple[str, int], int],
                   steps: Sequence[StepRecord] = ()) -> dict[int, int]:
    """K_l per layer: from ``run_start``, else the sum of the devices' kernels. Under
    the sample split the work units are samples: the batch (the devices' sum)."""
    if steps and any(t.by_samples for layer in steps[-1].layers for t in layer.devices):
        totals: dict[int, int] = {}
        for (_, layer), count in counts.items():
            totals[layer] = totals.get(layer, 0) + count
        return dict(sorted(totals.items()))
    kernels = {shape.index: shape.kernels for shape in records.layers}
    for (_, layer), count in counts.items():
        if layer not in {shape.index for shape in records.layers}:
            kernels[layer] = kernels.get(layer, 0) + count
    return dict(sorted(kernels.items()))


def compute_speeds(timings: dict[tuple[str, int], list[ParticipantTiming]],
                   layer: int) -> dict[str, float]:
    """participant -> k_dl / c~_dl (kernels per second, forward+backward) in one layer."""
    return {participant: samples[-1].kernels / max(median(t.compute_s for t in samples) or 0.0,
                                              _TINY_S)
            for (participant, other), samples in timings.items() if other == layer}


def time_split(steps: Sequence[StepRecord]) -> TimeSplit | None:
    """Medians of step, comm, conv - comm, dense and the rest; fractions of their sum."""
    if not steps:
        return None
    step_s = median(s.step_s for s in steps) or 0.0
    comm_s = median(s.comm_s for s in steps) or 0.0
    conv_s = median(max(0.0, s.conv_s - s.comm_s) for s in steps) or 0.0
    dense_s = median(s.dense_s for s in steps) or 0.0
    other_s = median(max(0.0, s.step_s - s.conv_s - s.dense_s) for s in steps) or 0.0
    total = comm_s + conv_s + dense_s + other_s

    def fraction(part: float) -> float:
        return part / total if total > 0 else 0.0

    return TimeSplit(step_s=step_s, comm_s=comm_s, conv_s=conv_s, dense_s=dense_s,
                     other_s=other_s, comm_fraction=fraction(comm_s),
                     conv_fraction=fraction(conv_s), dense_fraction=fraction(dense_s),
                     other_fraction=fraction(other_s),
                     after_results_s=median(_after_results(steps)))


def latest_result_s(step: StepRecord) -> float | None:
    """Sum over layers and phases of the latest participant's latency (None for local runs)."""
    total = 0.0
    for layer in step.layers:
        for phase in PHASES:
            latencies = [getattr(t, f"{phase}_latency_s") for t in layer.devices]
            if not latencies or any(value is None for value in latencies):
                return None
            total += max(float(value) for value in latencies if value is not None)
    return total


def _after_results(steps: Sequence[StepRecord]) -> list[float]:
    """Per step, max(0, conv_s - latest_result_s) where latencies were recorded."""
    gaps = []
    for step in steps:
        latest = latest_result_s(step)
        if latest is not None:
            gaps.append(max(0.0, step.conv_s - latest))
    return gaps


def phase_speeds(steps: Sequence[StepRecord]) -> dict[tuple[int, str], dict[str, float]]:
    """(layer, phase) -> {participant: v_dlp = k_dl / median t_dlp}, those with kernels."""
    speeds: dict[tuple[int, str], dict[str, float]] = {}
    for (participant, layer), timings in _timings(steps).items():
        kernels = timings[-1].kernels
        for phase in PHASES:
            seconds = median(getattr(t, f"{phase}_s") for t in timings) or 0.0
            speeds.setdefault((layer, phase), {})[participant] = kernels / max(seconds, _TINY_S)
    return speeds


def _phase_times(timing: ParticipantTiming) -> tuple[float, float]:
    return timing.forward_s, timing.backward_s


def layer_balance(steps: Sequence[StepRecord],
                  layer_kernels: dict[int, int]) -> tuple[tuple[LayerBalance, ...],
                                                          float | None, float | None]:
    """Per-layer balance, and the whole conv stage's (ideal_s, slowest_s).

    For every used step ``s``, layer ``l`` and phase ``p``, over the participants with
    kernels (speeds ``v_dlps = k_dl / t_dlps`` of that very step):

    * ``ideal_lps = K_l / sum_d v_dlps``: the layer's kernels divided among its
      participants in proportion to their measured speeds, all finishing together;
    * ``slowest_lps = max_d t_dlps``: the participant compute on the critical path
      (communication excluded: that is ``comm_s``).

    Per layer, ``ideal_s = median_s sum_p ideal_lps``, ``slowest_s = median_s
    sum_p slowest_lps`` and ``efficiency = ideal_s / slowest_s``; the stage
    figures use the per-step sums over layers as well. A single participant scores
    exactly 1. ``imbalance = median_s (max_d c_dls / mean_d c_dls)`` with
    ``c = forward + backward``; 1.0 is perfect, the number of participants the worst.
    """
    ideal_by_layer: dict[int, list[float]] = {}
    slowest_by_layer: dict[int, list[float]] = {}
    ratios_by_layer: dict[int, list[float]] = {}
    stage_ideal: list[float] = []
    stage_slowest: list[float] = []
    for step in steps:
        ideal_total = slowest_total = 0.0
        for layer in step.layers:
            active = [t for t in layer.devices if t.kernels > 0]
            if not active:
                continue
            kernels = sum(t.kernels for t in active)
            ideal = slowest = 0.0
            for phase in range(len(PHASES)):
                times = [max(_phase_times(t)[phase], _TINY_S) for t in active]
                ideal += kernels / sum(t.kernels / s for t, s in zip(active, times))
                slowest += max(times)
            ideal_by_layer.setdefault(layer.layer, []).append(ideal)
            slowest_by_layer.setdefault(layer.layer, []).append(slowest)
            ideal_total += ideal
            slowest_total += slowest
            mean = sum(t.compute_s for t in active) / len(active)
            if mean > 0:
                ratios_by_layer.setdefault(layer.layer, []).append(
                    max(t.compute_s for t in active) / mean)
        stage_ideal.append(ideal_total)
        stage_slowest.append(slowest_total)
    rows = []
    for index, kernels in layer_kernels.items():
        ideal_s = median(ideal_by_layer.get(index, []))
        slowest_s = median(slowest_by_layer.get(index, []))
        rows.append(LayerBalance(index, kernels, ideal_s, slowest_s, _ratio(ideal_s, slowest_s),
                                 median(ratios_by_layer.get(index, []))))
    if not ideal_by_layer:
        return tuple(rows), None, None
    return tuple(rows), median(stage_ideal), median(stage_slowest)


def single_device_conv_s(timings: dict[tuple[str, int], list[ParticipantTiming]],
                         participant: str, layer_kernels: dict[int, int],
                         costs: dict[int, tuple[float, float]] | None = None) -> float | None:
    """The participant alone doing every layer's conv work (an estimate): per layer the
    median over steps of its measured share time ``c~_dls`` at that step's ``k_dls``
    kernels (or samples) scaled to the whole layer's ``K_l`` by its fitted cost model,
    ``c~_dls * (a + b*K_l) / (a + b*k_dls)``, so the per-share fixed cost ``a`` counts
    once; linearly (``K_l / k_dls``) where a layer has no fit (and under the sample
    split, whose work unit is a sample: pass no ``costs``). Each step is scaled by its
    own share, so re-splits and an epoch's short last batch weigh right. None unless
    it has work in every layer."""
    total = 0.0
    for layer, kernels in layer_kernels.items():
        shares = [t for t in timings.get((participant, layer), []) if t.kernels > 0]
        if not shares or kernels <= 0:
            return None
        fixed, per_kernel = (costs or {}).get(layer, (0.0, 1.0))
        total += median(t.compute_s * (fixed + per_kernel * kernels)
                        / (fixed + per_kernel * t.kernels) for t in shares) or 0.0
    return total


def _fitted_costs(records: RunRecords, participant: str) -> dict[int, tuple[float, float]]:
    """Per layer the participant's calibrated cost fit (fixed_s, per_kernel_s), where usable."""
    out = {}
    for cal in records.calibration:
        entry = next((d for d in cal.devices if d.participant == participant), None)
        if (entry is not None and entry.fixed_s is not None and entry.per_kernel_s is not None
                and entry.fixed_s >= 0 and entry.per_kernel_s > 0):
            out[cal.layer] = (entry.fixed_s, entry.per_kernel_s)
    return out


def _participant_layers(records: RunRecords, participant: str,
                   timings: dict[tuple[str, int], list[ParticipantTiming]],
                   layer_kernels: dict[int, int],
                   counts: dict[tuple[str, int], int],
                   by_samples: bool = False) -> tuple[DeviceLayer, ...]:
    calibration = {c.layer: c for c in records.calibration}
    rows = []
    for layer, kernels in layer_kernels.items():
        compute = median(t.compute_s for t in timings.get((participant, layer), []))
        speeds = compute_speeds(timings, layer)
        speed = speeds.get(participant)
        calib_s = calib_speed = versus = None
        cal = calibration.get(layer)
        entry = (next((d for d in cal.devices if d.participant == participant), None)
                 if cal else None)
        if by_samples:
            # the sample split's calibration times the whole chain, not one layer, in
            # samples: only its relative speed compares (the kernel calibration's
            # kernels/s would not: another unit)
            per_sample = records.seconds_per_sample
            if per_sample.get(participant):
                calib_speed = min(per_sample.values()) / per_sample[participant]
        elif cal is not None and entry is not None and entry.seconds > 0:
            calib_s = entry.seconds
            calib_speed = min(d.seconds for d in cal.devices) / entry.seconds
            versus = _ratio(speed, cal.calibrated_kernels / entry.seconds)
        own = counts.get((participant, layer), 0)
        rows.append(DeviceLayer(layer=layer, kernels=own,
                                kernel_share=own / kernels if kernels else 0.0,
                                calibration_s=calib_s, calibrated_speed=calib_speed,
                                compute_s=compute,
                                throughput_share=_ratio(speed, sum(speeds.values())),
                                speed_vs_calibration=versus))
    return tuple(rows)


def _per_step(steps: Sequence[StepRecord], participant: str, field: str) -> float | None:
    """Median over steps (where the participant took part) of a per-layer field summed."""
    values = []
    for step in steps:
        entries = [t for layer in step.layers for t in layer.devices
                   if t.participant == participant]
        if entries:
            values.append(sum(float(getattr(t, field)) for t in entries))
    return median(values)


def device_summaries(records: RunRecords, steps: Sequence[StepRecord],
                     layer_kernels: dict[int, int]) -> tuple[DeviceSummary, ...]:
    counts = _kernel_counts(records, steps)
    by_samples = bool(steps) and any(t.by_samples for layer in steps[-1].layers
                                     for t in layer.devices)
    info = {d.id: d for d in records.devices}
    timings = _timings(steps)
    out = []
    for participant in _participant_order(records):
        meta = info.get(participant)
        out.append(DeviceSummary(
            id=participant, kind=meta.kind if meta else "?", name=meta.name if meta else "?",
            blas=meta.blas if meta else "",
            layers=_participant_layers(records, participant, timings, layer_kernels, counts,
                                       by_samples),
            compute_s=_per_step(steps, participant, "compute_s"),
            wait_s=_per_step(steps, participant, "wait_s"),
            bytes_sent=_per_step(steps, participant, "bytes_sent"),
            bytes_received=_per_step(steps, participant, "bytes_received"),
            single_device_conv_s=single_device_conv_s(
                timings, participant, layer_kernels,
                # the kernel calibration's fit is per kernel: no measure of samples
                None if by_samples else _fitted_costs(records, participant)),
            peer_bytes=_per_step(steps, participant, "peer_bytes")))
    return tuple(out)


def what_if(split: TimeSplit, steps: Sequence[StepRecord], layer_kernels: dict[int, int],
            fastest: str | None, workers: int) -> WhatIf:
    """Two predictions of the median step time, each from the measured one.

    * One more device like the fastest: every layer-phase's ideal time
      ``K_l / sum_d v_dlp`` becomes ``K_l / (sum_d v_dlp + v_flp)``; the measured
      conv part is scaled by ``rho = sum of the new ideals / sum of the old`` (the
      present balance efficiency is kept). The forward input goes whole to every
      worker and each returns a whole partial input gradient, so bytes on the
      master's link, and comm, scale by ``(W + 1) / W`` for ``W`` workers (unchanged
      when ``W = 0``: a local run's communication cannot be estimated).
      ``step' = step - conv - comm + rho * conv + comm * (W + 1) / W``.
    * A network twice as fast: ``step' = step - comm / 2``.
    """
    notes: list[str] = []
    new_step = speedup = None
    speeds = phase_speeds(steps)
    if fastest is not None and speeds:
        old = new = 0.0
        for (layer, _), by_device in speeds.items():
            combined = sum(by_device.values())
            old += layer_kernels.get(layer, 0) / combined
            new += layer_kernels.get(layer, 0) / (combined + by_device.get(fastest, 0.0))
        rho = new / old if old > 0 else 1.0
        comm_scale = (workers + 1) / workers if workers else 1.0
        if not workers:
            notes.append("no workers in this run: the new device's communication is not modelled")
        new_step = (split.step_s - split.conv_s - split.comm_s + rho * split.conv_s
                    + split.comm_s * comm_scale)
        speedup = _ratio(split.step_s, new_step)
    else:
        notes.append("no device ran every layer: cannot model a copy of the fastest")
    fast_network = split.step_s - split.comm_s / 2
    return WhatIf(split.step_s, fastest, new_step, speedup, fast_network,
                  _ratio(split.step_s, fast_network) or 1.0, tuple(notes))


def snapshot_cost(records: RunRecords, step_s: float | None) -> SnapshotCost | None:
    """Totals of the ``checkpoint`` records, per step trained (``len(records.steps)``:
    one per step, replays not counted) and as a fraction of the median step ``step_s``."""
    checkpoints = records.checkpoints
    if not checkpoints:
        return None
    total_s = sum(c.seconds for c in checkpoints)
    state = sum(c.state_bytes for c in checkpoints)
    written = sum(c.file_bytes for c in checkpoints)
    steps = len(records.steps)
    per_step_s = total_s / steps if steps else None
    return SnapshotCost(
        count=len(checkpoints), total_s=total_s,
        median_s=median(c.seconds for c in checkpoints) or 0.0, state_bytes=state,
        file_bytes=written, steps=steps, per_step_s=per_step_s,
        per_step_state_bytes=state / steps if steps else None,
        per_step_file_bytes=written / steps if steps else None,
        step_fraction=_ratio(per_step_s, step_s))


def resilience(records: RunRecords, step_s: float | None) -> Resilience:
    """The run's membership events, recoveries, replays and snapshot cost."""
    recoveries = [e for e in records.events if e.kind == RECOVERY]
    return Resilience(events=records.events, start_time=records.start_time,
                      recoveries=len(recoveries),
                      recovery_s=sum(e.seconds or 0.0 for e in recoveries),
                      replayed_steps=records.replayed_steps,
                      snapshots=snapshot_cost(records, step_s))


def summarize(records: RunRecords) -> RunSummary:
    """Every figure of the report for one run (see the module docstring)."""
    steps = used_steps(records.steps)
    counts = _kernel_counts(records, steps)
    layer_kernels = _layer_kernels(records, counts, steps)
    devices = device_summaries(records, steps, layer_kernels)
    split = time_split(steps)
    layers, ideal_s, slowest_s = layer_balance(steps, layer_kernels)
    imbalanced = [row for row in layers if row.imbalance is not None]
    worst = max(imbalanced, key=lambda row: row.imbalance or 0.0) if imbalanced else None
    candidates = [d for d in devices if d.single_device_conv_s is not None]
    fastest = min(candidates, key=lambda d: d.single_device_conv_s or 0.0) if candidates else None
    single_step = speedup = amdahl = None
    if fastest is not None and split is not None and fastest.single_device_conv_s is not None:
        single_step = fastest.single_device_conv_s + split.dense_s
        speedup = _ratio(single_step, split.step_s)
        amdahl = _ratio(single_step, split.dense_s)
    workers = len({participant for (participant, _), k in counts.items()
                   if k > 0 and participant != "master"})
    warnings = list(records.warnings)
    if not records.steps:
        warnings.append("no step records yet: nothing to measure")
    config = records.config
    epochs = records.epochs
    return RunSummary(
        run_dir=records.run_dir, name=records.name, mode=records.mode,
        status=records.status or "in progress",
        arch=tuple(int(k) for k in config.get("arch") or layer_kernels.values()),
        network=str(config.get("network") or ""),
        batch=config.get("batch"), steps_total=len(records.steps), steps_used=len(steps),
        epochs_planned=config.get("epochs"), devices=devices, split=split, layers=layers,
        conv_ideal_s=ideal_s, conv_slowest_s=slowest_s,
        balance_efficiency=_ratio(ideal_s, slowest_s),
        imbalance=worst.imbalance if worst else None,
        imbalance_layer=worst.layer if worst else None,
        fastest_device=fastest.id if fastest else None, single_device_step_s=single_step,
        speedup=speedup, amdahl_bound=amdahl,
        predicted_step_s=(records.rehearsal_predicted_step_s
                          if records.rehearsal_predicted_step_s is not None
                          else records.plan_predicted_step_s + split.dense_s
                          if records.plan_predicted_step_s is not None and split else None),
        predicted_by="rehearsal" if records.rehearsal_predicted_step_s is not None
        else "planner",
        what_if=(what_if(split, steps, layer_kernels, fastest.id if fastest else None, workers)
                 if split else None),
        epochs=epochs,
        final_test_accuracy=epochs[-1].test_accuracy if epochs else None,
        images_per_s=epochs[-1].images_per_s if epochs else None, warnings=tuple(warnings),
        resilience=resilience(records, split.step_s if split else None),
        checkpoint_every=_opt_int(config.get("checkpoint_every")),
        step_model=records.step_model,
        split_by="samples" if steps and any(t.by_samples for layer in steps[-1].layers
                                            for t in layer.devices) else "kernels",
        bn_statistics="slice" if config.get("bn_statistics") == "slice" else "batch",
        dense_part=records.dense_part, wire=records.wire, not_used=records.not_used,
        split_choice=records.split, ended_alone=ended_alone(records.events))


def _opt_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
