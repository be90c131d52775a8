"""``hetconv bench chaos``, short: on loopback, a master and 4 workers, a fault-free run
and a run with a fixed seed's SIGKILL, SIGSTOP and restart faults; every fault is
survived and the final accuracy matches the fault-free run's."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import run_hetconv

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# seed 2 draws sigkill, sigstop and restart at about 10, 17 and 27 s (plan_faults)
CHAOS = ["bench", "chaos", "--minutes", "0.5", "--interval-min", "7", "--interval-max", "10",
         "--faults", "sigkill,sigstop,restart", "--seed", "2", "--arch", "4:8", "--batch", "64",
         "--limit", "6400", "--test-limit", "256", "--epochs", "5", "--checkpoint-every", "10"]
SLOW_WORKERS = "0.006"  # HETCONV_TEST_DELAY_PER_KERNEL_S: steps long enough to fault mid-run


@pytest.mark.timeout(420)
def test_every_fault_is_survived_and_the_accuracy_kept(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETCONV_TEST_DELAY_PER_KERNEL_S", SLOW_WORKERS)  # the workers inherit it
    figures = tmp_path / "chaos.md"
    result = run_hetconv(*CHAOS, "--work-dir", str(tmp_path / "work"), "--markdown",
                         str(figures), timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    summary = json.loads((tmp_path / "work" / "chaos.json").read_text(encoding="utf-8"))
    assert summary["completed"]
    assert summary["faults_injected"] >= 2, summary
    assert summary["faults_survived"] == summary["faults_injected"]
    faults = summary["faults"]
    assert {f["kind"] for f in faults} >= {"sigkill", "sigstop"}
    killed = next(f for f in faults if f["kind"] == "sigkill")
    assert killed["effect"] == "recovery" and killed["time_lost_s"] > 0  # a death costs a step
    assert abs(summary["chaos_accuracy"] - summary["fault_free_accuracy"]) <= 0.02
    text = figures.read_text(encoding="utf-8")
    assert "- command: `hetconv bench chaos --minutes 0.5 " in text
    assert "| 1 |" in text and "sigkill" in text
    assert not _children_left(os.getpid())  # every worker and master it started is gone


def _children_left(pid: int) -> list[int]:
    """hetconv processes still running that descend from this test."""
    import psutil

    return [child.pid for child in psutil.Process(pid).children(recursive=True)
            if "hetconv" in " ".join(child.cmdline())]
