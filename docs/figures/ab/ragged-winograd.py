"""Ragged F(4x4, 3x3) tiles against F(2x2, 3x3) on maps 4 does not divide.

One 3x3 convolution (padding 1), forward, then backward with dx, one thread; medians of
the CPU milliseconds per call, the two variants alternated in 8 rounds of 25 calls.

    python docs/figures/ab/ragged-winograd.py BATCH CHANNELS KERNELS SIZE
    python docs/figures/ab/ragged-winograd.py BATCH CHANNELS KERNELS 14 --ceiling

Default: F(2x2) (``RAGGED_MAX_WASTE`` 1) against ragged F(4x4) (whatever the channel
count: ``RAGGED_MIN_CHANNELS`` 0) on the SIZE x SIZE map. ``--ceiling``: F(2x2) on
14x14 against F(4x4) on 16x16, the outputs ragged tiles compute over 14x14 without
their copies: the best they could do. Output: ragged-winograd.log beside this script.
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
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import numpy as np  # noqa: E402

from hetconv.ops import conv_winograd  # noqa: E402
from hetconv.ops.conv import conv2d_backward_cached, conv2d_forward_cached  # noqa: E402


def timed(x: np.ndarray, w: np.ndarray, calls: int) -> tuple[list[float], list[float]]:
    forward, backward = [], []
    for call in range(calls):
        started = time.process_time()
        y, cache = conv2d_forward_cached(x, w, None, 1, 1)
        middle = time.process_time()
        conv2d_backward_cached(cache, y, need_dx=True)
        if call >= 3:  # the first calls size the workspaces
            forward.append(middle - started)
            backward.append(time.process_time() - middle)
    return forward, backward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("batch", "channels", "kernels", "size"):
        parser.add_argument(name, type=int)
    parser.add_argument("--ceiling", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((args.kernels, args.channels, 3, 3), dtype=np.float32) * 0.1
    sides = (args.size, args.size + (-args.size) % 4) if args.ceiling else (args.size,) * 2
    inputs = [rng.standard_normal((args.batch, args.channels, s, s), dtype=np.float32)
              for s in sides]
    variants = [("F(2x2)", 1.0, inputs[0]),
                (f"F(4x4) on {sides[1]}x{sides[1]}" if args.ceiling else "ragged F(4x4)",
                 1.5, inputs[1])]
    figures: dict[str, tuple[list[float], list[float]]] = {v[0]: ([], []) for v in variants}
    conv_winograd.RAGGED_MIN_CHANNELS = 0
    for _ in range(8):
        for name, waste, x in variants:
            conv_winograd.RAGGED_MAX_WASTE = waste
            forward, backward = timed(x, w, 25)
            figures[name][0].extend(forward)
            figures[name][1].extend(backward)
    totals = []
    parts = []
    for name, (forward, backward) in figures.items():
        f, b = 1e3 * statistics.median(forward), 1e3 * statistics.median(backward)
        totals.append(f + b)
        parts.append(f"{name} fwd {f:.2f} bwd {b:.2f} = {f + b:.2f} ms")
    print(f"B{args.batch} C{args.channels} K{args.kernels} {args.size}x{args.size}: "
          + "; ".join(parts) + f" ({totals[1] / totals[0] - 1:+.1%})")


if __name__ == "__main__":
    main()
