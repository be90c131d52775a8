"""The wire dtype chosen link by link (``--wire-dtype auto`` under the sample split) on an
emulated switched LAN whose links differ: a worker behind a slow link gets float16, the
workers on fast links keep float32; and the lab's links each at their own cap."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hetconv.bench.scale import machine_rates
from hetconv.errors import UserError
from hetconv.lab import free_port, netns_unavailable_reason
from hetconv.lab.network import SwitchedLan
from hetconv.lab.processes import LocalWorker
from tests.conftest import child_env

pytestmark = [pytest.mark.lab, pytest.mark.integration, pytest.mark.serial]
REASON = netns_unavailable_reason()
RATES = ["1gbit", "1gbit", "1gbit", "10mbit"]  # the master's machine first


def test_bench_rates_are_one_for_all_or_one_per_machine() -> None:
    assert machine_rates("1gbit", 4) == ["1gbit"]
    assert machine_rates("1gbit, 1gbit,10mbit", 3) == ["1gbit", "1gbit", "10mbit"]
    with pytest.raises(UserError, match="2 rates for 3 machines"):
        machine_rates("1gbit,10mbit", 3)
    with pytest.raises(UserError, match="--rate"):
        machine_rates("1gbit,fast", 2)


@pytest.mark.timeout(60)
@pytest.mark.skipif(REASON is not None, reason=f"cannot emulate a LAN here: {REASON}")
def test_every_machine_of_a_switched_lan_gets_its_own_cap() -> None:
    with SwitchedLan(len(RATES), RATES, lan=10) as lan:
        shown = [subprocess.run(["tc", "qdisc", "show", "dev", machine.port],
                                capture_output=True, text=True, check=True).stdout
                 for machine in lan.machines]
    assert [" rate 1Gbit " in text for text in shown] == [True, True, True, False], shown
    assert " rate 10Mbit " in shown[3], shown[3]


@pytest.mark.timeout(240)
@pytest.mark.skipif(REASON is not None, reason=f"cannot emulate a LAN here: {REASON}")
def test_a_worker_behind_a_slow_link_alone_gets_a_float16_wire(tmp_path: Path) -> None:
    """train's defaults but the split (this is the sample split's choice): three workers,
    one behind 10 Mbit; the run completes."""
    run_dir = tmp_path / "run"
    with SwitchedLan(len(RATES), RATES, lan=11) as lan:
        master = lan.machines[0]
        endpoint = f"tcp://{master.address}:{free_port()}"
        workers = [LocalWorker(endpoint, f"w{index}", log_path=tmp_path / f"w{index}.log",
                               netns=machine.netns)
                   for index, machine in enumerate(lan.machines[1:], start=1)]
        try:
            result = subprocess.run(master.command([
                sys.executable, "-m", "hetconv", "train", "--listen", endpoint,
                "--min-workers", "3", "--wait", "60", "--data", "synthetic", "--limit", "1280",
                "--test-limit", "256", "--arch", "4:8", "--batch", "64", "--epochs", "1",
                "--threads", "1", "--no-progress", "--split-by", "samples",
                "--run-dir", str(run_dir)]), capture_output=True, text=True, timeout=200,
                env=child_env())
        finally:
            for worker in workers:
                worker.terminate()
            for worker in workers:
                worker.stop()
    print(result.stdout)  # what the user reads (pytest -s)
    assert result.returncode == 0, result.stderr[-3000:]
    # (and the dense part's features, where --dense-part auto keeps it on the master)
    assert re.search(r"hetconv: wire dtype for the samples' inputs[^:]*: float16 on the link "
                     r"of w3, float32 on the others \(", result.stdout), result.stdout[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plan = next(r for r in records if r["type"] == "plan")
    assert plan["link_wire_dtypes"] == {"w1": "float32", "w2": "float32", "w3": "float16"}
    assert plan["wire_dtype"] == "float32"  # a worker that joins later: its link unprobed
    assert records[-1]["type"] == "run_end" and records[-1]["status"] == "completed"
