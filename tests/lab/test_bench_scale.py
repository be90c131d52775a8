"""``hetconv bench scale`` on a small switched LAN: caps hold, every machine computes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetconv.bench.scale import run_scale_bench
from hetconv.lab import cpu_quota_unavailable_reason, netns_unavailable_reason
from hetconv.lab.network import SwitchedLan, parse_rate_bits
from hetconv.metrics import read_metrics

pytestmark = [pytest.mark.lab, pytest.mark.integration, pytest.mark.serial]
REASON = netns_unavailable_reason() or cpu_quota_unavailable_reason()

RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
connection, _ = server.accept()
total, start = 0, None
while chunk := connection.recv(1 << 20):
    start = start or time.perf_counter()
    total += len(chunk)
print(total, time.perf_counter() - start)
"""
SENDER = """
import socket, sys, time
deadline = time.monotonic() + 10
while True:
    try:
        connection = socket.create_connection((sys.argv[1], int(sys.argv[2])))
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
payload = bytes(1 << 20)
for _ in range(int(sys.argv[3])):
    connection.sendall(payload)
connection.close()
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(REASON is not None, reason=f"cannot emulate a LAN here: {REASON}")
def test_switched_lan_links_run_at_their_cap() -> None:
    rate = "40mbit"
    with SwitchedLan(2, rate, lan=7) as lan:
        a, b = lan.machines
        receiver = subprocess.Popen(b.command([sys.executable, "-c", RECEIVER, b.address, "6001"]),
                                    stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        sender = subprocess.run(a.command([sys.executable, "-c", SENDER, b.address, "6001", "15"]),
                                capture_output=True, text=True, timeout=60)
        assert sender.returncode == 0, sender.stderr
        out, _ = receiver.communicate(timeout=30)
        received_before = b.link_bytes()[0]
    total, seconds = out.split()
    measured_bits = int(total) * 8 / float(seconds)
    assert int(total) == 15 << 20
    assert received_before >= int(total)  # the bytes crossed b's switch port
    assert abs(measured_bits / parse_rate_bits(rate) - 1) <= 0.20, measured_bits


@pytest.mark.timeout(400)
@pytest.mark.skipif(REASON is not None, reason=f"cannot emulate a LAN here: {REASON}")
def test_bench_scale_small_configuration(tmp_path: Path) -> None:
    """Every machine computes (``--split equal``: the planner's timing-based choice, which a
    busy machine sways, is not what this tests), the bench counts their bytes and predicts
    the step, the link probe sees the cap, and the LAN is torn down."""
    lines: list[str] = []
    result = run_scale_bench([(0.5, 0.5, 0.5)], rate="1gbit", arch="8:16", batch=64, limit=512,
                             repeats=1, work_dir=str(tmp_path), data_planes=("star", "peer"),
                             out=lines.append, split="equal", split_by=("kernels",))
    row, peer = result["rows"]
    assert peer["machines"] == "3x[0.5,0.5,0.5] peer" and peer["speedup"] > 0
    assert row["speedup"] > 0 and row["ideal"] == pytest.approx(3.0)
    assert row["master_link_bytes"] > 0 and row["predicted_step_s"] is not None
    assert peer["busiest_worker_link_bytes"] > 0
    assert any(line.startswith("| 3x[0.5,0.5,0.5] star | 1gbit |") for line in lines)
    # the per-layer table: both conv layers of each run, three participants each
    layer_rows = [line for line in lines if line.endswith("| 3 |")]
    assert len(layer_rows) == 4 and layer_rows[0].startswith("| 3x[0.5,0.5,0.5] star | 1 |"), \
        lines[-12:]
    for plane in ("star", "peer"):
        run_dir = tmp_path / f"3x[0.5,0.5,0.5]-{plane}" / "repeat0"
        records = read_metrics(run_dir / "metrics.jsonl")
        for calibration in (r for r in records if r["type"] == "calibration"):
            assert calibration["split"] == "equal"
            assert [(d["participant"], d["kernels"] > 0) for d in calibration["participants"]] == [
                ("master", True), ("m1", True), ("m2", True)], calibration
        steps = [r for r in records if r["type"] == "step"]
        assert steps and all({d["participant"] for d in layer["participants"]} == {"master", "m1", "m2"}
                             for step in steps for layer in step["layers"])
        # the probe saw the cap (1 Gbit/s), not loopback: "link to m1: 941 Mbit/s down, ..."
        log = (run_dir.parent / "repeat0.log").read_text()
        probed = re.findall(r"link to (m\d): (\d+) Mbit/s down, (\d+) Mbit/s up", log)
        assert {name for name, _, _ in probed} == {"m1", "m2"}, log[-2000:]
        for name, down, up in probed:
            assert all(300 < int(rate) < 1300 for rate in (down, up)), (name, down, up)
    assert (tmp_path / "scale.json").exists()
    assert not [line for line in subprocess.run(["ip", "netns"], capture_output=True,
                                                text=True).stdout.splitlines()
                if line.startswith(f"hcm{os.getpid() % 10000}")]  # ours torn down


@pytest.mark.timeout(300)
@pytest.mark.skipif(REASON is not None, reason=f"cannot emulate a LAN here: {REASON}")
def test_on_a_slow_lan_the_master_trains_alone(tmp_path: Path) -> None:
    lines: list[str] = []
    run_scale_bench([(0.5, 0.5)], rate="10mbit", arch="8:16", batch=64, limit=256,
                    repeats=1, work_dir=str(tmp_path), epochs=1, out=lines.append,
                    split_by=("kernels",))
    records = read_metrics(tmp_path / "2x[0.5,0.5]-peer" / "repeat0" / "metrics.jsonl")
    plan = next(r for r in records if r["type"] == "plan")
    assert plan["chosen"] == ["master"], plan
    for link in plan["links"]:  # the probe saw the 10 Mbit/s cap
        assert 0.3 * 1.25e6 < link["down_bytes_per_s"] < 1.3 * 1.25e6, link
    steps = [r for r in records if r["type"] == "step"]
    assert steps and all(d["participant"] == "master"
                         for s in steps for layer in s["layers"] for d in layer["participants"])
    assert records[-1]["type"] == "run_end" and records[-1]["status"] == "completed"


@pytest.mark.timeout(300)
@pytest.mark.skipif(REASON is not None, reason=f"cannot emulate a LAN here: {REASON}")
def test_dilated_runs_get_every_quota_and_link_times_f(tmp_path: Path) -> None:
    """``--dilate 1 --dilate 0.5``: the same configuration on the plain lab and on one with
    half the quotas and half the link rate, interleaved; the dilated table puts the step
    times F beside the plain run's."""
    lines: list[str] = []
    result = run_scale_bench([(0.5, 0.5)], rate="200mbit", arch="8:16", batch=64, limit=256,
                             repeats=1, work_dir=str(tmp_path), epochs=1, out=lines.append,
                             split="equal", dilations=(1.0, 0.5), split_by=("kernels",))
    plain, dilated = result["rows"]
    assert (plain["machines"], plain["rate"], plain["dilation"]) == (
        "2x[0.5,0.5] peer", "200mbit", 1.0)
    assert (dilated["machines"], dilated["rate"], dilated["dilation"]) == (
        "2x[0.25,0.25] peer", "100mbit", 0.5)
    assert dilated["plain_machines"] == "2x[0.5,0.5] peer"
    assert dilated["baseline_step_s"] > 0  # its own one-machine run, at 0.25 core
    for row, cap in ((plain, 200), (dilated, 100)):  # each run's probe saw its cap (Mbit/s)
        log = (tmp_path / row["machines"].replace(" ", "-") / "repeat0.log").read_text()
        probed = re.findall(r"link to m1: (\d+) Mbit/s down, (\d+) Mbit/s up", log)
        assert probed, log[-2000:]
        assert all(0.3 * cap < int(rate) < 1.3 * cap for rate in probed[0]), (row, probed)
    assert any(line.startswith("| 2x[0.25,0.25] peer | 100mbit |") for line in lines)
    row = next(line for line in lines if line.startswith("| 2x[0.25,0.25] peer | 0.5 | 100mbit |"))
    assert row.split(" | ")[5] == f"{plain['step_s'] * 1e3:.1f}"  # the plain run beside it
    assert json.loads((tmp_path / "scale.json").read_text())["dilations"] == [1.0, 0.5]
