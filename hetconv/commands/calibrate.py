"""``hetconv calibrate``: membership and calibration only, no training.

Waits for the workers, calibrates every participant on every conv layer of the
given architecture and batch, and prints the split each layer would get under every
split mode, with the conv time each split is predicted to take (from the fitted
cost models).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from hetconv.backend import set_blas_threads
from hetconv.commands.options import (
    add_curve_master,
    add_membership,
    env,
    env_positive_int,
    positive_int,
)
from hetconv.commands.train import master_config
from hetconv.config import DATASETS, PADDINGS, SPLIT_MODES, CalibrateConfig
from hetconv.errors import UserError
from hetconv.model import conv_layer_shapes, model_config, parse_network
from hetconv.planning.partition import predicted_affine_seconds

INPUT_SHAPES = {"fashion-mnist": (1, 28, 28), "synthetic": (1, 28, 28), "cifar10": (3, 32, 32)}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="wait for workers, calibrate, print the kernel split "
                       "(no training)")
    add_membership(p, listen_required=True)
    p.add_argument("--device", default=env("DEVICE", "cpu"))
    p.add_argument("--threads", type=positive_int, default=env_positive_int("THREADS"))
    p.add_argument("--data", choices=DATASETS, default=DATASETS[0], help="sets the input shape")
    p.add_argument("--input-shape", default=None, help="CxHxW, overrides --data")
    p.add_argument("--arch", default="32:64")
    p.add_argument("--kernel-size", type=positive_int, default=5)
    p.add_argument("--padding", type=int, default=0, choices=PADDINGS)
    p.add_argument("--batch", type=positive_int, default=128)
    add_curve_master(p)


def parse_input_shape(text: str) -> tuple[int, int, int]:
    try:
        channels, height, width = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise UserError(f"--input-shape {text!r}: expected CxHxW such as 3x32x32") from None
    if min(channels, height, width) < 1:
        raise UserError(f"--input-shape {text!r}: dimensions must be positive")
    return channels, height, width


def calibrate_config(args: argparse.Namespace) -> CalibrateConfig:
    if not args.input_shape and args.data not in INPUT_SHAPES:
        raise UserError(f"--data {args.data}: the image shape depends on the files; give "
                        "--input-shape CxHxW (e.g. 3x32x32)")
    shape = (parse_input_shape(args.input_shape) if args.input_shape
             else INPUT_SHAPES[args.data])
    return CalibrateConfig(master=master_config(args), input_shape=shape, arch=args.arch,
                           kernel_size=args.kernel_size, padding=args.padding,
                           batch=args.batch, device=args.device, threads=args.threads)


def run(args: argparse.Namespace) -> int:
    return run_calibrate(calibrate_config(args))


def run_calibrate(config: CalibrateConfig, report: Callable[[str], None] = print) -> int:
    from hetconv.master.calibration import calibrate
    from hetconv.master.kernels.planner import ParticipantProfile
    from hetconv.master.kernels.split import SplitRule, layer_traffic
    from hetconv.master.setup import open_cluster

    set_blas_threads(config.threads)
    model = model_config(parse_network(config.arch, config.kernel_size, config.padding),
                         config.input_shape, kernel_size=config.kernel_size,
                         padding=config.padding)
    layers = conv_layer_shapes(model)
    cluster, participants = open_cluster(config.master, config.device, config.threads, report)
    try:
        results = calibrate(cluster, participants, layers, config.batch, report=report)
    finally:
        cluster.end_run("calibration only")
        cluster.close()
    names = [p.participant for p in participants]
    width = max(10, *(len(n) for n in names)) + 2
    report("")
    report(f"kernel split for --arch {config.arch}, batch {config.batch}, input "
           f"{'x'.join(map(str, config.input_shape))}")
    report(f"{'layer':<8}{'':<14}" + "".join(f"{n:>{width}}" for n in names)
           + f"{'predicted ms':>14}")
    # the split rule of a run, over compute alone (calibration probes no link)
    profiles = [ParticipantProfile(name, tuple(r.cost_models()[i] for r in results), None)
                for i, name in enumerate(names)]
    traffic = layer_traffic(layers, config.batch, 4)
    splits = {mode: SplitRule(mode, "star", tuple(r.calibrated_kernels for r in results))
              .split(profiles, traffic, names).counts for mode in SPLIT_MODES}
    for layer, result in zip(layers, results):
        costs = result.cost_models()
        rows = [("calib. ms", [f"{s * 1e3:.1f}" for s in result.seconds], ""),
                ("fixed ms", [f"{a * 1e3:.1f}" for a, _ in costs], "")]
        for mode in SPLIT_MODES:
            counts = list(splits[mode][layer.index])
            seconds = predicted_affine_seconds(costs, counts)
            rows.append((mode, [str(c) for c in counts], f"{seconds * 1e3:.1f}"))
        for index, (label, cells, predicted) in enumerate(rows):
            head = f"{layer.index + 1} ({layer.kernels})" if index == 0 else ""
            report(f"{head:<8}{label:<14}" + "".join(f"{c:>{width}}" for c in cells)
                   + f"{predicted:>14}")
    return 0
