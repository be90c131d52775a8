"""``hetconv plan`` on a real distributed run: the table, the measured step beside the
estimate, the files it writes, the report's plot, and one-line errors for bad input."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from hetconv.analysis.whatif_samples import measured_step, read_step_model
from tests.conftest import SMALL_RUN, run_hetconv

pytestmark = [pytest.mark.integration]


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def finished_run(tmp_path_factory: pytest.TempPathFactory, name: str, *flags: str) -> Path:
    """The run directory of a finished run of the master and two workers with ``flags``."""
    from hetconv.lab import LocalWorkers, free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    base = tmp_path_factory.mktemp(name)
    run_dir = base / "run"
    with LocalWorkers(endpoint, [{"name": "w1"}, {"name": "w2"}], log_dir=base):
        # --fall-back off: on one machine the master alone measures faster and would
        # train alone from set-up, with no distributed profile to predict from
        result = run_hetconv("train", "--listen", endpoint, *flags, "--min-workers", "2",
                             "--wait", "30", *SMALL_RUN, "--limit", "1280",
                             "--fall-back", "off", "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    return run_dir


@pytest.fixture(scope="module")
def distributed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run with the link-aware planner, split by kernels."""
    return finished_run(tmp_path_factory, "plan", "--split-by", "kernels", "--split", "model")


@pytest.mark.timeout(240)
def test_the_table_and_the_measured_step(distributed_run: Path, tmp_path: Path) -> None:
    records = metrics(distributed_run)
    participants = next(r for r in records if r["type"] == "calibration")["participants"]
    steps = [r["step_s"] for r in records if r["type"] == "step"][1:]
    markdown, data = tmp_path / "plan.md", tmp_path / "plan.json"
    result = run_hetconv("plan", str(distributed_run), "--machines", "1,2,4,128",
                         "--rate", "measured,100mbit", "--markdown", str(markdown),
                         "--json", str(data))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "Model estimates" in text and "est. step ms" in text
    rows = [line.split() for line in text.splitlines()
            if line.split()[:1] and line.split()[0].isdigit()]
    assert [(row[0], row[1]) for row in rows] == [
        (n, rate) for rate in ("measured", "100mbit") for n in ("1", "2", "4", "128")]
    assert all(row[2] == "64" and row[3] == "4:8" for row in rows)
    assert all(float(row[5]) > 0 and 1 <= int(row[7]) <= int(row[0]) for row in rows)
    assert f"Measured configuration ({len(participants)} participants" in text
    assert f"measured median  {statistics.median(steps) * 1e3:.1f} ms per step" in text

    document = json.loads(data.read_text())
    assert len(document["rows"]) == 8
    assert document["rows"][3]["machines"] == 128
    measured = document["measured_configuration"]
    assert measured["machines"] == len(participants)
    assert measured["measured_step_s"] == pytest.approx(statistics.median(steps))
    table = markdown.read_text()
    assert "- command: `hetconv plan " in table and table.count("\n| ") == 9

    other = run_hetconv("plan", str(distributed_run), "--machines", "8", "--rate", "1gbit",
                        "--batch", "128", "--arch", "8:16", "--like", "w1")
    assert other.returncode == 0, other.stderr
    assert any(line.split()[:4] == ["8", "1gbit", "128", "8:16"]
               for line in other.stdout.splitlines())


@pytest.mark.timeout(240)
def test_the_report_plots_the_predicted_scaling(distributed_run: Path) -> None:
    result = run_hetconv("report", str(distributed_run))
    assert result.returncode == 0, result.stderr
    page = (distributed_run / "report.html").read_text(encoding="utf-8")
    section = page.split("Predicted scaling (model estimate)", 1)[1].split("<h2>", 1)[0]
    assert '<img src="data:image/png;base64,' in section


def local_run(directory: Path) -> Path:
    directory.mkdir()
    config = {"mode": "local", "arch": [4, 8], "batch": 64, "input_shape": [1, 28, 28]}
    (directory / "metrics.jsonl").write_text(json.dumps({"type": "run_start",
                                                         "config": config}) + "\n")
    return directory


@pytest.mark.timeout(240)
@pytest.mark.parametrize("arguments,message", [
    (["{missing}"], "no such run directory"),
    (["{empty}"], "no metrics.jsonl here"),
    (["{local}"], "no calibration records"),
    (["{run}", "--rate", "fast"], "--rate 'fast': expected a number"),
    (["{run}", "--machines", "0"], "--machines 0: give 1 to 128"),
    (["{run}", "--machines", "1,129"], "--machines 129: give 1 to 128"),
    (["{run}", "--machines", "two"], "--machines 'two': not a whole number"),
    (["{run}", "--arch", "32:x"], "--arch '32:x'"),
    (["{run}", "--batch", "0"], "--batch '0'"),
    (["{run}", "--like", "nobody"], "--like nobody: no such participant"),
], ids=["missing", "empty", "local", "rate", "zero", "too-many", "not-a-number", "arch",
        "batch", "like"])
def test_bad_input_is_one_line(distributed_run: Path, tmp_path: Path, arguments: list[str],
                               message: str) -> None:
    (tmp_path / "empty").mkdir()
    paths = {"missing": tmp_path / "missing", "empty": tmp_path / "empty",
             "local": local_run(tmp_path / "local"), "run": distributed_run}
    result = run_hetconv("plan", *(a.format(**paths) for a in arguments))
    assert result.returncode == 2, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hetconv: error: "), result.stderr
    assert message in lines[0], lines[0]
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run split by samples."""
    return finished_run(tmp_path_factory, "plan-samples", "--split-by", "samples")


@pytest.mark.timeout(240)
def test_a_run_split_by_samples_is_modelled_as_the_sample_split(sample_run: Path,
                                                                tmp_path: Path) -> None:
    records = metrics(sample_run)
    plan = [r for r in records if r["type"] == "plan"][-1]
    assert plan["split_by"] == "samples" and len(plan["links"]) == 2
    dense = statistics.median([r["dense_s"] for r in records if r["type"] == "step"][1:])
    data = tmp_path / "plan.json"
    result = run_hetconv("plan", str(sample_run), "--machines", "1,3,8", "--rate",
                         "measured,1gbit", "--json", str(data))
    assert result.returncode == 0, result.stderr
    assert "split by samples" in result.stdout and "sample split" in result.stdout
    document = json.loads(data.read_text())
    assert document["split_by"] == "samples" and len(document["rows"]) == 6
    # the step model calibrated in place, as the run checked it (its `model` record)
    models = [r for r in records if r["type"] == "model"]
    if models:  # fitted after 10 steps, checked on 9 more: a run long enough has one
        assert document["step_model"]["predicted_s"] == pytest.approx(
            models[-1]["predicted_step_s"])  # the last one (a re-plan fits again)
        assert "in-place model" in result.stdout, result.stdout
    else:
        assert document["step_model"] is None
    # the measured configuration: the run's step model (fitted in place, or at set-up on
    # the plan's rehearsal in a run too short for that) at the slices by speed: one model
    fits = models or [r for r in records if r["type"] == "rehearsal"]
    assert fits, "set-up rehearses the plan under --split model"
    fitted = read_step_model(sample_run)  # every fit of the run pooled (whatif_samples.py)
    rehearsals = [r for r in records if r["type"] == "rehearsal"]
    assert fitted is not None and fitted.windows == len(models) + len(rehearsals), fitted
    assert fitted.describe() in document["estimate"], document["estimate"]
    # at the run's own slices (each step's, the first and the master alone's left out)
    steps = [r for r in records if r["type"] == "step"][1:]
    own = [{d["participant"]: d["samples"] for d in s["layers"][0]["participants"]
            if d["samples"] > 0} for s in steps]
    assert [dict(s) for s in fitted.run_slices] == [s for s in own if len(s) > 1]
    measured = document["measured_configuration"]
    assert measured["predicted_step_s"] == pytest.approx(
        measured_step(fitted.terms, fitted.run_slices), rel=1e-6)
    # not the calibration model's figure (its conv part and transfers plus the dense part)
    assert measured["predicted_step_s"] != pytest.approx(plan["predicted_step_s"] + dense,
                                                         rel=1e-6)
    assert 0.5 < measured["measured_step_s"] / measured["predicted_step_s"] < 2.0, measured
    assert all(row["predicted_step_s"] > 0 and 1 <= row["chosen"] <= row["machines"]
               for row in document["rows"])
    report = run_hetconv("report", str(sample_run))
    assert report.returncode == 0, report.stderr
    assert "whole batch's" in report.stdout  # the default batch-norm statistics
    assert "Predicted scaling (model estimate)" in (sample_run / "report.html").read_text(
        encoding="utf-8")
