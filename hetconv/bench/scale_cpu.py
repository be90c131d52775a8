"""What each emulated machine's CPU did over a run's timed steps, in ``hetconv bench
scale``: its CPU per step and the share of its quota it used.

A lab machine is a cgroup CPU quota (:mod:`hetconv.lab.quota`), so a step can be no
shorter than its busiest machine's CPU per step over that machine's quota (the *floor*):
what the step takes beyond the floor is time a machine waited with quota unused. The
table puts hetconv's machines beside PyTorch DDP's ranks on the same machines, so a
reader sees whether a gap is CPU (more work per machine) or waiting (quota left unused).

:class:`CpuSampler` (a thread) reads every ``period_s`` the CPU time of every thread of
the processes in the bench's own cgroups; the rest is pure: :func:`steady_window` picks
a run's timed steps from its metrics, :func:`machine_cpu` turns the samples into CPU
per step (seconds) and quota used (a fraction) per machine over that window.
"""
from __future__ import annotations

import bisect
import os
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetconv.lab.quota import CGROUP_CPU_ROOT

CPU_SAMPLE_PERIOD_S = 0.1
"""How often the sampler reads the lab's cgroups (a few hundred microseconds of CPU a
read, outside the machines' quotas)."""

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
"""``/proc/PID/task/TID/stat``'s time unit, per second."""

MIN_WINDOW_STEPS = 3
"""A window shorter than this many steps gives no CPU figures (too few to divide by)."""


@dataclass(frozen=True)
class GroupSample:
    """One reading of one lab cgroup: when (``time.time()``), its quota (cores), the CPU
    seconds (user and system, since each thread started) of its processes' threads:
    ZeroMQ's background threads apart from the rest, and which process it holds."""

    time_s: float
    group: str
    quota_cores: float
    python_s: float
    zmq_s: float
    role: str


def thread_kind(name: str) -> str:
    """``zmq`` for ZeroMQ's background threads (libzmq names them ``ZMQbg/...``), else
    ``python`` (the interpreter's threads: Python 3.11 does not name them for the OS)."""
    return "zmq" if name.startswith("ZMQbg") else "python"


def machine_role(command: str) -> str | None:
    """Which lab process a command line is: ``master`` (``hetconv train``), a worker's
    ``--name`` (``m1``), ``rank N`` (a PyTorch DDP rank), or None (not one of ours yet:
    ``ip netns exec`` before it execs)."""
    words = command.split()
    if "hetconv.bench.ddp" in words and "--rank" in words[:-1]:
        return f"rank {words[words.index('--rank') + 1]}"
    if "worker" in words and "--name" in words[:-1]:
        return words[words.index("--name") + 1]
    if "train" in words and "hetconv" in words:
        return "master"
    return None


def thread_cpu(task: Path) -> tuple[str, float]:
    """A thread's name and CPU seconds from its ``/proc/PID/task/TID`` directory: the
    nanoseconds on a CPU of ``schedstat``, or, where the kernel has no ``schedstat``,
    user + system time of ``stat`` (clock ticks: 10 ms steps). OSError when it ended."""
    stat = (task / "stat").read_text()
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    try:
        return name, int((task / "schedstat").read_text().split()[0]) / 1e9
    except FileNotFoundError:
        fields = stat[stat.rindex(")") + 1:].split()  # field 3 on: state, ppid, ...
        return name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def read_group(path: Path) -> tuple[float, float, float, str | None] | None:
    """A cgroup's quota (cores; None when unlimited), its threads' CPU seconds (Python's,
    ZeroMQ's, :func:`thread_cpu`), and its
    first process's role; None when the group is gone or empty."""
    try:
        quota = int((path / "cpu.cfs_quota_us").read_text())
        period = int((path / "cpu.cfs_period_us").read_text())
        pids = (path / "cgroup.procs").read_text().split()
    except OSError:
        return None
    if not pids or quota <= 0:
        return None
    seconds = {"python": 0.0, "zmq": 0.0}
    role = None
    for pid in pids:
        try:
            if role is None:
                role = machine_role(Path(f"/proc/{pid}/cmdline").read_text().replace(
                    "\0", " "))
            for task in Path(f"/proc/{pid}/task").iterdir():
                name, cpu_s = thread_cpu(task)
                seconds[thread_kind(name)] += cpu_s
        except (OSError, ValueError, IndexError):
            continue  # a thread or process that ended between the reads
    return quota / period, seconds["python"], seconds["zmq"], role


class CpuSampler:
    """Reads, every ``period_s`` on a daemon thread, every cgroup under ``root`` whose
    name starts with ``prefix`` (the bench's own: ``hetconv-<its pid>-``); a context
    manager. :meth:`snapshot` gives the samples so far (a run's, once it ended)."""

    def __init__(self, prefix: str, root: Path = CGROUP_CPU_ROOT,
                 period_s: float = CPU_SAMPLE_PERIOD_S):
        self.prefix, self.root, self.period_s = prefix, root, period_s
        self._samples: list[GroupSample] = []
        self._roles: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def snapshot(self) -> list[GroupSample]:
        with self._lock:
            return list(self._samples)

    def sample(self) -> None:
        """One reading of every matching group (the thread's loop; tests call it)."""
        now = time.time()
        try:
            groups = [p for p in self.root.iterdir() if p.name.startswith(self.prefix)]
        except OSError:
            return
        for group in groups:
            reading = read_group(group)
            if reading is None:
                continue
            quota, python_s, zmq_s, role = reading
            if role is not None:
                self._roles.setdefault(group.name, role)
            if group.name not in self._roles:
                continue
            with self._lock:
                self._samples.append(GroupSample(now, group.name, quota, python_s, zmq_s,
                                                 self._roles[group.name]))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period_s)


def steady_window(records: Sequence[dict[str, Any]], steps: Sequence[dict[str, Any]]
                  ) -> tuple[float, float, int] | None:
    """The CPU window of a run: of its step records ``steps`` (those its figures are
    taken from), the longest series that follow each other in ``records`` with no other
    record between (no snapshot, test pass or re-plan inside), from the end of its first
    step to the end of its last (``time``, ``time.time()``), and how many steps that is;
    None when that is fewer than MIN_WINDOW_STEPS."""
    chosen = {id(step) for step in steps}
    best: list[dict[str, Any]] = []
    run: list[dict[str, Any]] = []
    for record in records:
        if id(record) in chosen and "time" in record:
            run.append(record)
            if len(run) > len(best):
                best = list(run)
        else:
            run = []
    if len(best) - 1 < MIN_WINDOW_STEPS:
        return None
    return float(best[0]["time"]), float(best[-1]["time"]), len(best) - 1


def _value_at(points: Sequence[tuple[float, float]], t: float) -> float | None:
    """The value at ``t``, linear between the readings around it (None outside them)."""
    times = [point[0] for point in points]
    i = bisect.bisect_left(times, t)
    if i == 0 or i >= len(points):
        return None
    (t0, v0), (t1, v1) = points[i - 1], points[i]
    return v0 + (v1 - v0) * (t - t0) / max(t1 - t0, 1e-9)


def machine_cpu(samples: Sequence[GroupSample], window: tuple[float, float, int]
                ) -> dict[str, dict[str, float]]:
    """Per machine (role) read over the whole ``window`` (start, end, steps): ``cpu_s``
    its CPU per step (seconds, every thread), ``zmq_s`` the part in ZeroMQ's threads,
    ``quota_used`` its CPU over the window's wall time over its quota (0..1), and
    ``quota_cores``. Machines whose group was not read before the start and after the
    end are left out."""
    start, end, steps = window
    by_group: dict[str, list[GroupSample]] = {}
    for sample in samples:
        by_group.setdefault(sample.group, []).append(sample)
    figures: dict[str, dict[str, float]] = {}
    for readings in by_group.values():
        readings.sort(key=lambda s: s.time_s)
        python = [(s.time_s, s.python_s) for s in readings]
        zmq = [(s.time_s, s.zmq_s) for s in readings]
        ends = [(_value_at(python, t), _value_at(zmq, t)) for t in (start, end)]
        (p0, z0), (p1, z1) = ends
        if p0 is None or p1 is None or z0 is None or z1 is None or end <= start:
            continue
        used = (p1 - p0) + (z1 - z0)
        quota = readings[-1].quota_cores
        figures[readings[-1].role] = {"cpu_s": used / steps, "zmq_s": (z1 - z0) / steps,
                                      "quota_used": used / (end - start) / quota,
                                      "quota_cores": quota}
    return figures


def merge_cpu_repeats(repeats: Sequence[dict[str, dict[str, float]]]
                      ) -> dict[str, dict[str, float]]:
    """Per machine, the median of each figure over the repeats that measured it."""
    roles = sorted({role for repeat in repeats for role in repeat})
    return {role: {key: statistics.median(r[role][key] for r in repeats if role in r)
                   for key in ("cpu_s", "zmq_s", "quota_used", "quota_cores")}
            for role in roles}


def alone_cpu_s(machines: dict[str, dict[str, float]]) -> float | None:
    """One machine alone's CPU per step (the only machine of its run), or None."""
    return next(iter(machines.values()))["cpu_s"] if len(machines) == 1 else None


def floor_s(machines: dict[str, dict[str, float]]) -> float:
    """The shortest step the quotas allow: the largest CPU per step over quota."""
    return max(m["cpu_s"] / m["quota_cores"] for m in machines.values())


def format_cpu_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown lines: per configuration, hetconv's machines and PyTorch DDP's ranks
    (``cpu`` and ``ddp_even_cpu`` / ``ddp_speed_cpu`` of a row: :func:`merge_cpu_repeats`
    figures), their step, CPU per step, quota used, all machines' CPU per step over one
    machine alone's (``alone_cpu``, ``torch_alone_cpu``) and the floor; none without
    figures."""
    runs: list[tuple[dict[str, Any], str, dict[str, dict[str, float]], float, float | None]]
    runs = []
    for row in rows:
        for name, key, step_key, alone_key in (
                ("hetconv", "cpu", "step_s", "alone_cpu"),
                ("DDP even split", "ddp_even_cpu", "ddp_even_step_s", "torch_alone_cpu"),
                ("DDP split by speed", "ddp_speed_cpu", "ddp_speed_step_s", "torch_alone_cpu")):
            if row.get(key) and row.get(step_key):
                alone = row.get(alone_key) or {}
                runs.append((row, name, row[key], float(row[step_key]),
                             alone_cpu_s(alone)))
    if not runs:
        return []
    lines = ["", "CPU per step per machine over the timed steps (every thread of its processes, "
             "read from /proc every 0.1 s; medians over the repeats, lowest-highest machine) "
             "and the share of its quota it used. A step can be no shorter than the floor, "
             "the busiest machine's CPU per step over its quota; the rest of the step is "
             "quota left unused while a machine waited. All machines' CPU per step is "
             "their sum, and in brackets that over the CPU per step of one machine alone "
             "(hetconv alone for hetconv, PyTorch alone for DDP; the fastest machine's run): "
             "what splitting the step adds in CPU.", "",
             "| machines (core each) | run | step ms | CPU per step ms | of it ZeroMQ's "
             "threads ms | quota used | all machines' CPU per step ms (over one alone) | "
             "floor ms |",
             "|---|---|---|---|---|---|---|---|"]

    def span(values: list[float], scale: float, unit: str = "") -> str:
        low, high = min(values) * scale, max(values) * scale
        return (f"{low:.1f}{unit}" if abs(high - low) < 0.05
                else f"{low:.1f}-{high:.1f}{unit}")

    for row, name, machines, step, alone in runs:
        ms = list(machines.values())
        total = sum(m["cpu_s"] for m in ms)
        over = "" if not alone else f" ({total / alone:.2f}x)"
        lines.append(f"| {row['machines']} | {name} | {step * 1e3:.1f} | "
                     f"{span([m['cpu_s'] for m in ms], 1e3)} | "
                     f"{span([m['zmq_s'] for m in ms], 1e3)} | "
                     f"{span([m['quota_used'] for m in ms], 100, ' %')} | "
                     f"{total * 1e3:.1f}{over} | {floor_s(machines) * 1e3:.1f} |")
    return lines
