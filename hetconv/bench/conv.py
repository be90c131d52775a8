"""``hetconv bench conv``: hetconv's conv kernels against PyTorch CPU, side by side.

Times forward + backward (dx, dw, db) of the cached pair used in training
(``conv2d_forward_cached`` + ``conv2d_backward_cached``) and of the plain pair
(``conv2d`` + ``conv2d_backward``) on the paper's layer shapes, interleaved per repeat
with PyTorch's ``conv2d`` forward + autograd backward when torch is installed, after one
warm-up each. The machine's float32 matrix-product rate (median of 4096x4096 products)
is printed first as the practical ceiling. Only medians and ratios taken in the same
run mean anything on a shared machine.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetconv.ops.conv import (
    ConvGeometry,
    conv2d,
    conv2d_backward,
    conv2d_backward_cached,
    conv2d_forward_cached,
)

TORCH_MISSING = "torch not installed: pip install 'hetconv[bench]'"


@dataclass(frozen=True)
class BenchShape:
    """One convolution layer to time (the batch size is given separately)."""

    name: str
    channels: int
    height: int
    width: int
    kernels: int
    kernel_h: int
    kernel_w: int
    stride: int = 1
    padding: int = 0

    def geometry(self, batch: int) -> ConvGeometry:
        """This layer's sizes at ``batch``, as the conv ops see them."""
        return ConvGeometry(batch, self.channels, self.height, self.width, self.kernels,
                            self.kernel_h, self.kernel_w, self.stride, self.padding)

    def out_size(self) -> tuple[int, int]:
        geometry = self.geometry(1)
        return geometry.out_h, geometry.out_w

    def train_flop(self, batch: int) -> float:
        """Forward + backward FLOPs: 3 * 2*B*K*C*kh*kw*Ho*Wo."""
        return 3.0 * self.geometry(batch).forward_flop


PAPER_SHAPES = (
    BenchShape("C2 of 50:500", 50, 14, 14, 500, 5, 5),
    BenchShape("C2 of 150:800", 150, 14, 14, 800, 5, 5),
    BenchShape("C1 of 500:1500", 3, 32, 32, 500, 5, 5),
)


def _import_torch() -> Any | None:
    try:
        import torch
    except ImportError:
        return None
    return torch


@contextlib.contextmanager
def _thread_limit(threads: int | None, torch: Any | None) -> Iterator[None]:
    """Limit BLAS (threadpoolctl) and torch to ``threads`` inside the block."""
    if threads is None:
        yield
        return
    from threadpoolctl import threadpool_limits

    torch_before = torch.get_num_threads() if torch is not None else None
    with threadpool_limits(limits=threads):
        if torch is not None:
            torch.set_num_threads(threads)
        try:
            yield
        finally:
            if torch is not None:
                torch.set_num_threads(torch_before)


def _blas_thread_count() -> int | str:
    from threadpoolctl import threadpool_info

    counts = {info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"}
    return max(counts) if counts else "?"


def matmul_ceiling_gflops(repeats: int, size: int = 4096) -> float:
    """Median float32 GFLOP/s of size x size @ size x size (one warm-up)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    out = np.empty_like(a)
    np.matmul(a, b, out=out)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.matmul(a, b, out=out)
        seconds.append(time.perf_counter() - start)
    return 2.0 * size**3 / float(np.median(seconds)) / 1e9


def _timed_pair(forward: Callable[[], Any], backward: Callable[[Any], Any]
                ) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one call of each."""
    start = time.perf_counter()
    state = forward()
    middle = time.perf_counter()
    backward(state)
    return middle - start, time.perf_counter() - middle


def _contestants(shape: BenchShape, batch: int, torch: Any | None
                 ) -> dict[str, Callable[[], tuple[float, float]]]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, shape.channels, shape.height, shape.width), dtype=np.float32)
    w = rng.standard_normal((shape.kernels, shape.channels, shape.kernel_h, shape.kernel_w),
                            dtype=np.float32)
    dy = rng.standard_normal((batch, shape.kernels, *shape.out_size()), dtype=np.float32)
    st, pad = shape.stride, shape.padding
    runs: dict[str, Callable[[], tuple[float, float]]] = {
        "hetconv": lambda: _timed_pair(
            lambda: conv2d_forward_cached(x, w, None, st, pad)[1],
            lambda cache: conv2d_backward_cached(cache, dy, need_dx=True)),
        "plain": lambda: _timed_pair(
            lambda: conv2d(x, w, None, st, pad),
            lambda _: conv2d_backward(x, w, dy, st, pad, need_dx=True)),
    }
    if torch is not None:
        tx = torch.from_numpy(x).requires_grad_()
        tw = torch.from_numpy(w).requires_grad_()
        tdy = torch.from_numpy(dy)

        def torch_backward(y: Any) -> None:
            y.backward(tdy)
            tx.grad, tw.grad = None, None

        runs["torch"] = lambda: _timed_pair(
            lambda: torch.nn.functional.conv2d(tx, tw, None, stride=st, padding=pad),
            torch_backward)
    return runs


def _bench_shape(shape: BenchShape, batch: int, repeats: int, torch: Any | None,
                 ceiling_gflops: float) -> dict[str, Any]:
    runs = _contestants(shape, batch, torch)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for run in runs.values():  # warm-up
        run()
    names = list(runs)
    for repeat in range(repeats):  # interleaved, alternating order
        for name in names if repeat % 2 == 0 else names[::-1]:
            times[name].append(runs[name]())
    flop = shape.train_flop(batch)
    row: dict[str, Any] = {
        "shape": shape.name,
        "x_shape": [batch, shape.channels, shape.height, shape.width],
        "w_shape": [shape.kernels, shape.channels, shape.kernel_h, shape.kernel_w],
        "stride": shape.stride, "padding": shape.padding, "gflop": flop / 1e9,
        "batch": batch, "repeats": repeats, "ceiling_gflops": ceiling_gflops,
    }
    for name in ("hetconv", "plain", "torch"):
        pairs = np.array(times.get(name, []), dtype=np.float64).reshape(-1, 2) * 1e3
        found = pairs.shape[0] > 0
        total_ms = float(np.median(pairs.sum(axis=1))) if found else None
        row[f"{name}_fwd_ms"] = float(np.median(pairs[:, 0])) if found else None
        row[f"{name}_bwd_ms"] = float(np.median(pairs[:, 1])) if found else None
        row[f"{name}_total_ms"] = total_ms
        gflops = flop / total_ms / 1e6 if total_ms else None
        row[f"{name}_gflops"] = gflops
        row[f"{name}_pct_ceiling"] = 100.0 * gflops / ceiling_gflops if gflops else None
    torch_ms = row["torch_total_ms"]
    row["ratio"] = row["hetconv_total_ms"] / torch_ms if torch_ms else None
    row["plain_ratio"] = row["plain_total_ms"] / torch_ms if torch_ms else None
    return row


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict[str, Any]]) -> list[str]:
    """The printed table, one string per line (ms are medians)."""
    head = (f"{'shape':<16}{'x':>15}{'w':>15} | {'hetconv fwd':>11}{'bwd':>8}{'total':>8}"
            f"{'GF/s':>7}{'%ceil':>6} | {'torch total':>11}{'GF/s':>7}{'%ceil':>6} | "
            f"{'ratio':>6} | {'plain total':>11}{'ratio':>6}")
    lines = [head, "-" * len(head)]
    for row in rows:
        lines.append(
            f"{row['shape']:<16}{'x'.join(map(str, row['x_shape'])):>15}"
            f"{'x'.join(map(str, row['w_shape'])):>15} | "
            f"{_fmt(row['hetconv_fwd_ms'], '11.1f')}{_fmt(row['hetconv_bwd_ms'], '8.1f')}"
            f"{_fmt(row['hetconv_total_ms'], '8.1f')}{_fmt(row['hetconv_gflops'], '7.0f')}"
            f"{_fmt(row['hetconv_pct_ceiling'], '6.0f')} | "
            f"{_fmt(row['torch_total_ms'], '>11.1f')}{_fmt(row['torch_gflops'], '>7.0f')}"
            f"{_fmt(row['torch_pct_ceiling'], '>6.0f')} | {_fmt(row['ratio'], '>6.2f')} | "
            f"{_fmt(row['plain_total_ms'], '11.1f')}{_fmt(row['plain_ratio'], '>6.2f')}")
    return lines


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    """The result of :func:`run_conv_bench` as markdown lines (for ``--markdown``)."""
    if not rows:
        return ["No shape was timed."]
    first = rows[0]
    lines = [f"Batch {first['batch']}, median of {first['repeats']} interleaved repeats after "
             f"one warm-up; BLAS threads {first['blas_threads']}, torch threads "
             f"{first['torch_threads']} (torch {first['torch_version']}). Ceiling: float32 "
             f"matrix product, {_fmt(first['ceiling_gflops'], '.1f')} GFLOP/s. Times in ms, "
             "forward + backward (dx, dw); ratio = hetconv / torch.", "",
             "| shape | x | w | hetconv fwd | hetconv bwd | hetconv total | hetconv GFLOP/s "
             "| % of ceiling | torch total | torch GFLOP/s | ratio | plain total | plain ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['shape']} | {'x'.join(map(str, row['x_shape']))} | "
            f"{'x'.join(map(str, row['w_shape']))} | {_fmt(row['hetconv_fwd_ms'], '.1f')} | "
            f"{_fmt(row['hetconv_bwd_ms'], '.1f')} | {_fmt(row['hetconv_total_ms'], '.1f')} | "
            f"{_fmt(row['hetconv_gflops'], '.0f')} | {_fmt(row['hetconv_pct_ceiling'], '.0f')} | "
            f"{_fmt(row['torch_total_ms'], '.1f')} | {_fmt(row['torch_gflops'], '.0f')} | "
            f"{_fmt(row['ratio'], '.2f')} | {_fmt(row['plain_total_ms'], '.1f')} | "
            f"{_fmt(row['plain_ratio'], '.2f')} |")
    return lines


def run_conv_bench(repeats: int = 5, threads: int | None = None, batch: int = 64,
                   out: Callable[[str], Any] = print,
                   shapes: tuple[BenchShape, ...] | list[BenchShape] = PAPER_SHAPES,
                   ceiling_size: int = 4096) -> list[dict[str, Any]]:
    """Time every shape and print the table through ``out``; return one dict per shape
    (besides the timings: ``blas_threads``, ``torch_threads``, ``torch_version``).

    repeats: timed runs per contestant (after one warm-up); threads: BLAS and torch
    thread limit (None: leave as is); batch: samples per call; ceiling_size: side of
    the square float32 matrix product that measures the ceiling.
    """
    if repeats < 1 or batch < 1:
        raise ValueError(f"repeats and batch must be >= 1, got {repeats} and {batch}")
    torch = _import_torch()
    rows = []
    with _thread_limit(threads, torch):
        ceiling = matmul_ceiling_gflops(min(repeats, 5), ceiling_size)
        torch_threads = torch.get_num_threads() if torch is not None else "-"
        out(f"float32 matmul {ceiling_size}x{ceiling_size}: {ceiling:.1f} GFLOP/s (the ceiling); "
            f"BLAS threads {_blas_thread_count()}, torch threads {torch_threads}; batch {batch}; "
            f"median of {repeats} repeats; ratio = hetconv / torch (forward + backward)")
        if torch is None:
            out(TORCH_MISSING)
        blas_threads = _blas_thread_count()
        for shape in shapes:
            row = _bench_shape(shape, batch, repeats, torch, ceiling)
            row.update(blas_threads=blas_threads, torch_threads=torch_threads,
                       torch_version=torch.__version__ if torch is not None else "-")
            rows.append(row)
    for line in format_table(rows):
        out(line)
    return rows
