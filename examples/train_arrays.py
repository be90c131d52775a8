"""Train a small residual network on numpy arrays over two local worker daemons and print
the workload-balance report.

    python examples/train_arrays.py [--images N] [--epochs E] [--port P]

The images are made up here (which quarter of a 28x28 image is brightest: four classes);
any (N, C, H, W) uint8 or float array and its labels train the same way.
"""
from __future__ import annotations

import argparse

import numpy as np

import hetconv


def quarter_images(count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 120, (count, 1, 28, 28), dtype=np.uint8)
    y = rng.integers(0, 4, count)
    for index, label in enumerate(y):
        row, col = divmod(int(label), 2)
        x[index, 0, row * 14:row * 14 + 14, col * 14:col * 14 + 14] += 120
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--port", type=int, default=5599)
    parser.add_argument("--run-dir", default=None)
    args = parser.parse_args()
    x, y = quarter_images(args.images)
    data = hetconv.arrays(x, y, class_names=["top left", "top right", "bottom left",
                                             "bottom right"])
    master = f"tcp://127.0.0.1:{args.port}"
    with hetconv.start_worker(master, name="a", threads=1), \
            hetconv.start_worker(master, name="b", threads=1):
        run = hetconv.train("c16k3p1,res16,res32s2,gap", data, epochs=args.epochs, batch=64,
                            listen=f"tcp://127.0.0.1:{args.port}", workers=2, wait=60,
                            run_dir=args.run_dir, progress=False, threads=1)
    print(f"test accuracy {run.test_accuracy:.4f} after {len(run.history)} epoch(s)")
    print(run.report(html=False))


if __name__ == "__main__":
    main()
