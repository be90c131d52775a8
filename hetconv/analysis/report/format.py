"""Number formatting and the tables' contents, shared by the text and HTML renderers.

Each table is built once here as a header row plus rows of short strings, so the
terminal and the HTML page show the same figures with the same units. A missing
figure (no steps yet, a participant without kernels in a layer) is shown as ``-``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetconv.analysis.report.records import StepModelCheck
from hetconv.analysis.report.summary import Resilience, RunSummary

MISSING = "-"


def ms(seconds: float | None) -> str:
    return MISSING if seconds is None else f"{seconds * 1e3:.1f}"


def pct(fraction: float | None) -> str:
    return MISSING if fraction is None else f"{fraction * 100:.1f}%"


def times(ratio: float | None) -> str:
    if ratio is None:
        return MISSING
    return f"{ratio:.0f}x" if ratio >= 100 else f"{ratio:.1f}x" if ratio >= 10 else f"{ratio:.2f}x"


def num(value: float | None, digits: int = 2) -> str:
    return MISSING if value is None else f"{value:.{digits}f}"


def kib(size_bytes: float | None) -> str:
    return MISSING if size_bytes is None else f"{size_bytes / 1024:.1f}"


def mib(size_bytes: float | None) -> str:
    return MISSING if size_bytes is None else f"{size_bytes / 2**20:.2f}"


@dataclass(frozen=True)
class Table:
    """A titled table; ``headers`` and every row have one string per column."""

    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    left_columns: int = 1  # the first columns are text (left-aligned), the rest numbers
    text_columns: tuple[int, ...] | None = None  # instead: exactly these are text
    wrap: bool = False  # the terminal wraps a text cell that does not fit, not clips it

    def is_text(self, column: int) -> bool:
        """Whether a column holds text (left-aligned) rather than numbers."""
        if self.text_columns is not None:
            return column in self.text_columns
        return column < self.left_columns


def headline(summary: RunSummary) -> str:
    arch = summary.network or ":".join(str(k) for k in summary.arch) or "?"
    epochs = f"{len(summary.epochs)}/{summary.epochs_planned or '?'} epochs"
    skipped = ", first skipped as warm-up" if summary.steps_used < summary.steps_total else ""
    return (f"{summary.mode} run, arch {arch}, batch {summary.batch or '?'}, "
            f"{summary.status}; {summary.steps_total} steps ({summary.steps_used} used"
            f"{skipped}), {epochs}")


def overview_table(summary: RunSummary) -> Table:
    """The main figures: time split, balance, speedup, bounds, what-if, accuracy."""
    split = summary.split
    rows: list[tuple[str, str, str]] = []
    if split is not None:
        rows += [("median step time", f"{ms(split.step_s)} ms", "100%"),
                 ("  communication (comm_s)", f"{ms(split.comm_s)} ms", pct(split.comm_fraction)),
                 *([("    of which after the last result arrived",
                     f"{ms(split.after_results_s)} ms", "master side")]
                   if split.after_results_s is not None else []),
                 ("  distributed conv (conv_s - comm_s)", f"{ms(split.conv_s)} ms",
                  pct(split.conv_fraction)),
                 ("  dense part (dense_s)", f"{ms(split.dense_s)} ms", pct(split.dense_fraction))]
        if split.other_fraction >= 0.01:
            rows.append(("  other", f"{ms(split.other_s)} ms", pct(split.other_fraction)))
    rows += [
        ("balance efficiency (ideal / slowest conv)", pct(summary.balance_efficiency),
         f"{ms(summary.conv_ideal_s)} / {ms(summary.conv_slowest_s)} ms"),
        ("imbalance (slowest / mean participant)", times(summary.imbalance),
         MISSING if summary.imbalance_layer is None else f"layer {summary.imbalance_layer + 1}"),
        ("set-up's predicted step", MISSING if summary.predicted_step_s is None
         else f"{ms(summary.predicted_step_s)} ms",
         MISSING if summary.predicted_step_s is None or split is None
         else f"measured / predicted {split.step_s / summary.predicted_step_s:.2f} ("
         + ("rehearsed" if summary.predicted_by == "rehearsal" else "planner") + ")"),
        *([] if summary.step_model is None else [_step_model_row(summary.step_model)]),
        *([] if not summary.split_choice[0] else [
            ("split by (the plan's)", *summary.split_choice)]),
        *([] if summary.ended_alone is None else [
            ("trained alone", f"from step {summary.ended_alone[0]}",
             f"{summary.ended_alone[1]}: the figures mix both")]),
        *([] if not summary.not_used else [
            ("not used", ", ".join(summary.not_used),
             "left out by the plan: predicted or measured to lengthen the step (its link or "
             "its speed)")]),
        *([] if not summary.wire else [
            ("wire dtype", summary.wire,
             "of the activations on the links; the batch-norm sums and weight gradients "
             "float32" if summary.split_by == "samples"
             else "of the activations and their gradients on the links")]),
        *([] if summary.split_by != "samples" else [
            ("batch-norm statistics",
             "each slice's" if summary.bn_statistics == "slice" else "whole batch's",
             "--bn-statistics slice: DDP's per-rank" if summary.bn_statistics == "slice"
             else "as one machine: the local run's"),
            ("dense part",
             "every participant's slice" if summary.dense_part == "replicas" else "the master",
             "--dense-part: one step chain" if summary.dense_part == "replicas"
             else "conv output via its link")]),
        ("speedup over fastest participant alone (est., "
         + ("per sample)" if summary.split_by == "samples" else "cost model)"),
         times(summary.speedup),
         MISSING if summary.fastest_device is None else
         f"{summary.fastest_device}: {ms(summary.single_device_step_s)} ms"),
        ("Amdahl bound of the dense part",
         times(summary.amdahl_bound) if summary.dense_part != "replicas" else MISSING,
         "conv, comm = 0" if summary.dense_part != "replicas" else "dense part on every slice"),
    ]
    what_if = summary.what_if
    if what_if is not None:
        rows += [(f"what if: + a participant like {what_if.extra_device or '?'}",
                  f"{ms(what_if.extra_device_step_s)} ms", times(what_if.extra_device_speedup)),
                 ("what if: network twice as fast", f"{ms(what_if.fast_network_step_s)} ms",
                  times(what_if.fast_network_speedup))]
    rows += [("final test accuracy", pct(summary.final_test_accuracy),
              MISSING if summary.images_per_s is None else f"{summary.images_per_s:.0f} images/s")]
    return Table("Overview", ("figure", "value", "detail"), tuple(rows), left_columns=1,
                 text_columns=(0, 2), wrap=True)


def devices_table(summary: RunSummary) -> Table:
    rows = tuple((d.id, d.kind, f"{d.name} ({d.blas})" if d.blas else d.name, ms(d.compute_s),
                  ms(d.wait_s), kib(d.bytes_sent),
                  kib(d.bytes_received), kib(d.peer_bytes)) for d in summary.devices)
    return Table("Participants (medians per step; KiB over its link to the master and "
                 "to its peers)",
                 ("participant", "kind", "name", "compute\nms", "waited on\nms",
                  "from master\nKiB", "to master\nKiB", "with peers\nKiB"), rows,
                 text_columns=(0, 1, 2), wrap=True)


def layers_table(summary: RunSummary) -> Table:
    """Per layer and participant its share, calibration and measured speed. Under the
    sample split the calibration timed the whole chain (its relative speed only: no
    per-layer time, and samples/s do not compare with a kernel calibration's)."""
    samples = summary.split_by == "samples"
    rows = []
    for participant in summary.devices:
        for row in participant.layers:
            calibration = (() if samples else (ms(row.calibration_s),))
            versus = () if samples else (num(row.speed_vs_calibration),)
            rows.append((str(row.layer + 1), participant.id, str(row.kernels),
                         pct(row.kernel_share), *calibration, num(row.calibrated_speed),
                         ms(row.compute_s), pct(row.throughput_share), *versus))
    rows.sort(key=lambda r: int(r[0]))
    unit = "samples" if samples else "kernels"
    headers = ("layer", "participant", unit, f"{unit[:-1]}\nshare",
               *(() if samples else ("calib.\nms",)),
               "calib. speed\n(whole chain)" if samples else "calib.\nspeed", "compute\nms",
               "throughput\nshare", *(() if samples else ("measured\n/ calib.",)))
    return Table(f"{unit.capitalize()} per layer and participant", headers, tuple(rows),
                 left_columns=2)


def balance_table(summary: RunSummary) -> Table:
    rows = tuple((str(row.layer + 1), str(row.kernels), ms(row.ideal_s), ms(row.slowest_s),
                  pct(row.efficiency), times(row.imbalance)) for row in summary.layers)
    unit = "samples" if summary.split_by == "samples" else "kernels"
    return Table("Balance per layer (forward + backward, medians)",
                 ("layer", unit, "ideal\nms", "slowest\nms", "efficiency", "imbalance"), rows)


def epochs_table(summary: RunSummary) -> Table:
    rows = tuple((str(e.epoch + 1), num(e.train_loss, 4), pct(e.train_accuracy),
                  num(e.test_loss, 4), pct(e.test_accuracy), num(e.epoch_s, 1),
                  num(e.images_per_s, 0)) for e in summary.epochs)
    return Table("Epochs", ("epoch", "train\nloss", "train\naccuracy", "test\nloss",
                            "test\naccuracy", "time\ns", "images/s"), rows)


def notes(summary: RunSummary) -> list[str]:
    """Short remarks that qualify the figures."""
    out = []
    if summary.what_if is not None:
        out += [f"what-if: {note}" for note in summary.what_if.notes]
    if summary.speedup is None and summary.split is not None:
        out.append("speedup: no participant computed kernels in every layer; nothing to compare to")
    return out


def _since(resilience: Resilience, time: float) -> str:
    start = resilience.start_time
    return MISSING if start is None else f"{time - start:.1f}"


def _event_detail(event_kind: str, reason: str, split: str, failed: int | None,
                  resumed: int | None) -> str:
    if event_kind == "recovery" and failed is not None:
        head = f"step {failed} failed; restored the snapshot of step {resumed}, replaying " \
               f"{failed - (resumed or 0)} step(s): {reason}"
        return head
    return f"{reason}; now {split}" if split else reason


def events_table(summary: RunSummary) -> Table:
    """Membership and re-plans, one row per event in time order (times in seconds since
    the run's first record; the step is where it shows on the per-step plots)."""
    resilience = summary.resilience
    events = resilience.events if resilience is not None else ()
    rows = tuple((_since(resilience, e.time) if resilience else MISSING,
                  MISSING if e.step is None else str(e.step), e.kind, e.participant or MISSING,
                  num(e.seconds), _event_detail(e.kind, e.reason, e.split, e.failed_step,
                                                e.resumed_step))
                 for e in events)
    return Table("Membership and re-plans (joins, losses, recoveries, re-plans, re-splits, "
                 "resumes)", ("at\ns", "step", "event", "participant", "took\ns", "detail"),
                 rows, text_columns=(2, 3, 5), wrap=True)


def resilience_table(summary: RunSummary) -> Table:
    """The fault-free cost of resilience (the snapshots) and what faults cost."""
    resilience = summary.resilience
    rows: list[tuple[str, str, str]] = []
    if resilience is not None:
        cost = resilience.snapshots
        every = summary.checkpoint_every
        when = ("at the start and epoch ends" if every == 0 else
                f"every {every} steps, at the start and epoch ends" if every else
                "at the start, every --checkpoint-every steps, epoch ends")
        if cost is not None:
            rows += [("snapshots taken", str(cost.count), when),
                     ("snapshot time, all", f"{num(cost.total_s, 2)} s",
                      f"median {ms(cost.median_s)} ms each"),
                     ("snapshot time per step trained", f"{ms(cost.per_step_s)} ms",
                      f"{pct(cost.step_fraction)} of the median step"),
                     ("shard state pulled per step", f"{kib(cost.per_step_state_bytes)} KiB",
                      f"{mib(cost.state_bytes)} MiB in all"),
                     ("checkpoint file written per step", f"{kib(cost.per_step_file_bytes)} KiB",
                      f"{mib(cost.file_bytes)} MiB in all")]
        else:
            rows.append(("snapshots taken", MISSING, "no checkpoint records in this run"))
        rows += [("recoveries", str(resilience.recoveries),
                  f"{num(resilience.recovery_s, 2)} s restoring in all"),
                 ("replayed steps", str(resilience.replayed_steps),
                  "step records replaced by a later record of the same step"),
                 ("membership events", str(len(resilience.events)),
                  "joins, losses, recoveries, re-plans, re-splits, resumes")]
    return Table("Resilience: what the snapshots cost without faults, and what faults cost",
                 ("figure", "value", "detail"), tuple(rows), left_columns=1)


def resilience_tables(summary: RunSummary) -> list[Table]:
    """The "Membership and re-plans" section: the events, then the costs."""
    return [events_table(summary), resilience_table(summary)]


def run_tables(summary: RunSummary) -> list[Table]:
    return [overview_table(summary), devices_table(summary), layers_table(summary),
            balance_table(summary), epochs_table(summary)]


def display_names(summaries: Sequence[RunSummary]) -> list[str]:
    """Run directory names, or whole paths where two runs share a name."""
    names = [s.name for s in summaries]
    return [s.run_dir if names.count(s.name) > 1 else s.name for s in summaries]


def comparison_table(summaries: Sequence[RunSummary]) -> Table:
    """The main figures of several runs side by side, one column per run."""
    def split_cell(summary: RunSummary, part: str) -> str:
        split = summary.split
        if split is None:
            return MISSING
        return f"{ms(getattr(split, part + '_s'))} ({pct(getattr(split, part + '_fraction'))})"

    figures: list[tuple[str, list[str]]] = [
        ("mode", [s.mode for s in summaries]),
        ("status", [s.status for s in summaries]),
        ("participants", [str(sum(1 for d in s.devices if any(r.kernels for r in d.layers)))
                     for s in summaries]),
        ("steps used", [str(s.steps_used) for s in summaries]),
        ("step time ms", [ms(s.split.step_s if s.split else None) for s in summaries]),
        ("comm ms", [split_cell(s, "comm") for s in summaries]),
        ("conv ms", [split_cell(s, "conv") for s in summaries]),
        ("dense ms", [split_cell(s, "dense") for s in summaries]),
        ("balance efficiency", [pct(s.balance_efficiency) for s in summaries]),
        ("imbalance", [times(s.imbalance) for s in summaries]),
        ("speedup vs fastest participant", [times(s.speedup) for s in summaries]),
        ("Amdahl bound", [times(s.amdahl_bound) for s in summaries]),
        ("final test accuracy", [pct(s.final_test_accuracy) for s in summaries]),
    ]
    return Table("Comparison", ("figure", *display_names(summaries)),
                 tuple((label, *values) for label, values in figures))


def _step_model_row(model: StepModelCheck) -> tuple[str, str, str]:
    """The sample split's step model calibrated in place: its prediction, and what the
    next steps measured (its terms in ms)."""
    error = (model.predicted_s - model.measured_s) / model.measured_s
    again = "" if model.attempt <= 1 else f" (check {model.attempt}: fitted again)"
    return ("step model: compute + rounds x round + serial", f"{ms(model.predicted_s)} ms",
            f"measured {ms(model.measured_s)} ms ({error:+.0%}){again}; "
            f"{ms(model.compute_s)} + {model.rounds} x {ms(model.round_s)} + "
            f"{ms(model.serial_s)}")
