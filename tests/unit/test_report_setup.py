"""The report's set-up prediction (issue 50): the rehearsed plan's step model where set-up
rehearsed it, else the planner's plus the measured dense part."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from hetconv.analysis.report.analysis import summarize
from hetconv.analysis.report.records import parse_run
from hetconv.analysis.report.render_text import render_run
from tests.unit.test_report import sample_split_records, write_run


def test_set_ups_prediction_is_the_rehearsed_plans_where_set_up_rehearsed_it(
        tmp_path: Path) -> None:
    """Issue 50: set-up's prediction beside the measured step is the rehearsal's whole
    step (no dense part added); without a rehearsal, the planner's plus the dense part."""
    plain = summarize(parse_run(write_run(tmp_path / "plain", sample_split_records())))
    assert plain.predicted_by == "planner" and plain.split is not None
    assert plain.predicted_step_s == pytest.approx(0.08 + plain.split.dense_s)
    assert re.search(r"set-up's predicted step\s+81\.0 ms\s+measured / predicted 1\.05\s+"
                     r"\(planner\)", render_run(plain))
    records = sample_split_records()
    records.insert(5, {"type": "rehearsal", "time": 999.6, "predicted_step_s": 0.0842,
                       "steps": 6})
    rehearsed = summarize(parse_run(write_run(tmp_path / "rehearsed", records)))
    assert rehearsed.predicted_by == "rehearsal"
    assert rehearsed.predicted_step_s == pytest.approx(0.0842)
    text = render_run(rehearsed)
    assert re.search(r"set-up's predicted step\s+84\.2 ms\s+measured / predicted 1\.01\s+"
                     r"\(rehearsed\)", text), text
