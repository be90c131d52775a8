"""``hetconv calibrate``: membership and calibration only, no training.

Waits for the workers, calibrates every device on every conv layer of the given
architecture and batch, and prints the split each layer would get under every split mode, with the
conv time each split is predicted to take (from the fitted cost models).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

from hetconv.backend import array_module_for
from hetconv.errors import UserError
from hetconv.model import ModelConfig, conv_layer_shapes, parse_arch
from hetconv.partition import predicted_affine_seconds
from master.calibration import SPLIT_MODES, calibrate, layer_counts
from master.session import open_cluster

INPUT_SHAPES = {"fashion-mnist": (1, 28, 28), "synthetic": (1, 28, 28), "cifar10": (3, 32, 32)}


def parse_input_shape(text: str) -> tuple[int, int, int]:
    try:
        channels, height, width = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise UserError(f"--input-shape {text!r}: expected CxHxW such as 3x32x32") from None
    if min(channels, height, width) < 1:
        raise UserError(f"--input-shape {text!r}: dimensions must be positive")
    return channels, height, width


def run_calibrate(args: argparse.Namespace, report: Callable[[str], None] = print) -> int:
    shape = (parse_input_shape(args.input_shape) if args.input_shape
             else INPUT_SHAPES[args.data])
    model = ModelConfig(conv_kernels=parse_arch(args.arch), input_shape=shape,
                        kernel_size=args.kernel_size, padding=args.padding)
    layers = conv_layer_shapes(model)
    cluster, participants = open_cluster(args, report)
    try:
        results = calibrate(cluster, participants, layers, args.batch,
                            array_module_for(args.device), report=report)
    finally:
        cluster.end_run("calibration only")
        cluster.close()
    names = [p.device for p in participants]
    width = max(10, *(len(n) for n in names)) + 2
    report("")
    report(f"kernel split for --arch {args.arch}, batch {args.batch}, input "
           f"{'x'.join(map(str, shape))}")
    report(f"{'layer':<8}{'':<14}" + "".join(f"{n:>{width}}" for n in names)
           + f"{'predicted ms':>14}")
    for layer, result in zip(layers, results):
        costs = result.cost_models()
        rows = [("calib. ms", [f"{s * 1e3:.1f}" for s in result.seconds], ""),
                ("fixed ms", [f"{a * 1e3:.1f}" for a, _ in costs], "")]
        for mode in SPLIT_MODES:
            counts = layer_counts(mode, result, layer.kernels)
            seconds = predicted_affine_seconds(costs, counts)
            rows.append((mode, [str(c) for c in counts], f"{seconds * 1e3:.1f}"))
        for index, (label, cells, predicted) in enumerate(rows):
            head = f"{layer.index + 1} ({layer.kernels})" if index == 0 else ""
            report(f"{head:<8}{label:<14}" + "".join(f"{c:>{width}}" for c in cells)
                   + f"{predicted:>14}")
    return 0
