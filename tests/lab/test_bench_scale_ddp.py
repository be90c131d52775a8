"""``hetconv bench scale --peer ddp`` on a small switched LAN: PyTorch DDP beside hetconv.

Not ``serial``, unlike tests/lab/test_bench_scale.py: its two machines' quotas (0.6 and
0.3 core) do not add up to the host's cores and it asserts no time or rate, only that
every run, trace and table is there; so it runs beside the other tests (deploy/test.sh,
part 1), which makes its steps slower, not its checks weaker."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from hetconv.bench.scale import run_scale_bench
from hetconv.lab import cpu_quota_unavailable_reason, netns_unavailable_reason

pytestmark = [pytest.mark.lab, pytest.mark.integration]
REASON = netns_unavailable_reason() or cpu_quota_unavailable_reason()


@pytest.mark.timeout(400)
@pytest.mark.skipif(REASON is not None, reason=f"cannot emulate a LAN here: {REASON}")
def test_bench_scale_runs_pytorch_ddp_beside_hetconv(tmp_path: Path) -> None:
    """``--peer ddp``: DDP over gloo on the same namespaces and quotas (even and by-speed
    batch splits), PyTorch alone, and a table with both steps and their ratio; hetconv
    with ``--split-by auto`` (what a user gets: the sample split here), its batch-norm
    barriers traced in every process of the run."""
    pytest.importorskip("torch")
    lines: list[str] = []
    result = run_scale_bench([(0.6, 0.3)], rate="1gbit", arch="8:16", batch=64, limit=512,
                             repeats=1, work_dir=str(tmp_path), data_planes=("peer",),
                             epochs=1, out=lines.append, split="equal", peer="ddp",
                             split_by=("auto",))
    (row,) = result["rows"]
    # both participants traced both barriers of both layers: a wait per participant each
    assert sorted(row["barriers"]) == ["0:moments", "0:sums", "1:moments", "1:sums"], row
    for barrier in row["barriers"].values():
        assert barrier["per_step"] == pytest.approx(2.0), row["barriers"]
        assert barrier["skew_s"] + barrier["delivery_s"] == pytest.approx(barrier["wait_s"])
        assert 0 <= barrier["to_read_s"] <= barrier["delivery_s"]
    traces = list((tmp_path / "2x[0.6,0.3]-auto" / "repeat0" / "trace").glob("trace-*.jsonl"))
    assert len(traces) == 2  # the master's process and the worker's, in their namespaces
    assert any(line.startswith("|  | per participant and step | all |") for line in lines)
    # one typical step laid out: both participants at all four barriers, and their results
    timeline = row["timeline"]
    assert sorted(timeline["participants"]) == ["m1", "master"], timeline
    for entry in timeline["participants"].values():
        assert [mark[:2] for mark in entry["marks"]] == [
            [0, "moments"], [1, "moments"], [1, "sums"], [0, "sums"]], entry
        # two steps in flight: a participant done with the step before starts this one
        # before the master turns to it (a negative time), never a whole step before
        assert all(-timeline["step_s"] < mark[2] < timeline["step_s"]
                   for mark in entry["marks"]), entry
        assert 0 < entry["result_s"] < 10
    assert any(line.startswith("| participant | layer 1 forward ms | layer 2 forward ms |")
               for line in lines)
    for key in ("ddp_even_step_s", "ddp_speed_step_s", "torch_alone_step_s"):
        assert 0 < row[key] < 10, row
    assert row["hetconv_over_ddp_even"] == pytest.approx(row["step_s"] / row["ddp_even_step_s"])
    assert any(line.startswith("| 2x[0.6,0.3] auto | 1gbit |") and line.count("|") == 8
               for line in result["table"])
    # every run's step in each repeat: the baselines', hetconv's and DDP's
    repeats = [line for line in result["table"] if line.startswith("| ")]
    for name in ("baseline-0.6", "2x[0.6,0.3] auto", "ddp-even 2x[0.6,0.3]",
                 "ddp-speed 2x[0.6,0.3]", "ddp-even 1x[0.6]"):
        assert any(line.startswith(f"| {name} | ") and line.endswith(" | 0% |")
                   for line in repeats), (name, result["table"])
    log = (tmp_path / "ddp-speed-2x[0.6,0.3]" / "repeat0" / "rank1.log")
    assert log.exists()
    # rank 0 ran in its machine's quota (it joined after importing PyTorch)
    ranks = json.loads((tmp_path / "ddp-speed-2x[0.6,0.3]" / "repeat0" / "ddp.json").read_text())
    assert any(":cpu" in line and "/hetconv-" in line for line in ranks["cgroups"]), ranks
    # every rank's compute-only step (no_sync), and DDP's step broken down beside hetconv's
    even = json.loads((tmp_path / "ddp-even-2x[0.6,0.3]" / "repeat0" / "ddp.json").read_text())
    assert len(even["compute_s"]) == 2 and all(0 < s < 10 for s in even["compute_s"]), even
    assert row["ddp_even_compute_s"] == pytest.approx(even["compute_s"])
    header = next(i for i, line in enumerate(result["table"]) if "DDP rank compute ms" in line)
    assert result["table"][header + 2].startswith("| 2x[0.6,0.3] auto | "), result["table"]
    # every machine's CPU per step and quota used over the timed steps, both systems
    assert sorted(row["alone_cpu"]) == ["master"] and sorted(row["torch_alone_cpu"]) == ["rank 0"]
    for key, roles in (("cpu", ["m1", "master"]), ("ddp_even_cpu", ["rank 0", "rank 1"]),
                       ("ddp_speed_cpu", ["rank 0", "rank 1"])):
        assert sorted(row[key]) == roles, (key, row.get(key))
        for figures in row[key].values():
            assert 0 < figures["cpu_s"] < 10 and 0 <= figures["zmq_s"] <= figures["cpu_s"]
            assert 0 < figures["quota_used"] < 1.5, row[key]
        assert sorted(m["quota_cores"] for m in row[key].values()) == pytest.approx([0.3, 0.6])
    assert row["cpu"]["m1"]["zmq_s"] > 0  # the worker's exchanges run on ZeroMQ's thread
    for run in ("hetconv", "DDP even split", "DDP split by speed"):
        assert any(line.startswith(f"| 2x[0.6,0.3] auto | {run} | ") and line.count("|") == 9
                   and "x) | " in line for line in result["table"]), (run, result["table"])
    assert result["table"][header + 2].count("|") == 8, result["table"]
    assert not [line for line in subprocess.run(["ip", "netns"], capture_output=True,
                                                text=True).stdout.splitlines()
                if line.startswith(f"hcm{os.getpid() % 10000}")]  # ours torn down
