"""``hetconv bench step``: one machine's whole training step, hetconv against PyTorch.

hetconv's side is the code path of ``hetconv train --local``: a
:class:`hetconv.engine.training.Trainer` over a :class:`hetconv.engine.stage.LocalConvStage`, one
``train_step`` per sample. PyTorch's is a plain CPU loop over the same layers (conv ->
batch norm -> ReLU -> pool per conv layer, the dense layers, cross-entropy, SGD with
momentum 0.9 and weight decay on the weights), started from the same weights, on the
same synthetic batch. Per network and per setting (threads, and a cgroup v1 CPU quota
where one is asked for; both sides run under it) the steps are interleaved (the order
alternates every repeat) after warm-up steps, and the medians and the spread (min-max)
are reported, with the ratio hetconv / PyTorch.

Beside them: a per-op breakdown of both (hetconv's own timers, ``hetconv.ops.timers``;
``torch.profiler`` self CPU time by op, mapped onto the same rows: the PyTorch side is
``hetconv.bench.step_torch``), and the roofline:
the step's GEMM FLOPs at the measured numpy float32 matrix-product rate plus the
bytes an ideal fused step must move at the measured copy bandwidth, both measured at
the setting's threads and quota. Pure parts (the arithmetic and the tables) are plain
functions over plain data.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetconv.backend import run_parallel
from hetconv.bench.step_torch import (  # the PyTorch side, also used by bench scale/ddp
    LEARNING_RATE,
    ROWS,
    torch_breakdown,
)
from hetconv.bench.step_torch import TORCH_MISSING as TORCH_MISSING
from hetconv.bench.step_torch import import_torch as import_torch
from hetconv.bench.step_torch import torch_network as torch_network
from hetconv.bench.step_torch import torch_row as torch_row
from hetconv.bench.step_torch import torch_step as torch_step
from hetconv.config import STEP_OPS
from hetconv.device_info import blas_note
from hetconv.errors import UserError
from hetconv.model import (
    ModelConfig,
    conv_layer_shapes,
    dense_shapes,
    init_parameters,
    model_config,
    parse_network,
)

INPUT_SHAPE = (1, 28, 28)  # Fashion-MNIST, what the networks of the docs train on
CLASSES = 10
WARMUP_STEPS = 2
PROFILE_STEPS = 3
BANDWIDTH_BYTES = 64 << 20  # the copy that measures the memory bandwidth
GEMM_SIZE = 1536  # side of the square matrix product that measures the GEMM rate


@dataclass(frozen=True)
class Setting:
    """Threads for both sides (hetconv's host threads, each with a single-threaded BLAS,
    as ``--threads`` sets them; torch's intra-op threads) and the CPU quota in cores
    (None: none)."""

    threads: int
    quota: float | None = None

    @property
    def label(self) -> str:
        quota = f" at {self.quota:g} core" if self.quota is not None else ""
        return f"{self.threads} thread{'s' if self.threads > 1 else ''}{quota}"


def parse_settings(threads: list[int] | None, quotas: list[str] | None) -> list[Setting]:
    """``--threads`` and ``--quota`` (paired in order; ``none`` for no quota) -> settings.

    No --threads: every core. One --quota applies to every --threads; otherwise there
    must be one per --threads.
    """
    counts = list(threads or [os.cpu_count() or 1])
    texts = list(quotas or [])
    if len(texts) == 1:
        texts *= len(counts)
    if texts and len(texts) != len(counts):
        raise UserError(f"--quota: give one, or one per --threads ({len(counts)}), "
                        f"not {len(texts)}")
    settings = []
    for index, count in enumerate(counts):
        text = texts[index] if texts else "none"
        if text.lower() == "none":
            settings.append(Setting(count))
            continue
        try:
            fraction = float(text)
        except ValueError:
            raise UserError(f"--quota {text!r}: expected a fraction of a core like 0.45, "
                            "or none") from None
        if not 0.01 <= fraction <= 64:
            raise UserError(f"--quota {text}: must be within 0.01..64 cores")
        settings.append(Setting(count, fraction))
    return settings


# --- the roofline (pure) -------------------------------------------------------------
@dataclass(frozen=True)
class StepWork:
    """What one training step must do at least: GEMM FLOPs and bytes to move."""

    gemm_flop: float
    bytes_moved: float


def step_work(model: ModelConfig, batch: int, itemsize: int = 4) -> StepWork:
    """The step's GEMM FLOPs (every conv and dense product: forward, weight gradient, and
    the input gradient of every layer but the first conv) and the bytes an ideal fused
    step moves through memory: per conv layer the conv output written and read back
    forward, read, overwritten by its gradient and read again backward (5 passes), the
    layer's input read forward and its gradient written backward, its output written
    forward and its gradient read backward; per dense layer its input and output twice."""
    flop = 0.0
    numbers = 0.0
    for shape in conv_layer_shapes(model):
        forward = float(shape.conv_flops(batch))
        flop += forward * (3 if shape.index > 0 else 2)
        conv_out = batch * shape.kernels * shape.conv_height * shape.conv_width
        numbers += 5 * conv_out + 2 * np.prod(shape.input_shape(batch)) \
            + 2 * np.prod(shape.output_shape(batch))
    for _, features, units in dense_shapes(model):
        flop += 3 * 2.0 * batch * features * units
        numbers += 2 * batch * (features + units)
    return StepWork(flop, float(numbers) * itemsize)


def roofline_seconds(work: StepWork, gemm_flop_per_s: float, bytes_per_s: float
                     ) -> tuple[float, float]:
    """(GEMM seconds, memory seconds) of the step at the measured rates."""
    if gemm_flop_per_s <= 0 or bytes_per_s <= 0:
        raise ValueError("rates must be positive")
    return work.gemm_flop / gemm_flop_per_s, work.bytes_moved / bytes_per_s


def spread(samples: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of samples."""
    if not samples:
        raise ValueError("no samples")
    return float(statistics.median(samples)), float(min(samples)), float(max(samples))


# --- hetconv's side --------------------------------------------------------------------
OPS = STEP_OPS
"""hetconv's conv layers: the fused pass (what training runs), or the separate ops."""


@contextlib.contextmanager
def hetconv_step(model: ModelConfig, params: dict[str, np.ndarray], x: np.ndarray,
                 labels: np.ndarray, batch: int, ops: str = "fused"
                 ) -> Iterator[Callable[[], None]]:
    """One ``Trainer.train_step`` of ``hetconv train --local`` per call (momentum 0.9);
    ``ops`` "separate" runs the conv layers as the separate ops instead of fused."""
    from hetconv.engine.scratch_trainer import scratch_trainer
    from hetconv.engine.stage import layer_settings
    from hetconv.ops import conv_layer

    with scratch_trainer(model, params, layer_settings(model, 0.9, 5e-4), batch) as (trainer,
                                                                                   stage):
        counter = iter(range(1 << 62))

        def step() -> None:
            fused, conv_layer.FUSED = conv_layer.FUSED, ops == "fused"
            try:
                trainer.train_step(x, labels, next(counter), LEARNING_RATE)
            finally:
                conv_layer.FUSED = fused
            stage.end_step()
        yield step


# --- measured rates --------------------------------------------------------------------
def gemm_rate(threads: int, repeats: int = 3, size: int = GEMM_SIZE) -> float:
    """numpy float32 matrix-product FLOP/s (median, after a warm-up) on ``threads`` host
    threads, one single-threaded product each (as hetconv computes)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    outs = [np.empty_like(a) for _ in range(threads)]

    def product(index: int) -> None:
        np.matmul(a, b, out=outs[index])
    seconds = _median_seconds(lambda: run_parallel(product, threads, threads), repeats)
    return threads * 2.0 * size**3 / seconds


def copy_bandwidth(threads: int, repeats: int = 3, size: int = BANDWIDTH_BYTES) -> float:
    """Bytes/s (read + written) of a big numpy copy split over ``threads`` host threads."""
    source = np.ones(size // 4, np.float32)
    target = np.empty_like(source)
    edges = [len(source) * i // threads for i in range(threads + 1)]

    def copy_part(index: int) -> None:
        np.copyto(target[edges[index]:edges[index + 1]], source[edges[index]:edges[index + 1]])
    seconds = _median_seconds(lambda: run_parallel(copy_part, threads, threads), repeats)
    return 2.0 * source.nbytes / seconds


def _median_seconds(call: Callable[[], Any], repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(statistics.median(times))


# --- one network at one setting ----------------------------------------------------------
@dataclass
class StepResult:
    """One network at one setting: step seconds of both sides, per-op seconds per step,
    the rates measured for the roofline and the step's work."""

    arch: str
    setting: Setting
    batch: int
    hetconv_s: list[float]
    torch_s: list[float]
    hetconv_ops: dict[str, float] = field(default_factory=dict)
    torch_ops: dict[str, float] = field(default_factory=dict)
    torch_top: list[tuple[str, float]] = field(default_factory=list)
    gemm_flop_per_s: float = 0.0
    bytes_per_s: float = 0.0
    work: StepWork = StepWork(0.0, 0.0)

    @property
    def ratio(self) -> float:
        return spread(self.hetconv_s)[0] / spread(self.torch_s)[0]


@contextlib.contextmanager
def _setting(setting: Setting, torch: Any) -> Iterator[None]:
    """Threads (hetconv's host threads, torch's intra-op threads) and the quota (this
    whole process) inside."""
    from hetconv.backend import computing_threads
    from hetconv.lab.quota import CpuQuota, cpu_quota_unavailable_reason

    quota = None
    if setting.quota is not None:
        reason = cpu_quota_unavailable_reason()
        if reason:
            raise UserError(f"--quota {setting.quota:g}: CPU quotas unavailable ({reason}); "
                            "run as root on a cgroup v1 machine, or use --quota none")
        quota = CpuQuota(setting.quota)
    torch_before = torch.get_num_threads()
    try:
        with computing_threads(setting.threads):
            torch.set_num_threads(setting.threads)
            if quota is not None:
                quota.add(os.getpid())
            yield
    finally:
        torch.set_num_threads(torch_before)
        if quota is not None:
            quota.remove()


def measure(arch: str, setting: Setting, batch: int, repeats: int, torch: Any,
            seed: int = 0, ops: str = "fused") -> StepResult:
    """Time ``arch`` on both sides at ``setting``: warm-ups, ``repeats`` interleaved steps,
    then the per-op breakdown and the roofline rates (all under the setting)."""
    model = model_config(parse_network(arch), INPUT_SHAPE, CLASSES)
    params = init_parameters(model, seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, *INPUT_SHAPE), dtype=np.float32)
    labels = rng.integers(0, CLASSES, batch)
    result = StepResult(arch, setting, batch, [], [], work=step_work(model, batch))
    with _setting(setting, torch), hetconv_step(model, params, x, labels, batch,
                                                 ops) as ours:
        theirs = torch_step(torch, torch_network(torch, model, params), x, labels)
        sides = {"hetconv": (ours, result.hetconv_s), "torch": (theirs, result.torch_s)}
        for _ in range(WARMUP_STEPS):
            ours()
            theirs()
        for repeat in range(repeats):
            for name in ("hetconv", "torch") if repeat % 2 == 0 else ("torch", "hetconv"):
                step, samples = sides[name]
                start = time.perf_counter()
                step()
                samples.append(time.perf_counter() - start)
        result.hetconv_ops = hetconv_breakdown(ours)
        result.torch_ops, result.torch_top = torch_breakdown(torch, theirs, PROFILE_STEPS)
        result.gemm_flop_per_s = gemm_rate(setting.threads)
        result.bytes_per_s = copy_bandwidth(setting.threads)
    return result


def hetconv_breakdown(step: Callable[[], None], steps: int = PROFILE_STEPS
                      ) -> dict[str, float]:
    """Seconds per step by row (median over ``steps``), "other" the rest of the step."""
    from hetconv.ops.timers import collect

    per_step: dict[str, list[float]] = {row: [] for row in ROWS}
    for _ in range(steps):
        with collect() as totals:
            start = time.perf_counter()
            step()
            total = time.perf_counter() - start
        for row in ROWS[:-1]:
            per_step[row].append(totals.get(row, 0.0))
        per_step["other"].append(total - sum(totals.values()))
    return {row: float(statistics.median(values)) for row, values in per_step.items()}


# --- tables (pure) -----------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def summary_table(results: list[StepResult]) -> list[str]:
    """One row per network and setting: medians (min-max) in ms, the ratio, the roofline."""
    lines = ["| network | setting | hetconv ms (min-max) | PyTorch ms (min-max) | "
             "hetconv / PyTorch | roofline ms: GEMM + memory | hetconv / roofline |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        ours, theirs = spread(r.hetconv_s), spread(r.torch_s)
        gemm_s, memory_s = roofline_seconds(r.work, r.gemm_flop_per_s, r.bytes_per_s)
        lines.append(
            f"| `{r.arch}` | {r.setting.label} | {_ms(ours[0])} ({_ms(ours[1])}-{_ms(ours[2])})"
            f" | {_ms(theirs[0])} ({_ms(theirs[1])}-{_ms(theirs[2])}) | {r.ratio:.2f} | "
            f"{_ms(gemm_s + memory_s)}: {_ms(gemm_s)} + {_ms(memory_s)} | "
            f"{ours[0] / (gemm_s + memory_s):.2f} |")
    return lines


def speedup_table(results: list[StepResult]) -> list[str]:
    """Per network: the step at 1 thread without a quota against the most threads
    without one, for both sides (empty when the settings do not include both)."""
    lines = ["| network | threads | hetconv speed-up | PyTorch speed-up |", "|---|---|---|---|"]
    for arch in dict.fromkeys(r.arch for r in results):
        free = [r for r in results if r.arch == arch and r.setting.quota is None]
        single = [r for r in free if r.setting.threads == 1]
        many = max(free, key=lambda r: r.setting.threads, default=None)
        if not single or many is None or many.setting.threads == 1:
            continue
        ours = spread(single[0].hetconv_s)[0] / spread(many.hetconv_s)[0]
        theirs = spread(single[0].torch_s)[0] / spread(many.torch_s)[0]
        lines.append(f"| `{arch}` | 1 -> {many.setting.threads} | {ours:.2f} | {theirs:.2f} |")
    return lines if len(lines) > 2 else []


def breakdown_table(result: StepResult) -> list[str]:
    """Per-op ms per step of both sides (hetconv's timers; torch.profiler self CPU time,
    which also counts the profiler's own overhead)."""
    lines = ["| op | hetconv ms | PyTorch ms |", "|---|---|---|"]
    for row in ROWS:
        lines.append(f"| {row} | {_ms(result.hetconv_ops.get(row, 0.0))} | "
                     f"{_ms(result.torch_ops.get(row, 0.0))} |")
    lines.append(f"| total | {_ms(sum(result.hetconv_ops.values()))} | "
                 f"{_ms(sum(result.torch_ops.values()))} |")
    return lines


def markdown_lines(results: list[StepResult], notes: list[str]) -> list[str]:
    """The figure file's body: notes, the summary, the speed-ups and every breakdown."""
    lines = [*notes, "", *summary_table(results), ""]
    speedups = speedup_table(results)
    if speedups:
        lines += ["Speed-up from 1 thread to the most threads, no quota (medians):", "",
                  *speedups, ""]
    for r in results:
        lines += [f"### `{r.arch}`, {r.setting.label}", "",
                  f"GEMM {r.work.gemm_flop / 1e9:.1f} GFLOP per step at "
                  f"{r.gemm_flop_per_s / 1e9:.0f} GFLOP/s (numpy float32 product); "
                  f"{r.work.bytes_moved / 2**20:.0f} MiB moved per step at "
                  f"{r.bytes_per_s / 2**30:.1f} GiB/s (numpy copy). PyTorch's largest ops "
                  "(self ms per step): " + ", ".join(
                      f"`{name}` {_ms(seconds)}" for name, seconds in r.torch_top[:6]) + ".",
                  "", *breakdown_table(r), ""]
    return lines


def run_step_bench(archs: list[str], settings: list[Setting], batch: int = 128,
                   repeats: int = 7, out: Callable[[str], Any] = print,
                   ops: str = "fused") -> dict[str, Any]:
    """Measure every network at every setting; print and return ``{"results", "table"}``
    (the table: markdown lines for ``--markdown``). ops: hetconv's conv layers as the
    fused pass or as the separate ops (``OPS``)."""
    if repeats < 1 or batch < 2:
        raise UserError(f"--repeats must be >= 1 and --batch >= 2, got {repeats}, {batch}")
    for arch in archs:
        model_config(parse_network(arch), INPUT_SHAPE, CLASSES)  # bad specs fail first
        conv_layer_shapes(model_config(parse_network(arch), INPUT_SHAPE, CLASSES))
    torch = import_torch()
    if ops not in OPS:
        raise UserError(f"--ops {ops!r}: use one of {', '.join(OPS)}")
    path = ("" if ops == "fused" else " hetconv's conv layers run as the separate ops "
            "(--ops separate), not the fused pass that training uses.")
    notes = [f"Batch {batch} of synthetic {'x'.join(map(str, INPUT_SHAPE))} images, "
             f"{CLASSES} classes; median of {repeats} interleaved steps per side after "
             f"{WARMUP_STEPS} warm-up steps (min-max in brackets), SGD momentum 0.9. "
             f"{blas_note()}; PyTorch {torch.__version__}. The breakdowns are the median of "
             f"{PROFILE_STEPS} further steps (hetconv's op timers; torch.profiler self CPU "
             "time). hetconv's conv rows include the batch-norm statistics, max pooling "
             "and batch-norm gradient that its fused layers do inside the conv's chunks; "
             "its BN+ReLU+pool rows are the passes outside them. Roofline: the direct "
             "convolution's and the dense layers' GEMM FLOPs (hetconv's Winograd layers "
             "do fewer) at the measured product rate plus an "
             "ideal fused step's bytes at the measured copy bandwidth, at the same "
             "setting." + path]
    results = []
    for setting in settings:
        for arch in archs:
            out(f"hetconv bench step: {arch}, {setting.label} ...")
            results.append(measure(arch, setting, batch, repeats, torch, ops=ops))
    table = markdown_lines(results, notes)
    for line in table:
        out(line)
    return {"results": results, "table": table}
