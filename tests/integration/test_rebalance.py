"""Rebalancing from measured step times over real worker processes on loopback.

One worker is made slower in training than its calibration says by the tests' faulty
worker's ``delay_per_kernel_s`` (``tests/support/faulty_worker.py``: it sleeps per
kernel in each training forward and backward, never in calibration). The master must notice,
re-split between two steps, and still reproduce the local run's loss trace.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SMALL_RUN, run_hetconv
from tests.integration.test_distributed import assert_reproduces
from tests.support.faulty_worker import WorkerFaults

pytestmark = [pytest.mark.integration]

SLOW = WorkerFaults(delay_per_kernel_s=0.01)  # 10 ms per kernel per phase: far slower than calibrated


def records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def kernels_of(step: dict[str, Any], participant: str) -> int:
    return sum(d["kernels"] for layer in step["layers"] for d in layer["participants"]
               if d["participant"] == participant)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("data_plane", ["peer", "star"])
def test_a_slow_worker_loses_kernels_and_the_run_stays_exact(
        data_plane: str, endpoint: str, workers: Any, tmp_path: Path,
        local_reference: Path) -> None:
    workers("w1")
    workers("slow", faults=SLOW)
    run_dir = tmp_path / data_plane
    result = run_hetconv("train", "--listen", endpoint, "--split-by", "kernels", "--min-workers", "2", "--wait", "30",
                         "--split", "equal", "--rebalance", "on", "--data-plane", data_plane,
                         *SMALL_RUN, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert "hetconv: re-split after step" in result.stdout, result.stdout
    rebalances = records(run_dir, "rebalance")
    assert rebalances and rebalances[0]["step"] >= 7
    assert rebalances[0]["new_predicted_step_s"] < 0.9 * rebalances[0]["old_predicted_step_s"]
    steps = records(run_dir, "step")
    assert kernels_of(steps[-1], "slow") < kernels_of(steps[0], "slow")
    for layer, row in zip(records(run_dir, "run_start")[0]["layers"],
                          rebalances[-1]["counts"]):
        assert sum(d["kernels"] for d in row["participants"]) == layer["kernels"]
    assert_reproduces(run_dir, local_reference)  # every step's loss within rtol 1e-4
    assert json.loads((run_dir / "config.json").read_text())["rebalance"] is True


@pytest.mark.timeout(120)
def test_rebalance_off_never_re_splits(endpoint: str, workers: Any, tmp_path: Path) -> None:
    workers("w1")
    workers("slow", faults=SLOW)
    args = list(SMALL_RUN)
    args[args.index("--limit") + 1] = "1920"  # 30 steps: a re-split would come at step 7
    run_dir = tmp_path / "off"
    result = run_hetconv("train", "--listen", endpoint, "--split-by", "kernels", "--min-workers", "2", "--wait", "30",
                         "--split", "equal", "--rebalance", "off", *args,
                         "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert "re-split" not in result.stdout
    assert records(run_dir, "rebalance") == []
    steps = records(run_dir, "step")
    assert kernels_of(steps[-1], "slow") == kernels_of(steps[0], "slow") > 0
    assert json.loads((run_dir / "config.json").read_text())["rebalance"] is False
