"""Under the defaults, set-up measures the master alone and trains alone from the start
where it is no slower than the plan with workers (issue 50, master/alone_first.py): on this
one machine, whose two workers share its cores, that is what a user gets. Real daemons, a
real ``hetconv train``, then ``hetconv report`` and ``hetconv plan`` on the run."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SMALL_RUN, run_hetconv

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(180)
def test_a_master_no_slower_alone_trains_alone_from_set_up(endpoint: str, workers: Any,
                                                           tmp_path: Path) -> None:
    pool = workers("w1", "w2")
    run_dir = tmp_path / "run"
    result = run_hetconv("train", "--listen", endpoint, "--min-workers", "2", "--wait", "30",
                         *SMALL_RUN, "--limit", "1280", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "hetconv: the master alone measured at " in out, out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    probe = next(r for r in records if r["type"] == "alone_probe")
    assert probe["alone_measured_conv_s"] > 0 and probe["predicted_conv_s"] > 0
    plan = [r for r in records if r["type"] == "plan"]
    rehearsals = [r for r in records if r["type"] == "rehearsal"]
    # alone where the calibration's (optimistic) prediction already loses to the master
    # alone; else the plan is rehearsed and its fitted prediction decides
    assert probe["alone_no_slower"] or len(rehearsals) == 1, records
    if rehearsals:
        assert re.search(r"hetconv: rehearsed the plan \(\d+ steps at learning rate 0", out), out
        assert rehearsals[0]["alone_measured_step_s"] == probe["alone_measured_step_s"]
    if probe["alone_no_slower"] or rehearsals[0]["alone_no_slower"]:  # what this machine gives
        assert "the master trains alone: measured no slower than the plan with workers" in out
        assert plan[-1]["alone"] is True and plan[-1]["chosen"] == ["master"]
        assert records[-1]["type"] == "run_end" and records[-1]["status"] == "completed"
        assert all(w.process.poll() is None for w in pool), "the workers stay up"
        planned = run_hetconv("plan", str(run_dir))
        assert planned.returncode != 0
        assert planned.stderr.strip().endswith("--fall-back off keeps the workers"), \
            planned.stderr
    else:
        assert "the plan with workers predicted from calibration at" in out and not any(
            r.get("alone") for r in plan)
    report = run_hetconv("report", str(run_dir))
    assert report.returncode == 0, report.stderr
