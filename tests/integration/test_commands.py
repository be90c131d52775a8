"""The user-facing commands other tests do not cover: calibrate, bench split and bench accuracy."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from hetconv.lab import cpu_quota_unavailable_reason
from tests.conftest import epoch_records, run_hetconv

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(90)
def test_calibrate_prints_every_split_and_leaves_workers_up(endpoint: str, workers: Any) -> None:
    (worker,) = workers("solo")
    result = run_hetconv("calibrate", "--listen", endpoint, "--min-workers", "1", "--wait", "30",
                         "--arch", "4:8", "--batch", "16", "--threads", "1", timeout=80)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "kernel split for --arch 4:8, batch 16, input 1x28x28" in out
    for mode in ("model", "calibrated", "equal"):
        rows = re.findall(rf"^\s*{mode}\s+(\d+)\s+(\d+)\s+[\d.]+$", out, re.MULTILINE)
        assert [sum(map(int, row)) for row in rows] == [4, 8], (mode, out)
    assert worker.process.poll() is None  # still serving, ready for the next run


@pytest.mark.lab
@pytest.mark.timeout(300)
@pytest.mark.skipif(cpu_quota_unavailable_reason() is not None,
                    reason=f"cgroup CPU quotas unavailable: {cpu_quota_unavailable_reason()}")
def test_bench_split_prints_the_comparison(tmp_path: Path) -> None:
    result = run_hetconv("bench", "split", "--arch", "4:16", "--batch", "32", "--limit", "96",
                         "--work-dir", str(tmp_path), timeout=280)
    assert result.returncode == 0, result.stderr
    for label in ("(a) fast worker alone", "(b) equal split", "(c) calibrated (eq. 1)",
                  "(d) cost-model split", "ideal conv phase for the combined speed"):
        assert label in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "calibrated-0", "equal-0", "model-0", "one-0"]


@pytest.mark.timeout(120)
def test_bench_accuracy_trains_each_seed_and_checks_the_target(tmp_path: Path) -> None:
    figures = tmp_path / "accuracy.md"
    result = run_hetconv("bench", "accuracy", "--seeds", "4,5", "--data", "synthetic",
                         "--limit", "256", "--test-limit", "128", "--arch", "4:8",
                         "--epochs", "2", "--batch", "64", "--workers", "2",
                         "--train-flags=--wire-dtype float32", "--target", "0",
                         "--work-dir", str(tmp_path / "runs"), "--markdown", str(figures),
                         timeout=110)
    assert result.returncode == 0, result.stderr
    assert "every seed reached the target of 0.00% test accuracy" in result.stdout
    text = figures.read_text()
    assert "'--train-flags=--wire-dtype float32'" in text  # the command line re-runs as is
    rows = re.findall(r"^\| (\d) \| ([\d.]+) \| ([\d. /]+) \|", text, re.MULTILINE)
    assert [row[0] for row in rows] == ["4", "5"]
    for seed, final, per_epoch in rows:  # the table holds what each run recorded
        run_dir = tmp_path / "runs" / f"seed-{seed}"
        accuracies = [100 * r["test_accuracy"] for r in epoch_records(run_dir)]
        assert len(accuracies) == 2
        assert float(final) == pytest.approx(accuracies[-1], abs=0.006)
        assert [float(a) for a in per_epoch.split(" / ")] == pytest.approx(accuracies, abs=0.006)
    # an unreachable target fails the command with one line, after the table
    missed = run_hetconv("bench", "accuracy", "--seeds", "4", "--data", "synthetic",
                         "--limit", "128", "--test-limit", "64", "--arch", "4:8", "--epochs", "1",
                         "--batch", "64", "--workers", "1", "--target", "100.0",
                         "--work-dir", str(tmp_path / "missed"), timeout=110)
    assert missed.returncode == 2
    assert "NOT every seed reached" in missed.stdout
    assert missed.stderr.strip().splitlines()[-1].startswith("hetconv: error: not every seed")
