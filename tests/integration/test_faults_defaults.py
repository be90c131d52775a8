"""Faults under the defaults a user gets (issue 20): ``--split model``, ``--wire-dtype
auto``, rebalancing on, the peer data plane (and the star plane as a second case).
Each fault costs at most 2 recoveries and the run completes; a worker that comes back
is taken in as a join, never re-assigned into the plan it left; a worker answering
wrong results is evicted for good. Real worker processes on loopback.

The pinned-settings versions (exactness against the local run with a float32 wire)
are tests/integration/test_failover.py and test_rejoin_resume.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from hetconv.lab import wait_for
from tests.conftest import child_env, hetconv_command
from tests.integration.test_failover import records, steps_done
from tests.support.faulty_worker import WorkerFaults

pytestmark = [pytest.mark.integration]

# Nothing here pins --split, --split-by, --wire-dtype, --data-plane or rebalancing: the
# defaults. One exception: three processes sharing this machine's two cores are slower
# than the master alone, and the default --fall-back on would rightly drop the workers at
# the first snapshot (tests/integration/test_sample_split.py checks that); the faults here
# must hit a run that keeps its workers, as on a LAN where they pay.
DEFAULT_RUN = ["--data", "synthetic", "--limit", "12800", "--test-limit", "256", "--arch",
               "8:16", "--epochs", "1", "--batch", "64", "--threads", "1", "--no-progress",
               "--seed", "5", "--fall-back", "off"]
MAX_RECOVERIES = 2
FAULT_AT_STEP = 60


def start_master(endpoint: str, run_dir: Path, workers: int, *extra: str) -> Any:
    return subprocess.Popen(
        hetconv_command("train", "--listen", endpoint, "--min-workers", str(workers),
                        "--wait", "30", *DEFAULT_RUN, "--run-dir", str(run_dir), *extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())


def holders_now(run_dir: Path) -> list[str]:
    """The workers holding kernels in the last step recorded."""
    steps = [r for r in records(run_dir) if r["type"] == "step"]
    if not steps:
        return []
    return sorted({d["participant"] for layer in steps[-1]["layers"] for d in layer["devices"]
                   if d["kernels"] > 0 and d["participant"] != "master"})


def finish(master: Any) -> tuple[str, str]:
    try:
        out, err = master.communicate(timeout=150)
    finally:
        if master.poll() is None:
            master.kill()
    assert master.returncode == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return out, err


def assert_completed(run_dir: Path, victim: str) -> list[dict[str, Any]]:
    """The run completed, with 1..MAX_RECOVERIES recoveries, the first naming ``victim``."""
    events = records(run_dir)
    assert events[-1]["type"] == "run_end" and events[-1]["status"] == "completed", events[-1]
    recoveries = [r for r in events if r["type"] == "recovery"]
    assert 1 <= len(recoveries) <= MAX_RECOVERIES, json.dumps(recoveries, indent=1)
    assert recoveries[0]["participant"] == victim, recoveries
    epochs = [r for r in events if r["type"] == "epoch"]
    assert epochs and epochs[-1]["test_accuracy"] >= 0.9, epochs
    return events


def joins_of(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in events if r["type"] == "replan" and r["reason"].startswith("join")
            and any(d["participant"] == name and d["kernels"] > 0
                    for layer in r["counts"] for d in layer["devices"])]


def turn_a_holder_bad(run_dir: Path, flags: dict[str, Path]) -> str:
    """Touch the flag of a worker holding kernels, and keep it only if that worker still
    held kernels in a step that began after the flag (a re-split just before it may
    have moved its kernels away: then no request would ever see it wrong); else try
    again. Returns the worker that went bad."""
    assert wait_for(lambda: steps_done(run_dir) >= FAULT_AT_STEP and holders_now(run_dir),
                    120), "no worker ever held kernels"
    for _ in range(20):
        bad = holders_now(run_dir)[-1]
        flags[bad].touch()
        touched, target = time.time(), steps_done(run_dir) + 2
        assert wait_for(lambda: steps_done(run_dir) >= target, 60)  # noqa: B023
        events = [r for r in records(run_dir) if r["time"] > touched]
        if any(r["type"] == "recovery" and r["participant"] == bad for r in events):
            return bad  # seen wrong already
        steps = [r for r in events if r["type"] == "step"]
        if steps and any(d["participant"] == bad and d["kernels"] > 0
                         for layer in steps[-1]["layers"] for d in layer["devices"]):
            return bad  # wrong while holding kernels: the next check or audit sees it
        flags[bad].unlink()
    raise AssertionError("no worker kept its kernels long enough to turn it bad")


PLANES = [pytest.param((), id="default"),
          pytest.param(("--split-by", "kernels"), id="kernels-peer"),
          pytest.param(("--split-by", "kernels", "--data-plane", "star"), id="kernels-star")]
FAULTS = ("kill", "stop", "restart")
WRONG = (("nan", "NaN"), ("scale", "result audit"), ("crop", "shape"))
# the star plane is a third case of one fault each (the suite's time): kill, crop
LOST_CASES = [pytest.param(fault, plane.values[0], id=f"{plane.id}-{fault}")
              for plane in PLANES for fault in FAULTS
              if plane.id != "kernels-star" or fault == "kill"]
WRONG_CASES = [pytest.param(mode, evidence, plane.values[0], id=f"{plane.id}-{mode}")
               for plane in PLANES for mode, evidence in WRONG
               if plane.id != "kernels-star" or mode == "crop"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault,plane", LOST_CASES)
def test_a_lost_worker_costs_at_most_two_recoveries(endpoint: str, workers: Any, tmp_path: Path,
                                                    fault: str, plane: tuple[str, ...]) -> None:
    started = {w.name: w for w in workers("a", "b", "c")}
    run_dir = tmp_path / "run"
    # still training when it is back: 4 epochs are 800 steps, the stop and the join
    # about 250 of them at the pace of two shared cores (a kill: 200 steps, the fault at
    # step 60; a restart's join came too late for 200 once in CI)
    longer = ("--epochs", "4") if fault in ("stop", "restart") else ()
    master = start_master(endpoint, run_dir, 3, *plane, *longer)
    try:
        assert wait_for(lambda: steps_done(run_dir) >= FAULT_AT_STEP and holders_now(run_dir),
                        120), "no worker ever held kernels: " + str(master.poll())
    except BaseException:
        master.kill()
        master.communicate()  # closes the pipes
        raise
    victim = holders_now(run_dir)[-1]
    pid = started[victim].process.pid
    if fault == "stop":  # frozen for 10 s: evicted by liveness, back as a join
        os.kill(pid, signal.SIGSTOP)
        time.sleep(10)
        os.kill(pid, signal.SIGCONT)
    else:
        os.kill(pid, signal.SIGKILL)
        if fault == "restart":  # the same name again, at once
            workers(victim)
    out, _ = finish(master)
    events = assert_completed(run_dir, victim)
    if fault in ("stop", "restart"):
        assert joins_of(events, victim), "the worker that came back was not taken in"
    recovered_at = next(r["time"] for r in events if r["type"] == "recovery")
    for replan in (r for r in events if r["type"] in ("replan", "rebalance")):
        if replan["time"] >= recovered_at and not replan["reason"].startswith("join"):
            held = [d for layer in replan["counts"] for d in layer["devices"]
                    if d["participant"] == victim and d["kernels"] > 0]
            if joins_of([r for r in events if r["time"] <= replan["time"]], victim):
                continue  # back through a join: it may hold kernels again
            assert not held, f"{victim} was put back into the plan it left: {replan}"
    assert victim in out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode,evidence,plane", WRONG_CASES)
def test_a_worker_answering_wrong_results_is_evicted_for_good(
        endpoint: str, workers: Any, tmp_path: Path, mode: str, evidence: str,
        plane: tuple[str, ...]) -> None:
    flags = {name: tmp_path / f"corrupt-{name}" for name in ("a", "b", "c")}
    for name, flag in flags.items():  # each turns bad when its flag file appears
        workers(name, faults=WorkerFaults(corrupt_file=str(flag), corrupt_mode=mode))
    run_dir = tmp_path / "run"
    master = start_master(endpoint, run_dir, 3, *plane)
    try:
        bad = turn_a_holder_bad(run_dir, flags)
    except BaseException:
        master.kill()
        master.communicate()  # closes the pipes
        raise
    finish(master)
    events = assert_completed(run_dir, bad)
    first = next(r for r in events if r["type"] == "recovery")
    assert evidence in first["reason"], first
    assert not joins_of(events, bad), "a worker evicted for wrong results was taken back"
    last = [r for r in events if r["type"] == "step"][-1]
    assert all(d["kernels"] == 0 for layer in last["layers"] for d in layer["devices"]
               if d["participant"] == bad)
