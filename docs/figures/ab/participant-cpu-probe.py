"""CPU per training step of a sample-split participant, and how much of it is fixed.

Starts ``hetconv train`` (synthetic data, ``--split-by samples``, one thread, the
workers kept: ``--fall-back off``, ``--rebalance off``) with
``WORKERS`` local worker daemons (no quotas), twice per batch: ``STEPS_SHORT`` and
``STEPS_LONG`` steps; the difference of each worker's CPU time (user + system, from
psutil, whole process and its busiest thread, the compute thread) over the difference
of steps is its CPU per step, free of start-up and calibration. A straight line
through the two largest batches' figures gives the fixed CPU per step (slice 0) and
the CPU per sample; a smaller batch shows how far tiny slices fall off that line.
Prints one line per batch and the fit.

    .venv-test/bin/python docs/figures/ab/participant-cpu-probe.py [--arch 32:64]
        [--workers 3] [--batch 16 --batch 64 --batch 128] [--steps 50,250] [--repeats 3]

Medians over repeats and workers. CPU time, not wall time: the host's load moves it
far less than it moves the step time.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from hetconv.lab import LocalWorker, free_port  # noqa: E402


def run(arch: str, batch: int, steps: int, workers: int) -> list[tuple[float, float]]:
    """Per worker: (process CPU s, compute thread CPU s) at the end of a run."""
    port = free_port()
    command = [sys.executable, "-m", "hetconv", "train", "--listen", f"tcp://127.0.0.1:{port}",
               "--min-workers", str(workers), "--data", "synthetic", "--arch", arch,
               "--batch", str(batch), "--limit", str(batch * steps), "--test-limit",
               str(batch), "--epochs", "1", "--split-by", "samples", "--threads", "1",
               "--no-progress", "--rebalance", "off", "--fall-back", "off", "--run-dir",
               f"/tmp/participant-cpu-probe-{port}", "--overwrite"]
    master = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=ROOT)
    daemons = [LocalWorker(f"tcp://127.0.0.1:{port}", f"w{i}", threads=1)
               for i in range(workers)]
    output, _ = master.communicate(timeout=600)
    if master.returncode != 0:
        raise SystemExit(f"train failed:\n{output[-2000:]}")
    figures = []
    for daemon in daemons:
        process = psutil.Process(daemon.process.pid)
        total = process.cpu_times()
        busiest = max(t.user_time + t.system_time for t in process.threads())
        figures.append((total.user + total.system, busiest))
        daemon.stop()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="32:64")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--steps", default="50,250")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    batches = args.batch or [16, 64, 128]
    short, long = (int(s) for s in args.steps.split(","))
    participants = args.workers + 1
    print(f"{args.arch}, {args.workers} workers + the master, one thread each, "
          f"steps {short} and {long}, {args.repeats} repeats; commit "
          + subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip())
    per_step: dict[int, tuple[float, float]] = {}
    for batch in batches:
        process_ms, thread_ms = [], []
        for _ in range(args.repeats):
            a = run(args.arch, batch, short, args.workers)
            b = run(args.arch, batch, long, args.workers)
            for (pa, ta), (pb, tb) in zip(a, b):
                process_ms.append((pb - pa) / (long - short) * 1000)
                thread_ms.append((tb - ta) / (long - short) * 1000)
        per_step[batch] = (statistics.median(process_ms), statistics.median(thread_ms))
        print(f"batch {batch} (about {batch / participants:.0f} samples a participant): "
              f"worker CPU per step {per_step[batch][0]:.2f} ms, its compute thread "
              f"{per_step[batch][1]:.2f} ms (spread {min(thread_ms):.2f}-{max(thread_ms):.2f})")
    if len(batches) >= 2:
        (b1, (p1, t1)), (b2, (p2, t2)) = sorted(per_step.items())[-2:]
        n1, n2 = b1 / participants, b2 / participants
        slope_p, slope_t = (p2 - p1) / (n2 - n1), (t2 - t1) / (n2 - n1)
        print(f"fit through batches {b1} and {b2}: fixed {p1 - slope_p * n1:.2f} ms a step "
              f"(compute thread "
              f"{t1 - slope_t * n1:.2f}), {slope_p:.3f} ms a sample ({slope_t:.3f})")


if __name__ == "__main__":
    main()
