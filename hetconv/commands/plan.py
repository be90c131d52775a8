"""``hetconv plan RUN_DIR``: the performance model as a what-if tool.

From a run directory's measured profiles (the calibration fits and the probed links
of a ``hetconv train --listen`` run), print the model's estimated step time and
speedup for other machine counts (up to 128), link rates, batch sizes and networks
(:mod:`hetconv.analysis.whatif`), and beside the estimate for the measured
configuration the run's measured median step. A run split by samples is estimated
from its step model fitted in place where it has a usable one (its last ``model``
record), else from the sample split's calibration model
(:mod:`hetconv.analysis.whatif_samples`): one model for every row, named in the note
above the table, on the measured configuration's estimate line and in the JSON's
``estimate``. ``--markdown FILE`` and ``--json FILE`` also write the table. Every bad
input is a one-line :class:`UserError`.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from hetconv.analysis.report.records import StepModelCheck, parse_run
from hetconv.analysis.whatif import (
    DEFAULT_MACHINES,
    MAX_MACHINES,
    MEASURED_LINK,
    MeasuredRun,
    Prediction,
    Scenario,
    measured_run,
    measured_scenario,
    predict_scenarios,
    read_plan_links,
)
from hetconv.analysis.whatif_samples import (
    CALIBRATION_MODEL,
    FittedModel,
    fitted_terms,
    predict_sample_scenarios,
    read_sample_plan,
    read_step_model,
)
from hetconv.commands.options import check_output_path
from hetconv.engine.checkpoint import save_text
from hetconv.errors import UserError
from hetconv.lab.network import parse_rate_bits
from hetconv.model import parse_arch

HEADERS = ("machines", "link", "batch", "arch", "est. step ms", "est. speedup",
           "share of ideal", "used", "master link MB/step")
SAMPLE_NOTE = ("Model estimates of the sample split from its calibration model "
               "(predict_sample_step: the slowest slice's calibrated compute, the master's "
               "link, the rounds and the reduction among the peers, plus the measured dense "
               "part), not measurements: speedup is over the fastest single machine's "
               "compute; share of ideal is that speedup over the machines' summed speed; "
               "'used' is how many machines get samples.")
FITTED_NOTE = ("Model estimates of the sample split from {model} (master/samples/"
               "step_model.py){calibrated}. For other clusters the compute per sample scales "
               "with the conv chain's flop, a round's cost moves by the change in transfer "
               "time the link model predicts (the barriers' skew and the message handling "
               "per round stay as measured), and the serial part scales like the dense part. "
               "Not measurements: speedup is over the fastest single machine's estimate (its "
               "compute and the serial part); share of ideal is that speedup over the "
               "machines' summed speed; 'used' is how many machines get samples.")
NO_FIT = {"none": "The run has no usable step model fitted in place (no model record with "
                  "its terms: a run too short for the model's check, or one from an older "
                  "hetconv), so the calibration model estimates every row.",
          "links": "The run has no measured links, so its fitted round cost cannot be moved "
                   "to other links: the calibration model estimates every row."}
KERNEL_ESTIMATE = "performance model (hetconv.planning.perf_model via the planner)"
ESTIMATE_NOTE = ("Model estimates (hetconv.planning.perf_model through the planner), not measurements: "
                 "speedup is over the fastest single machine's estimate; share of ideal is "
                 "that speedup over the machines' summed compute speed; 'used' is how many "
                 "machines the planner gives kernels.")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="what if: the model's step time and speedup for other "
                       "machine counts, links, batches and networks, from a run's measurements")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of 'hetconv train --listen'")
    p.add_argument("--machines", default=",".join(map(str, DEFAULT_MACHINES)),
                   metavar="N1,N2,...", help=f"machine counts, 1 to {MAX_MACHINES} (default "
                   "%(default)s)")
    p.add_argument("--rate", default=MEASURED_LINK, metavar="R1,R2,...",
                   help="every worker link's rate (tc units: 100mbit, 1gbit, 10gbit) or "
                   "'measured' (default: the run's measured links)")
    p.add_argument("--batch", default=None, metavar="B1,B2,...",
                   help="batch sizes (default: the run's)")
    p.add_argument("--arch", default=None, metavar="A:B[,C:D]",
                   help="networks, as --arch of hetconv train (default: the run's)")
    p.add_argument("--like", default=None, metavar="PARTICIPANT",
                   help="N copies of this participant (the first one the master's own device) "
                   "instead of the run's participants repeated")
    p.add_argument("--markdown", metavar="FILE", default=None,
                   help="also write the table as markdown to FILE")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="also write the rows as JSON to FILE")


# --- flags ------------------------------------------------------------------------------------
def _items(flag: str, text: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise UserError(f"{flag} {text!r}: an empty item (expected a comma-separated list)")
    return items


def parse_machines(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; each 1 .. MAX_MACHINES."""
    counts = []
    for item in _items("--machines", text):
        try:
            count = int(item)
        except ValueError:
            raise UserError(f"--machines {item!r}: not a whole number") from None
        if not 1 <= count <= MAX_MACHINES:
            raise UserError(f"--machines {count}: give 1 to {MAX_MACHINES} machines")
        counts.append(count)
    return counts


def parse_rates(text: str) -> list[tuple[float | None, str]]:
    """``"100mbit,measured"`` -> [(1e8, "100mbit"), (None, "measured")] (bits per second)."""
    rates: list[tuple[float | None, str]] = []
    for item in _items("--rate", text):
        if item.lower() == MEASURED_LINK:
            rates.append((None, MEASURED_LINK))
            continue
        try:
            rates.append((parse_rate_bits(item), item))
        except ValueError:
            raise UserError(f"--rate {item!r}: expected a number with bit, kbit, mbit or gbit "
                            "(e.g. 1gbit), or 'measured'") from None
    return rates


def parse_batches(text: str) -> list[int]:
    batches = []
    for item in _items("--batch", text):
        if not item.isdigit() or int(item) < 1:
            raise UserError(f"--batch {item!r}: expected a positive whole number")
        batches.append(int(item))
    return batches


def scenarios(args: argparse.Namespace, run: MeasuredRun) -> list[Scenario]:
    """Every combination of the flags' values, machine count varying fastest."""
    machines = parse_machines(args.machines)
    rates = parse_rates(args.rate)
    batches = parse_batches(args.batch) if args.batch else [run.batch]
    archs = [parse_arch(item) for item in _items("--arch", args.arch)] if args.arch else [run.arch]
    if any(rate is None for rate, _ in rates) and not run.links_measured:
        raise UserError(f"{run.run_dir}: the run has no measured links (the link probe runs "
                        "with --split model); give --rate, e.g. --rate 1gbit")
    return [Scenario(n, rate, batch, arch, args.like, label)
            for arch in archs for batch in batches for rate, label in rates for n in machines]


# --- output -----------------------------------------------------------------------------------
def _arch(arch: Sequence[int]) -> str:
    return ":".join(map(str, arch))


def cells(prediction: Prediction) -> list[str]:
    s = prediction.scenario
    return [str(s.machines), s.rate_label, str(s.batch), _arch(s.arch),
            f"{prediction.step_s * 1e3:.1f}", f"{prediction.speedup:.2f}",
            f"{prediction.share_of_ideal:.2f}", str(prediction.chosen),
            f"{prediction.master_link_bytes / 1e6:.2f}"]


def text_table(predictions: Sequence[Prediction]) -> list[str]:
    rows = [list(HEADERS)] + [cells(p) for p in predictions]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADERS))]
    return ["  ".join(cell.ljust(w) if i < 4 else cell.rjust(w)
                      for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows]


def markdown_table(predictions: Sequence[Prediction]) -> list[str]:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    return lines + ["| " + " | ".join(cells(p)) + " |" for p in predictions]


def describe(run: MeasuredRun) -> str:
    names = ", ".join(p.participant for p in run.profiles)
    left_out = (f"; left out by the plan (their links, or a trial without them), not modelled: "
                f"{', '.join(run.left_out)}" if run.left_out else "")
    return (f"run {run.run_dir}: {len(run.profiles)} participants ({names}){left_out}, data "
            f"plane {run.data_plane}, batch {run.batch}, arch {_arch(run.arch)}")


@dataclass(frozen=True)
class EstimateModel:
    """The model behind the table: for a run split by samples its step model fitted in
    place where usable (``fitted``), else the calibration model; the note printed above
    the table and the JSON's ``estimate``."""

    fitted: FittedModel | None
    note: str
    estimate: str


def estimate_model(run_dir: str, run: MeasuredRun,
                   per_sample: dict[str, float] | None) -> EstimateModel:
    if per_sample is None:
        return EstimateModel(None, ESTIMATE_NOTE, KERNEL_ESTIMATE)
    fitted = read_step_model(run_dir)
    if fitted is None or not run.links_measured:
        why = NO_FIT["none" if fitted is None else "links"]
        return EstimateModel(None, f"{SAMPLE_NOTE} {why}", CALIBRATION_MODEL)
    calibrated = fitted.calibrated(run)
    extra = (f"; {', '.join(calibrated)} without a fitted figure: from the calibrated "
             "seconds per sample" if calibrated else "")
    return EstimateModel(fitted, FITTED_NOTE.format(model=fitted.describe(), calibrated=extra),
                         fitted.describe() + extra)


def estimate_detail(run: MeasuredRun, per_sample: dict[str, float] | None,
                    model: EstimateModel) -> str:
    """What the measured configuration's estimate is made of, after its figure."""
    if per_sample is None:
        return ""
    if model.fitted is None:
        return " (the calibration model)"
    cluster, terms = fitted_terms(run, per_sample, model.fitted, measured_scenario(run))
    slices = model.fitted.run_slices
    compute = (statistics.median(terms.compute_s(s) for s in slices) if slices
               else terms.compute_s(cluster.samples))
    where = (f"at the run's own slices, median over its {len(slices)} steps with workers"
             if slices else "at the slices by speed")
    return (f" = compute {compute * 1e3:.1f} + {terms.rounds} rounds "
            f"x {terms.round_s * 1e3:.1f} + serial {terms.serial_s * 1e3:.1f} ("
            f"{model.fitted.describe()}, {where})")


def measured_lines(run: MeasuredRun, prediction: Prediction | None,
                   in_place: StepModelCheck | None = None, detail: str = "") -> list[str]:
    """The estimate for the measured configuration (``detail``: what it is made of)
    beside the measured median step, and the sample split's step model calibrated in
    place (its ``model`` record), if any."""
    if prediction is None:
        lines = ["No estimate for the measured configuration: the run has no measured links."]
    else:
        lines = [f"Measured configuration ({len(run.profiles)} participants, measured links, "
                 f"batch {run.batch}, arch {_arch(run.arch)}):",
                 f"  model estimate   {prediction.step_s * 1e3:.1f} ms per step{detail}"]
        if run.measured_step_s is None:
            lines.append("  measured median  (no step recorded)")
        else:
            lines.append(f"  measured median  {run.measured_step_s * 1e3:.1f} ms per step "
                         f"(over {run.steps_used} steps, the first skipped; measured / "
                         f"estimate {run.measured_step_s / prediction.step_s:.2f})")
    if in_place is not None:
        error = in_place.predicted_s / in_place.measured_s - 1.0
        lines.append(f"  in-place model   {in_place.predicted_s * 1e3:.1f} ms per step = "
                     f"compute {in_place.compute_s * 1e3:.1f} + {in_place.rounds} rounds x "
                     f"{in_place.round_s * 1e3:.1f} + serial {in_place.serial_s * 1e3:.1f}, "
                     f"fitted on the run's first steps; measured "
                     f"{in_place.measured_s * 1e3:.1f} ms over the next "
                     f"{in_place.checked_steps} ({error:+.1%})")
    return lines


def command_line(args: argparse.Namespace) -> str:
    """The ``hetconv plan`` command that reproduces this table, every option spelled out."""
    words = ["hetconv", "plan", args.run_dir, "--machines", args.machines, "--rate", args.rate]
    for flag, value in (("--batch", args.batch), ("--arch", args.arch), ("--like", args.like),
                        ("--markdown", args.markdown)):
        if value is not None:
            words += [flag, value]
    return shlex.join(words)


def run_plan(args: argparse.Namespace, out: Callable[[str], None] = print) -> int:
    for flag, path in (("--markdown", args.markdown), ("--json", args.json)):
        if path:
            check_output_path(flag, path)
    records = parse_run(args.run_dir)
    run = measured_run(records, read_plan_links(args.run_dir))
    per_sample = read_sample_plan(args.run_dir)
    model = estimate_model(args.run_dir, run, per_sample)
    note = model.note

    def predict(wanted: list[Scenario]) -> list[Prediction]:
        if per_sample is None:
            return predict_scenarios(run, wanted)
        return predict_sample_scenarios(run, per_sample, wanted, model.fitted)

    predictions = predict(scenarios(args, run))
    measured = predict([measured_scenario(run)])[0] if run.links_measured else None
    detail = estimate_detail(run, per_sample, model) if measured is not None else ""
    out(describe(run) + ("" if per_sample is None else ", split by samples"))
    for line in textwrap.wrap(note, width=100):
        out(line)
    out("")
    for line in text_table(predictions):
        out(line)
    out("")
    for line in measured_lines(run, measured, records.step_model, detail):
        out(line)
    if args.markdown:
        now = datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")
        header = ["# `hetconv plan`: model estimates", "",
                  f"- command: `{command_line(args)}`", f"- date: {now}",
                  f"- {describe(run)}", "", note, ""]
        save_text(args.markdown, "\n".join(header + markdown_table(predictions) + [""]
                                           + measured_lines(run, measured,
                                                            records.step_model, detail))
                  + "\n")
        out(f"wrote {args.markdown}")
    if args.json:
        document = {"run_dir": run.run_dir, "data_plane": run.data_plane,
                    "participants": [p.participant for p in run.profiles],
                    "split_by": "kernels" if per_sample is None else "samples",
                    "estimate": model.estimate,
                    "rows": [p.record() for p in predictions],
                    "measured_configuration": None if measured is None else {
                        **measured.record(), "steps_used": run.steps_used},
                    "step_model": None if records.step_model is None
                    else asdict(records.step_model)}
        save_text(args.json, json.dumps(document, indent=2) + "\n")
        out(f"wrote {args.json}")
    return 0


def run(args: argparse.Namespace) -> int:
    return run_plan(args)
