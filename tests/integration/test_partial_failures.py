"""Partial failures under the defaults (issue 49): a worker that stays connected and
heartbeats but fails the others in part. Each costs at most 2 recoveries, evicts the
right participant (for a cut link one of its two ends), never an honest third, and the
run completes. Real worker processes on loopback, the tests' faulty worker
(tests/support/faulty_worker.py) with the fault from a step on:

- a silent sender: every piece it sends on the data plane is dropped (a wedged peer
  socket), while it receives, heartbeats and answers the master;
- a hung compute thread: it sleeps in a request while its socket thread heartbeats;
- a cut link between two workers: each drops what it sends to the other; their links
  to the master and to the third worker are fine.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_failover import records
from tests.integration.test_faults_defaults import (
    MAX_RECOVERIES,
    finish,
    start_master,
    story,
)
from tests.support.faulty_worker import WorkerFaults

pytestmark = [pytest.mark.integration]

FAULT_STEP = 25
RUN_IMAGES = 4800
"""75 steps of 64: the fault at step 25, its recoveries within a few steps."""

CASES = {
    # case: {worker: its faults}, the participants that may be blamed, what the first
    # recovery's reason says
    # (its piece never arrived while it waits further on, or never left as it idles)
    "silent-sender": ({"b": WorkerFaults(mute_from_step=FAULT_STEP)}, {"b"}, "piece never "),
    "hung-compute": ({"b": WorkerFaults(hang_from_step=FAULT_STEP)}, {"b"}, "no progress"),
    "cut-link": ({"a": WorkerFaults(mute_from_step=FAULT_STEP, mute_to=("b",)),
                  "b": WorkerFaults(mute_from_step=FAULT_STEP, mute_to=("a",))}, {"a", "b"},
                 "cut link between a and b"),
}


RUNS = [pytest.param(case, (), id=case) for case in CASES] + [
    pytest.param(case, ("--split-by", "kernels"), id=f"kernels-{case}")
    for case in ("silent-sender", "hung-compute")]
"""Every case under the defaults (the sample split); the kernel split as a second case."""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case,split", RUNS)
def test_a_partial_failure_evicts_the_one_at_fault_and_the_run_goes_on(
        endpoint: str, workers: Any, tmp_path: Path, case: str, split: tuple[str, ...]) -> None:
    faults, at_fault, evidence = CASES[case]
    names = ("a", "b", "c")
    for name in names:
        workers(name, faults=faults.get(name, WorkerFaults()))
    run_dir = tmp_path / "run"
    master = start_master(endpoint, run_dir, len(names), "--limit", str(RUN_IMAGES), *split)
    out, err = finish(master)
    events = records(run_dir)
    told = story(run_dir, sorted(at_fault)[0])
    assert events[-1]["type"] == "run_end" and events[-1]["status"] == "completed", told
    recoveries = [r for r in events if r["type"] == "recovery"]
    assert 1 <= len(recoveries) <= MAX_RECOVERIES, json.dumps(recoveries, indent=1) + told
    assert evidence in recoveries[0]["reason"], (recoveries[0], told)
    blamed = {r["participant"] for r in recoveries}
    assert blamed <= at_fault, (blamed, told)  # never an honest third
    evicted = [name for name in names if name in blamed
               and any(d["participant"] == name and d["kernels"] > 0
                       for layer in recoveries[-1].get("counts", [])
                       for d in layer["participants"])]
    assert not evicted, (evicted, told)
    last = [r for r in events if r["type"] == "step"][-1]
    holding = {d["participant"] for layer in last["layers"] for d in layer["participants"]
               if d["kernels"] > 0}
    assert not (holding & blamed), (holding, told)  # the one at fault is out
    assert set(names) - at_fault <= holding, (holding, told)  # the honest ones go on
    epochs = [r for r in events if r["type"] == "epoch"]
    assert epochs and epochs[-1]["test_accuracy"] >= 0.9, epochs
    assert "Traceback" not in out + err
