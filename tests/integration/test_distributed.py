"""Distributed training over real worker processes on loopback."""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetconv.engine.checkpoint import load_weights
from hetconv.lab import free_port, wait_for
from tests.conftest import (
    SMALL_RUN,
    child_env,
    epoch_records,
    hetconv_command,
    run_hetconv,
    step_losses,
)

pytestmark = [pytest.mark.integration]


def assert_reproduces(run_dir: Path, reference: Path) -> None:
    local, distributed = step_losses(reference), step_losses(run_dir)
    assert len(local) == len(distributed) >= 100  # one epoch of 6400 images, batch 64
    n = 100
    np.testing.assert_allclose(distributed[:n], local[:n], rtol=1e-4)
    acc_local = epoch_records(reference)[0]["test_accuracy"]
    acc_dist = epoch_records(run_dir)[0]["test_accuracy"]
    assert abs(acc_local - acc_dist) <= 0.005


KEEP_WORKERS = ["--fall-back", "off"]
"""On one machine the master alone measures faster than the workers, and the default
--fall-back on would train alone from set-up (master/alone_first.py): these runs are
about the workers."""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("split", ["model", "equal"])
def test_two_workers_reproduce_local_run(endpoint: str, workers: Any, tmp_path: Path,
                                         local_reference: Path, split: str) -> None:
    """Under the default split (``model``) the planner may leave workers out that it
    measures slower than they pay (the suite's load on two cores can make them so: CI
    saw the master alone once), so there the steps are held by whom the plan chose;
    ``equal`` always gives both workers kernels."""
    workers("w1", "w2")
    run_dir = tmp_path / "dist"
    result = run_hetconv("train", "--listen", endpoint, "--split-by", "kernels", "--min-workers", "2", "--wait", "30",
                         *KEEP_WORKERS,
                         "--split", split, *SMALL_RUN, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert "split of 8 kernels" in result.stdout
    assert_reproduces(run_dir, local_reference)
    # the final weights have the local run's layout and (nearly) its values
    local_w, dist_w = load_weights(local_reference / "weights.npz"), load_weights(run_dir / "weights.npz")
    assert sorted(local_w) == sorted(dist_w)
    for name in local_w:
        assert local_w[name].shape == dist_w[name].shape
        np.testing.assert_allclose(dist_w[name], local_w[name], rtol=1e-3, atol=1e-4)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    calibrations = [r for r in records if r["type"] == "calibration"]
    assert len(calibrations) == 2
    assert all(sum(d["kernels"] for d in c["participants"]) == c["kernels"] for c in calibrations)
    steps = [r for r in records if r["type"] == "step"]
    devices = {d["participant"] for s in steps for layer in s["layers"] for d in layer["participants"]
               if d["kernels"] > 0}
    assert devices <= {"master", "w1", "w2"}
    first = {d["participant"] for layer in steps[0]["layers"] for d in layer["participants"]
             if d["kernels"] > 0}
    if split == "model":  # the planner's choice, recorded
        (plan,) = [r for r in records if r["type"] == "plan"]
        assert first == set(plan["chosen"]), (first, plan["chosen"])
    else:
        assert first == {"master", "w1", "w2"}, first


@pytest.mark.timeout(180)
def test_three_workers_no_local_equal_split(endpoint: str, workers: Any, tmp_path: Path,
                                            local_reference: Path) -> None:
    workers("w1", "w2", "w3")
    run_dir = tmp_path / "dist"
    result = run_hetconv("train", "--listen", endpoint, "--split-by", "kernels", "--min-workers", "3", "--wait", "30",
                         "--no-local", "--split", "equal", *SMALL_RUN, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    assert "w1 2 (50%), w2 1 (25%), w3 1 (25%)" in result.stdout  # equal split of 4
    assert_reproduces(run_dir, local_reference)


@pytest.mark.timeout(120)
def test_worker_started_late_is_accepted(endpoint: str, workers: Any, tmp_path: Path) -> None:
    run_dir = tmp_path / "dist"
    master = subprocess.Popen(
        hetconv_command("train", "--listen", endpoint, "--min-workers", "1", "--wait", "60",
                        *SMALL_RUN, "--run-dir", str(run_dir)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        time.sleep(2.0)
        assert master.poll() is None
        workers("late")
        out, err = master.communicate(timeout=100)
        assert master.returncode == 0, err
        assert "late" in out
    finally:
        if master.poll() is None:
            master.kill()


@pytest.fixture(scope="module")
def run_without_workers(tmp_path_factory: pytest.TempPathFactory
                        ) -> tuple[subprocess.CompletedProcess[str], float, Path]:
    """A master that no worker joins (``--wait 1``): its result, its seconds and its run
    directory, read only by the two tests below."""
    run_dir = tmp_path_factory.mktemp("no-workers") / "r"
    start = time.monotonic()
    result = run_hetconv("train", "--listen", f"tcp://127.0.0.1:{free_port()}",
                         "--min-workers", "1", "--wait", "1", *SMALL_RUN, "--run-dir",
                         str(run_dir))
    return result, time.monotonic() - start, run_dir


@pytest.mark.timeout(60)
def test_no_workers_is_a_clear_error(
        run_without_workers: tuple[subprocess.CompletedProcess[str], float, Path]) -> None:
    result, seconds, _ = run_without_workers
    assert result.returncode == 2
    assert seconds < 30
    assert result.stderr.strip().splitlines()[-1].startswith("hetconv: error: only 0 of 1")


@pytest.mark.timeout(60)
def test_worker_survives_a_run_and_stops_on_sigterm(endpoint: str, workers: Any,
                                                    tmp_path: Path) -> None:
    (worker,) = workers("stay")
    for run in range(2):
        result = run_hetconv("train", "--listen", endpoint, "--min-workers", "1", "--wait", "30",
                             "--data", "synthetic", "--limit", "128", "--test-limit", "64",
                             "--arch", "2:4", "--epochs", "1", "--batch", "64", "--threads", "1",
                             "--no-progress", "--run-dir", str(tmp_path / f"r{run}"))
        assert result.returncode == 0, result.stderr
    assert worker.process.poll() is None
    start = time.monotonic()
    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(5) == 0
    assert time.monotonic() - start < 2.0


@pytest.mark.timeout(60)
def test_failed_start_is_recorded(
        run_without_workers: tuple[subprocess.CompletedProcess[str], float, Path]) -> None:
    result, _, run_dir = run_without_workers
    assert result.returncode == 2
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["type"] == "run_end" and last["status"] == "failed"
    assert last["error"].startswith("only 0 of 1 worker")


@pytest.mark.timeout(30)
def test_worker_without_master_keeps_trying_and_stops_on_sigterm(endpoint: str,
                                                                 workers: Any) -> None:
    (worker,) = workers("lonely")
    # up (its SIGTERM handler is installed before it says so), then a while with no master
    assert wait_for(lambda: "connecting to" in worker.output(), 20), worker.output()
    time.sleep(1.5)
    assert worker.process.poll() is None  # no master yet: still trying
    start = time.monotonic()
    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(5) == 0
    assert time.monotonic() - start < 2.0
    assert "connecting to" in worker.output()


@pytest.mark.timeout(120)
def test_float16_on_the_wire_halves_traffic_and_still_trains(endpoint: str, workers: Any,
                                                              tmp_path: Path,
                                                              local_reference: Path) -> None:
    workers("w1", "w2")
    run_dir = tmp_path / "fp16"
    result = run_hetconv("train", "--listen", endpoint, "--split-by", "kernels", "--min-workers", "2", "--wait", "30",
                         *KEEP_WORKERS,
                         *SMALL_RUN, "--wire-dtype", "float16",  # after SMALL_RUN's float32
                         "--data-plane", "star", "--run-dir", str(run_dir))  # byte counts below
    assert result.returncode == 0, result.stderr
    local, half = step_losses(local_reference), step_losses(run_dir)
    np.testing.assert_allclose(half[:20], local[:20], rtol=2e-2)  # fp16 rounding, no more
    assert abs(epoch_records(run_dir)[0]["test_accuracy"]
               - epoch_records(local_reference)[0]["test_accuracy"]) <= 0.02
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in records if r["type"] == "step" and r["step"] == 1)
    # per layer of 4:8 at batch 64: its input's values (sent whole to every holder under
    # the star plane) and its pooled output's positions (the dy of a holder's kernels);
    # the planner (--split model) may keep the small first layer on the master alone
    # when the workers measure slow, so check every layer a worker holds kernels of
    shapes = {0: (64 * 1 * 28 * 28, 12 * 12), 1: (64 * 4 * 12 * 12, 4 * 4)}
    held = [(entry["layer"], d) for entry in step["layers"] for d in entry["participants"]
            if d["participant"] != "master" and d["kernels"] > 0]
    assert held, f"no worker held kernels at step 1: nothing crossed the wire {step['layers']}"
    for layer, device in held:
        values, positions = shapes[layer]
        assert device["bytes_sent"] == values * 2 + 64 * device["kernels"] * positions * 2, (
            layer, device)
