"""Faults a LAN brings (root: network namespaces, tc, CPU quotas; skipped otherwise):
a short link cut costs no failover, a long one costs a failover and a rejoin, and a
machine that slows down loses kernels (docs/resilience.md)."""
from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetconv.lab import LanHost, LocalWorkers, free_port, netns_unavailable_reason
from hetconv.lab.quota import cpu_quota_unavailable_reason
from tests.conftest import child_env, hetconv_command, run_hetconv
from tests.integration.test_failover import final_losses, records, steps_done

pytestmark = [pytest.mark.lab, pytest.mark.integration]
REASON = netns_unavailable_reason()
RUN = ["--data", "synthetic", "--limit", "3200", "--test-limit", "128", "--arch", "4:8",
       "--epochs", "4", "--batch", "64", "--threads", "1", "--no-progress", "--seed", "7",
       "--checkpoint-every", "10", "--wire-dtype", "float32", "--split", "equal",
       "--data-plane", "star"]
# LanHost namespaces reach the master's host, not each other: the star plane here (the
# peer plane over a switched LAN is what `hetconv bench scale` and tests/lab/
# test_bench_scale.py run)
SLOW = {"HETCONV_TEST_DELAY_PER_KERNEL_S": "0.008"}


@pytest.fixture
def lan() -> Iterator[list[LanHost]]:
    hosts: list[LanHost] = []
    try:
        hosts = [LanHost(11, rate="1gbit"), LanHost(12, rate="1gbit")]
        yield hosts
    finally:
        for host in hosts:
            host.remove()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    local = [a for a in RUN if a not in ("--split", "equal", "--data-plane", "star")]
    assert run_hetconv("train", "--local", *local, "--run-dir", str(run_dir)).returncode == 0
    return final_losses(run_dir)


def train_with_cut(lan: list[LanHost], tmp_path: Path, cut_s: float) -> tuple[Path, Any]:
    """Two workers on LAN hosts; w2's link goes down for ``cut_s`` at step 20."""
    port = free_port()
    groups = [LocalWorkers(f"tcp://{host.host_address}:{port}",
                           [{"name": f"w{i + 1}", "netns": host.netns, "env": SLOW}],
                           log_dir=tmp_path) for i, host in enumerate(lan)]
    for group in groups:
        group.__enter__()
    run_dir = tmp_path / "run"
    try:
        master = subprocess.Popen(
            hetconv_command("train", "--listen", f"tcp://*:{port}", "--min-workers", "2",
                            "--wait", "30", *RUN, "--run-dir", str(run_dir)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
        deadline = time.monotonic() + 90
        while steps_done(run_dir) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        link = lan[1].host_if
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        cut_at = time.time()
        time.sleep(cut_s)
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
        out, err = master.communicate(timeout=240)
        assert master.returncode == 0, err
        return run_dir, cut_at
    finally:
        for group in groups:
            group.__exit__()


@pytest.mark.timeout(300)
@pytest.mark.skipif(REASON is not None, reason=f"cannot emulate a LAN here: {REASON}")
@pytest.mark.parametrize("cut_s", [2.0, 3.0])  # 4 s is evicted: see the issue 10 note
def test_a_short_link_cut_costs_no_failover(lan: list[LanHost], tmp_path: Path,
                                            reference: list[float], cut_s: float) -> None:
    run_dir, _ = train_with_cut(lan, tmp_path, cut_s)
    evictions = [r for r in records(run_dir) if r["type"] == "recovery" and r["gone"]]
    assert not evictions, evictions  # late, not lost: nobody was evicted
    np.testing.assert_allclose(final_losses(run_dir), reference, rtol=1e-4)


@pytest.mark.timeout(300)
@pytest.mark.skipif(REASON is not None, reason=f"cannot emulate a LAN here: {REASON}")
def test_a_long_link_cut_fails_over_then_the_worker_rejoins(lan: list[LanHost], tmp_path: Path,
                                                            reference: list[float]) -> None:
    run_dir, cut_at = train_with_cut(lan, tmp_path, 20.0)
    events = records(run_dir)
    lost = [r for r in events if r["type"] == "recovery" and r["participant"] == "w2"]
    assert lost and lost[0]["time"] - cut_at < 12, lost
    joins = [r for r in events if r["type"] == "replan" and "join" in r["reason"]]
    assert joins and joins[0]["time"] > cut_at + 20, joins
    np.testing.assert_allclose(final_losses(run_dir), reference, rtol=1e-4)


@pytest.mark.timeout(300)
@pytest.mark.skipif(cpu_quota_unavailable_reason() is not None,
                    reason=f"no CPU quotas here: {cpu_quota_unavailable_reason()}")
def test_a_machine_that_slows_down_loses_kernels(endpoint: str, workers: Any,
                                                 tmp_path: Path) -> None:
    busy, steady = workers("busy", cpu_fraction=0.9), workers("steady", cpu_fraction=0.9)
    run_dir = tmp_path / "run"
    args = [a for a in RUN if a not in ("--split", "equal")]
    args[args.index("--arch") + 1] = "16:64"
    slowed: list[int] = []

    def slow_down() -> None:
        deadline = time.monotonic() + 120
        while steps_done(run_dir) < 25 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert busy[0].quota is not None
        busy[0].quota.set(0.2)
        slowed.append(steps_done(run_dir))
    thread = threading.Thread(target=slow_down, daemon=True)
    thread.start()
    result = run_hetconv("train", "--listen", endpoint, "--min-workers", "2", "--wait", "30",
                         "--no-local", *args, "--run-dir", str(run_dir), timeout=280)
    thread.join(5)
    assert result.returncode == 0, result.stderr
    assert steady[0].process.poll() is None
    resplits = [r for r in records(run_dir) if r["type"] == "rebalance"]
    after = [r for r in resplits if slowed and r["step"] >= slowed[0]]
    assert after, resplits
    assert after[0]["step"] - slowed[0] <= 30  # re-split within a few windows

    def kernels(record: dict[str, Any], who: str) -> int:
        return sum(d["kernels"] for layer in record["counts"] for d in layer["devices"]
                   if d["device"] == who)
    assert kernels(after[0], "busy") < kernels(after[0], "steady")
