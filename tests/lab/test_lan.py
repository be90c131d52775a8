"""Workers on other 'machines': network namespaces joined by bandwidth-capped veth links."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hetconv.lab import LanHost, LocalWorkers, free_port, netns_unavailable_reason
from hetconv.lab.network import forwarding_unavailable_reason
from tests.conftest import SMALL_RUN, epoch_records, run_hetconv, step_losses

pytestmark = [pytest.mark.lab, pytest.mark.integration]
# not serial: no CPU quotas and nothing timed (the loss trace and the accuracy against the
# local run, the devices that joined), so it runs in part 1 beside other tests; its host
# addresses (LanHost 1 and 2: 10.77.1-2.1) are no other test's
REASON = netns_unavailable_reason()


@pytest.fixture
def lan() -> Iterator[list[LanHost]]:
    hosts: list[LanHost] = []
    unrouted = forwarding_unavailable_reason()  # the default peer plane: worker to worker
    if unrouted is not None:
        pytest.skip(f"cannot emulate a routed LAN here: {unrouted}")
    try:
        hosts = [LanHost(1, rate="200mbit"), LanHost(2, rate="100mbit")]
        yield hosts
    finally:
        for host in hosts:
            host.remove()


@pytest.mark.timeout(200)
@pytest.mark.skipif(REASON is not None, reason=f"cannot emulate a LAN here: {REASON}")
@pytest.mark.parametrize("flags", [(), ("--split", "equal"), ("--split", "equal", "--split-by", "kernels")],
                         ids=["defaults", "equal-split", "equal-kernel-split"])
def test_training_over_capped_links_reproduces_the_local_run(
        lan: list[LanHost], tmp_path: Path, local_reference: Path, flags: tuple[str, ...]
) -> None:
    """Under the defaults the master may train alone from set-up on this small network
    (its own measure); ``--split equal`` makes it compute beside both workers, so the
    pieces cross the capped links, the master's to each worker from its address on the
    link toward it (a master with two interfaces: its pieces were once dropped)."""
    port = free_port()
    specs = [{"name": f"lan{index}", "netns": host.netns} for index, host in enumerate(lan)]
    groups = [LocalWorkers(f"tcp://{host.host_address}:{port}", [spec], log_dir=tmp_path)
              for host, spec in zip(lan, specs)]
    try:
        for group in groups:
            group.__enter__()
        run_dir = tmp_path / "run"
        result = run_hetconv("train", "--listen", f"tcp://*:{port}", "--min-workers", "2",
                             "--wait", "30", *SMALL_RUN, *flags, "--run-dir", str(run_dir),
                             timeout=150)
    finally:
        for group in groups:  # every worker told first: they wind down together
            for worker in group.workers:
                worker.terminate()
        for group in groups:
            group.__exit__()
    assert result.returncode == 0, result.stderr
    np.testing.assert_allclose(step_losses(run_dir)[:100], step_losses(local_reference)[:100],
                               rtol=1e-4)
    assert abs(epoch_records(run_dir)[0]["test_accuracy"]
               - epoch_records(local_reference)[0]["test_accuracy"]) <= 0.005
    devices = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if '"type":"devices"' in line][0]["devices"]
    assert {d["id"] for d in devices} == {"master", "lan0", "lan1"}
    recoveries = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                  if '"type":"recovery"' in line]
    assert not recoveries, recoveries  # nothing failed on the way
    if flags:  # every participant computed: pieces crossed both capped links
        assert computing(run_dir) == {"master", "lan0", "lan1"}


def computing(run_dir: Path) -> set[str]:
    """Who computed a conv layer's share: the sample split's plan record, or the
    kernel split's first calibration record (which names each participant's kernels)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plans = [r for r in records if r["type"] == "plan"]
    if plans:
        return set(plans[0]["chosen"])
    first = next(r for r in records if r["type"] == "calibration")
    return {p["participant"] for p in first["participants"] if p["kernels"] > 0}
