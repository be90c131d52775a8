"""Training on ``gpu:N`` devices served by the strict stand-in for cupy, in real processes.

``HETCONV_TEST_GPU_MODULE`` makes every process (the master and the worker daemons)
use tests/support/strict_gpu.py for ``gpu:N``: its arrays refuse implicit host/device
conversions and work on the wrong device, and each process writes the copies it
counted to ``HETCONV_STRICT_REPORT_DIR`` when it exits. A run that finishes is the
proof that nothing mixed host and device; the reports show where the copies went.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetconv.backend import TEST_GPU_MODULE_VARIABLE
from hetconv.lab import LocalWorkers
from tests.conftest import REPO, SMALL_RUN, epoch_records, run_hetconv, step_losses
from tests.support.strict_gpu import REPORT_DIR_VARIABLE

pytestmark = [pytest.mark.integration]
LAYERS = 2  # SMALL_RUN's --arch 4:8
# The stand-in computes with numpy's own kernels, but like cupy it runs the batch as one
# chunk where the CPU path splits it into cache-sized chunks (hetconv/ops/conv.py), so
# weight-gradient sums round differently: a local run matches the CPU run to float32
# rounding (LOCAL_RTOL), never exactly, as a real GPU would. A distributed run splits
# the kernels too: the same tolerance as tests/integration/test_distributed.py.
LOCAL_RTOL = 1e-5
DISTRIBUTED_RTOL = 1e-4


@pytest.fixture
def strict_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every process started from here on uses the stand-in and reports into the folder."""
    reports = tmp_path / "strict-reports"
    reports.mkdir()
    monkeypatch.setenv(TEST_GPU_MODULE_VARIABLE, "tests.support.strict_gpu")
    monkeypatch.setenv(REPORT_DIR_VARIABLE, str(reports))
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return reports


def report_of(reports: Path, command: str) -> dict[str, Any]:
    """The report of the one process whose command line holds ``command``."""
    found = [r for r in (json.loads(p.read_text()) for p in sorted(reports.glob("*.json")))
             if command in r["argv"]]
    assert len(found) == 1, f"{len(found)} reports of a {command!r} process in {reports}"
    assert found[0]["violations"] == []
    return found[0]


def assert_matches_cpu(run_dir: Path, reference: Path, rtol: float = DISTRIBUTED_RTOL) -> int:
    """Losses and accuracy as in the CPU run; returns the number of steps."""
    cpu, device = step_losses(reference), step_losses(run_dir)
    assert len(cpu) == len(device) >= 100
    np.testing.assert_allclose(device, cpu, rtol=rtol, atol=0)
    assert abs(epoch_records(run_dir)[0]["test_accuracy"]
               - epoch_records(reference)[0]["test_accuracy"]) <= 0.005
    return len(device)


def layers_held(run_dir: Path, participant: str) -> int:
    """Conv layers in which ``participant`` was given kernels."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sum(any(d["participant"] == participant and d["kernels"] > 0 for d in r["participants"])
               for r in records if r["type"] == "calibration")


def assert_copies(report: dict[str, Any], device: str, layers: int, steps: int) -> None:
    """Only ``device`` was used; per step and layer at least x and dy went to it and y
    came back (dx too, except from the first layer)."""
    assert report["devices_used"] == [device]
    to_device, to_host = report["copies"]["host_to_device"], report["copies"]["device_to_host"]
    assert set(to_device) == set(to_host) == {device}
    assert to_device[device] >= 2 * steps * layers
    assert to_host[device] >= steps * layers


@pytest.mark.timeout(180)
def test_local_training_on_gpu0(strict_reports: Path, tmp_path: Path,
                                local_reference: Path) -> None:
    run_dir = tmp_path / "gpu0"
    result = run_hetconv("train", "--local", "--device", "gpu:0", *SMALL_RUN,
                         "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    steps = assert_matches_cpu(run_dir, local_reference, rtol=LOCAL_RTOL)
    report = report_of(strict_reports, "train")
    assert_copies(report, "gpu:0", LAYERS, steps)
    assert report["copies"]["device_to_host"]["gpu:0"] >= steps * (2 * LAYERS - 1)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pinned", [(), ("--split", "equal", "--fall-back", "off")],
                         ids=["defaults", "every-step"])
def test_worker_on_gpu1_serves_a_distributed_run(strict_reports: Path, endpoint: str,
                                                 tmp_path: Path, local_reference: Path,
                                                 pinned: tuple[str, ...]) -> None:
    """The defaults, then a second case pinned so that the worker computes every step.
    With the defaults the planner may rightly leave the stand-in (numpy in one chunk)
    out on a loaded host, and the master-alone check may train on alone (a CI run of
    the suite under -n 2 did the first): the run stays exact, the worker's device is
    still the only one it touched, and when it was left out the plan says so."""
    run_dir = tmp_path / "dist"
    spec = {"name": "g1", "extra_args": ("--device", "gpu:1")}
    with LocalWorkers(endpoint, [spec], log_dir=tmp_path):  # stopped (and reporting) on exit
        result = run_hetconv("train", "--listen", endpoint, "--min-workers", "1", "--wait",
                             "30", *SMALL_RUN, *pinned, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    steps = assert_matches_cpu(run_dir, local_reference)
    held = layers_held(run_dir, "g1")
    worker = report_of(strict_reports, "worker")
    master = report_of(strict_reports, "train")  # the master computed on its CPU
    assert master["devices_used"] == [] and master["copies"]["host_to_device"] == {}
    if pinned:
        assert held >= 1, "the gpu:1 worker was given no kernels"
        assert_copies(worker, "gpu:1", held, steps)
        return
    assert worker["devices_used"] == ["gpu:1"]  # it calibrated there at least
    if held == 0:
        plans = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text()
                 .splitlines() if json.loads(line)["type"] == "plan"]
        assert plans and "g1" not in plans[-1].get("chosen", ["g1"]), plans
