"""Set-up's prediction against the first steps in ``hetconv bench scale`` (hetconv/bench/scale_setup.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from hetconv.bench.scale_setup import (
    SetupFigures,
    format_setup_table,
    merge_setup_repeats,
    setup_figures,
)
from hetconv.master.samples.step_model import MODEL_SKIP, MODEL_WINDOW


def records(first: float, later: float) -> list[dict[str, object]]:
    steps = [{"type": "step", "step": i, "step_s": 9.0 if i < MODEL_SKIP else
              (first if i < MODEL_SKIP + MODEL_WINDOW else later), "dense_s": 0.002}
             for i in range(40)]
    return [{"type": "alone_probe", "alone_measured_step_s": 0.130},
            {"type": "plan", "predicted_step_s": 0.038},
            *steps,
            {"type": "model", "predicted_step_s": 0.0617},
            {"type": "model", "predicted_step_s": 0.0599},
            {"type": "plan", "predicted_step_s": 0.5}]  # a re-plan: not set-up's


def test_set_up_is_judged_on_the_first_fitted_window() -> None:
    figures = setup_figures(records(0.060, 0.050))
    assert figures.first_steps_s == pytest.approx(0.060)  # the start-up step left out
    assert figures.setup_s == pytest.approx(0.040)  # the first plan, plus the dense part
    assert figures.setup_error == pytest.approx(-1 / 3)
    assert figures.fitted_s == pytest.approx(0.0617)  # the first fit
    assert figures.alone_s == pytest.approx(0.130)
    rehearsed = records(0.060, 0.050)
    rehearsed.insert(2, {"type": "rehearsal", "predicted_step_s": 0.057})
    assert setup_figures(rehearsed).setup_s == pytest.approx(0.057)  # the whole step, as is
    assert setup_figures(rehearsed).setup_error == pytest.approx(-0.05)
    # a rehearsal that sent the run to the master alone: the run is the master alone's,
    # and set-up's figure for it is the master alone measured there
    rehearsed[2] = {"type": "rehearsal", "predicted_step_s": 0.107, "alone_no_slower": True,
                    "alone_measured_step_s": 0.063}
    assert setup_figures(rehearsed).setup_s == pytest.approx(0.063)
    bare = setup_figures([{"type": "step", "step": 0, "step_s": 0.1}])
    assert bare == SetupFigures(None, None, None, None) and bare.setup_error is None


def test_repeats_merge_to_medians_and_the_table_says_each_figure() -> None:
    merged = merge_setup_repeats([setup_figures(records(0.060, 0.05)),
                                  setup_figures(records(0.050, 0.05)),
                                  SetupFigures(None, None, None, None, 0.050, 0.056)])
    assert merged["first_steps_s"] == pytest.approx(0.055)
    assert merged["plan_s"] == pytest.approx(0.050)
    assert merged["plan_ratio"] == pytest.approx(1.12)
    lines = format_setup_table([{"machines": "4x[0.45]", "step_s": 0.061,
                                 "baseline_step_s": 0.131, "setup": merged}])
    assert lines[-1] == ("| 4x[0.45] | 40.0 | 55.0 | -27% | 61.7 | 61.0 | 130.0 | 131.0 | "
                         "50.0 | 1.12 |")
    assert format_setup_table([{"machines": "m", "step_s": 0.1, "baseline_step_s": 0.1,
                                "setup": {}}])[-1] == ("| m | - | - | - | - | 100.0 | - | "
                                                       "100.0 | - | - |")


def test_a_run_directory_hetconv_plan_cannot_model_gives_no_plan_figure(tmp_path: Path) -> None:
    """A run split by kernels (or alone, or without measured links): no estimate, no
    error (the bench goes on)."""
    (tmp_path / "metrics.jsonl").write_text('{"type": "plan", "split_by": "kernels"}\n')
    figures = setup_figures(records(0.060, 0.05), tmp_path)
    assert figures.plan_s is None and figures.plan_ratio is None
