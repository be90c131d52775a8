"""``hetconv bench conv|split|protocol``: the benchmarks, each in ``hetconv.bench``."""
from __future__ import annotations

import argparse
from typing import Any

from hetconv.commands.options import Parser, positive_int
from hetconv.errors import UserError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks (conv kernels against PyTorch, kernel splits)")
    bench = p.add_subparsers(dest="bench", metavar="{conv,split,protocol}", parser_class=Parser)
    bench.required = True
    conv = bench.add_parser("conv", help="conv forward+backward against PyTorch's CPU conv2d")
    conv.add_argument("--repeats", type=positive_int, default=7)
    conv.add_argument("--batch", type=positive_int, default=64)
    conv.add_argument("--threads", type=positive_int, default=None)
    proto = bench.add_parser("protocol", help="loopback round trip: hetconv codec vs bare pyzmq")
    proto.add_argument("--repeats", type=positive_int, default=9)
    split = bench.add_parser("split", help="one device vs equal vs calibrated split, one worker "
                             "under a CPU quota (needs root for cgroups)")
    split.add_argument("--slow-fraction", type=float, default=0.3,
                       help="CPU share of the slow worker (default 0.3 of a core)")
    split.add_argument("--arch", default="32:256")
    split.add_argument("--batch", type=positive_int, default=128)
    split.add_argument("--limit", type=positive_int, default=1152, help="images per run")
    split.add_argument("--repeats", type=positive_int, default=1)
    split.add_argument("--work-dir", default=None, help="where the runs go (default a temp dir)")


def run(args: argparse.Namespace) -> int:
    if args.bench == "conv":
        from hetconv.bench.conv import run_conv_bench

        run_conv_bench(repeats=args.repeats, threads=args.threads, batch=args.batch)
    elif args.bench == "protocol":
        from hetconv.bench.protocol_roundtrip import run_roundtrip_bench

        run_roundtrip_bench(repeats=args.repeats)
    elif args.bench == "split":
        from hetconv.bench.split import run_split_bench

        if not 0.01 <= args.slow_fraction <= 1.0:
            raise UserError("--slow-fraction must be within 0.01..1")
        run_split_bench(slow_fraction=args.slow_fraction, arch=args.arch, batch=args.batch,
                        limit=args.limit, repeats=args.repeats, work_dir=args.work_dir)
    else:
        raise UserError(f"unknown benchmark {args.bench!r}")
    return 0
