"""``hetconv bench scale``: N machines on an emulated switched LAN against one machine.

Every machine, the master's included, is a network namespace attached to one Linux
bridge by a veth capped with ``tc tbf`` at ``--rate`` in both directions
(:class:`hetconv.lab.SwitchedLan`), and every process runs in a CPU quota of its
machine's fraction of a core (:class:`hetconv.lab.CpuQuota`) with one BLAS thread.
The first fraction of a configuration is the master's machine, which also computes
a shard. The baseline is the fastest machine alone (``hetconv train --local`` under
its quota). Configurations are interleaved within every repeat; medians are
reported. Every run keeps its run directory, so ``hetconv report`` works on it.

Per configuration it prints: median step time, speedup over the baseline, the share
of the ideal speedup (sum of fractions / fastest fraction), array bytes per step on
the master's link and on the busiest worker link (from the run's metrics), and the
performance model's prediction (:mod:`hetconv.planning.perf_model`) beside the measurement
(each run's figures: :mod:`hetconv.bench.scale_figures`).
Needs root (namespaces, cgroup v1 quotas); everything is torn down on exit, also on
Ctrl-C or SIGTERM.

With ``peer="ddp"`` (``--peer ddp``) every repeat also runs what a user would run instead
on the same machines (:mod:`hetconv.bench.ddp`): PyTorch DDP over gloo with the batch
split evenly and split by speed, and PyTorch alone on the fastest machine, interleaved
with hetconv's runs; a second table gives both step times and their ratio, a third
where each side's step goes (:mod:`hetconv.bench.scale_peer`).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from hetconv.bench.ddp import SPLITS, batch_shares, quota_after_import, rank_command
from hetconv.bench.scale_breakdown import (
    format_barrier_breakdown,
    format_breakdown,
    format_layer_breakdown,
    format_step_timeline,
)
from hetconv.bench.scale_cpu import (
    CpuSampler,
    format_cpu_table,
    machine_cpu,
)
from hetconv.bench.scale_dilate import (
    check_dilations,
    dilated_fractions,
    dilated_rate,
    format_dilation_table,
)
from hetconv.bench.scale_figures import RunFigures, format_table, run_figures, summarize
from hetconv.bench.scale_peer import (
    add_peer_figures,
    ddp_label,
    format_peer_breakdown,
    format_peer_table,
)
from hetconv.bench.scale_repeats import format_repeats_table
from hetconv.bench.scale_setup import format_setup_table
from hetconv.bench.signals import terminate_as_interrupt
from hetconv.config import (
    BENCH_PEERS,
    BN_STATISTICS,
    DENSE_PARTS,
    SPLIT_MODES,
    STEPS_IN_FLIGHT,
    WIRE_DTYPE_AUTO,
    WIRE_DTYPE_FLAGS,
    WIRE_DTYPES,
    check_choice,
)
from hetconv.errors import UserError
from hetconv.lab import (
    CFS_PERIOD_US,
    CpuQuota,
    LocalWorker,
    cpu_quota_unavailable_reason,
    free_port,
    quota_refusal,
)
from hetconv.lab.network import SwitchedLan, netns_unavailable_reason, parse_rate_bits
from hetconv.participant.samples.barrier_trace import TRACE_ENV

RUN_TIMEOUT_S = 600.0


def parse_machines(text: str) -> tuple[float, ...]:
    """``"0.6,0.4,0.2"`` -> fractions of a core per machine (master's machine first)."""
    try:
        fractions = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise UserError(f"--machines {text!r}: expected fractions of a core like "
                        "0.45,0.45,0.45,0.45") from None
    if not fractions or any(not 0.05 <= f <= 1.0 for f in fractions):
        raise UserError(f"--machines {text!r}: every fraction must be within 0.05..1")
    return fractions


def _run_in_quota(command: list[str], fraction: float, log_path: Path,
                  period_us: int = CFS_PERIOD_US, env: dict[str, str] | None = None) -> int:
    quota = CpuQuota(fraction, period_us)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env=None if env is None else {**os.environ, **env})
        try:
            quota.add(process.pid)
            return process.wait(RUN_TIMEOUT_S)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            quota.remove()


def _run_ddp(lan: SwitchedLan, fractions: tuple[float, ...], arch: str, batch: int,
             split: str, run_dir: Path, period_us: int = CFS_PERIOD_US
             ) -> tuple[float, list[float], tuple[float, float, int] | None]:
    """One PyTorch DDP run over the first ``len(fractions)`` machines of ``lan`` (rank i
    on machine i, in its quota): the median step time rank 0 measured, each rank's
    median compute-only step (``no_sync()``; none alone), seconds, and the timed steps'
    window (wall-clock start and end, steps; None when rank 0 gave none)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    shares = batch_shares(fractions, batch, split)
    result = run_dir / "ddp.json"
    result.unlink(missing_ok=True)
    port = free_port()
    running: list[tuple[subprocess.Popen[bytes], CpuQuota, Any]] = []
    statuses: list[int | None] = []
    try:
        for rank, (fraction, samples) in enumerate(zip(fractions, shares)):
            machine = lan.machines[rank]
            command = machine.command(rank_command(
                sys.executable, rank, len(fractions), lan.machines[0].address, port, arch,
                samples, machine.interface, result if rank == 0 else None, True))
            log = open(run_dir / f"rank{rank}.log", "wb")
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            quota = CpuQuota(fraction, period_us)
            running.append((process, quota, log))
        for process, quota, _ in running:  # PyTorch's import is not the machine's work
            try:
                quota_after_import(process, quota)
            except RuntimeError as error:
                raise UserError(f"{error}; see {run_dir}/rank*.log") from None
        for process, _, _ in running:
            statuses.append(process.wait(RUN_TIMEOUT_S))
    finally:
        for process, quota, log in running:
            if process.poll() is None:
                process.kill()
                process.wait()
            quota.remove()
            log.close()
    if any(status != 0 for status in statuses) or not result.exists():
        raise UserError(f"the PyTorch DDP run failed (status {statuses}); see "
                        f"{run_dir}/rank*.log")
    figures = json.loads(result.read_text())
    start, end = (figures.get("window") or [0.0, 0.0])[:2]
    return (float(statistics.median(figures["step_s"])),
            [float(value) for value in figures.get("compute_s", [])],
            (float(start), float(end), len(figures["step_s"])) if end > start else None)


def machine_rates(rate: str, machines: int) -> list[str]:
    """``--rate``: one cap for every link (``1gbit``), or one per machine, the master's
    first (``1gbit,1gbit,20mbit``: as many as ``machines``); the caps, one per link
    or one for all. UserError naming what is wrong."""
    parts = [part.strip() for part in rate.split(",")]
    for part in parts:
        try:
            parse_rate_bits(part)
        except ValueError as error:
            raise UserError(f"--rate: {error}") from None
    if len(parts) > 1 and len(parts) != machines:
        raise UserError(f"--rate: {len(parts)} rates for {machines} machines (give one for "
                        "every link, or one per machine of the largest --machines set)")
    return parts


def run_scale_bench(machine_sets: list[tuple[float, ...]], rate: str = "1gbit",
                    arch: str = "32:64", batch: int = 128, limit: int | None = None,
                    repeats: int = 3, work_dir: str | None = None,
                    data_planes: tuple[str, ...] = ("peer",), epochs: int = 4,
                    out: Callable[[str], None] = print, split: str = "model",
                    peer: str | None = None,
                    split_by: tuple[str, ...] = ("auto",),
                    cfs_period_ms: float = CFS_PERIOD_US / 1000,
                    bn_statistics: tuple[str, ...] = ("batch",),
                    dense_parts: tuple[str, ...] = ("auto",),
                    steps_in_flight: tuple[int, ...] = STEPS_IN_FLIGHT[:1],
                    dilations: tuple[float, ...] = (1.0,),
                    wire_dtypes: tuple[str, ...] = (WIRE_DTYPE_AUTO,)) -> dict[str, Any]:
    """Run every machine set with every data plane, and the baselines, ``repeats``
    times, interleaved within each repeat. ``split``: the runs' ``--split``; ``model``
    (the default) lets the link-aware planner choose the machines from its timings,
    ``equal`` has every machine compute the same share whatever they measure.
    ``peer="ddp"``: PyTorch DDP (even and by-speed batch splits) and PyTorch alone on
    the same machines too, interleaved (needs torch: the ``bench`` extra).
    ``cfs_period_ms``: every machine's CPU quota is granted per period of this length
    (default 10 ms; a real slower CPU is the limit of short periods).
    ``bn_statistics``: the sample split's batch norm in its runs (``batch``, the default,
    and/or ``slice``: PyTorch DDP's per-rank semantics; labelled ``samples-slice``).
    ``dense_parts``: where the sample split's runs put the dense part (``auto``, the
    default a user gets, and/or ``master``: labelled with ``-dense-master``).
    ``steps_in_flight``: the sample split's step chains sent ahead (2, the default a
    user gets, and/or 1: labelled with ``-one-in-flight``).
    ``dilations``: run everything on each of these labs, every machine's quota and every
    link's rate times the factor (1: the plain lab; :mod:`hetconv.bench.scale_dilate`),
    interleaved within every repeat; the dilated rows are labelled with their quotas.
    ``wire_dtypes``: the distributed runs' ``--wire-dtype`` (``auto``, the default a user
    gets, and/or ``float32``/``float16``: labelled with ``-wire-float32``...)."""
    period_us = int(round(cfs_period_ms * 1000))
    factors = check_dilations(dilations)
    refusal = quota_refusal(min(min(fractions) for fractions in machine_sets) * min(factors),
                            period_us)
    if refusal:
        raise UserError(f"--cfs-period-ms {cfs_period_ms:g}"
                        + (f" with --dilate {min(factors):g}" if min(factors) < 1 else "")
                        + f": {refusal}")
    check_choice("split", split, SPLIT_MODES)
    for norm in bn_statistics:
        check_choice("--bn-statistics", norm, BN_STATISTICS)
    if not {SAMPLES, AUTO} & set(split_by) and bn_statistics != ("batch",):
        raise UserError("--bn-statistics applies to the sample split's runs: add "
                        "--split-by samples or --split-by auto")
    for part in dense_parts:
        check_choice("--dense-part", part, DENSE_PARTS)
    if not {SAMPLES, AUTO} & set(split_by) and dense_parts != ("auto",):
        raise UserError("--dense-part applies to the sample split's runs: add "
                        "--split-by samples or --split-by auto")
    for value in steps_in_flight:
        if value not in STEPS_IN_FLIGHT:
            raise UserError(f"--steps-in-flight {value}: choose 1 or 2")
    if not {SAMPLES, AUTO} & set(split_by) and steps_in_flight != STEPS_IN_FLIGHT[:1]:
        raise UserError("--steps-in-flight applies to the sample split's runs: add "
                        "--split-by samples or --split-by auto")
    for wire in wire_dtypes:
        check_choice("--wire-dtype", wire, WIRE_DTYPE_FLAGS)
    if peer is not None:
        check_choice("peer", peer, BENCH_PEERS)
        from hetconv.bench.step_torch import import_torch
        import_torch()  # one line saying how to install it, before any LAN is made
    # a configuration's "plane" is the data plane of a kernel split, or "samples"
    configurations = [(fractions, plane) for fractions in machine_sets
                      for plane in (data_planes if "kernels" in split_by else ())]
    for choice in (SAMPLES, AUTO):
        for norm in (BN_STATISTICS if choice in split_by else ()):
            if norm not in bn_statistics:
                continue
            for part in dense_parts:
                for in_flight in steps_in_flight:
                    label_of = (choice + ("" if norm == "batch" else SLICE_SUFFIX)
                                + DENSE_SUFFIXES.get(part, "")
                                + (ONE_IN_FLIGHT_SUFFIX if in_flight == 1 else ""))
                    configurations += [(fractions, label_of) for fractions in machine_sets]
    configurations = [(fractions, plane + WIRE_SUFFIXES.get(wire, ""))
                      for fractions, plane in configurations for wire in wire_dtypes]
    size = max(len(fractions) for fractions in machine_sets)
    link_rates = machine_rates(rate, size)
    rates = {factor: ",".join(dilated_rate(part, factor) for part in link_rates)
             for factor in factors}
    sets_of = {factor: [dilated_fractions(fractions, factor) for fractions in machine_sets]
               for factor in factors}
    all_sets = [fractions for factor in factors for fractions in sets_of[factor]]
    if len(set(all_sets)) != len(set(machine_sets)) * len(factors):
        raise UserError("--dilate: a dilated machine set equals another one of this "
                        "invocation (e.g. --machines 0.9 at 0.5 and 0.45 plain); run them apart")
    by_factor = {factor: [(dilated_fractions(fractions, factor), plane)
                          for fractions, plane in configurations] for factor in factors}
    factor_rows = [(factor, fractions, plane) for factor in factors
                   for fractions, plane in configurations]
    configurations = [configuration for factor in factors for configuration in by_factor[factor]]
    for reason in (netns_unavailable_reason(), cpu_quota_unavailable_reason()):
        if reason:
            raise UserError(f"hetconv bench scale needs root features: {reason}")
    root = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="hetconv-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    common = ["--data", "synthetic", "--arch", arch, "--batch", str(batch), "--epochs",
              str(epochs),
              "--threads", "1", "--no-progress", "--overwrite"]
    if limit:
        common += ["--limit", str(limit)]
    results: dict[str, list[RunFigures]] = {}
    peer_results: dict[str, list[float]] = {}  # ddp_label -> step seconds per repeat
    peer_compute: dict[str, list[list[float]]] = {}  # ddp_label -> per repeat, per rank
    peer_cpu: dict[str, list[dict[str, dict[str, float]]]] = {}  # ddp_label -> per repeat
    sampler = CpuSampler(f"hetconv-{os.getpid()}-")  # the lab's quotas are ours

    def label(configuration: tuple[tuple[float, ...], str]) -> str:
        return configuration_label(*configuration)

    def keep(what: str, name: str, status: int, run_dir: Path, repeat: int,
             link: float | None) -> None:
        """A finished run's figures under ``name``, or UserError when it failed."""
        if status != 0:
            raise UserError(f"{what} failed (status {status}); see "
                            f"{run_dir.parent / f'repeat{repeat}.log'}")
        figures = run_figures(run_dir, link)
        if figures.window is not None:
            figures = replace(figures, cpu=machine_cpu(sampler.snapshot(), figures.window))
        results.setdefault(name, []).append(figures)
        out(f"  repeat {repeat + 1}: {name}: median step "
            f"{results[name][-1].step_s * 1e3:.1f} ms")

    def run_repeat(repeat: int, lan: SwitchedLan, link_rate: str,
                   lab_sets: list[tuple[float, ...]],
                   lab_configurations: list[tuple[tuple[float, ...], str]]) -> None:
        """One repeat on one lab (``lan``, its links at ``link_rate``): the baselines,
        every configuration, then the peer."""
        master = lan.machines[0]
        link_bytes_per_s = parse_rate_bits(link_rate.split(",")[0]) / 8  # the master's
        baselines = sorted({max(fractions) for fractions in lab_sets})
        for fraction in baselines:
            name = f"baseline-{fraction:g}"
            run_dir = root / name / f"repeat{repeat}"
            run_dir.mkdir(parents=True, exist_ok=True)
            status = _run_in_quota(master.command([python, "-m", "hetconv", "train",
                                                   "--local", *common, "--run-dir",
                                                   str(run_dir)]),
                                   fraction, run_dir.parent / f"repeat{repeat}.log",
                                   period_us)
            keep("baseline run", name, status, run_dir, repeat, None)
        for configuration in lab_configurations:
            config, plane = configuration
            name = label(configuration)
            run_dir = root / name.replace(" ", "-") / f"repeat{repeat}"
            run_dir.mkdir(parents=True, exist_ok=True)
            port = free_port()
            endpoint = f"tcp://{master.address}:{port}"
            trace = {TRACE_ENV: str(run_dir / "trace")}  # the barriers' events (pure appends)
            workers = []
            try:
                for index, fraction in enumerate(config[1:], start=1):
                    machine = lan.machines[index]
                    workers.append(LocalWorker(
                        endpoint, f"m{index}", threads=1, cpu_fraction=fraction,
                        log_path=run_dir.parent / f"repeat{repeat}-m{index}.log",
                        netns=machine.netns, extra_args=("--once",),
                        cpu_period_us=period_us, env=trace))
                train = [python, "-m", "hetconv", "train", "--listen",
                         f"tcp://{master.address}:{port}", "--min-workers",
                         str(len(config) - 1), "--wait", "60",
                         *split_flags(plane),
                         "--split", split, *common, "--run-dir", str(run_dir)]
                if len(config) == 1:
                    train[train.index("--min-workers") + 1] = "0"
                status = _run_in_quota(master.command(train), config[0],
                                       run_dir.parent / f"repeat{repeat}.log", period_us,
                                       trace)
            finally:
                for worker in workers:
                    worker.stop()
            keep(f"run {name}", name, status, run_dir, repeat, link_bytes_per_s)
            time.sleep(0.2)
        if peer is not None:
            runs = [((fraction,), "even") for fraction in baselines] + [
                (fractions, batch_split) for fractions in dict.fromkeys(lab_sets)
                for batch_split in SPLITS
                if batch_split == "even" or len(set(fractions)) > 1]
            for fractions, batch_split in runs:
                name = ddp_label(fractions, batch_split)
                where = root / name.replace(" ", "-") / f"repeat{repeat}"
                try:
                    step_s, compute, window = _run_ddp(lan, fractions, arch, batch,
                                                       batch_split, where, period_us)
                except UserError as error:  # gloo's teardown aborts now and then
                    out(f"  repeat {repeat + 1}: {name}: {error}; measuring it again")
                    step_s, compute, window = _run_ddp(
                        lan, fractions, arch, batch, batch_split,
                        where.with_name(where.name + "-again"), period_us)
                peer_results.setdefault(name, []).append(step_s)
                peer_compute.setdefault(name, []).append(compute)
                peer_cpu.setdefault(name, []).append(
                    {} if window is None else machine_cpu(sampler.snapshot(), window))
                out(f"  repeat {repeat + 1}: {name}: median step {step_s * 1e3:.1f} ms")

    out(f"hetconv bench scale: rate {rate}, arch {arch}, batch {batch}, {repeats} repeat(s), "
        + (f"dilated by {', '.join(f'{f:g}' for f in factors)}, " if factors != (1.0,) else "")
        + f"runs in {root}")
    with terminate_as_interrupt(), sampler:
        for repeat, factor in ((r, f) for r in range(repeats) for f in factors):
            with SwitchedLan(size, rates[factor].split(",")) as lan:
                run_repeat(repeat, lan, rates[factor], sets_of[factor], by_factor[factor])
    summary = summarize(configurations, results, label)
    for row, (factor, fractions, plane) in zip(summary, factor_rows):
        row.update({"dilation": factor, "rate": rates[factor]})
        if factor != 1.0 and 1.0 in factors:
            row["plain_machines"] = label((fractions, plane))
    table = format_table(summary, rate)
    if peer is not None:
        add_peer_figures(summary, configurations, peer_results, peer_compute, peer_cpu)
        table += format_peer_table(summary, rate)
        table += format_peer_breakdown(summary)
    table += format_setup_table(summary)
    table += format_cpu_table(summary)
    table += format_repeats_table({**{name: [r.step_s for r in runs]
                                      for name, runs in results.items()}, **peer_results})
    table += format_breakdown(summary)
    table += format_layer_breakdown(summary)
    table += format_barrier_breakdown(summary)
    table += format_step_timeline(summary)
    table += format_dilation_table(summary)
    for line in table:
        out(line)
    (root / "scale.json").write_text(json.dumps(
        {"rate": rate, "arch": arch, "batch": batch, "repeats": repeats,
         "dilations": list(factors), "rows": summary,
         "runs": {k: [asdict(f) for f in v] for k, v in results.items()},
         "peer_runs": peer_results, "peer_compute": peer_compute, "peer_cpu": peer_cpu},
        indent=1))
    return {"rows": summary, "work_dir": str(root), "table": table}


SAMPLES = "samples"
"""The configuration label of a run split by samples (``--split-by samples``)."""
AUTO = "auto"
"""The configuration label of a run that lets hetconv choose (``--split-by auto``, the
default a user gets)."""


SLICE_SUFFIX = "-slice"
"""Appended to ``samples``/``auto``: the runs with ``--bn-statistics slice``."""
DENSE_SUFFIXES = {"master": "-dense-master", "replicas": "-dense-replicas"}
"""Appended next: the runs with ``--dense-part master`` or ``replicas`` (none: ``auto``)."""
ONE_IN_FLIGHT_SUFFIX = "-one-in-flight"
"""Appended next: the runs with ``--steps-in-flight 1`` (none: 2, the default)."""
WIRE_SUFFIXES = {dtype: f"-wire-{dtype}" for dtype in WIRE_DTYPES}
"""Appended last, to every distributed run's label: ``--wire-dtype`` (none: auto)."""


def split_flags(plane: str) -> tuple[str, ...]:
    """hetconv train's flags for a configuration's plane label: ``samples``, ``auto``
    (either with ``-slice``: ``--bn-statistics slice``, then ``-dense-master`` or
    ``-dense-replicas``: ``--dense-part``, then ``-one-in-flight``:
    ``--steps-in-flight 1``) or a kernel split's data plane; either ending in
    ``-wire-float32`` or ``-wire-float16``: ``--wire-dtype``."""
    wire = next((dtype for dtype, suffix in WIRE_SUFFIXES.items() if plane.endswith(suffix)),
                None)
    if wire is not None:
        return split_flags(plane.removesuffix(WIRE_SUFFIXES[wire])) + ("--wire-dtype", wire)
    if plane.endswith(ONE_IN_FLIGHT_SUFFIX):
        return split_flags(plane.removesuffix(ONE_IN_FLIGHT_SUFFIX)) + (
            "--steps-in-flight", "1")
    dense = next((part for part, suffix in DENSE_SUFFIXES.items() if plane.endswith(suffix)),
                 None)
    rest = plane.removesuffix(DENSE_SUFFIXES[dense]) if dense else plane
    base = rest.removesuffix(SLICE_SUFFIX)
    if base in (SAMPLES, AUTO):
        return ("--split-by", base) + (
            ("--bn-statistics", "slice") if rest.endswith(SLICE_SUFFIX) else ()) + (
            ("--dense-part", dense) if dense else ())
    return ("--split-by", "kernels", "--data-plane", plane)


def configuration_label(fractions: tuple[float, ...], data_plane: str) -> str:
    """``4x[0.45,0.45,0.45,0.45] peer``: the machines' fractions and the data plane."""
    return f"{len(fractions)}x[{','.join(f'{f:g}' for f in fractions)}] {data_plane}"
