"""How much of its CPU quota each emulated machine uses in training, and its CPU per step,
for hetconv and PyTorch DDP in one ``hetconv bench scale`` invocation.

On the lab's quota machines a step cannot be shorter than its busiest machine's CPU per
step over its quota; what is left over is time that machine waits with quota unused.
This runs ``hetconv bench scale ARGS`` (as root: the lab) while a thread samples, every
0.2 s, every lab cgroup (``/sys/fs/cgroup/cpu/hetconv-*``): its quota and the summed
CPU time (user + system, every thread) of the processes in it. Afterwards, per run of the
work directory:

- hetconv: the longest series of step records in ``metrics.jsonl`` after the first
  ``SKIP_STEPS`` with no other record between them (no snapshot, test pass or re-plan
  inside; each record's ``time`` is when it was written: the window runs from the end
  of the series' first step to the end of its last);
- DDP: the timed steps' ``window`` in ``ddp.json`` (rank 0's clock; the ranks step
  together);

and per machine alive over the whole window: CPU per step (ms; in parentheses by
thread: Python's threads, ZeroMQ's background threads) and the
share of its quota it used over the window. Prints a table per run and repeat.

    python docs/figures/ab/machine-cpu.py --work-dir DIR -- ARGS OF hetconv bench scale
    python docs/figures/ab/machine-cpu.py --work-dir DIR --samples FILE   # analyse again
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

CGROUPS = Path("/sys/fs/cgroup/cpu")
SKIP_STEPS = 5
TICKS = os.sysconf("SC_CLK_TCK")


def sample_forever(out: Path, stop: threading.Event, period_s: float = 0.2) -> None:
    """Append one JSON line per lab cgroup and sample: [time, cgroup, quota cores, CPU s,
    first process's command line]."""
    commands: dict[str, str] = {}
    with out.open("w") as file:
        while not stop.is_set():
            now = time.time()
            for group in CGROUPS.glob("hetconv-*"):
                try:
                    quota = int((group / "cpu.cfs_quota_us").read_text())
                    period = int((group / "cpu.cfs_period_us").read_text())
                    pids = (group / "cgroup.procs").read_text().split()
                except OSError:
                    continue
                cpu = 0.0
                threads: dict[str, float] = {}
                for pid in pids:
                    try:
                        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                        cpu += (int(fields[11]) + int(fields[12])) / TICKS
                        for task in Path(f"/proc/{pid}/task").iterdir():
                            name, rest = (task / "stat").read_text().split("(", 1)[1].rsplit(
                                ")", 1)
                            kind = thread_kind(name)
                            ticks = rest.split()
                            threads[kind] = threads.get(kind, 0.0) + (
                                int(ticks[11]) + int(ticks[12])) / TICKS
                        if group.name not in commands:
                            commands[group.name] = Path(f"/proc/{pid}/cmdline").read_text(
                                ).replace("\0", " ")[:200]
                    except OSError:
                        pass
                if pids:
                    file.write(json.dumps([now, group.name, quota / period, cpu,
                                           commands.get(group.name, ""), threads]) + "\n")
            file.flush()
            stop.wait(period_s)


def thread_kind(name: str) -> str:
    """A thread's part: ZeroMQ's background threads (libzmq names them) or Python's
    (Python 3.11 does not name its threads for the OS)."""
    return "zmq" if name.startswith("ZMQbg") else "python"


def cpu_at(series: list[tuple[float, float]], t: float) -> float | None:
    """CPU seconds at time ``t``, linear between the samples around it (None outside)."""
    times = [s[0] for s in series]
    i = bisect.bisect_left(times, t)
    if i == 0 or i >= len(series):
        return None
    (t0, c0), (t1, c1) = series[i - 1], series[i]
    return c0 + (c1 - c0) * (t - t0) / max(t1 - t0, 1e-9)


def windows(work_dir: Path) -> list[tuple[str, float, float, int]]:
    """(run/repeat, start, end, steps) of every run in a bench work directory."""
    found = []
    for metrics in sorted(work_dir.glob("*/repeat*/metrics.jsonl")):
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        best: list[dict[str, object]] = []
        run: list[dict[str, object]] = []
        seen = 0
        for record in records:  # steps with nothing between them (no snapshot, test pass)
            if record.get("type") == "step":
                seen += 1
                if seen > SKIP_STEPS:
                    run.append(record)
                    best = max(best, run, key=len)
            else:
                run = []
        if len(best) > 2:  # from the end of its first step to the end of its last
            found.append((str(metrics.parent.relative_to(work_dir)), float(best[0]["time"]),
                          float(best[-1]["time"]), len(best) - 1))
    for result in sorted(work_dir.glob("*/repeat*/ddp.json")):
        record = json.loads(result.read_text())
        if record.get("window") and record["window"][1] > record["window"][0]:
            found.append((str(result.parent.relative_to(work_dir)), record["window"][0],
                          record["window"][1], len(record["step_s"])))
    return sorted(found, key=lambda w: w[1])


def report(samples: Path, work_dir: Path) -> None:
    series: dict[str, list[tuple[float, float]]] = {}
    quota: dict[str, float] = {}
    command: dict[str, str] = {}
    by_thread: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for line in samples.read_text().splitlines():
        t, group, cores, cpu, cmd, threads = json.loads(line)
        series.setdefault(group, []).append((t, cpu))
        for kind, seconds in threads.items():
            by_thread.setdefault((group, kind), []).append((t, seconds))
        quota[group], command[group] = cores, cmd or command.get(group, "")
    for name, start, end, steps in windows(work_dir):
        rows = []
        for group, points in series.items():
            a, b = cpu_at(points, start), cpu_at(points, end)
            if a is None or b is None:
                continue
            kind = ("DDP rank" if "hetconv.bench.ddp" in command[group] else
                    "master" if " train " in command[group] else
                    "worker " + command[group].split("--name ")[-1].split()[0]
                    if "--name " in command[group] else "?")
            parts = []
            for part in ("python", "zmq"):
                pa, pb = (cpu_at(by_thread.get((group, part), []), t) for t in (start, end))
                if pa is not None and pb is not None and pb > pa:
                    parts.append(f"{part} {(pb - pa) / steps * 1e3:.1f}")
            rows.append((kind, (b - a) / steps * 1e3, (b - a) / (end - start) / quota[group],
                         ", ".join(parts)))
        if rows:
            print(f"{name}: {steps} steps, {(end - start) / steps * 1e3:.1f} ms a step; "
                  + "; ".join(f"{k} {ms:.1f} ms CPU a step ({parts}), {used:.0%} of its quota"
                              for k, ms, used, parts in sorted(rows)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--samples", type=Path, default=None,
                        help="analyse these samples again instead of running the bench")
    parser.add_argument("bench", nargs="*", help="the arguments of hetconv bench scale")
    args = parser.parse_args()
    samples = args.samples or args.work_dir.with_name(args.work_dir.name + "-cpu.jsonl")
    if args.samples is None:
        stop = threading.Event()
        sampler = threading.Thread(target=sample_forever, args=(samples, stop), daemon=True)
        sampler.start()
        command = [sys.executable, "-m", "hetconv", "bench", "scale", *args.bench,
                   "--work-dir", str(args.work_dir)]
        print("$ " + " ".join(command), flush=True)
        code = subprocess.call(command, stdout=sys.stdout, stderr=subprocess.STDOUT)
        stop.set()
        sampler.join()
        if code:
            raise SystemExit(f"hetconv bench scale failed ({code})")
    report(samples, args.work_dir)


if __name__ == "__main__":
    main()
