"""The peer in ``hetconv bench scale --peer ddp``: PyTorch DDP (gloo, CPU) on the same LAN.

What a user would otherwise run on the same machines: the same network
(:func:`hetconv.bench.step.torch_network`, hetconv's initial weights), plain PyTorch
DistributedDataParallel over gloo, one process per machine in that machine's
namespace and CPU quota (joined once PyTorch is imported: ``--stop-after-import``),
one thread each, SGD with momentum 0.9. The batch is split
over the ranks either evenly (what DDP's users get from ``DistributedSampler``) or in
proportion to the machines' core fractions (``by speed``: what a careful user could
do by hand). Batch-norm statistics are per rank (PyTorch's SyncBatchNorm refuses CPU
modules), gradients are averaged over ranks. The baseline is the same loop on one
machine (``world 1``), the fastest machine's quota.

Run as ``python -m hetconv.bench.ddp --rank R --world N ...`` (one process per
machine, started by :mod:`hetconv.bench.scale`); rank 0 writes the wall time of every
step after the warm-up to ``--out`` as JSON, and every rank's median compute-only step
(``compute_s``: DDP_COMPUTE_STEPS more steps under ``no_sync()``, no all-reduce), so
that the step beyond the slowest rank's compute is DDP's communication and waiting,
and the wall-clock ``window`` (``time.time()``, start and end) of the timed steps, for
probes that sample the machines' CPU (docs/figures/ab/machine-cpu.py).
PyTorch is needed only here (the optional ``bench`` extra).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the ranks themselves never need the lab
    from hetconv.lab.quota import CpuQuota

DDP_STEPS = 40
"""Timed steps per DDP run (after DDP_WARMUP_STEPS): the median is the figure."""
DDP_WARMUP_STEPS = 5
DDP_COMPUTE_STEPS = 10
"""Steps after the timed ones under DDP's ``no_sync()`` (no gradient all-reduce), every
rank at once: each rank's compute alone, for the breakdown of DDP's step."""
DDP_TIMEOUT_S = 180.0
"""How long the ranks may take to meet (gloo's rendezvous) before the run fails."""
SPLITS = ("even", "speed")


def batch_shares(fractions: Sequence[float], batch: int, split: str) -> list[int]:
    """Samples per rank: ``even`` the same for each (largest remainders), ``speed`` in
    proportion to ``fractions`` (cores per machine). Every rank gets at least one."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}")
    if batch < len(fractions):
        raise ValueError("the batch must give every rank at least one sample")
    weights = [1.0] * len(fractions) if split == "even" else [float(f) for f in fractions]
    total = sum(weights)
    raw = [(batch - len(weights)) * w / total for w in weights]
    shares = [1 + int(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    for i in order[:batch - sum(shares)]:
        shares[i] += 1
    return shares


def rank_command(python: str, rank: int, world: int, address: str, port: int, arch: str,
                 samples: int, interface: str | None, out: Path | None,
                 stop_after_import: bool = False) -> list[str]:
    """The command line of one rank (``out``: where rank 0 writes its step times;
    ``stop_after_import``: the rank stops itself (SIGSTOP) once PyTorch is imported, for
    its starter to put it into the machine's CPU quota and let it go on)."""
    command = [python, "-m", "hetconv.bench.ddp", "--rank", str(rank), "--world", str(world),
               "--address", address, "--port", str(port), "--arch", arch,
               "--samples", str(samples)]
    if interface:
        command += ["--interface", interface]
    if stop_after_import:
        command += ["--stop-after-import"]
    if out is not None:
        command += ["--out", str(out)]
    return command


IMPORT_TIMEOUT_S = 120.0
"""How long a rank may take to import PyTorch and stop itself."""


def quota_after_import(process: subprocess.Popen[bytes], quota: CpuQuota,
                       timeout_s: float = IMPORT_TIMEOUT_S) -> None:
    """Put a rank started with ``--stop-after-import`` into ``quota`` once it stopped
    itself, then continue it; a rank that ended before that keeps its status; one that
    did neither within ``timeout_s`` is killed (RuntimeError, one line)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status = os.waitpid(process.pid, os.WUNTRACED | os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"a PyTorch DDP rank did not finish importing PyTorch within "
                               f"{timeout_s:.0f} s")
        time.sleep(0.02)
    if os.WIFSTOPPED(status):
        quota.add(process.pid)
        os.kill(process.pid, signal.SIGCONT)
    else:  # it ended (reaped here: its status goes where Popen looks for it)
        process.returncode = os.waitstatus_to_exitcode(status)


def _arguments(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hetconv.bench.ddp",
                                     description="one rank of the PyTorch DDP peer")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--arch", required=True)
    parser.add_argument("--samples", type=int, required=True, help="this rank's share")
    parser.add_argument("--interface", default=None, help="GLOO_SOCKET_IFNAME")
    parser.add_argument("--steps", type=int, default=DDP_STEPS)
    parser.add_argument("--stop-after-import", action="store_true",
                        help="SIGSTOP this rank once PyTorch is imported (its starter puts "
                        "it into the machine's CPU quota, then continues it: the seconds "
                        "of the import are not what is measured)")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """One rank: meet the others, train ``--steps`` timed steps, rank 0 writes them."""
    args = _arguments(sys.argv[1:] if argv is None else argv)
    if args.interface:  # gloo picks its interface from the host name otherwise
        os.environ["GLOO_SOCKET_IFNAME"] = args.interface
    from hetconv.bench.step import CLASSES, INPUT_SHAPE
    from hetconv.bench.step_torch import import_torch, torch_network, torch_step
    from hetconv.model import init_parameters, model_config, parse_network

    torch = import_torch()
    torch.set_num_threads(1)
    import torch.distributed as dist

    if args.stop_after_import:  # continued in the machine's quota
        os.kill(os.getpid(), signal.SIGSTOP)

    distributed = args.world > 1
    if distributed:
        dist.init_process_group("gloo", init_method=f"tcp://{args.address}:{args.port}",
                                rank=args.rank, world_size=args.world,
                                timeout=datetime.timedelta(seconds=DDP_TIMEOUT_S))
    model = model_config(parse_network(args.arch), INPUT_SHAPE, CLASSES)
    network = torch_network(torch, model, init_parameters(model, 0))
    if distributed:
        network = torch.nn.parallel.DistributedDataParallel(network)
    rng = np.random.default_rng(args.rank)
    x = rng.standard_normal((args.samples, *INPUT_SHAPE), dtype=np.float32)
    labels = rng.integers(0, CLASSES, args.samples)
    step = torch_step(torch, network, x, labels)
    seconds: list[float] = []
    window = [0.0, 0.0]  # wall-clock (time.time()) start and end of the timed steps
    for index in range(DDP_WARMUP_STEPS + args.steps):
        if index == DDP_WARMUP_STEPS:
            window[0] = time.time()
        started = time.perf_counter()
        step()
        if index >= DDP_WARMUP_STEPS:
            seconds.append(time.perf_counter() - started)
    window[1] = time.time()
    compute: list[float] = []
    for _ in range(DDP_COMPUTE_STEPS if distributed else 0):
        started = time.perf_counter()
        with network.no_sync():  # the same step without the gradients' all-reduce
            step()
        compute.append(time.perf_counter() - started)
    compute_s = [float(np.median(compute))] if compute else []
    if distributed:
        by_rank: list[float] = [0.0] * args.world
        dist.all_gather_object(by_rank, compute_s[0])  # every rank's, in rank order
        compute_s = by_rank
        dist.barrier()
        dist.destroy_process_group()
    if args.out and args.rank == 0:
        Path(args.out).write_text(json.dumps({
            "step_s": seconds, "compute_s": compute_s, "samples": args.samples,
            "window": window,
            "world": args.world,
            "cgroups": Path("/proc/self/cgroup").read_text().split()}))  # its quota's
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
