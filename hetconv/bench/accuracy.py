"""``hetconv bench accuracy``: final test accuracy of real distributed trainings, per seed.

For every seed it starts ``--workers`` local worker daemons (``hetconv.lab``, one BLAS
thread each), runs the real ``hetconv train --listen ... --no-local`` over them on a
real dataset (Fashion-MNIST by default), and reads the run's ``metrics.jsonl``: the
test accuracy after every epoch, the training time and the throughput. It prints one
row per seed and whether every seed reached ``--target`` (a percentage), so that an
accuracy claimed in README.md is a command anyone can run again.

This is a benchmark (minutes to hours), not a test: the suite checks its logic on a
tiny synthetic run.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hetconv.errors import UserError
from hetconv.lab import LocalWorkers, free_port


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"`` -> ``[0, 1, 2]``; one clear error for anything else."""
    try:
        seeds = [int(word) for word in text.split(",") if word.strip() != ""]
    except ValueError:
        raise UserError(f"--seeds {text!r}: give integers separated by commas, e.g. 0,1,2") from None
    if not seeds:
        raise UserError("--seeds: give at least one seed, e.g. 0,1,2")
    if len(set(seeds)) != len(seeds):
        raise UserError(f"--seeds {text!r}: a seed is repeated")
    return seeds


def read_run(run_dir: Path) -> dict[str, Any]:
    """A finished run's figures: test accuracy per epoch (fractions), training seconds,
    wall seconds of its epochs, images per second of the last epoch, and its status."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise UserError(f"{run_dir}: no metrics.jsonl (the run did not start)")
    epochs: list[dict[str, Any]] = []
    status = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a cut-off last line
        if record.get("type") == "epoch":
            epochs.append(record)
        elif record.get("type") == "run_end":
            status = record.get("status")
    if not epochs:
        raise UserError(f"{run_dir}: the run recorded no epoch")
    return {"test_accuracy": [float(e["test_accuracy"]) for e in epochs],
            "train_s": sum(float(e["train_s"]) for e in epochs),
            "epochs_s": sum(float(e["epoch_s"]) for e in epochs),
            "images_per_s": float(epochs[-1]["images_per_s"]),
            "status": status}


def run_accuracy_bench(seeds: Sequence[int], arch: str = "32:64", epochs: int = 3,
                       batch: int = 128, workers: int = 2, data: str = "fashion-mnist",
                       data_dir: str | None = None, limit: int | None = None,
                       test_limit: int | None = None, train_args: Sequence[str] = (),
                       target: float | None = None, work_dir: str | None = None,
                       out: Callable[[str], None] = print, peer: str | None = None
                       ) -> dict[str, Any]:
    """Train once per seed over ``workers`` local worker daemons; print and return one
    row per seed (final and best test accuracy in percent, training minutes) and the
    markdown ``table``. ``target`` (percent) marks each row met or missed. ``peer``
    "torch": the same network, weights, data order and recipe in PyTorch beside each
    run (:mod:`hetconv.bench.accuracy_torch`), its accuracy per epoch in the row."""
    if peer not in (None, "torch"):
        raise UserError(f"--peer {peer!r}: the peer of bench accuracy is torch")
    torch = None
    if peer == "torch":
        from hetconv.bench.step_torch import import_torch

        torch = import_torch()  # before any run: a missing torch is one line now
    if workers < 1:
        raise UserError("--workers must be at least 1")
    base = Path(work_dir or tempfile.mkdtemp(prefix="hetconv-bench-accuracy-"))
    base.mkdir(parents=True, exist_ok=True)
    out(f"hetconv bench accuracy: arch {arch}, {epochs} epoch(s), batch {batch}, data {data}, "
        f"{workers} local worker(s) with 1 thread each, seeds {', '.join(map(str, seeds))}; "
        f"runs in {base}")
    rows: list[dict[str, Any]] = []
    for seed in seeds:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        run_dir = base / f"seed-{seed}"
        command = [sys.executable, "-m", "hetconv", "train", "--listen", endpoint,
                   "--min-workers", str(workers), "--wait", "60", "--no-local",
                   "--data", data, "--arch", arch, "--epochs", str(epochs),
                   "--batch", str(batch), "--seed", str(seed), "--threads", "1",
                   "--no-progress", "--run-dir", str(run_dir), "--overwrite", *train_args]
        if data_dir is not None:
            command += ["--data-dir", data_dir]
        if limit is not None:
            command += ["--limit", str(limit)]
        if test_limit is not None:
            command += ["--test-limit", str(test_limit)]
        specs = [{"name": f"worker-{i}", "threads": 1} for i in range(workers)]
        started = time.monotonic()
        log_dir = base / f"seed-{seed}-logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        with LocalWorkers(endpoint, specs, log_dir=log_dir):
            result = subprocess.run(command, capture_output=True, text=True)
        wall_s = time.monotonic() - started
        if result.returncode != 0:
            lines = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()
            raise UserError(f"bench accuracy: the run with seed {seed} failed: {lines[-1]} "
                            f"(logs in {log_dir})")
        figures = read_run(run_dir)
        final = 100.0 * figures["test_accuracy"][-1]
        row = {"seed": seed, "final_percent": final,
               "best_percent": 100.0 * max(figures["test_accuracy"]),
               "per_epoch_percent": [100.0 * a for a in figures["test_accuracy"]],
               "train_minutes": figures["train_s"] / 60.0, "wall_minutes": wall_s / 60.0,
               "images_per_s": figures["images_per_s"], "run_dir": str(run_dir),
               "met": None if target is None else final >= target}
        rows.append(row)
        out(f"seed {seed}: test accuracy {final:.2f}% after epoch {len(figures['test_accuracy'])} "
            f"(per epoch: {', '.join(f'{a:.2f}' for a in row['per_epoch_percent'])}); training "
            f"{row['train_minutes']:.1f} min, {row['images_per_s']:.0f} images/s; {run_dir}")
        if torch is not None:
            theirs = [100.0 * a for a in _torch_side(torch, run_dir, seed, epochs)]
            row["torch_per_epoch_percent"] = theirs
            row["torch_final_percent"] = theirs[-1]
            out(f"seed {seed}: PyTorch, same network, weights, data order and recipe: "
                f"{theirs[-1]:.2f}% (per epoch: {', '.join(f'{a:.2f}' for a in theirs)}); "
                f"hetconv - PyTorch {final - theirs[-1]:+.2f} points")
    settings = {"arch": arch, "epochs": epochs, "batch": batch, "workers": workers,
                "data": data, "train_args": list(train_args), "target": target, "peer": peer}
    result_: dict[str, Any] = {
        "settings": settings, "rows": rows,
        "all_met": None if target is None else all(r["met"] for r in rows)}
    result_["table"] = markdown_table(result_)
    if target is not None:
        verdict = "every seed reached" if result_["all_met"] else "NOT every seed reached"
        out(f"{verdict} the target of {target:.2f}% test accuracy")
    return result_


def _torch_side(torch: Any, run_dir: Path, seed: int, epochs: int) -> list[float]:
    """PyTorch's accuracy per epoch with the hetconv run's own data and recipe (read from
    its config.json: the data as loaded, the network, batch, learning rate, momentum,
    weight decay and schedule)."""
    from hetconv.bench.accuracy_torch import torch_accuracy
    from hetconv.engine.optim import OptimizerConfig
    from hetconv.inference.trained_run import load_run, load_run_data

    run = load_run(run_dir)
    config = run.config
    if config.get("augment"):
        raise UserError("bench accuracy --peer torch: --augment is not mirrored on the "
                        "PyTorch side; leave it out of --train-flags")
    data = load_run_data(run)
    optimizer = OptimizerConfig(learning_rate=float(config["lr"]),
                                momentum=float(config["momentum"]),
                                weight_decay=float(config["weight_decay"]),
                                schedule=str(config["schedule"]))
    return torch_accuracy(torch, run.model, data, seed, epochs, int(config["batch"]),
                          optimizer, int(config.get("eval_batch") or 1000))


def markdown_table(result: dict[str, Any]) -> list[str]:
    """The result of :func:`run_accuracy_bench` as markdown lines (for ``--markdown``)."""
    s = result["settings"]
    extra = " ".join(s["train_args"])
    lines = [f"Real dataset `{s['data']}`, network `{s['arch']}`, {s['epochs']} epoch(s), batch "
             f"{s['batch']}, distributed over {s['workers']} local worker daemon(s) with one BLAS "
             f"thread each (the master computes no kernels)"
             + (f", extra training flags `{extra}`" if extra else "") + ". Accuracy on the "
             "whole test set after the last epoch; training minutes exclude evaluation.", "",
             "| seed | test accuracy % (last epoch) | per epoch % | training min | images/s |"
             + (" target |" if s["target"] is not None else "")
             + (" PyTorch % (last epoch) | PyTorch per epoch % | hetconv - PyTorch |"
                if s.get("peer") else ""),
             "|---|---|---|---|---|" + ("---|" if s["target"] is not None else "")
             + ("---|---|---|" if s.get("peer") else "")]
    for r in result["rows"]:
        target = ""
        if s["target"] is not None:
            target = f" {'met' if r['met'] else 'missed'} (≥ {s['target']:.2f}) |"
        lines.append(f"| {r['seed']} | {r['final_percent']:.2f} | "
                     f"{' / '.join(f'{a:.2f}' for a in r['per_epoch_percent'])} | "
                     f"{r['train_minutes']:.1f} | {r['images_per_s']:.0f} |{target}"
                     + (f" {r['torch_final_percent']:.2f} | "
                        f"{' / '.join(f'{a:.2f}' for a in r['torch_per_epoch_percent'])} | "
                        f"{r['final_percent'] - r['torch_final_percent']:+.2f} |"
                        if s.get("peer") else ""))
    return lines
