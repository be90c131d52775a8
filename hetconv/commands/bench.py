"""``hetconv bench conv|step|backward-split|split|protocol|scale|chaos``: the benchmarks, each in ``hetconv.bench``.

With ``--markdown FILE`` a benchmark also writes its result table as markdown,
headed by the full command line that reproduces it (every option spelled out, so
a later change of a default cannot change what it means), the date and the machine
(CPU model, cores, load average when it started). The file is written atomically.
These files are the only source of the figures quoted in README.md and docs/
(docs/figures/README.md): nobody types a measured number by hand.
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
from datetime import datetime, timezone
from typing import Any

from hetconv.commands.options import Parser, check_output_path, positive_int
from hetconv.config import (
    ACCURACY_PEERS,
    BENCH_DENSE_PARTS,
    BENCH_PEERS,
    BN_STATISTICS,
    DATA_PLANES,
    DATASETS,
    SPLIT_BY,
    SPLIT_MODES,
    STEP_OPS,
    STEPS_IN_FLIGHT,
    WIRE_DTYPE_AUTO,
    WIRE_DTYPE_FLAGS,
)
from hetconv.engine.checkpoint import save_text
from hetconv.errors import UserError

FLAGS: dict[str, tuple[tuple[str, str], ...]] = {
    "conv": (("--repeats", "repeats"), ("--batch", "batch"), ("--threads", "threads")),
    "step": (("--arch", "arch"), ("--batch", "batch"), ("--repeats", "repeats"),
             ("--ops", "ops"), ("--threads", "threads"), ("--quota", "quota")),
    "protocol": (("--repeats", "repeats"), ("--sizes", "sizes")),
    "backward-split": (("--batch", "batch"), ("--repeats", "repeats")),
    "split": (("--slow-fraction", "slow_fraction"), ("--arch", "arch"), ("--batch", "batch"),
              ("--limit", "limit"), ("--repeats", "repeats"), ("--work-dir", "work_dir")),
    "scale": (("--machines", "machines"), ("--data-plane", "data_plane"), ("--rate", "rate"),
              ("--arch", "arch"), ("--epochs", "epochs"),
              ("--batch", "batch"), ("--limit", "limit"), ("--repeats", "repeats"),
              ("--work-dir", "work_dir"), ("--split", "split"), ("--peer", "peer"),
              ("--split-by", "split_by"), ("--bn-statistics", "bn_statistics"),
              ("--dense-part", "dense_parts"), ("--steps-in-flight", "steps_in_flight"),
              ("--wire-dtype", "wire_dtypes"),
              ("--cfs-period-ms", "cfs_period_ms"), ("--dilate", "dilations")),
    "chaos": (("--minutes", "minutes"), ("--interval-min", "interval_min"),
              ("--interval-max", "interval_max"), ("--faults", "faults"), ("--lab", "lab"),
              ("--rate", "rate"), ("--arch", "arch"), ("--batch", "batch"),
              ("--epochs", "epochs"), ("--limit", "limit"), ("--test-limit", "test_limit"),
              ("--seed", "seed"), ("--checkpoint-every", "checkpoint_every"),
              ("--split", "split"), ("--data-plane", "data_plane"),
              ("--wire-dtype", "wire_dtype"), ("--recovery-window", "recovery_window"),
              ("--work-dir", "work_dir")),
    "accuracy": (("--seeds", "seeds"), ("--arch", "arch"), ("--epochs", "epochs"),
                 ("--batch", "batch"), ("--workers", "workers"), ("--data", "data"),
                 ("--data-dir", "data_dir"), ("--limit", "limit"),
                 ("--test-limit", "test_limit"), ("--train-flags", "train_flags"),
                 ("--target", "target"), ("--work-dir", "work_dir"), ("--peer", "peer")),
}
"""Per benchmark, the options that shape its result, as (flag, argparse dest)."""

MAX_SIZE_MIB = 1024.0  # one array frame is at most 1 GiB (protocol.limits.MAX_FRAME_BYTES)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks (conv kernels against PyTorch, kernel splits, "
                       "protocol overhead)")
    bench = p.add_subparsers(dest="bench",
                             metavar="{conv,step,backward-split,split,protocol,scale,chaos,"
                                     "accuracy}",
                             parser_class=Parser)
    bench.required = True
    conv = bench.add_parser("conv", help="conv forward+backward against PyTorch's CPU conv2d")
    conv.add_argument("--repeats", type=positive_int, default=7)
    conv.add_argument("--batch", type=positive_int, default=64)
    conv.add_argument("--threads", type=positive_int, default=None)
    step = bench.add_parser("step", help="one machine's whole training step against a "
                            "PyTorch CPU loop of the same layers, with per-op breakdowns")
    step.add_argument("--arch", action="append", default=None, metavar="SPEC",
                      help="network (as hetconv train --arch); repeat for several "
                      "(default 32:64)")
    step.add_argument("--batch", type=positive_int, default=128)
    step.add_argument("--repeats", type=positive_int, default=7,
                      help="timed steps per side (interleaved; default 7)")
    step.add_argument("--ops", choices=STEP_OPS, default="fused",
                      help="hetconv's conv layers: the fused pass that training runs "
                      "(default), or the separate ops (the path before it)")
    step.add_argument("--threads", type=positive_int, action="append", default=None,
                      help="threads for both sides; repeat for several settings "
                      "(default: every core)")
    step.add_argument("--quota", action="append", default=None, metavar="CORES",
                      help="cgroup v1 CPU quota for both sides in cores (e.g. 0.45) or "
                      "none: one for every --threads, or one per --threads (needs root)")
    backward = bench.add_parser(
        "backward-split", help="the sample split's two-part conv backward (dx now, dW "
        "inside the next barrier) against the one-part backward, one thread")
    backward.add_argument("--batch", type=positive_int, default=62,
                          help="samples (default 62: a participant's slice of 128 at 2)")
    backward.add_argument("--repeats", type=positive_int, default=30,
                          help="timed repeats of each, interleaved (default 30)")
    proto = bench.add_parser("protocol", help="loopback round trip: hetconv codec vs bare pyzmq")
    proto.add_argument("--repeats", type=positive_int, default=9)
    proto.add_argument("--sizes", type=float, nargs="+", default=[4.0, 64.0], metavar="MIB",
                       help="array sizes in MiB (default 4 64)")
    split = bench.add_parser("split", help="one device vs equal vs calibrated vs cost-model "
                             "split, one worker under a CPU quota (needs root for cgroups)")
    split.add_argument("--slow-fraction", type=float, default=0.3,
                       help="CPU share of the slow worker (default 0.3 of a core)")
    split.add_argument("--arch", default="32:256")
    split.add_argument("--batch", type=positive_int, default=128)
    split.add_argument("--limit", type=positive_int, default=1152, help="images per run")
    split.add_argument("--repeats", type=positive_int, default=1)
    split.add_argument("--work-dir", default=None, help="where the runs go (default a temp dir)")
    scale = bench.add_parser("scale", help="N machines on an emulated switched LAN (bridge, "
                             "tc-capped links, CPU quotas) against the fastest one alone "
                             "(needs root)")
    scale.add_argument("--machines", action="append", default=None, metavar="F1,F2,...",
                       help="one configuration: each machine's fraction of a core, the "
                       "master's machine first (repeat the flag for several; default "
                       "0.45,0.45,0.45,0.45)")
    scale.add_argument("--data-plane", action="append", default=None, choices=DATA_PLANES,
                       help="data plane(s) to run every machine set with (repeat the flag "
                       "to compare; default peer)")
    scale.add_argument("--rate", default="1gbit", help="every link's cap (tc units: 1gbit, "
                       "100mbit, ...; default 1gbit), or one per machine, the master's "
                       "first (R1,R2,...: as many as the largest --machines set)")
    scale.add_argument("--arch", default="32:64")
    scale.add_argument("--batch", type=positive_int, default=128)
    scale.add_argument("--limit", type=positive_int, default=None,
                       help="training images per run (default: the synthetic set, 2048)")
    scale.add_argument("--epochs", type=positive_int, default=4,
                       help="epochs per run (default 4, 64 steps of 128: enough for the "
                       "rebalancer to settle; the figures are the steps after its last "
                       "re-split that 8 or more steps follow)")
    scale.add_argument("--repeats", type=positive_int, default=3)
    scale.add_argument("--work-dir", default=None, help="where the runs go (default a temp dir)")
    scale.add_argument("--split", default="model", choices=SPLIT_MODES,
                       help="hetconv's --split in every run (default model: the planner "
                       "chooses the machines)")
    scale.add_argument("--split-by", action="append", default=None,
                       choices=SPLIT_BY,
                       help="hetconv's --split-by in the distributed runs (repeat the flag "
                       "for several, interleaved; default auto, train's default, what a "
                       "user gets; 'kernels' is the paper's split)")
    scale.add_argument("--peer", default=None, choices=BENCH_PEERS,
                       help="also run what users would run instead on the same machines: "
                       "PyTorch DDP (gloo; even and by-speed batch splits) and PyTorch alone, "
                       "interleaved (needs the bench extra: pip install '.[bench]')")
    scale.add_argument("--bn-statistics", action="append", default=None,
                       choices=BN_STATISTICS,
                       help="the sample split's batch norm in its runs (repeat the flag for "
                       "both, interleaved; default batch: the whole batch's statistics, "
                       "what a user gets; 'slice' is PyTorch DDP's per-rank semantics, "
                       "labelled samples-slice)")
    scale.add_argument("--dense-part", dest="dense_parts", action="append", default=None,
                       choices=BENCH_DENSE_PARTS,
                       help="where the sample split's runs put the dense part (repeat the "
                       "flag for several, interleaved; default auto: the model chooses, what "
                       "a user gets; 'replicas' and 'master' are labelled -dense-replicas "
                       "and -dense-master)")
    scale.add_argument("--steps-in-flight", dest="steps_in_flight", action="append",
                       type=int, default=None, choices=STEPS_IN_FLIGHT,
                       help="the sample split's step chains sent ahead in its runs (repeat the "
                       "flag for both, interleaved; default 2: what a user gets; 1 is "
                       "labelled -one-in-flight)")
    scale.add_argument("--wire-dtype", dest="wire_dtypes", action="append", default=None,
                       choices=WIRE_DTYPE_FLAGS,
                       help="hetconv's --wire-dtype in the distributed runs (repeat the flag "
                       "for several, interleaved; default auto: what a user gets; the others "
                       "are labelled -wire-float32 and -wire-float16)")
    scale.add_argument("--cfs-period-ms", type=float, default=10.0,
                       help="the CPU quotas' period in ms (default 10; 1 to 1000, and the smallest "
                       "machine's share of it at least 1 ms): a machine "
                       "that used its share of a period waits for the next one, so a "
                       "protocol with many synchronisation points pays up to (1 - share) x "
                       "period at each; shorter is closer to a really slower CPU")
    scale.add_argument("--dilate", dest="dilations", action="append", type=float,
                       default=None, metavar="F",
                       help="run everything on a lab with every machine's CPU quota and every "
                       "link's rate times F (0 < F <= 1; repeat the flag for several, "
                       "interleaved, e.g. --dilate 1 --dilate 0.5): the same work on "
                       "machines F times as fast, so the host's cores are less shared; a "
                       "table gives each dilated step times F beside the plain run")
    chaos = bench.add_parser("chaos", help="a master and 4 workers under a seeded random fault "
                             "every 20-40 s (SIGKILL, SIGSTOP, restart; with --lab also CPU "
                             "quota and link faults) against a fault-free run of the same seed")
    chaos.add_argument("--minutes", type=float, default=10.0,
                       help="inject faults for this long, or until the run ends (default 10)")
    chaos.add_argument("--interval-min", type=float, default=20.0,
                       help="shortest time between two faults in seconds (default 20)")
    chaos.add_argument("--interval-max", type=float, default=40.0,
                       help="longest time between two faults in seconds (default 40)")
    chaos.add_argument("--faults", default=None, metavar="KIND,...",
                       help="fault kinds to draw from: sigkill, sigstop, restart; with --lab "
                       "also cpu-quota, link-down-2s, link-down-20s (default: all available)")
    chaos.add_argument("--lab", action="store_true",
                       help="every machine a network namespace with a capped link, every "
                       "worker in a CPU quota (needs root); default loopback")
    chaos.add_argument("--rate", default="1gbit", help="--lab: every link's cap (default 1gbit)")
    chaos.add_argument("--arch", default="32:64")
    chaos.add_argument("--batch", type=positive_int, default=64)
    chaos.add_argument("--epochs", type=epochs_or_auto, default="auto",
                       help="epochs per run, or auto (default): enough to outlast --minutes, "
                       "measured by a one-epoch probe run")
    chaos.add_argument("--limit", type=positive_int, default=None, help="training images")
    chaos.add_argument("--test-limit", type=positive_int, default=None, help="test images")
    chaos.add_argument("--seed", type=int, default=1,
                       help="seeds the training and the fault schedule (default 1)")
    chaos.add_argument("--checkpoint-every", type=positive_int, default=20)
    chaos.add_argument("--split", choices=SPLIT_MODES, default=SPLIT_MODES[0],
                       help="as hetconv train --split (default: train's, model)")
    chaos.add_argument("--data-plane", choices=DATA_PLANES, default=DATA_PLANES[0],
                       help="as hetconv train --data-plane (default: train's, peer)")
    chaos.add_argument("--wire-dtype", choices=WIRE_DTYPE_FLAGS, default=WIRE_DTYPE_AUTO,
                       help="as hetconv train --wire-dtype (default: train's, auto)")
    chaos.add_argument("--recovery-window", type=float, default=30.0,
                       help="a recovery within this many seconds of a fault is its effect "
                       "(default 30)")
    chaos.add_argument("--work-dir", default=None, help="where the runs go (default a temp dir)")
    accuracy = bench.add_parser("accuracy", help="final test accuracy of real distributed "
                                "trainings over local worker daemons, one per seed")
    accuracy.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    accuracy.add_argument("--arch", default="32:64", help="network (as hetconv train --arch)")
    accuracy.add_argument("--epochs", type=positive_int, default=3)
    accuracy.add_argument("--batch", type=positive_int, default=128)
    accuracy.add_argument("--workers", type=positive_int, default=2,
                          help="local worker daemons (default 2)")
    accuracy.add_argument("--data", choices=DATASETS, default=DATASETS[0])
    accuracy.add_argument("--data-dir", default=None)
    accuracy.add_argument("--limit", type=positive_int, default=None, help="training images")
    accuracy.add_argument("--test-limit", type=positive_int, default=None, help="test images")
    accuracy.add_argument("--train-flags", default=None, metavar="FLAGS",
                          help="more hetconv train flags, quoted as one word "
                          "(e.g. '--augment --lr 0.1')")
    accuracy.add_argument("--target", type=float, default=None, metavar="PERCENT",
                          help="the test accuracy every seed must reach (e.g. 90)")
    accuracy.add_argument("--work-dir", default=None, help="where the runs go (default a temp dir)")
    accuracy.add_argument("--peer", choices=ACCURACY_PEERS, default=None,
                          help="torch: beside each run, the same network, initial weights, "
                          "data order and recipe in PyTorch (needs pip install '.[bench]')")
    for parser in (conv, step, backward, proto, split, scale, chaos, accuracy):
        parser.add_argument("--markdown", metavar="FILE", default=None,
                            help="also write the result table, the command line, the date "
                            "and the machine to FILE as markdown (e.g. docs/figures/NAME.md)")


def epochs_or_auto(text: str) -> str:
    """``auto`` or a positive integer (kept as text)."""
    return text if text == "auto" else str(positive_int(text))


# --- the figure file --------------------------------------------------------------------
def command_line(args: argparse.Namespace) -> str:
    """The ``hetconv bench`` command that reproduces this run, every option spelled out."""
    words = ["hetconv", "bench", args.bench]
    for flag, dest in FLAGS[args.bench]:
        value = getattr(args, dest)
        if value is None or value is False:
            continue
        if value is True:  # a switch
            words.append(flag)
            continue
        if dest == "train_flags":  # flags as a value: --train-flags='--augment'
            words.append(f"{flag}={value}")
            continue
        if isinstance(value, list) and (dest in ("machines", "data_plane", "split_by",
                                                 "bn_statistics", "dense_parts", "dilations",
                                                 "steps_in_flight", "wire_dtypes")
                                        or args.bench == "step"):  # one flag per value
            if args.bench == "step" and dest in ("threads", "quota"):
                continue  # written as pairs below
            for configuration in value:
                words += [flag, f"{configuration:g}" if isinstance(configuration, float)
                          else str(configuration)]
            continue
        words += [flag, *(f"{v:g}" if isinstance(v, float) else str(v)
                          for v in (value if isinstance(value, list) else [value]))]
    if args.bench == "step":
        for index, threads in enumerate(args.threads or []):
            words += ["--threads", str(threads)]
            if args.quota:
                words += ["--quota", args.quota[index if len(args.quota) > 1 else 0]]
    if args.markdown:
        words += ["--markdown", args.markdown]
    return shlex.join(words)


def machine_description() -> str:
    """CPU model, cores, OS, Python, numpy with its BLAS kernels, and the load average
    right now."""
    import numpy as np
    import psutil

    from hetconv.device_info import blas_description, cpu_model_name

    physical = psutil.cpu_count(logical=False)
    logical = psutil.cpu_count(logical=True) or os.cpu_count()
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    return (f"{cpu_model_name()}, {physical or '?'} cores / {logical} logical CPUs, "
            f"{platform.system()} {platform.machine()}, Python {platform.python_version()}, "
            f"numpy {np.__version__} ({blas_description()}); "
            f"load average {load} when it started")


def figure_header(args: argparse.Namespace) -> list[str]:
    """The lines that say where a figure file's numbers come from."""
    now = datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")
    return [f"# Figures: `hetconv bench {args.bench}`", "",
            "Written by the command below; do not edit by hand. Re-run it on a quiet "
            "machine to update this file (see [README.md](README.md)).", "",
            f"- command: `{command_line(args)}`",
            f"- date: {now}",
            f"- machine: {machine_description()}", ""]


def write_markdown(path: str, lines: list[str]) -> None:
    """Write ``lines`` to ``path`` atomically (temp file, fsync, rename)."""
    save_text(path, "\n".join(lines).rstrip("\n") + "\n")


# --- dispatch -----------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    if args.markdown:
        check_output_path("--markdown", args.markdown)  # before a long benchmark, not after
    if args.bench == "chaos" and args.faults is None:  # spelled out in the command line
        from hetconv.bench.chaos import FAULT_KINDS, LOOPBACK_FAULTS

        args.faults = ",".join(FAULT_KINDS if args.lab else LOOPBACK_FAULTS)
    if args.bench == "step":  # spelled out in the command line
        from hetconv.bench.step import parse_settings

        args.arch = args.arch or ["32:64"]
        settings = parse_settings(args.threads, args.quota)
        args.threads = [setting.threads for setting in settings]
        args.quota = ["none" if s.quota is None else f"{s.quota:g}" for s in settings]
    if args.bench == "scale" and args.split_by is None:  # spelled out in the command line
        args.split_by = [SPLIT_BY[0]]  # train's default, auto: what a user gets
    header = figure_header(args) if args.markdown else []  # load average before the run
    table: list[str]
    failed = False
    if args.bench == "conv":
        from hetconv.bench.conv import markdown_table as conv_table
        from hetconv.bench.conv import run_conv_bench

        table = conv_table(run_conv_bench(repeats=args.repeats, threads=args.threads,
                                          batch=args.batch))
    elif args.bench == "step":
        from hetconv.bench.step import parse_settings, run_step_bench

        settings = parse_settings(args.threads, args.quota)
        table = run_step_bench(args.arch, settings, batch=args.batch,
                               repeats=args.repeats, ops=args.ops)["table"]
    elif args.bench == "backward-split":
        from hetconv.bench.backward_split import run_backward_split_bench

        table = run_backward_split_bench(args.batch, args.repeats)
    elif args.bench == "protocol":
        from hetconv.bench.protocol_roundtrip import markdown_table as protocol_table
        from hetconv.bench.protocol_roundtrip import run_roundtrip_bench

        if not all(0 < size <= MAX_SIZE_MIB for size in args.sizes):
            raise UserError(f"--sizes must be within 0..{MAX_SIZE_MIB:g} MiB")
        table = protocol_table(run_roundtrip_bench(sizes_mib=tuple(args.sizes),
                                                   repeats=args.repeats))
    elif args.bench == "split":
        from hetconv.bench.split import markdown_table as split_table
        from hetconv.bench.split import run_split_bench

        if not 0.01 <= args.slow_fraction <= 1.0:
            raise UserError("--slow-fraction must be within 0.01..1")
        table = split_table(run_split_bench(
            slow_fraction=args.slow_fraction, arch=args.arch, batch=args.batch,
            limit=args.limit, repeats=args.repeats, work_dir=args.work_dir))
    elif args.bench == "scale":
        from hetconv.bench.scale import parse_machines, run_scale_bench

        if args.machines is None:
            args.machines = ["0.45,0.45,0.45,0.45"]
        configurations = [parse_machines(text) for text in args.machines]
        if args.data_plane is None:
            args.data_plane = [DATA_PLANES[0]]
        result = run_scale_bench(configurations, rate=args.rate, arch=args.arch,
                                 batch=args.batch, limit=args.limit, repeats=args.repeats,
                                 work_dir=args.work_dir, data_planes=tuple(args.data_plane),
                                 epochs=args.epochs, split=args.split, peer=args.peer,
                                 split_by=tuple(args.split_by),
                                 cfs_period_ms=args.cfs_period_ms,
                                 bn_statistics=tuple(args.bn_statistics or ("batch",)),
                                 dense_parts=tuple(args.dense_parts or ("auto",)),
                                 steps_in_flight=tuple(args.steps_in_flight
                                                       or STEPS_IN_FLIGHT[:1]),
                                 dilations=tuple(args.dilations or (1.0,)),
                                 wire_dtypes=tuple(args.wire_dtypes or (WIRE_DTYPE_AUTO,)))
        table = result["table"]
    elif args.bench == "chaos":
        from hetconv.bench.chaos import run_chaos_bench

        result = run_chaos_bench(
            minutes=args.minutes, interval_min_s=args.interval_min,
            interval_max_s=args.interval_max, faults=args.faults, lab=args.lab, rate=args.rate,
            arch=args.arch, batch=args.batch,
            epochs=None if args.epochs == "auto" else int(args.epochs), limit=args.limit,
            test_limit=args.test_limit, seed=args.seed, checkpoint_every=args.checkpoint_every,
            split=args.split, data_plane=args.data_plane, wire_dtype=args.wire_dtype,
            recovery_window_s=args.recovery_window, work_dir=args.work_dir)
        table = result["table"]
        failed = not result["completed"] or result["faults_survived"] < result["faults_injected"]
    elif args.bench == "accuracy":
        from hetconv.bench.accuracy import parse_seeds, run_accuracy_bench

        if args.target is not None and not 0.0 <= args.target <= 100.0:
            raise UserError("--target is a percentage within 0..100")
        try:
            train_flags = shlex.split(args.train_flags or "")
        except ValueError as error:
            raise UserError(f"--train-flags: {error}") from None
        result = run_accuracy_bench(
            parse_seeds(args.seeds), arch=args.arch, epochs=args.epochs, batch=args.batch,
            workers=args.workers, data=args.data, data_dir=args.data_dir, limit=args.limit,
            test_limit=args.test_limit, train_args=train_flags, target=args.target,
            work_dir=args.work_dir, peer=args.peer)
        table = result["table"]
        failed = result["all_met"] is False
    else:
        raise UserError(f"unknown benchmark {args.bench!r}")
    if args.markdown:
        write_markdown(args.markdown, header + table)
        print(f"hetconv: wrote {args.markdown}")
    if failed and args.bench == "accuracy":
        raise UserError("not every seed reached --target: see the table above")
    if failed:
        raise UserError("the run with faults did not complete: see the table above and the "
                        "logs in the work directory")
    return 0
