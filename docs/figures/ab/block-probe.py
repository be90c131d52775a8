"""One conv block (3x3 conv, padding 1, batch norm, ReLU, optional 2x2 max pool), forward
and backward, hetconv's fused layer against PyTorch's conv + BN + ReLU (+ pool), one
thread: medians of the CPU seconds per call.

    python docs/figures/ab/block-probe.py BATCH CHANNELS KERNELS SIZE POOL [--repo DIR]
        [--repeats N]

``--repo``: the checkout whose ``hetconv`` to import (default: this one), to compare
two versions (block-probe.sh). PyTorch's line only where torch is installed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("batch", "channels", "kernels", "size"):
        parser.add_argument(name, type=int)
    parser.add_argument("pool", choices=("max", "none"))
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[3])
    parser.add_argument("--repeats", type=int, default=150)
    args = parser.parse_args()
    sys.path.insert(0, str(args.repo))
    import numpy as np

    from hetconv.ops.conv_layer import conv_layer_backward, conv_layer_forward
    from hetconv.ops.workspace import Workspace

    rng = np.random.default_rng(0)
    shape = (args.batch, args.channels, args.size, args.size)
    x = rng.standard_normal(shape, dtype=np.float32)
    weight = rng.standard_normal((args.kernels, args.channels, 3, 3), dtype=np.float32) * 0.1
    ones, zeros = np.ones(args.kernels, np.float32), np.zeros(args.kernels, np.float32)
    workspace = Workspace()

    def hetconv_block() -> tuple[float, float]:
        started = time.process_time()
        y, cache, _, _ = conv_layer_forward(x, weight, ones, zeros, zeros, ones, True,
                                            padding=1, pool=args.pool, workspace=workspace)
        forward = time.process_time()
        conv_layer_backward(cache, np.ones_like(y), need_dx=True)
        return forward - started, time.process_time() - forward

    def report(name: str, block: object) -> None:
        times = [block() for _ in range(args.repeats)][3:]  # type: ignore[operator]
        print(f"{name} B{args.batch} C{args.channels} K{args.kernels} {args.size}x{args.size} "
              f"pool {args.pool}: forward {1e3 * statistics.median(t[0] for t in times):.2f} "
              f"backward {1e3 * statistics.median(t[1] for t in times):.2f} ms")

    report(f"hetconv ({args.repo.name})", hetconv_block)
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)
    tx = torch.tensor(x, requires_grad=True)
    conv = torch.nn.Conv2d(args.channels, args.kernels, 3, padding=1, bias=False)
    norm = torch.nn.BatchNorm2d(args.kernels)

    def torch_block() -> tuple[float, float]:
        started = time.process_time()
        y = torch.relu(norm(conv(tx)))
        if args.pool == "max":
            y = torch.nn.functional.max_pool2d(y, 2)
        forward = time.process_time()
        y.backward(torch.ones_like(y))
        return forward - started, time.process_time() - forward

    report("torch", torch_block)


if __name__ == "__main__":
    main()
