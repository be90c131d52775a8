"""``hetconv worker``: flags -> :class:`WorkerConfig` -> a worker daemon in this process."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from hetconv.backend import array_module_for
from hetconv.commands.options import env, env_int, env_positive_int, positive_int
from hetconv.config import WorkerConfig
from hetconv.errors import UserError
from hetconv.keys import client_keys
from hetconv.logs import add_output_flags
from hetconv.prometheus import add_metrics_port, serve, worker_exporter

if TYPE_CHECKING:
    from hetconv.worker.service import FaultInjector


def add_parser(sub: Any) -> None:
    p = sub.add_parser("worker", help="run a worker daemon that serves a master")
    p.add_argument("--master", default=env("MASTER", None), required=env("MASTER", None) is None,
                   help="the master's endpoint, e.g. tcp://192.168.1.10:5555")
    p.add_argument("--device", default=env("DEVICE", "cpu"), help="cpu or gpu:N (default cpu)")
    p.add_argument("--threads", type=positive_int, default=env_positive_int("THREADS"),
                   help="BLAS threads for this worker (default: all cores)")
    p.add_argument("--name", default=env("WORKER_NAME", None),
                   help="worker name shown in reports (default host-pid-device)")
    p.add_argument("--once", action="store_true",
                   help="exit after one training run instead of waiting for the next")
    p.add_argument("--curve-secret", default=env("CURVE_SECRET", None), metavar="FILE",
                   help="encrypt and authenticate: this worker's NAME.key_secret")
    p.add_argument("--master-key", default=env("MASTER_KEY", None), metavar="FILE",
                   help="with --curve-secret: the master's public NAME.key")
    p.add_argument("--data-port", type=int, default=env_int("DATA_PORT", 0),
                   help="TCP port of the peer data endpoint (default 0: any free port)")
    p.add_argument("--advertise", default=env("ADVERTISE", None), metavar="HOST",
                   help="the address peers reach this worker's data endpoint at (default: "
                   "this machine's address on the route to the master)")
    add_output_flags(p)
    add_metrics_port(p)


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The typed configuration of ``hetconv worker`` from parsed flags."""
    array_module_for(args.device)  # a clear error for a bad or unavailable device
    curve = None
    if args.curve_secret or args.master_key:
        if not (args.curve_secret and args.master_key):
            raise UserError("CURVE needs both --curve-secret (this worker's "
                            "NAME.key_secret) and --master-key (the master's NAME.key)")
        curve = client_keys(args.curve_secret, args.master_key)
    return WorkerConfig(master=args.master, device=args.device, threads=args.threads,
                        name=args.name, once=args.once, curve=curve,
                        data_port=args.data_port, advertise=args.advertise)


def run(args: argparse.Namespace, faults: FaultInjector | None = None) -> int:
    """Run the worker daemon; ``faults``: only a test's worker has them
    (``tests/support/faulty_worker.py``)."""
    from hetconv.worker.daemon import run_worker

    config = worker_config(args)
    exporter = worker_exporter()
    server = serve(exporter, args.metrics_port)
    try:
        return run_worker(config, exporter if server else None, faults)
    finally:
        if server is not None:
            server.close()
