"""The quota table of ``hetconv bench scale`` (hetconv/bench/scale_cpu.py): which lab
process a cgroup holds, the timed steps' window, CPU per step and quota used from the
readings, the medians over repeats, the table, and the sampler on a cgroup tree made of
plain files (no root needed) holding a real process."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hetconv.bench.scale_cpu import (
    CpuSampler,
    GroupSample,
    format_cpu_table,
    machine_cpu,
    machine_role,
    merge_cpu_repeats,
    steady_window,
    thread_cpu,
    thread_kind,
)


@pytest.mark.parametrize("command, role", [
    ("/usr/bin/python -m hetconv train --listen tcp://10.0.0.1:5 --run-dir x", "master"),
    ("/usr/bin/python -m hetconv train --local --data synthetic", "master"),
    ("/usr/bin/python -m hetconv worker --master tcp://10.0.0.1:5 --name m3 --once", "m3"),
    ("/usr/bin/python -m hetconv.bench.ddp --rank 2 --world 4 --address x", "rank 2"),
    ("ip netns exec hetconv-lab-1 /usr/bin/python", None),
    ("/usr/bin/python -m hetconv worker --name", None),
])
def test_machine_role_names_each_lab_process(command: str, role: str | None) -> None:
    assert machine_role(command) == role


def test_zeromq_threads_are_told_apart() -> None:
    assert thread_kind("ZMQbg/IO/0") == "zmq"
    assert thread_kind("ZMQbg/Reaper") == "zmq"
    assert thread_kind("python") == "python"


def _step(n: int, t: float) -> dict[str, object]:
    return {"type": "step", "step": n, "time": t, "step_s": 0.1}


def test_steady_window_is_the_longest_series_without_other_records() -> None:
    records = [_step(1, 1.0), _step(2, 1.1), {"type": "snapshot", "time": 1.15},
               _step(3, 1.2), _step(4, 1.3), _step(5, 1.4), _step(6, 1.5),
               {"type": "test", "time": 1.55}, _step(7, 1.6)]
    steps = [r for r in records if r["type"] == "step"]
    assert steady_window(records, steps) == (1.2, 1.5, 3)
    # only the figures' steps count: without step 3 the longest series is 4-6
    assert steady_window(records, [s for s in steps if s["step"] != 3]) is None
    assert steady_window(records, []) is None


def _readings(group: str, role: str, quota: float, rate: float, zmq_rate: float,
              times: list[float]) -> list[GroupSample]:
    """A machine busy at ``rate`` cores (``zmq_rate`` of it in ZeroMQ's threads)."""
    return [GroupSample(t, group, quota, (rate - zmq_rate) * t, zmq_rate * t, role)
            for t in times]


def test_machine_cpu_divides_the_window_by_its_steps_and_its_quota() -> None:
    times = [0.1 * i for i in range(0, 31)]  # readings from 0 to 3 s
    samples = (_readings("g1", "master", 0.5, 0.45, 0.05, times)
               + _readings("g2", "m1", 0.25, 0.25, 0.0, times)
               + _readings("g3", "m2", 0.5, 0.5, 0.0, times[:12]))  # ended at 1.1 s
    figures = machine_cpu(samples, (1.0, 2.0, 10))
    assert sorted(figures) == ["m1", "master"]  # m2 was not read after the window
    master = figures["master"]
    assert master["cpu_s"] == pytest.approx(0.045)  # 0.45 s of CPU over 10 steps
    assert master["zmq_s"] == pytest.approx(0.005)
    assert master["quota_used"] == pytest.approx(0.9)
    assert master["quota_cores"] == 0.5
    assert figures["m1"]["quota_used"] == pytest.approx(1.0)
    # a window between readings is interpolated; one outside them gives nothing
    assert machine_cpu(samples, (1.05, 2.05, 10))["master"]["cpu_s"] == pytest.approx(0.045)
    assert machine_cpu(samples, (2.5, 3.5, 10)) == {}


def test_merge_cpu_repeats_takes_each_figure_s_median() -> None:
    one = {"master": {"cpu_s": 0.08, "zmq_s": 0.005, "quota_used": 0.9, "quota_cores": 0.45}}
    two = {"master": {"cpu_s": 0.10, "zmq_s": 0.007, "quota_used": 0.8, "quota_cores": 0.45},
           "m1": {"cpu_s": 0.07, "zmq_s": 0.004, "quota_used": 0.7, "quota_cores": 0.45}}
    three = {"master": {"cpu_s": 0.09, "zmq_s": 0.006, "quota_used": 1.0,
                        "quota_cores": 0.45}}
    merged = merge_cpu_repeats([one, two, three])
    assert merged["master"] == pytest.approx(
        {"cpu_s": 0.09, "zmq_s": 0.006, "quota_used": 0.9, "quota_cores": 0.45})
    assert merged["m1"]["cpu_s"] == pytest.approx(0.07)  # only the repeat that had it


def test_cpu_table_sets_hetconv_beside_ddp_with_the_floor() -> None:
    def machine(cpu_ms: float, quota: float, used: float) -> dict[str, float]:
        return {"cpu_s": cpu_ms / 1e3, "zmq_s": 0.005, "quota_used": used,
                "quota_cores": quota}

    row = {"machines": "2x[0.5,0.25] auto", "step_s": 0.200, "ddp_even_step_s": 0.180,
           "ddp_speed_step_s": 0.170,
           "cpu": {"master": machine(80, 0.5, 0.8), "m1": machine(45, 0.25, 0.9)},
           "alone_cpu": {"master": machine(100, 0.5, 1.0)},
           "ddp_even_cpu": {"rank 0": machine(72, 0.5, 0.8), "rank 1": machine(40, 0.25, 0.9)}}
    lines = format_cpu_table([row])
    body = [line for line in lines if line.startswith("| 2x")]
    # all machines: 125 ms a step, 1.25 times hetconv alone's 100; floor: the busiest
    # machine's CPU over its quota, m1's 45 ms / 0.25 = 180 ms
    assert body[0] == ("| 2x[0.5,0.25] auto | hetconv | 200.0 | 45.0-80.0 | 5.0 | "
                       "80.0-90.0 % | 125.0 (1.25x) | 180.0 |")
    # without PyTorch alone's figures, no ratio
    assert body[1] == ("| 2x[0.5,0.25] auto | DDP even split | 180.0 | 40.0-72.0 | 5.0 | "
                       "80.0-90.0 % | 112.0 | 160.0 |")
    assert len(body) == 2  # no by-speed figures: no row for them
    assert format_cpu_table([{"machines": "x", "step_s": 0.1}]) == []


def test_sampler_reads_a_group_and_its_process_threads(tmp_path: Path) -> None:
    """A cgroup tree of plain files: one of the bench's groups holding a real process
    whose command line says it is a master, one of another bench, one not ours yet."""
    process = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: pass",
                                "hetconv", "train"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for name, pid in (("hetconv-7-aaaaaa", process.pid), ("hetconv-8-bbbbbb", process.pid),
                          ("hetconv-7-cccccc", other.pid)):
            group = tmp_path / name
            group.mkdir()
            (group / "cpu.cfs_quota_us").write_text("4500\n")
            (group / "cpu.cfs_period_us").write_text("10000\n")
            (group / "cgroup.procs").write_text(f"{pid}\n")
        sampler = CpuSampler("hetconv-7-", root=tmp_path)
        sampler.sample()
        time.sleep(0.3)
        sampler.sample()
        samples = sampler.snapshot()
        assert [s.group for s in samples] == ["hetconv-7-aaaaaa"] * 2  # not 8's, not "other"
        first, second = samples
        assert first.role == "master" and first.quota_cores == pytest.approx(0.45)
        assert second.python_s > first.python_s >= 0  # the spinning process used CPU
        assert second.zmq_s == 0.0
        with CpuSampler("hetconv-7-", root=tmp_path, period_s=0.05) as running:
            time.sleep(0.3)
        assert len(running.snapshot()) >= 2
    finally:
        process.kill()
        other.kill()
        process.wait()
        other.wait()


def test_thread_cpu_reads_schedstat_or_else_the_stat_ticks(tmp_path: Path) -> None:
    """Nanoseconds on a CPU where the kernel has ``schedstat``; user + system clock
    ticks of ``stat`` where it has not (a thread name with a space and a parenthesis)."""
    ticks = os.sysconf("SC_CLK_TCK")
    task = tmp_path / "123"
    task.mkdir()
    fields = ["S", "1", "1", "1", "0", "-1", "0", "0", "0", "0", "0", str(3 * ticks),
              str(ticks), "0", "0"]
    (task / "stat").write_text(f"123 (ZMQbg/IO) 0) {' '.join(fields)}\n")
    assert thread_cpu(task) == ("ZMQbg/IO) 0", pytest.approx(4.0))  # 3 s user + 1 s system
    (task / "schedstat").write_text("2500000000 100 7\n")
    assert thread_cpu(task) == ("ZMQbg/IO) 0", pytest.approx(2.5))
    (task / "stat").unlink()
    with pytest.raises(OSError):  # the thread ended
        thread_cpu(task)
