"""Set-up's prediction against the run's first steps (issue 50), for ``hetconv bench scale``.

Per run, from its ``metrics.jsonl`` (seconds):

- ``setup_s``: what set-up predicted before any step: the ``rehearsal`` record's
  ``predicted_step_s`` (the whole step, master/samples/rehearsal.py) where set-up
  rehearsed the plan; otherwise the first ``plan`` record's ``predicted_step_s`` (the
  conv part and its transfers) plus the run's measured dense part;
- ``first_steps_s``: the median step of the in-place model's first fitted window (steps
  ``MODEL_SKIP`` .. ``MODEL_SKIP + MODEL_WINDOW`` - 1, master/samples/step_model.py), the
  steps set-up's prediction is judged on;
- ``fitted_s``: the step model's first prediction fitted on those steps (its first
  ``model`` record), None where the run has none (split by kernels, or alone);
- ``alone_s``: the master alone measured at set-up (the ``alone_probe`` record,
  master/alone_first.py), None where it was not measured;
- ``plan_s``, ``plan_measured_s``: ``hetconv plan RUN_DIR``'s estimate for the run's own
  configuration and the run's median step it prints beside it (:func:`plan_estimate`,
  which reads the run directory).

Pure but for :func:`plan_estimate`: records in, figures and table lines out
(``tests/unit/test_scale_setup.py``).
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetconv.errors import UserError
from hetconv.master.samples.step_model import MODEL_SKIP, MODEL_WINDOW


@dataclass(frozen=True)
class SetupFigures:
    """One run's set-up prediction and what its first steps measured (module doc)."""

    setup_s: float | None
    first_steps_s: float | None
    fitted_s: float | None
    alone_s: float | None
    plan_s: float | None = None  # ``hetconv plan``'s estimate of the run's configuration
    plan_measured_s: float | None = None  # the run's median step as ``hetconv plan`` reads it

    @property
    def plan_ratio(self) -> float | None:
        """The run's median step over ``hetconv plan``'s estimate of it (issue 50: within
        10 %)."""
        if not self.plan_s or self.plan_measured_s is None:
            return None
        return self.plan_measured_s / self.plan_s

    @property
    def setup_error(self) -> float | None:
        """(set-up − first steps) / first steps: negative where set-up was optimistic."""
        if self.setup_s is None or not self.first_steps_s:
            return None
        return (self.setup_s - self.first_steps_s) / self.first_steps_s


def setup_figures(records: Sequence[dict[str, Any]], run_dir: Path | None = None
                  ) -> SetupFigures:
    """The figures of one run's records (module doc)."""
    steps = [r for r in records if r.get("type") == "step"]
    window = [float(r["step_s"]) for r in steps[MODEL_SKIP:MODEL_SKIP + MODEL_WINDOW]]
    first_steps = statistics.median(window) if window else None
    plans = [r for r in records if r.get("type") == "plan"]
    rehearsals = [r for r in records if r.get("type") == "rehearsal"]
    setup = None
    if rehearsals and rehearsals[0].get("alone_no_slower"):
        # the rehearsal sent the run to the master alone: set-up's figure for the run it
        # then ran is the master alone measured there
        setup = float(rehearsals[0]["alone_measured_step_s"])
    elif rehearsals:
        setup = float(rehearsals[0]["predicted_step_s"])
    elif plans and plans[0].get("predicted_step_s") is not None:
        dense = [float(r.get("dense_s", 0.0)) for r in steps[MODEL_SKIP:]] or [0.0]
        setup = float(plans[0]["predicted_step_s"]) + statistics.median(dense)
    models = [r for r in records if r.get("type") == "model"]
    fitted = float(models[0]["predicted_step_s"]) if models else None
    probes = [r for r in records if r.get("type") == "alone_probe"]
    alone = float(probes[-1]["alone_measured_step_s"]) if probes else None
    plan = None if run_dir is None else plan_estimate(run_dir)
    return SetupFigures(setup, first_steps, fitted, alone, *(plan or (None, None)))


def plan_estimate(run_dir: Path) -> tuple[float, float] | None:
    """``hetconv plan``'s estimate for the run's own configuration and the run's median
    step as it reads it (seconds), as ``hetconv plan RUN_DIR`` prints them; None where
    it gives none (no measured links, a run split by kernels or alone)."""
    from hetconv.analysis.report.records import parse_run
    from hetconv.analysis.whatif import measured_run, measured_scenario, read_plan_links
    from hetconv.analysis.whatif_samples import (
        predict_sample_scenarios,
        read_sample_plan,
        read_step_model,
    )

    try:
        per_sample = read_sample_plan(run_dir)
        run = measured_run(parse_run(str(run_dir)), read_plan_links(run_dir))
        if per_sample is None or not run.links_measured or run.measured_step_s is None:
            return None
        (prediction,) = predict_sample_scenarios(run, per_sample, [measured_scenario(run)],
                                                 read_step_model(run_dir))
    except (UserError, ValueError, OSError):
        return None
    return prediction.step_s, run.measured_step_s


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def merge_setup_repeats(runs: Sequence[SetupFigures]) -> dict[str, float | None]:
    """Medians over a configuration's repeats (a figure no repeat has is None)."""
    return {"setup_s": _median([r.setup_s for r in runs]),
            "first_steps_s": _median([r.first_steps_s for r in runs]),
            "setup_error": _median([r.setup_error for r in runs]),
            "fitted_s": _median([r.fitted_s for r in runs]),
            "alone_s": _median([r.alone_s for r in runs]),
            "plan_s": _median([r.plan_s for r in runs]),
            "plan_ratio": _median([r.plan_ratio for r in runs])}


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def format_setup_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The table: set-up's prediction, the first steps, its error, the model fitted on
    them, the run's measured step and the master alone measured at set-up."""
    lines = ["", "Set-up's prediction (before any step: the step model fitted on the "
             "first plan's rehearsal, 7-20 steps at learning rate 0 "
             "(master/samples/rehearsal.py), or the master alone measured at set-up where "
             "that sent the run to it; where set-up did not rehearse, the first plan's conv "
             "part and transfers plus the measured dense part) against the median of the first "
             f"fitted steps ({MODEL_SKIP}..{MODEL_SKIP + MODEL_WINDOW - 1}), the step model "
             "fitted on them, the run's measured step, and the master alone measured at "
             "set-up (medians over the repeats; issue 50's target: set-up within 10 % of "
             "the first steps).", "",
             "| machines (core each) | set-up ms | first steps ms | set-up error | "
             "fitted model ms | step ms | master alone at set-up ms | one machine ms | "
             "hetconv plan ms | run's median / plan |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        figures = row.get("setup") or {}
        error = figures.get("setup_error")
        lines.append(
            f"| {row['machines']} | {_ms(figures.get('setup_s'))} | "
            f"{_ms(figures.get('first_steps_s'))} | "
            f"{'-' if error is None else f'{error:+.0%}'} | {_ms(figures.get('fitted_s'))} | "
            f"{_ms(row['step_s'])} | {_ms(figures.get('alone_s'))} | "
            f"{_ms(row['baseline_step_s'])} | {_ms(figures.get('plan_s'))} | "
            f"{_ratio(figures.get('plan_ratio'))} |")
    return lines
