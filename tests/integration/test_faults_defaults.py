"""Faults under the defaults a user gets (issue 20): ``--split model``, ``--wire-dtype
auto``, rebalancing on, the peer data plane (and the kernel split as a second case).
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from hetconv.analysis.report.events import JOIN_PREFIX
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
WRONG_RUN_IMAGES = 6400
"""The wrong-results runs' --limit: 100 steps (the suite's time; the lost-worker runs
need DEFAULT_RUN's 200 steps or more for the joins)."""


def start_master(endpoint: str, run_dir: Path, workers: int, *extra: str) -> Any:
    return subprocess.Popen(
        hetconv_command("train", "--listen", endpoint, "--min-workers", str(workers),
                        "--wait", "30", *DEFAULT_RUN, "--run-dir", str(run_dir), *extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())


def holders_now(run_dir: Path, before_the_last_layer: bool = False) -> list[str]:
    """The workers holding kernels in the last step recorded (``before_the_last_layer``:
    of a conv layer other than the last)."""
    steps = [r for r in records(run_dir) if r["type"] == "step"]
    if not steps:
        return []
    layers = steps[-1]["layers"][:-1] if before_the_last_layer else steps[-1]["layers"]
    return sorted({d["participant"] for layer in layers for d in layer["participants"]
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
    """The run completed, with 1..MAX_RECOVERIES recoveries, the first that names a
    participant naming ``victim`` (one before it may be the loss guard's restore, which
    names nobody: hetconv/engine/loss_guard.py)."""
    events = records(run_dir)
    assert events[-1]["type"] == "run_end" and events[-1]["status"] == "completed", events[-1]
    recoveries = [r for r in events if r["type"] == "recovery"]
    assert 1 <= len(recoveries) <= MAX_RECOVERIES, (
        json.dumps(recoveries, indent=1) + "\n" + story(run_dir, victim))
    named = [r for r in recoveries if r["participant"] is not None]
    assert named and named[0]["participant"] == victim, recoveries
    assert all("loss jumped" in r["reason"] for r in recoveries if r["participant"] is None)
    epochs = [r for r in events if r["type"] == "epoch"]
    assert epochs and epochs[-1]["test_accuracy"] >= 0.9, epochs
    return events


def joins_of(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The re-plans that took ``name`` in as a join (reason ``join of a, c``), whatever
    the planner then gave it: under ``--split model`` a joiner measured slow (a loaded
    host) may rightly be given no kernels until a rebalance finds it pays."""
    return [r for r in events if r["type"] == "replan" and r["reason"].startswith(JOIN_PREFIX)
            and name in (part.strip() for part in r["reason"][len(JOIN_PREFIX):].split(","))]


def story(run_dir: Path, victim: str) -> str:
    """The run's records but its steps and calibrations, one line each, and the end of
    ``victim``'s log: what a failed fault test prints."""
    victim_log = run_dir.parent / f"{victim}.log"  # the workers fixture's log_dir
    return ("\n".join(json.dumps({k: v for k, v in r.items() if k not in ("layers", "config")})
                       for r in records(run_dir)
                       if r["type"] not in ("step", "calibration", "checkpoint"))[-6000:]
            + f"\n{victim}'s log:\n"
            + (victim_log.read_text(errors="replace")[-4000:] if victim_log.exists() else "none"))


def turn_a_holder_bad(run_dir: Path, flags: dict[str, Path]) -> str:
    """Touch the flag of a worker holding kernels, and keep it only if that worker still
    held kernels in a step that began after the flag (a re-split just before it may
    have moved its kernels away: then no request would ever see it wrong); else try
    again. Returns the worker that went bad.

    A worker holding kernels of a layer before the last is taken where there is one.
    Its wrong outputs (x1000) go into the next layer's batch norm, which takes them in
    its statistics, and stay wrong where the audit looks. Wrong outputs of only the last
    conv layer go straight into the dense part: in one CI run (kernel split, peer plane,
    ``scale``) the loss reached the thousands for a few steps and no audit evicted the
    worker; its channels most likely died (the ReLU then answers 0 whatever the scale)."""
    assert wait_for(lambda: steps_done(run_dir) >= FAULT_AT_STEP and holders_now(run_dir),
                    120), "no worker ever held kernels"
    for _ in range(20):
        bad = (holders_now(run_dir, before_the_last_layer=True) or holders_now(run_dir))[-1]
        flags[bad].touch()
        touched, target = time.time(), steps_done(run_dir) + 2
        assert wait_for(lambda: steps_done(run_dir) >= target, 60)  # noqa: B023
        events = [r for r in records(run_dir) if r["time"] > touched]
        if any(r["type"] == "recovery" and r["participant"] == bad for r in events):
            return bad  # seen wrong already
        steps = [r for r in events if r["type"] == "step"]
        if steps and any(d["participant"] == bad and d["kernels"] > 0
                         for layer in steps[-1]["layers"] for d in layer["participants"]):
            return bad  # wrong while holding kernels: the next check or audit sees it
        flags[bad].unlink()
    raise AssertionError("no worker kept its kernels long enough to turn it bad")


PLANES = [pytest.param((), id="default"),
          pytest.param(("--split-by", "kernels", "--fall-back", "off"), id="kernels-peer")]
# The kernel split's case keeps its workers (--fall-back off): set-up rehearses its plan
# and, on this small network under CI's load, measured the master alone no slower and
# trained alone, so no worker held kernels to strike (seen in CI; the sample split's
# default case has kept its workers in every run).
# The star plane (a third case) is tests/integration/test_failover.py's: a killed worker
# replaced, exact against the local run; a wrong result (NaN, misshapen, scaled) is caught
# by the checks and the audit both planes share (tests/unit/test_result_checks.py).
# One run takes every fault in turn (the suite's time): the stop at FAULT_AT_STEP, then the
# restart, then the kill (it ends its worker for good: last), each STEPS_AFTER_JOIN steps
# after the worker the last one hit was taken in again, each into a worker then holding
# kernels, each judged on what happened from it to the next fault (Fault).
FAULTS = ("stop", "restart", "kill")
STEPS_AFTER_JOIN = 20
WRONG = (("nan", "NaN"), ("scale", ("result audit", "batch-norm spread")), ("crop", "shape"))
"""(mode, what the first recovery naming the worker says: one of them). x1000 is caught
by the audit at a snapshot, or sooner under the sample split by the batch-norm spread
the participants compare (hetconv/participant/samples/outliers.py)."""
LOST_CASES = [pytest.param(FAULTS, plane.values[0], id=f"{plane.id}-{'-'.join(FAULTS)}")
              for plane in PLANES]
WRONG_CASES = [pytest.param(mode, evidence, plane.values[0], id=f"{plane.id}-{mode}")
               for plane in PLANES for mode, evidence in WRONG] + [
    # right in evaluation mode (the audit passes), wrong in what the sample split trains
    # with: its batch-norm moments, its weight gradient (outliers by sender, issue 49)
    # (struck just before a snapshot, the audit there may see its state first: CI did)
    pytest.param("train-scale", ("batch-norm spread", "result audit", "NaN"), (),
                 id="default-train-scale")]


@dataclass(frozen=True)
class Fault:
    """One fault of a run: its kind, its victim, when it struck (Unix time) and when the
    next fault (or the end of the run) came; what happens in [at, until) is its doing."""

    kind: str
    victim: str
    at: float
    until: float = float("inf")

    def window(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in events if self.at <= r["time"] < self.until]


def strike(kind: str, victim: str, started: dict[str, Any], workers: Any) -> None:
    pid = started[victim].process.pid
    if kind == "stop":  # frozen for 10 s: evicted by liveness, back as a join
        os.kill(pid, signal.SIGSTOP)
        time.sleep(10)
        os.kill(pid, signal.SIGCONT)
    else:
        os.kill(pid, signal.SIGKILL)
        if kind == "restart":  # the same name again, at once
            started[victim] = workers(victim)[0]


def rejoined(run_dir: Path, fault: Fault) -> bool:
    """Whether ``fault``'s victim was taken in again by a join after it."""
    return bool(joins_of(fault.window(records(run_dir)), fault.victim))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("faults,plane", LOST_CASES)
def test_a_lost_worker_costs_at_most_two_recoveries(endpoint: str, workers: Any, tmp_path: Path,
                                                    faults: tuple[str, ...],
                                                    plane: tuple[str, ...]) -> None:
    started = {w.name: w for w in workers("a", "b", "c")}
    run_dir = tmp_path / "run"
    # still training when it is back: 4 epochs of 11200 images are 700 steps, the stop
    # and the join about 80-320 of them (80 beside busy tests, 320 on a quiet machine,
    # where the 10 s stop sees the most steps), the restart, its join and the kill about
    # 80-170 more: the kill came at steps 220-490, and every step after the kill's
    # recovery only spends the suite's time (800 steps: 300-580 of them, 25-35 s beside
    # busy tests). The kill alone: 200 steps, the fault at step 60; a restart's join
    # came too late for 200 once in CI.
    longer = ("--epochs", "4", "--limit", "11200") if faults != ("kill",) else ()
    master = start_master(endpoint, run_dir, 3, *plane, *longer)
    struck: list[Fault] = []
    try:
        for kind in faults:
            if struck:  # the last victim back first, and some steps with it
                last = struck[-1]
                assert wait_for(lambda: rejoined(run_dir, last), 120), (  # noqa: B023
                    f"{last.victim} was not taken in again after the {last.kind} (master's "
                    f"exit status {master.poll()}):\n{story(run_dir, last.victim)}")
                target = steps_done(run_dir) + STEPS_AFTER_JOIN
            else:
                target = FAULT_AT_STEP
            assert wait_for(lambda: steps_done(run_dir) >= target  # noqa: B023
                            and holders_now(run_dir), 120), (
                f"no worker held kernels at step {steps_done(run_dir)} for the {kind}, or the "
                f"run ended: {master.poll()}")
            victim = holders_now(run_dir)[-1]
            at = time.time()
            if struck:
                struck[-1] = replace(struck[-1], until=at)
            struck.append(Fault(kind, victim, at))
            strike(kind, victim, started, workers)
    except BaseException:
        master.kill()
        master.communicate()  # closes the pipes
        raise
    out, _ = finish(master)
    events = records(run_dir)
    assert events[-1]["type"] == "run_end" and events[-1]["status"] == "completed", events[-1]
    epochs = [r for r in events if r["type"] == "epoch"]
    assert epochs and epochs[-1]["test_accuracy"] >= 0.9, epochs
    before = [r for r in events if r["type"] == "recovery" and r["time"] < struck[0].at]
    assert not before, json.dumps(before, indent=1)  # every recovery is a fault's doing
    for fault in struck:
        victim, window = fault.victim, fault.window(events)
        recoveries = [r for r in window if r["type"] == "recovery"]
        assert 1 <= len(recoveries) <= MAX_RECOVERIES, (fault, json.dumps(recoveries, indent=1))
        assert recoveries[0]["participant"] == victim, (fault, recoveries)
        if fault.kind in ("stop", "restart"):
            assert joins_of(window, victim), f"the worker that came back was not taken in: {fault}"
        recovered_at = recoveries[0]["time"]
        for replan in (r for r in window if r["type"] in ("replan", "rebalance")):
            if replan["time"] >= recovered_at and not replan["reason"].startswith("join"):
                held = [d for layer in replan["counts"] for d in layer["participants"]
                        if d["participant"] == victim and d["kernels"] > 0]
                if joins_of([r for r in window if r["time"] <= replan["time"]], victim):
                    continue  # back through a join: it may hold kernels again
                assert not held, f"{victim} was put back into the plan it left: {replan}"
        assert victim in out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode,evidence,plane", WRONG_CASES)
def test_a_worker_answering_wrong_results_is_evicted_for_good(
        endpoint: str, workers: Any, tmp_path: Path, mode: str, evidence: str | tuple[str, ...],
        plane: tuple[str, ...]) -> None:
    flags = {name: tmp_path / f"corrupt-{name}" for name in ("a", "b", "c")}
    for name, flag in flags.items():  # each turns bad when its flag file appears
        workers(name, faults=WorkerFaults(corrupt_file=str(flag), corrupt_mode=mode))
    run_dir = tmp_path / "run"
    # 100 steps: the fault comes at FAULT_AT_STEP, its eviction within a few steps
    master = start_master(endpoint, run_dir, 3, *plane, "--limit", str(WRONG_RUN_IMAGES))
    try:
        bad = turn_a_holder_bad(run_dir, flags)
    except BaseException:
        master.kill()
        master.communicate()  # closes the pipes
        raise
    finish(master)
    events = assert_completed(run_dir, bad)
    first = next(r for r in events if r["type"] == "recovery" and r["participant"] is not None)
    said = (evidence,) if isinstance(evidence, str) else evidence
    assert any(e in first["reason"] for e in said), first["reason"]
    assert not joins_of(events, bad), "a worker evicted for wrong results was taken back"
    last = [r for r in events if r["type"] == "step"][-1]
    assert all(d["kernels"] == 0 for layer in last["layers"] for d in layer["participants"]
               if d["participant"] == bad)


@pytest.mark.timeout(240)
def test_a_residual_network_survives_a_killed_worker(endpoint: str, workers: Any,
                                                     tmp_path: Path) -> None:
    """The defaults with a residual network (the participants' chains join the shortcuts
    under the sample split the planner takes): a worker killed mid-run costs at most 2
    recoveries, the first naming it, and the run completes with the loss still falling."""
    started = {w.name: w for w in workers("a", "b")}
    run_dir = tmp_path / "run"
    master = start_master(endpoint, run_dir, 2, "--arch", "c8k3p1,res8,res16s2,gap",
                          "--limit", "3200", "--test-limit", "64")
    try:
        assert wait_for(lambda: steps_done(run_dir) >= 15 and holders_now(run_dir), 120), (
            f"no worker held kernels by step 15: {master.poll()}")
        victim = holders_now(run_dir)[-1]
        os.kill(started[victim].process.pid, signal.SIGKILL)
    except BaseException:
        master.kill()
        master.communicate()
        raise
    out, err = finish(master)
    assert "split by samples" in out + err
    events = records(run_dir)
    assert events[-1]["type"] == "run_end" and events[-1]["status"] == "completed", events[-1]
    recoveries = [r for r in events if r["type"] == "recovery"]
    assert 1 <= len(recoveries) <= MAX_RECOVERIES, json.dumps(recoveries, indent=1)
    assert recoveries[0]["participant"] == victim
    losses = [r["loss"] for r in events if r["type"] == "step"]
    assert len(losses) >= 50 and sum(losses[-10:]) < sum(losses[:10])
