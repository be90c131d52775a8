"""The user-facing commands other tests do not cover: calibrate and bench split."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from hetconv.lab import cpu_quota_unavailable_reason
from tests.conftest import run_hetconv

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
