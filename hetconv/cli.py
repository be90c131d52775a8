"""The ``hetconv`` command: argument parsing and dispatch to thin subcommands.

Subcommands: ``train`` (local or distributed training), ``worker`` (a worker
daemon), ``calibrate`` (membership and calibration only), ``report`` (the
workload-balance report) and ``bench conv|split``. Settings come from flags, then
``HETCONV_*`` environment variables, then defaults. A :class:`UserError` (or a bad
flag) prints one line, ``hetconv: error: ...``, and exits with status 2.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from hetconv import __version__
from hetconv.errors import UserError


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line."""

    def error(self, message: str) -> Any:
        raise UserError(f"{message} (see '{self.prog} --help')")


def _env(name: str, default: Any) -> Any:
    return os.environ.get(f"HETCONV_{name}", default)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _add_train(sub: Any) -> None:
    p = sub.add_parser("train", help="train the network (locally or over worker daemons)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true",
                       help="train on this machine's own device only (the default without --listen)")
    where.add_argument("--listen", metavar="ENDPOINT", default=_env("LISTEN", None),
                       help="distributed: bind here and wait for workers, e.g. tcp://*:5555")
    p.add_argument("--min-workers", type=int, default=int(_env("MIN_WORKERS", 1)),
                   help="distributed: workers to wait for before starting (default 1)")
    p.add_argument("--wait", type=_non_negative_float, default=float(_env("WAIT", 60)),
                   help="distributed: seconds to wait for --min-workers (default 60)")
    p.add_argument("--no-local", action="store_true",
                   help="distributed: the master's own device computes no kernels")
    p.add_argument("--split", choices=("model", "calibrated", "equal"), default="model",
                   help="distributed: 'model' (default) balances each device's calibrated "
                   "fixed + per-kernel cost; 'calibrated' is the paper's equation (1); "
                   "'equal' gives every device the same share")
    p.add_argument("--device", default=_env("DEVICE", "cpu"),
                   help="the master's own device: cpu or gpu:N (default cpu)")
    p.add_argument("--wire-dtype", choices=("float32", "float16"), default="float32",
                   help="distributed: activations and gradients on the wire; float16 halves "
                   "the traffic for slow links (computation stays float32)")
    p.add_argument("--data", default=_env("DATA", "fashion-mnist"),
                   choices=("fashion-mnist", "cifar10", "synthetic"), help="dataset")
    p.add_argument("--data-dir", default=_env("DATA_DIR", None),
                   help="dataset directory (default: Debian's /usr/share/datasets/fashion-mnist)")
    p.add_argument("--limit", type=_positive_int, default=None,
                   help="train on the first N training images only")
    p.add_argument("--test-limit", type=_positive_int, default=None,
                   help="evaluate on the first N test images only")
    p.add_argument("--arch", default="32:64",
                   help="kernels per conv block, e.g. 50:500 (default 32:64)")
    p.add_argument("--kernel-size", type=_positive_int, default=5, help="conv kernel size (5)")
    p.add_argument("--padding", type=int, default=0, choices=(0, 1, 2),
                   help="conv zero padding (default 0: valid convolution as in the paper)")
    p.add_argument("--epochs", type=_positive_int, default=3)
    p.add_argument("--batch", type=_positive_int, default=128)
    p.add_argument("--eval-batch", type=_positive_int, default=1000)
    p.add_argument("--lr", type=_non_negative_float, default=0.05, help="base learning rate")
    p.add_argument("--momentum", type=_non_negative_float, default=0.9)
    p.add_argument("--weight-decay", type=_non_negative_float, default=5e-4)
    p.add_argument("--schedule", choices=("cosine", "step", "constant"), default="cosine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="BLAS threads on the master (default: all cores)")
    p.add_argument("--run-dir", default=None,
                   help="where config.json, metrics.jsonl and weights.npz go (default runs/<time>)")
    p.add_argument("--overwrite", action="store_true",
                   help="allow a --run-dir that already holds a run")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_curve_master(p)


def _add_bench(sub: Any) -> None:
    p = sub.add_parser("bench", help="benchmarks (conv kernels against PyTorch, kernel splits)")
    bench = p.add_subparsers(dest="bench", metavar="{conv,split,protocol}", parser_class=_Parser)
    bench.required = True
    conv = bench.add_parser("conv", help="conv forward+backward against PyTorch's CPU conv2d")
    conv.add_argument("--repeats", type=_positive_int, default=7)
    conv.add_argument("--batch", type=_positive_int, default=64)
    conv.add_argument("--threads", type=_positive_int, default=None)
    proto = bench.add_parser("protocol", help="loopback round trip: hetconv codec vs bare pyzmq")
    proto.add_argument("--repeats", type=_positive_int, default=9)
    split = bench.add_parser("split", help="one device vs equal vs calibrated split, one worker "
                             "under a CPU quota (needs root for cgroups)")
    split.add_argument("--slow-fraction", type=float, default=0.3,
                       help="CPU share of the slow worker (default 0.3 of a core)")
    split.add_argument("--arch", default="32:256")
    split.add_argument("--batch", type=_positive_int, default=128)
    split.add_argument("--limit", type=_positive_int, default=1152, help="images per run")
    split.add_argument("--repeats", type=_positive_int, default=1)
    split.add_argument("--work-dir", default=None, help="where the runs go (default a temp dir)")


def _add_worker(sub: Any) -> None:
    p = sub.add_parser("worker", help="run a worker daemon that serves a master")
    p.add_argument("--master", default=_env("MASTER", None), required=_env("MASTER", None) is None,
                   help="the master's endpoint, e.g. tcp://192.168.1.10:5555")
    p.add_argument("--device", default=_env("DEVICE", "cpu"), help="cpu or gpu:N (default cpu)")
    p.add_argument("--threads", type=_positive_int, default=_env("THREADS", None),
                   help="BLAS threads for this worker (default: all cores)")
    p.add_argument("--name", default=_env("WORKER_NAME", None),
                   help="worker name shown in reports (default host-pid-device)")
    p.add_argument("--once", action="store_true",
                   help="exit after one training run instead of waiting for the next")
    p.add_argument("--curve-secret", default=_env("CURVE_SECRET", None), metavar="FILE",
                   help="encrypt and authenticate: this worker's NAME.key_secret")
    p.add_argument("--master-key", default=_env("MASTER_KEY", None), metavar="FILE",
                   help="with --curve-secret: the master's public NAME.key")


def _add_calibrate(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="wait for workers, calibrate, print the kernel split "
                       "(no training)")
    p.add_argument("--listen", required=True, metavar="ENDPOINT", help="e.g. tcp://*:5555")
    p.add_argument("--min-workers", type=int, default=1)
    p.add_argument("--wait", type=_non_negative_float, default=60.0)
    p.add_argument("--no-local", action="store_true")
    p.add_argument("--device", default=_env("DEVICE", "cpu"))
    p.add_argument("--threads", type=_positive_int, default=None)
    p.add_argument("--data", choices=("fashion-mnist", "cifar10", "synthetic"),
                   default="fashion-mnist", help="sets the input shape")
    p.add_argument("--input-shape", default=None, help="CxHxW, overrides --data")
    p.add_argument("--arch", default="32:64")
    p.add_argument("--kernel-size", type=_positive_int, default=5)
    p.add_argument("--padding", type=int, default=0, choices=(0, 1, 2))
    p.add_argument("--batch", type=_positive_int, default=128)
    _add_curve_master(p)


def _add_report(sub: Any) -> None:
    p = sub.add_parser("report", help="workload-balance report of one or more run directories")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories to report on")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--no-html", action="store_true", help="do not write report.html")


def _add_curve_master(p: Any) -> None:
    p.add_argument("--curve-secret", default=_env("CURVE_SECRET", None), metavar="FILE",
                   help="encrypt and authenticate: the master's NAME.key_secret")
    p.add_argument("--curve-allow", default=_env("CURVE_ALLOW", None), metavar="DIR",
                   help="with --curve-secret: directory of allowed workers' NAME.key files")


def _add_keygen(sub: Any) -> None:
    p = sub.add_parser("keygen", help="create a CURVE key pair (NAME.key, NAME.key_secret)")
    p.add_argument("--dir", default="keys", help="where to write the files (default keys/)")
    p.add_argument("--name", required=True, help="e.g. master or worker-a")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hetconv", description=(
        "Train convolutional networks with every conv layer's kernels spread over CPU and "
        "GPU worker daemons on mismatched machines. Start 'hetconv worker' on each machine, "
        "'hetconv train --listen' on the master, then read 'hetconv report RUN_DIR'."))
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"hetconv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    _add_train(sub)
    _add_worker(sub)
    _add_report(sub)
    _add_calibrate(sub)
    _add_keygen(sub)
    _add_bench(sub)
    return parser


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "train":
        from hetconv.train_command import run_train

        return run_train(args)
    if args.command == "calibrate":
        from hetconv.backend import set_blas_threads
        from master.calibrate_command import run_calibrate

        set_blas_threads(args.threads)
        return run_calibrate(args)
    if args.command == "keygen":
        from hetconv.keys import create_keypair

        public, secret = create_keypair(args.dir, args.name)
        print(f"hetconv: wrote {public} (public: copy it to the peers) and {secret} "
              "(secret: keep it on this machine)")
        return 0
    if args.command == "worker":
        from worker.daemon import WorkerConfig, run_worker

        if not args.master.startswith(("tcp://", "ipc://", "inproc://")):
            raise UserError(f"--master {args.master!r}: expected an endpoint like tcp://host:5555")
        threads = int(args.threads) if args.threads is not None else None
        from hetconv.backend import array_module_for

        array_module_for(args.device)  # a clear error for a bad or unavailable device
        curve = None
        if args.curve_secret or args.master_key:
            if not (args.curve_secret and args.master_key):
                raise UserError("CURVE needs both --curve-secret (this worker's "
                                "NAME.key_secret) and --master-key (the master's NAME.key)")
            from hetconv.keys import client_keys

            curve = client_keys(args.curve_secret, args.master_key)
        return run_worker(WorkerConfig(master=args.master, device=args.device, threads=threads,
                                       name=args.name, once=args.once, curve=curve))
    if args.command == "report":
        from master.report.command import run_report

        return run_report(args.run_dirs, json_output=args.json, html=not args.no_html)
    if args.command == "bench" and args.bench == "conv":
        from hetconv.bench_conv import run_conv_bench

        run_conv_bench(repeats=args.repeats, threads=args.threads, batch=args.batch)
        return 0
    if args.command == "bench" and args.bench == "protocol":
        from protocol.bench_roundtrip import run_roundtrip_bench

        run_roundtrip_bench(repeats=args.repeats)
        return 0
    if args.command == "bench" and args.bench == "split":
        from hetconv.bench_split import run_split_bench

        if not 0.01 <= args.slow_fraction <= 1.0:
            raise UserError("--slow-fraction must be within 0.01..1")
        run_split_bench(slow_fraction=args.slow_fraction, arch=args.arch, batch=args.batch,
                        limit=args.limit, repeats=args.repeats, work_dir=args.work_dir)
        return 0
    raise UserError(f"unknown command {args.command!r}")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                            format="%(asctime)s %(name)s %(levelname)s: %(message)s")
        return _dispatch(args)
    except UserError as error:
        print(f"hetconv: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hetconv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
