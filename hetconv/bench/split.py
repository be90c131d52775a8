"""``hetconv bench split``: one worker alone vs three ways to split over two workers.

Starts local worker daemons (one at full speed, one under a cgroup v1 CPU quota,
``hetconv.lab``), then runs the same short training four times through the real
``hetconv train`` command, side by side in one invocation:

(a) the fast worker alone, (b) both workers with an equal kernel split,
(c) both with the paper's calibrated split (equation 1), (d) both with hetconv's
cost-model split (fixed + per-kernel cost per participant, equal finish times); the
master computes no kernels (``--no-local``) so that only the two workers share the
machine's cores. It reads each run's ``metrics.jsonl`` and prints median conv-phase,
communication and step times (first step skipped), the ratios between the runs, and
the ideal conv time for the workers' combined speed,
``T_a / (1 + t_fast / t_slow)``, with the calibration times t of run (c).
:func:`markdown_table` renders the same result for ``--markdown``.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetconv.errors import UserError
from hetconv.lab import LocalWorkers, cpu_quota_unavailable_reason, free_port
from hetconv.metrics import participant_entries, participant_of

RUN_LABELS = {"one": "(a) fast worker alone", "equal": "(b) equal split",
              "calibrated": "(c) calibrated (eq. 1)", "model": "(d) cost-model split"}


def _median_phase_times(run_dir: Path) -> dict[str, float]:
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r.get("type") == "step"]
    steps = steps[1:] if len(steps) > 1 else steps
    if not steps:
        raise UserError(f"{run_dir}: the run recorded no steps")
    return {"conv_s": statistics.median(s["conv_s"] for s in steps),
            "step_s": statistics.median(s["step_s"] for s in steps),
            "comm_s": statistics.median(s["comm_s"] for s in steps)}


def _calibration(run_dir: Path) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("type") == "calibration"]


def run_split_bench(slow_fraction: float = 0.3, arch: str = "32:256", batch: int = 128,
                    limit: int = 1152, repeats: int = 1, work_dir: str | None = None,
                    out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (a) the fast worker alone, (b) equal, (c) calibrated and (d) cost-model splits
    over both workers, ``repeats`` times each; print and return the medians and ratios
    (and, under ``settings``, the arguments)."""
    reason = cpu_quota_unavailable_reason()
    if reason:
        raise UserError(f"bench split needs cgroup v1 CPU quotas (run as root): {reason}")
    base = Path(work_dir or tempfile.mkdtemp(prefix="hetconv-bench-split-"))
    base.mkdir(parents=True, exist_ok=True)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    common = ["--data", "synthetic", "--limit", str(limit), "--test-limit", "256",
              "--arch", arch, "--batch", str(batch), "--epochs", "1", "--threads", "1",
              "--no-progress", "--no-local", "--wait", "60"]

    def train(name: str, workers: int, split: str) -> Path:
        run_dir = base / name
        command = [sys.executable, "-m", "hetconv", "train", "--listen", endpoint,
                   "--min-workers", str(workers), "--split", split,
                   "--split-by", "kernels", *common,
                   "--run-dir", str(run_dir), "--overwrite"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            raise UserError(f"bench run {name} failed: {result.stderr.strip().splitlines()[-1]}")
        return run_dir

    out(f"hetconv bench split: arch {arch}, batch {batch}, {limit} images per run, workers "
        f"'fast' (1 thread) and 'slow' (1 thread, {slow_fraction:.0%} of a core); runs in {base}")
    figures: dict[str, list[dict[str, float]]] = {"one": [], "equal": [], "calibrated": [],
                                                  "model": []}
    calibration: list[dict[str, Any]] = []
    model_split: list[dict[str, Any]] = []
    for repeat in range(repeats):
        with LocalWorkers(endpoint, [{"name": "fast", "threads": 1}], log_dir=base):
            figures["one"].append(_median_phase_times(train(f"one-{repeat}", 1, "equal")))
            with LocalWorkers(endpoint, [{"name": "slow", "threads": 1,
                                          "cpu_fraction": slow_fraction}], log_dir=base):
                time.sleep(0.5)
                figures["equal"].append(_median_phase_times(train(f"equal-{repeat}", 2, "equal")))
                run_dir = train(f"calibrated-{repeat}", 2, "calibrated")
                figures["calibrated"].append(_median_phase_times(run_dir))
                calibration = _calibration(run_dir)
                run_dir = train(f"model-{repeat}", 2, "model")
                figures["model"].append(_median_phase_times(run_dir))
                model_split = _calibration(run_dir)
    med = {name: {key: statistics.median(f[key] for f in runs) for key in runs[0]}
           for name, runs in figures.items()}
    # combined speed from calibration: sum over layers of per-participant seconds for equal work
    fast_s = sum(d["seconds"] for c in calibration for d in participant_entries(c)
                 if participant_of(d) == "fast")
    slow_s = sum(d["seconds"] for c in calibration for d in participant_entries(c)
                 if participant_of(d) == "slow")
    ideal_conv = med["one"]["conv_s"] / (1.0 + fast_s / slow_s)
    result = {"settings": {"slow_fraction": slow_fraction, "arch": arch, "batch": batch,
                           "limit": limit, "repeats": repeats},
              "median": med, "ideal_conv_s": ideal_conv,
              "calibrated_over_ideal": med["calibrated"]["conv_s"] / ideal_conv,
              "equal_over_calibrated_conv": med["equal"]["conv_s"] / med["calibrated"]["conv_s"],
              "equal_over_calibrated_step": med["equal"]["step_s"] / med["calibrated"]["step_s"],
              "one_over_calibrated_step": med["one"]["step_s"] / med["calibrated"]["step_s"],
              "model_over_ideal": med["model"]["conv_s"] / ideal_conv,
              "equal_over_model_conv": med["equal"]["conv_s"] / med["model"]["conv_s"],
              "one_over_model_step": med["one"]["step_s"] / med["model"]["step_s"],
              "model_split": [{"layer": c["layer"], **{participant_of(d): d["kernels"]
                                                      for d in participant_entries(c)}}
                              for c in model_split],
              "calibrated_slow_speed": fast_s / slow_s,
              "split": [{"layer": c["layer"],
                         **{participant_of(d): d["kernels"] for d in participant_entries(c)}}
                        for c in calibration]}
    out(f"{'run':<28}{'conv phase ms':>15}{'comm ms':>10}{'step ms':>10}")
    for name, label in RUN_LABELS.items():
        m = med[name]
        out(f"{label:<28}{m['conv_s'] * 1e3:>15.1f}{m['comm_s'] * 1e3:>10.1f}"
            f"{m['step_s'] * 1e3:>10.1f}")
    for key, label in (("split", "calibrated (eq. 1)"), ("model_split", "cost-model")):
        out(f"{label} kernel split: " + "; ".join(
            f"layer {s['layer'] + 1}: fast {s.get('fast', 0)}, slow {s.get('slow', 0)}"
            for s in result[key]))
    out(f"slow worker's calibrated speed: {result['calibrated_slow_speed']:.2f} of the fast one "
        f"(quota {slow_fraction:.2f})")
    out(f"ideal conv phase for the combined speed: {ideal_conv * 1e3:.1f} ms; calibrated / ideal "
        f"= {result['calibrated_over_ideal']:.2f}x")
    out(f"equal / calibrated: conv phase {result['equal_over_calibrated_conv']:.2f}x, step "
        f"{result['equal_over_calibrated_step']:.2f}x; one device / calibrated step "
        f"{result['one_over_calibrated_step']:.2f}x")
    out(f"cost model / ideal = {result['model_over_ideal']:.2f}x; equal / cost model: conv "
        f"phase {result['equal_over_model_conv']:.2f}x; one device / cost model step "
        f"{result['one_over_model_step']:.2f}x")
    return result


def markdown_table(result: dict[str, Any]) -> list[str]:
    """The result of :func:`run_split_bench` as markdown lines (for ``--markdown``)."""
    settings, med = result["settings"], result["median"]
    lines = [f"Synthetic data, arch {settings['arch']}, batch {settings['batch']}, "
             f"{settings['limit']} images per run, median over steps (the first skipped) and "
             f"over {settings['repeats']} repeat(s). Workers on this machine: 'fast' (1 "
             f"thread) and 'slow' (1 thread, {settings['slow_fraction']:.0%} of a core); the "
             "master computes no kernels. Times in ms per training step.", "",
             "| run | conv phase | communication | step |", "|---|---|---|---|"]
    for name, label in RUN_LABELS.items():
        row = med[name]
        lines.append(f"| {label} | {row['conv_s'] * 1e3:.1f} | {row['comm_s'] * 1e3:.1f} | "
                     f"{row['step_s'] * 1e3:.1f} |")
    lines += ["", "| kernel split | layer | fast | slow |", "|---|---|---|---|"]
    for key, label in (("split", "calibrated (eq. 1)"), ("model_split", "cost-model")):
        for layer in result[key]:
            lines.append(f"| {label} | {layer['layer'] + 1} | {layer.get('fast', 0)} | "
                         f"{layer.get('slow', 0)} |")
    lines += ["", "| ratio | value |", "|---|---|",
              f"| slow worker's calibrated speed / fast one's | "
              f"{result['calibrated_slow_speed']:.2f} |",
              f"| ideal conv phase for the combined speed, ms | "
              f"{result['ideal_conv_s'] * 1e3:.1f} |"]
    for key, label in (("calibrated_over_ideal", "calibrated / ideal, conv phase"),
                       ("model_over_ideal", "cost model / ideal, conv phase"),
                       ("equal_over_calibrated_conv", "equal / calibrated, conv phase"),
                       ("equal_over_model_conv", "equal / cost model, conv phase"),
                       ("equal_over_calibrated_step", "equal / calibrated, step"),
                       ("one_over_calibrated_step", "fast alone / calibrated, step"),
                       ("one_over_model_step", "fast alone / cost model, step")):
        lines.append(f"| {label} | {result[key]:.2f} |")
    return lines
