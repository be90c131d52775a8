"""Per-step CPU of issue 49's new checks at the demo's shapes (32:64, batch 128, two
workers, --no-local): the scales by sender (two batch-norm layers' moments) and the
heartbeat marks of a step's waits.

Run: .venv-test/bin/python docs/figures/ab/issue49-check-cost.py
"""
from __future__ import annotations

import time

import numpy as np

from hetconv.participant.progress import ComputeProgress
from hetconv.participant.samples.outliers import check_scales, moments_scale

RNG = np.random.default_rng(0)
MOMENTS = [{m: np.abs(RNG.standard_normal((2, k))).astype(np.float32) for m in ("a", "b")}
           for k in (32, 64)]
PROGRESS = ComputeProgress()


def one_step() -> None:
    for pieces in MOMENTS:
        check_scales({m: moments_scale(v, 64 * 784) for m, v in pieces.items()}, "a", "x")
    for _ in range(8):
        PROGRESS.waiting(["b"])
        PROGRESS.waiting(["b"])
        PROGRESS.progressed()


def main() -> None:
    for _ in range(200):
        one_step()
    count = 3000
    started = time.perf_counter()
    for _ in range(count):
        one_step()
    print(f"checks and marks per step: {(time.perf_counter() - started) / count * 1e6:.0f} us")


if __name__ == "__main__":
    main()
