"""Failover without restart: a worker that dies or answers garbage costs the run
nothing but a few replayed steps (docs/resilience.md), with real worker processes."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetconv.lab import wait_for
from hetconv.metrics import MetricsTail
from tests.conftest import SMALL_RUN, child_env, epoch_records, hetconv_command
from tests.support.faulty_worker import WorkerFaults

pytestmark = [pytest.mark.integration]

SLOW = WorkerFaults(delay_per_kernel_s=0.003)  # steps long enough to kill one mid-run


_TAILS: dict[Path, MetricsTail] = {}


def _tail(run_dir: Path) -> MetricsTail:
    """One follower per metrics file: the tests poll it ten times a second, and parsing
    a long run's whole file each time took CPU from the run under test."""
    path = run_dir / "metrics.jsonl"
    return _TAILS.setdefault(path, MetricsTail(path))


def records(run_dir: Path) -> list[dict[str, Any]]:
    """The run's records so far; a live run's last line may be half written (it waits)."""
    return _tail(run_dir).records()


def final_losses(run_dir: Path) -> list[float]:
    """The loss of every step, the last record of a replayed step counting."""
    by_step: dict[int, float] = {}
    for record in records(run_dir):
        if record["type"] == "step":
            by_step[int(record["step"])] = float(record["loss"])
    return [by_step[step] for step in sorted(by_step)]


def steps_done(run_dir: Path) -> int:
    tail = _tail(run_dir)
    tail.records()
    return tail.steps


def start_master(endpoint: str, run_dir: Path, workers: int, *extra: str) -> Any:
    """--fall-back off: on two shared cores the master alone is faster, and the default
    would drop the workers at the first snapshot, before the faults these tests inject
    (that fall-back is tested in test_sample_split.py)."""
    return subprocess.Popen(
        hetconv_command("train", "--listen", endpoint, "--min-workers", str(workers),
                        "--wait", "30", *SMALL_RUN, "--checkpoint-every", "10",
                        "--fall-back", "off", "--run-dir", str(run_dir), *extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())


def assert_reproduces_all(run_dir: Path, reference: Path) -> None:
    local, distributed = final_losses(reference), final_losses(run_dir)
    assert len(distributed) == len(local) == 100
    np.testing.assert_allclose(distributed, local, rtol=1e-4)
    assert abs(epoch_records(run_dir)[-1]["test_accuracy"]
               - epoch_records(reference)[-1]["test_accuracy"]) <= 0.005


@pytest.mark.timeout(180)
@pytest.mark.parametrize("plane", ["peer", "star"])
def test_a_killed_worker_is_replaced_and_nothing_is_lost(endpoint: str, workers: Any,
                                                         tmp_path: Path, local_reference: Path,
                                                         plane: str) -> None:
    started = workers("w1", "w2", "w3", faults=SLOW)
    victim = started[1]
    run_dir = tmp_path / "run"
    master = start_master(endpoint, run_dir, 3, "--data-plane", plane, "--split", "equal")
    try:
        assert wait_for(lambda: steps_done(run_dir) >= 30, 90), master.stderr
        os.kill(victim.process.pid, signal.SIGKILL)
        killed_at = time.time()
        out, err = master.communicate(timeout=120)
    finally:
        if master.poll() is None:
            master.kill()
    assert master.returncode == 0, err
    assert "Traceback" not in err
    recoveries = [r for r in records(run_dir) if r["type"] == "recovery"]
    assert recoveries and recoveries[0]["participant"] == "w2", recoveries
    # the liveness timeout, not minutes (nor the peers' timeout: under the default peer
    # plane this network is split by samples, two steps in flight, and the step sent
    # ahead of the failed one is abandoned at once, its late answers dropped quietly)
    assert recoveries[0]["time"] - killed_at < 5.0
    if plane == "peer":
        before = [r for r in records(run_dir) if r["type"] == "step" and r["time"] < killed_at]
        assert any(r["sent_ahead"] for r in before[-5:]), before[-5:]
        assert "dropped a stale" not in err, err
    assert "w2" in out and "restored the snapshot" in out
    assert records(run_dir)[-1]["status"] == "completed"
    assert_reproduces_all(run_dir, local_reference)
    last = [r for r in records(run_dir) if r["type"] == "step"][-1]
    holders = {d["participant"] for layer in last["layers"] for d in layer["participants"]
               if d["kernels"] > 0}
    assert "w2" not in holders and {"master", "w1", "w3"} <= holders  # the master kept its share


@pytest.mark.timeout(180)
def test_a_worker_sending_nan_is_evicted_and_its_work_recomputed(
        endpoint: str, workers: Any, tmp_path: Path, local_reference: Path) -> None:
    workers("w1", faults=SLOW)
    workers("bad", faults=replace(SLOW, corrupt_from_step=25))
    run_dir = tmp_path / "run"
    master = start_master(endpoint, run_dir, 2, "--split", "equal")
    out, err = master.communicate(timeout=150)
    assert master.returncode == 0, err
    recoveries = [r for r in records(run_dir) if r["type"] == "recovery"]
    assert [r["participant"] for r in recoveries] == ["bad"], recoveries
    assert "NaN" in recoveries[0]["reason"]
    assert_reproduces_all(run_dir, local_reference)


@pytest.mark.timeout(180)
def test_when_the_last_worker_dies_the_master_trains_on_alone(
        endpoint: str, workers: Any, tmp_path: Path, local_reference: Path) -> None:
    only = workers("only", faults=SLOW)[0]
    run_dir = tmp_path / "run"
    master = start_master(endpoint, run_dir, 1, "--split", "equal")
    try:
        assert wait_for(lambda: steps_done(run_dir) >= 20, 90), master.stderr
        os.kill(only.process.pid, signal.SIGKILL)
        out, err = master.communicate(timeout=120)
    finally:
        if master.poll() is None:
            master.kill()
    assert master.returncode == 0, err
    assert "training on alone" in out + err
    assert_reproduces_all(run_dir, local_reference)


@pytest.mark.timeout(120)
def test_on_worker_loss_stop_ends_with_one_line(endpoint: str, workers: Any,
                                                tmp_path: Path) -> None:
    only = workers("only", faults=SLOW)[0]
    run_dir = tmp_path / "run"
    master = start_master(endpoint, run_dir, 1, "--split", "equal", "--on-worker-loss", "stop")
    try:
        assert wait_for(lambda: steps_done(run_dir) >= 10, 90), master.stderr
        os.kill(only.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = master.communicate(timeout=60)
        assert time.monotonic() - killed_at < 8.0
    finally:
        if master.poll() is None:
            master.kill()
    assert master.returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("hetconv: error:")]
    assert len(lines) == 1 and "only" in lines[0] and "--on-worker-loss stop" in lines[0], err
    assert "Traceback" not in err
