"""The report's pictures: matplotlib figures rendered to PNG bytes (Agg, no pyplot).

Each function takes parsed records or a summary and returns PNG bytes, or None
when there is nothing to draw (no steps yet). Figures are 10 inches wide at 100
dpi so they fit the HTML page's column; every axis says its unit.
"""
from __future__ import annotations

import io
from collections.abc import Sequence

from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from hetconv.analysis.report.events import JOIN, LOSS, RECOVERY, REPLAN, RESPLIT, RESUME
from hetconv.analysis.report.records import RunRecords, StepRecord
from hetconv.analysis.report.summary import RunSummary
from hetconv.errors import UserError

DPI = 100
WIDTH_IN = 10.0
TIMELINE_STEPS = 20
COLOURS = {"comm": "#d62728", "conv": "#1f77b4", "dense": "#2ca02c", "other": "#bbbbbb",
           "forward": "#1f77b4", "backward": "#ff7f0e", "wait": "#c7c7c7", "rest": "#f7b6d2",
           "kernels": "#9467bd", "throughput": "#17becf", "loss": "#1f77b4",
           "train": "#1f77b4", "test": "#d62728", "predicted": "#1f77b4", "ideal": "#7f7f7f"}
EVENT_STYLE = {  # kind -> (colour, line style, where on the step axis: 0 at the step, -0.5 before)
    LOSS: ("#000000", "-", 0.0), RECOVERY: ("#d62728", "--", 0.0),
    JOIN: ("#2ca02c", "-", -0.5), REPLAN: ("#9467bd", ":", -0.5),
    RESPLIT: ("#ff7f0e", ":", -0.5), RESUME: ("#8c564b", "-.", -0.5)}


def event_marks(records: RunRecords) -> list[tuple[float, str, str | None]]:
    """(x on the step axis, kind, participant) per membership event with a step: at the
    failed step for a loss or a recovery, between two steps for the others."""
    return [(event.step + EVENT_STYLE[event.kind][2], event.kind, event.participant)
            for event in records.events if event.step is not None and event.kind in EVENT_STYLE]


def _mark_events(axes: Axes, records: RunRecords) -> None:
    """Vertical lines for the membership events, one legend entry per kind, the worker
    named beside a join or a loss."""
    labelled: set[str] = set()
    for x, kind, participant in event_marks(records):
        colour, style, _ = EVENT_STYLE[kind]
        axes.axvline(x, color=colour, linestyle=style, linewidth=1.1,
                     label=None if kind in labelled else kind)
        labelled.add(kind)
        if participant is not None and kind in (JOIN, LOSS):
            axes.annotate(f"{'+' if kind == JOIN else '-'}{participant}", (x, 1.0),
                          xycoords=("data", "axes fraction"), xytext=(2, -2),
                          textcoords="offset points", ha="left", va="top", rotation=90,
                          fontsize="x-small", color=colour)


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def time_breakdown(records: RunRecords) -> bytes | None:
    """Stacked per-step time: communication, distributed conv, dense (ms)."""
    steps = records.steps
    if not steps:
        return None
    x = [s.step for s in steps]
    comm = [s.comm_s * 1e3 for s in steps]
    conv = [max(0.0, s.conv_s - s.comm_s) * 1e3 for s in steps]
    dense = [s.dense_s * 1e3 for s in steps]
    figure = Figure(figsize=(WIDTH_IN, 3.6), layout="constrained")
    axes = figure.add_subplot()
    if len(steps) <= 300:
        axes.bar(x, comm, width=1.0, color=COLOURS["comm"], label="communication (comm_s)")
        axes.bar(x, conv, width=1.0, bottom=comm, color=COLOURS["conv"],
                 label="distributed conv (conv_s - comm_s)")
        axes.bar(x, dense, width=1.0, bottom=[a + b for a, b in zip(comm, conv)],
                 color=COLOURS["dense"], label="dense part (dense_s)")
    else:
        axes.stackplot(x, comm, conv, dense, colors=[COLOURS[k] for k in ("comm", "conv", "dense")],
                       labels=["communication (comm_s)", "distributed conv (conv_s - comm_s)",
                               "dense part (dense_s)"])
    _mark_events(axes, records)
    axes.set_xlabel("training step (from 0; step 0 is warm-up)")
    axes.set_ylabel("time per step (ms)")
    axes.set_title("Where each step's time goes" + (", with membership events"
                                                    if records.events else ""))
    axes.legend(loc="upper right", fontsize="small")
    axes.grid(axis="y", alpha=0.3)
    return _png(figure)


def kernel_vs_throughput(summary: RunSummary) -> bytes | None:
    """Per layer, each participant's kernel share (its sample share under the sample
    split) next to its measured throughput share (%)."""
    unit = "samples" if summary.split_by == "samples" else "kernels"
    layers = [row.layer for row in summary.layers]
    participants = [d for d in summary.devices if any(r.kernels for r in d.layers)]
    if not layers or not participants or summary.steps_used == 0:
        return None
    columns = min(len(layers), 3)
    rows = -(-len(layers) // columns)
    figure = Figure(figsize=(WIDTH_IN, 3.4 * rows), layout="constrained")
    width = 0.38
    for index, layer in enumerate(layers):
        axes = figure.add_subplot(rows, columns, index + 1)
        positions = list(range(len(participants)))
        kernel = [100 * d.layers[index].kernel_share for d in participants]
        throughput = [100 * (d.layers[index].throughput_share or 0.0) for d in participants]
        axes.bar([p - width / 2 for p in positions], kernel, width, color=COLOURS["kernels"],
                 label=f"{unit[:-1]} share")
        axes.bar([p + width / 2 for p in positions], throughput, width,
                 color=COLOURS["throughput"], label="measured throughput share")
        axes.set_xticks(positions, [d.id for d in participants],
                        rotation=20 if len(participants) > 3 else 0)
        axes.set_title(f"layer {layer + 1} ({summary.layers[index].kernels} {unit})")
        axes.set_xlabel("participant")
        axes.set_ylabel("share of the layer (%)")
        axes.set_ylim(0, 105)
        axes.grid(axis="y", alpha=0.3)
        if index == 0:
            axes.legend(fontsize="small")
    return _png(figure)


def _phase_order(step: StepRecord) -> list[tuple[int, str]]:
    layers = sorted(layer.layer for layer in step.layers)
    return [(layer, "forward") for layer in layers] + \
        [(layer, "backward") for layer in reversed(layers)]


def timeline(records: RunRecords, last: int = TIMELINE_STEPS) -> bytes | None:
    """Per participant, the last steps laid out phase by phase (forward layers, dense,
    backward layers): compute bars, then the time until its result reached the
    master (transfer and queueing) in grey. A phase is as long as its latest participant."""
    steps = list(records.steps[-last:])
    participants = sorted({t.participant for s in steps for layer in s.layers
                           for t in layer.devices},
                          key=lambda name: (name != "master", name))
    if not steps or not participants:
        return None
    if len(participants) > 4:
        steps = steps[-10:]
    height = 0.5 + 0.16 * len(steps)
    figure = Figure(figsize=(WIDTH_IN, 0.8 + height * len(participants)), layout="constrained")
    axes_list = figure.subplots(len(participants), 1, sharex=True, squeeze=False)[:, 0]
    row_of = {participant: axes for participant, axes in zip(participants, axes_list)}
    bars: dict[str, dict[tuple[str, int], list[tuple[float, float]]]] = {
        p: {} for p in participants}
    for row, step in enumerate(steps):
        cursor = 0.0
        by_layer = {layer.layer: layer for layer in step.layers}
        for layer_index, phase in _phase_order(step):
            if phase == "backward" and layer_index == max(by_layer):
                if "master" in bars:  # the dense part runs on the master between the phases
                    bars["master"].setdefault(("dense", row), []).append(
                        (cursor, step.dense_s * 1e3))
                cursor += step.dense_s * 1e3
            wall = 0.0
            for timing in by_layer[layer_index].devices:
                compute = getattr(timing, f"{phase}_s") * 1e3
                latency = getattr(timing, f"{phase}_latency_s")
                latency = compute if latency is None else max(latency * 1e3, compute)
                bars[timing.participant].setdefault((phase, row), []).append((cursor, compute))
                if latency > compute:
                    bars[timing.participant].setdefault(("wait", row), []).append(
                        (cursor + compute, latency - compute))
                wall = max(wall, latency)
            cursor += wall
        rest = (step.conv_s + step.dense_s) * 1e3 - cursor
        if rest > 0:  # conv wall time after the results came in: not placed in the metrics
            for participant in participants:
                bars[participant].setdefault(("rest", row), []).append((cursor, rest))
    labels = {"forward": "forward compute", "backward": "backward compute + update",
              "wait": "until result at master (transfer, queue)", "dense": "dense part (master)",
              "rest": "rest of the conv wall time (master side, not placed)"}
    for participant, axes in row_of.items():
        seen: set[str] = set()
        for (kind, row), spans in bars[participant].items():
            axes.broken_barh(spans, (row - 0.4, 0.8), facecolors=COLOURS[kind],
                             edgecolor="white", linewidth=0.4,
                             label=None if kind in seen else labels[kind])
            seen.add(kind)
        axes.set_yticks(range(len(steps)), [str(s.step) for s in steps], fontsize="x-small")
        axes.set_ylim(len(steps) - 0.5, -0.5)
        axes.set_ylabel(f"{participant}\nstep")
        axes.grid(axis="x", alpha=0.3)
    figure.suptitle(f"Timeline of the last {len(steps)} steps, per participant")
    axes_list[-1].set_xlabel("time since the step started (ms)")
    handles: dict[str, Artist] = {}
    for axes in axes_list:
        for handle, label in zip(*axes.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    figure.legend(list(handles.values()), list(handles.keys()), fontsize="small",
                  loc="outside lower center", ncols=min(3, len(handles)))
    return _png(figure)


def _epoch_end_steps(steps: Sequence[StepRecord]) -> dict[int, int]:
    ends: dict[int, int] = {}
    for step in steps:
        ends[step.epoch] = max(ends.get(step.epoch, step.step), step.step)
    return ends


def training_curves(records: RunRecords) -> bytes | None:
    """Loss per step and per epoch; batch accuracy per step, test accuracy per epoch."""
    steps = records.steps
    if not steps:
        return None
    ends = _epoch_end_steps(steps)
    epochs = [e for e in records.epochs if e.epoch in ends]
    figure = Figure(figsize=(WIDTH_IN, 3.6), layout="constrained")
    loss_axes, accuracy_axes = figure.subplots(1, 2)
    x = [s.step for s in steps]
    loss_axes.plot(x, [s.loss for s in steps], color=COLOURS["loss"], linewidth=0.8,
                   label="batch loss")
    if epochs:
        loss_axes.plot([ends[e.epoch] for e in epochs], [e.train_loss for e in epochs], "o-",
                       color=COLOURS["train"], label="epoch mean train loss")
        loss_axes.plot([ends[e.epoch] for e in epochs if e.test_loss is not None],
                       [e.test_loss for e in epochs if e.test_loss is not None], "s--",
                       color=COLOURS["test"], label="test loss")
    loss_axes.set_xlabel("training step")
    loss_axes.set_ylabel("cross-entropy loss (nats)")
    loss_axes.set_title("Loss")
    loss_axes.legend(fontsize="small")
    loss_axes.grid(alpha=0.3)
    accuracy_axes.plot(x, [100 * s.accuracy for s in steps], color=COLOURS["train"],
                       linewidth=0.6, alpha=0.6, label="batch accuracy")
    tested = [e for e in epochs if e.test_accuracy is not None]
    if tested:
        accuracy_axes.plot([ends[e.epoch] for e in tested],
                           [100 * (e.test_accuracy or 0.0) for e in tested], "s--",
                           color=COLOURS["test"], label="test accuracy (end of epoch)")
    accuracy_axes.set_xlabel("training step")
    accuracy_axes.set_ylabel("accuracy (%)")
    accuracy_axes.set_ylim(0, 102)
    accuracy_axes.set_title("Accuracy")
    accuracy_axes.legend(fontsize="small", loc="lower right")
    accuracy_axes.grid(alpha=0.3)
    return _png(figure)


def predicted_scaling(records: RunRecords) -> bytes | None:
    """The model's estimated speedup against machine count (1 to 128, the run's participants
    repeated at its measured links, batch and network; :mod:`master.whatif`, or
    :mod:`master.whatif_samples` for a run split by samples), with the
    ideal (the machines' summed compute speed). None without cost fits or measured links."""
    from hetconv.analysis import whatif
    from hetconv.analysis.whatif_samples import (
        predict_sample_scenarios,
        read_sample_plan,
        read_step_model,
    )

    try:
        run = whatif.measured_run(records, whatif.read_plan_links(records.run_dir))
        if not run.links_measured:
            return None
        per_sample = read_sample_plan(records.run_dir)
        curve = (whatif.scaling_curve(run) if per_sample is None else predict_sample_scenarios(
            run, per_sample, [whatif.Scenario(n, None, run.batch, run.arch)
                              for n in whatif.DEFAULT_MACHINES],
            read_step_model(records.run_dir)))  # the run's step model, as `hetconv plan`
    except (UserError, ValueError, OSError):
        return None
    machines = [p.scenario.machines for p in curve]
    figure = Figure(figsize=(WIDTH_IN, 3.6), layout="constrained")
    axes = figure.add_subplot()
    axes.plot(machines, [p.speedup for p in curve], "o-", color=COLOURS["predicted"],
              label="model estimate (planner's choice of machines)")
    axes.plot(machines, [p.ideal_speedup for p in curve], "--", color=COLOURS["ideal"],
              label="ideal (summed compute speed over the fastest machine's)")
    for prediction in curve:
        axes.annotate(f"{prediction.chosen} used", (prediction.scenario.machines,
                                                    prediction.speedup),
                      textcoords="offset points", xytext=(0, 6), ha="center", fontsize="x-small")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log", base=2)
    axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axes.set_xticks(machines, [str(n) for n in machines])
    axes.set_xlabel("machines (the run's participants repeated, measured links)")
    axes.set_ylabel("speedup over one machine (x)")
    axes.set_title(f"Predicted scaling (model estimate): batch {run.batch}, "
                   f"arch {':'.join(map(str, run.arch))}, {run.data_plane} data plane")
    axes.legend(fontsize="small", loc="upper left")
    axes.grid(alpha=0.3, which="both")
    return _png(figure)
