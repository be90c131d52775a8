"""CPU per training step of a hetconv sample-split participant beside a PyTorch DDP rank.

On the lab's quota machines a step lasts about what its busiest participant's CPU per
step takes at the machine's quota, so the CPU each side spends per step, not its wall
time, says where the gap between hetconv and DDP is. Unthrottled, one thread each,
on loopback:

- hetconv: ``hetconv train`` (synthetic data, ``--split-by samples``, the workers kept:
  ``--fall-back off``, ``--rebalance off``, everything else the defaults) with
  ``WORKERS`` local worker daemons; each worker's process CPU (user + system, all its
  threads) at the end, for a short and a long run: the difference over the difference
  of steps is its CPU per step, free of start-up and calibration;
- PyTorch: ``python -m hetconv.bench.ddp`` (the bench's DDP peer) with WORKERS + 1
  ranks and the same share of the batch, and once alone (``world 1``) with that share;
  each rank's CPU from ``os.wait4``, short and long runs the same way.

Alternates the two (hetconv, torch, hetconv, torch, ...) ``--repeats`` times and prints
medians over repeats and participants, with the spread.

    .venv-test/bin/python docs/figures/ab/cpu-per-step-vs-ddp.py
        [--arch c32k3p1,c32k3p1,pool,c64k3p1,c64k3p1,pool,fc256,drop0.5]
        [--workers 3] [--batch 128] [--steps 20,80] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from hetconv.lab import LocalWorker, free_port  # noqa: E402

VGG = "c32k3p1,c32k3p1,pool,c64k3p1,c64k3p1,pool,fc256,drop0.5"


def hetconv_cpu(arch: str, batch: int, steps: int, workers: int) -> list[float]:
    """Each worker's process CPU seconds at the end of a run of ``steps`` steps."""
    port = free_port()
    command = [sys.executable, "-m", "hetconv", "train", "--listen", f"tcp://127.0.0.1:{port}",
               "--min-workers", str(workers), "--data", "synthetic", "--arch", arch,
               "--batch", str(batch), "--limit", str(batch * steps), "--test-limit",
               str(batch), "--epochs", "1", "--split-by", "samples", "--threads", "1",
               "--no-progress", "--rebalance", "off", "--fall-back", "off", "--run-dir",
               f"/tmp/cpu-per-step-{port}", "--overwrite"]
    master = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=ROOT)
    daemons = [LocalWorker(f"tcp://127.0.0.1:{port}", f"w{i}", threads=1)
               for i in range(workers)]
    output, _ = master.communicate(timeout=900)
    if master.returncode != 0:
        raise SystemExit(f"train failed:\n{output[-2000:]}")
    figures = []
    for daemon in daemons:
        times = psutil.Process(daemon.process.pid).cpu_times()
        figures.append(times.user + times.system)
        daemon.stop()
    return figures


def torch_cpu(arch: str, samples: int, steps: int, world: int) -> list[float]:
    """Each DDP rank's CPU seconds over its whole run (``os.wait4``)."""
    port = free_port()
    ranks = [subprocess.Popen(
        [sys.executable, "-m", "hetconv.bench.ddp", "--rank", str(rank), "--world", str(world),
         "--address", "127.0.0.1", "--port", str(port), "--arch", arch, "--samples",
         str(samples), "--steps", str(steps)], cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"}) for rank in range(world)]
    figures = []
    for rank in ranks:
        _, status, usage = os.wait4(rank.pid, 0)
        rank.returncode = os.waitstatus_to_exitcode(status)
        if rank.returncode != 0:
            raise SystemExit(f"a DDP rank failed ({rank.returncode})")
        figures.append(usage.ru_utime + usage.ru_stime)
    return figures


def per_step(short: list[float], long: list[float], steps: int) -> list[float]:
    """ms per step of each process: the long run's CPU over the short's."""
    return [(b - a) / steps * 1000 for a, b in zip(short, long)]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default=VGG)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", default="20,80")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    short, long = (int(s) for s in args.steps.split(","))
    world = args.workers + 1
    samples = args.batch // world
    print(f"{args.arch}, batch {args.batch}: {args.workers} hetconv workers + the master / "
          f"{world} DDP ranks of {samples} samples and one alone; one thread each, "
          f"unthrottled; steps {short} and {long}; commit "
          + subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip(), flush=True)
    hetconv, ddp, alone = [], [], []
    for repeat in range(args.repeats):
        h = per_step(hetconv_cpu(args.arch, args.batch, short, args.workers),
                     hetconv_cpu(args.arch, args.batch, long, args.workers), long - short)
        d = per_step(torch_cpu(args.arch, samples, short, world),
                     torch_cpu(args.arch, samples, long, world), long - short)
        a = per_step(torch_cpu(args.arch, samples, short, 1),
                     torch_cpu(args.arch, samples, long, 1), long - short)
        hetconv += h
        ddp += d
        alone += a
        print(f"repeat {repeat + 1}: hetconv workers "
              + " ".join(f"{v:.1f}" for v in h) + " ms; DDP ranks "
              + " ".join(f"{v:.1f}" for v in d) + f" ms; torch alone {a[0]:.1f} ms",
              flush=True)
    print(f"CPU per step, medians (lowest-highest): hetconv worker {spread(hetconv)} ms, "
          f"DDP rank {spread(ddp)} ms, PyTorch alone on {samples} samples {spread(alone)} ms")


if __name__ == "__main__":
    main()
