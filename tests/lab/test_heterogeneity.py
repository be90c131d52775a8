"""Unequal machines on one host: a worker under a cgroup v1 CPU quota."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hetconv.lab import cpu_quota_unavailable_reason
from tests.conftest import run_hetconv

pytestmark = [pytest.mark.lab, pytest.mark.integration, pytest.mark.serial]

QUOTA = 0.3  # the slow machine's speed relative to the fast one
FAST = 0.9  # the fast machine's quota: a ratio of quotas holds on a busy host too


@pytest.mark.timeout(240)
@pytest.mark.skipif(cpu_quota_unavailable_reason() is not None,
                    reason=f"cgroup CPU quotas unavailable: {cpu_quota_unavailable_reason()}")
@pytest.mark.parametrize("split_by", ["kernels", "samples"])
def test_calibrated_share_follows_the_cpu_quota(endpoint: str, workers: Any,
                                                tmp_path: Path, split_by: str) -> None:
    workers("fast", threads=1, cpu_fraction=FAST)
    workers("slow", threads=1, cpu_fraction=FAST * QUOTA)
    run_dir = tmp_path / "run"
    result = run_hetconv("train", "--listen", endpoint, "--min-workers", "2", "--wait", "30",
                         "--no-local", "--split", "calibrated", "--split-by", split_by,
                         "--data", "synthetic",
                         "--limit", "256",
                         "--test-limit", "128", "--arch", "16:128", "--epochs", "1",
                         "--batch", "64", "--threads", "1", "--no-progress",
                         "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    layer2 = [r for r in records if r["type"] == "calibration"][1]
    unit = "kernels" if split_by == "kernels" else "samples"  # what is shared out
    kernels = {d["participant"]: d[unit] for d in layer2["participants"]}
    whole = layer2["kernels"] if split_by == "kernels" else 64  # the batch
    # speeds 1 : QUOTA -> the slow worker's share is QUOTA / (1 + QUOTA) of the whole
    predicted = whole * QUOTA / (1 + QUOTA)
    # per-call costs, which a small quota stretches more than compute, put the slow
    # machine's measured speed ratio below the ratio of quotas (0.2-0.25 against 0.3 at
    # 0.27 core on this host, for both splits; 0.16 once in CI, split by samples: 9 of 64
    # samples): the quota is the looser check, one-sided below, the equation of what was
    # measured the exact one
    assert predicted * 0.5 <= kernels["slow"] <= predicted * 1.35, (kernels, predicted)
    assert kernels["slow"] < kernels["fast"], kernels
    assert kernels["fast"] + kernels["slow"] == whole
    if split_by == "kernels":  # exactly the paper's equation (1) of what was measured
        seconds = {d["participant"]: d["seconds"] for d in layer2["participants"]}
        share = (1 / seconds["slow"]) / (1 / seconds["slow"] + 1 / seconds["fast"])
        assert abs(kernels["slow"] - whole * share) <= 1.0, (kernels, seconds)
    if split_by == "samples":  # exactly the paper's equation (1) of what was measured
        # in place: every layer whole on a slice of the batch (master/calibration.py)
        times = [r for r in records if r["type"] == "plan"][-1]["seconds_per_sample"]
        share = (1 / times["slow"]) / (1 / times["slow"] + 1 / times["fast"])
        assert abs(kernels["slow"] - whole * share) <= 1.0, (kernels, times)
