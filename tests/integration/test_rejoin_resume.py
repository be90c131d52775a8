"""Workers that freeze and come back, workers that join, and a killed master resumed:
real processes on loopback (docs/resilience.md)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetconv.lab import wait_for
from tests.conftest import child_env, hetconv_command, run_hetconv
from tests.integration.test_failover import final_losses, records, steps_done
from tests.support.faulty_worker import WorkerFaults

pytestmark = [pytest.mark.integration]

RUN = ["--data", "synthetic", "--limit", "3200", "--test-limit", "128", "--arch", "4:8",
       "--epochs", "2", "--batch", "64", "--threads", "1", "--no-progress", "--seed", "5",
       "--checkpoint-every", "10", "--wire-dtype", "float32"]
SLOW = WorkerFaults(delay_per_kernel_s=0.006)


def master(endpoint: str, run_dir: Path, workers: int, *extra: str) -> Any:
    """--fall-back off: the runs must keep their workers on two shared cores (see
    test_failover.start_master)."""
    return subprocess.Popen(
        hetconv_command("train", "--listen", endpoint, "--min-workers", str(workers),
                        "--wait", "30", "--split", "equal", *RUN, "--fall-back", "off",
                        "--run-dir", str(run_dir), *extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())


def holders_after(run_dir: Path, step: int) -> set[str]:
    """Participants holding kernels in the step records after ``step``."""
    return {d["participant"] for r in records(run_dir) if r["type"] == "step" and r["step"] > step
            for layer in r["layers"] for d in layer["participants"] if d["kernels"] > 0}


def evicted(run_dir: Path, name: str) -> bool:
    """Whether a complete ``recovery`` record says worker ``name`` is gone (the master may
    be writing the next line)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return False
    for line in metrics.read_text().splitlines():
        if line.startswith('{"type":"recovery"'):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # cut off: being written
            if record.get("participant") == name and record.get("gone"):
                return True
    return False


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    result = run_hetconv("train", "--local", *RUN, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    return final_losses(run_dir)


@pytest.mark.timeout(240)
def test_a_frozen_worker_is_evicted_then_rejoins(endpoint: str, workers: Any, tmp_path: Path,
                                                 reference: list[float]) -> None:
    frozen = workers("w1", "w2", faults=SLOW)[1]
    run_dir = tmp_path / "run"
    process = master(endpoint, run_dir, 2)
    try:
        assert wait_for(lambda: steps_done(run_dir) >= 20, 90), process.stderr
        os.kill(frozen.process.pid, signal.SIGSTOP)
        wait_for(lambda: evicted(run_dir, "w2"), 8)  # past the liveness timeout: evicted
        os.kill(frozen.process.pid, signal.SIGCONT)
        woke = time.time()
        out, err = process.communicate(timeout=200)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    events = records(run_dir)
    lost = [r for r in events if r["type"] == "recovery"]
    assert lost and lost[0]["participant"] == "w2" and lost[0]["gone"], lost
    joins = [r for r in events if r["type"] == "replan" and "join" in r["reason"]]
    assert joins, "the worker never came back"
    assert joins[0]["reason"] == "join of w2"  # named: bench chaos measures its way back
    back = next(r for r in events if r["type"] == "checkpoint" and r["time"] >= woke)
    assert joins[0]["time"] - woke < 5.0 + (back["time"] - woke)  # at the next re-plan point
    rejoined_at = max(r["step"] for r in events if r["type"] == "checkpoint"
                      and r["time"] <= joins[0]["time"])
    assert "w2" in holders_after(run_dir, rejoined_at)
    np.testing.assert_allclose(final_losses(run_dir), reference, rtol=1e-4)


@pytest.mark.timeout(240)
def test_a_worker_that_joins_mid_run_gets_kernels(endpoint: str, workers: Any, tmp_path: Path,
                                                  reference: list[float]) -> None:
    workers("first", faults=SLOW)
    run_dir = tmp_path / "run"
    process = master(endpoint, run_dir, 1)
    try:
        assert wait_for(lambda: steps_done(run_dir) >= 15, 90), process.stderr
        workers("late", faults=SLOW)
        out, err = process.communicate(timeout=200)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    joins = [r for r in records(run_dir) if r["type"] == "replan" and "late" in r["reason"]]
    assert joins, out
    checkpoints = [r["step"] for r in records(run_dir) if r["type"] == "checkpoint"]
    joined_at = max(s for s in checkpoints if s <= max(
        r["step"] for r in records(run_dir) if r["type"] == "step"
        and r["time"] <= joins[0]["time"]) + 1)
    assert "late" in holders_after(run_dir, joined_at)
    np.testing.assert_allclose(final_losses(run_dir), reference, rtol=1e-4)


def kill_at(run_dir: Path, step: int, process: Any) -> int:
    """SIGKILL the master once ``step`` steps are recorded; the last step it recorded."""
    assert wait_for(lambda: steps_done(run_dir) >= step, 120, interval_s=0.01)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=30)
    return max(r["step"] for r in records(run_dir) if r["type"] == "step")


def assert_resumed_within_checkpoint_interval(run_dir: Path, last_done: int) -> None:
    start = [r for r in records(run_dir) if r["type"] == "run_start"][-1]
    assert start["resumed_from"] is not None
    assert 0 <= last_done + 1 - start["resumed_from"] <= 10  # --checkpoint-every 10


LOCAL_RUN = [*RUN]
LOCAL_RUN[LOCAL_RUN.index("--limit") + 1] = "6400"
LOCAL_RUN[LOCAL_RUN.index("--arch") + 1] = "8:16"


@pytest.fixture(scope="module")
def whole_local_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LOCAL_RUN uninterrupted: what every killed and resumed local run must equal (read
    only, so the kill steps share it)."""
    whole = tmp_path_factory.mktemp("whole") / "run"
    assert run_hetconv("train", "--local", *LOCAL_RUN, "--run-dir", str(whole)).returncode == 0
    return whole


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kill_step", [17, 44, 120])
def test_a_killed_local_master_resumes_bit_for_bit(tmp_path: Path, kill_step: int,
                                                   whole_local_run: Path) -> None:
    """Some kills land while a checkpoint is being written: the rename keeps the last
    complete one either way."""
    local, whole = LOCAL_RUN, whole_local_run
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        hetconv_command("train", "--local", *local, "--run-dir", str(run_dir)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    last_done = kill_at(run_dir, kill_step, process)
    result = run_hetconv("train", "--resume", str(run_dir), "--local", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "resuming" in result.stdout
    assert final_losses(run_dir) == final_losses(whole)  # bit for bit on the CPU
    assert_resumed_within_checkpoint_interval(run_dir, last_done)
    assert not list(run_dir.glob(".*.tmp"))


@pytest.mark.timeout(240)
def test_a_killed_distributed_master_resumes_with_the_same_workers(
        endpoint: str, workers: Any, tmp_path: Path, reference: list[float]) -> None:
    started = workers("w1", "w2", faults=SLOW)
    run_dir = tmp_path / "run"
    last_done = kill_at(run_dir, 33, master(endpoint, run_dir, 2))
    result = run_hetconv("train", "--resume", str(run_dir), "--listen", endpoint,
                         "--min-workers", "2", "--wait", "60", "--split", "equal",
                         "--no-progress", timeout=200)
    assert result.returncode == 0, result.stderr
    assert all(w.process.poll() is None for w in started)  # the same daemons served it
    np.testing.assert_allclose(final_losses(run_dir), reference, rtol=1e-4)
    assert_resumed_within_checkpoint_interval(run_dir, last_done)


def test_resume_refuses_a_flag_that_changes_the_result(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    short = [*RUN]
    short[short.index("--epochs") + 1] = "1"
    assert run_hetconv("train", "--local", *short, "--run-dir", str(run_dir)).returncode == 0
    result = run_hetconv("train", "--resume", str(run_dir), "--local", "--lr", "0.2")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "hetconv: error: --resume: --lr 0.2 differs from the run's 0.05; resuming with it "
        "would change the result (start a new run for that)"]
    done = run_hetconv("train", "--resume", str(run_dir), "--local")
    assert done.returncode == 2 and "nothing left to do" in done.stderr
    missing = run_hetconv("train", "--resume", str(tmp_path / "nope"), "--local")
    assert missing.returncode == 2 and "no config.json" in missing.stderr


@pytest.mark.timeout(420)
def test_twenty_random_master_kills_all_resume_bit_for_bit(tmp_path: Path) -> None:
    """The issue's twenty trials: one local run SIGKILLed at twenty seeded random moments
    (a snapshot is written after every step, so kills also land inside checkpoint
    writes), resumed after each; every resume starts and trains on, the last one
    finishes, and the loss trace equals the uninterrupted run's bit for bit."""
    args = [*RUN]
    args[args.index("--limit") + 1] = "6400"
    args[args.index("--checkpoint-every") + 1] = "1"
    whole = tmp_path / "whole"
    assert run_hetconv("train", "--local", *args, "--run-dir", str(whole)).returncode == 0
    run_dir = tmp_path / "run"
    rng = random.Random(20)
    process = subprocess.Popen(
        hetconv_command("train", "--local", *args, "--run-dir", str(run_dir)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    inside_writes = 0
    for trial in range(20):
        target = steps_done(run_dir) + rng.randint(1, 6)

        def advanced(target: int = target, process: Any = process) -> bool:
            return steps_done(run_dir) >= target or process.poll() is not None
        assert wait_for(advanced, 120, interval_s=0.002), f"trial {trial}: no progress"
        assert process.poll() is None, f"trial {trial}: the run ended before its kill"
        time.sleep(rng.uniform(0.0, 0.01))  # anywhere in the step, its snapshot included
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=30)
        inside_writes += bool(list(run_dir.glob(".*.tmp")))
        process = subprocess.Popen(
            hetconv_command("train", "--resume", str(run_dir), "--local", "--no-progress"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    assert final_losses(run_dir) == final_losses(whole)  # no half line: the writer drops it
    starts = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if line.startswith('{"type":"run_start"')]
    assert len(starts) == 21 and all(s["resumed_from"] is not None for s in starts[1:])
    print(f"20 kills, {inside_writes} of them left a checkpoint write unfinished")
