"""`hetconv bench accuracy`'s pure parts: seeds, reading a run, the table, its command line."""
from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import numpy as np
import pytest

from hetconv.bench.accuracy import markdown_table, parse_seeds, read_run
from hetconv.commands.bench import command_line
from hetconv.commands.cli import build_parser
from hetconv.errors import UserError


def test_seeds() -> None:
    assert parse_seeds("0,1,2") == [0, 1, 2]
    assert parse_seeds("7") == [7]
    for bad in ("", "a,b", "1,1", "1.5"):
        with pytest.raises(UserError, match="--seeds"):
            parse_seeds(bad)


def test_read_run_takes_every_epoch_and_skips_a_cut_line(tmp_path: Path) -> None:
    lines = [{"type": "run_start"},
             {"type": "epoch", "epoch": 0, "test_accuracy": 0.8, "train_s": 60.0,
              "epoch_s": 62.0, "images_per_s": 1000.0},
             {"type": "step", "step": 3},
             {"type": "epoch", "epoch": 1, "test_accuracy": 0.9, "train_s": 30.0,
              "epoch_s": 31.0, "images_per_s": 2000.0},
             {"type": "run_end", "status": "completed"}]
    (tmp_path / "metrics.jsonl").write_text(
        "\n".join(json.dumps(line) for line in lines) + '\n{"type": "ep')
    run = read_run(tmp_path)
    assert run == {"test_accuracy": [0.8, 0.9], "train_s": 90.0, "epochs_s": 93.0,
                   "images_per_s": 2000.0, "status": "completed"}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"type": "run_start"}) + "\n")
    with pytest.raises(UserError, match="no epoch"):
        read_run(tmp_path)
    with pytest.raises(UserError, match="no metrics.jsonl"):
        read_run(tmp_path / "missing")


def test_table_marks_each_seed_against_the_target() -> None:
    rows = [{"seed": 0, "final_percent": 90.25, "per_epoch_percent": [86.8, 89.7, 90.25],
             "train_minutes": 2.5, "images_per_s": 1300.0, "met": True},
            {"seed": 1, "final_percent": 89.89, "per_epoch_percent": [86.0, 89.0, 89.89],
             "train_minutes": 2.6, "images_per_s": 1290.0, "met": False}]
    settings = {"arch": "32:64", "epochs": 3, "batch": 128, "workers": 2,
                "data": "fashion-mnist", "train_args": ["--augment"], "target": 90.0}
    text = "\n".join(markdown_table({"settings": settings, "rows": rows}))
    assert "| 0 | 90.25 | 86.80 / 89.70 / 90.25 | 2.5 | 1300 | met (≥ 90.00) |" in text
    assert "| 1 | 89.89 | 86.00 / 89.00 / 89.89 | 2.6 | 1290 | missed (≥ 90.00) |" in text
    assert "`--augment`" in text


def test_command_line_round_trips_through_the_parser() -> None:
    parser = build_parser()
    argv = ["bench", "accuracy", "--seeds", "0,1", "--arch", "c8k3p1,pool", "--epochs", "2",
            "--train-flags=--augment --lr 0.1", "--target", "93"]
    args = parser.parse_args(argv)
    line = command_line(args)
    again = parser.parse_args(shlex.split(line)[1:])
    assert isinstance(again, argparse.Namespace)
    assert vars(again) == vars(args)
    assert "'--train-flags=--augment --lr 0.1'" in line


@pytest.mark.parametrize("arch", ["c6k3p1,pool,c8k3p1,pool", "c6k3p1,res6,res8s2,gap"])
def test_the_pytorch_side_trains_what_hetconv_trains(arch: str, tmp_path: Path) -> None:
    """Same network, initial weights, data order and recipe: PyTorch's accuracy after each
    epoch is hetconv's local run's (float sums aside)."""
    torch = pytest.importorskip("torch")
    import hetconv
    from hetconv.bench.accuracy import _torch_side

    rng = np.random.default_rng(3)
    x = rng.integers(0, 100, (480, 1, 12, 12), dtype=np.uint8)
    y = rng.integers(0, 4, 480)
    for index, label in enumerate(y):  # the class is the brightest quarter
        row, col = divmod(int(label), 2)
        x[index, 0, row * 6:row * 6 + 6, col * 6:col * 6 + 6] += 100
    run = hetconv.train(arch, hetconv.arrays(x, y, test_fraction=0.25), epochs=2, batch=32,
                        seed=4, run_dir=tmp_path / "run", quiet=True, threads=1)
    with pytest.raises(hetconv.UserError, match="cannot load the run's data"):  # arrays: gone
        _torch_side(torch, run.run_dir, 4, 2)
    from hetconv.bench.accuracy_torch import torch_accuracy
    from hetconv.engine.optim import OptimizerConfig
    from hetconv.inference.trained_run import load_run

    theirs = torch_accuracy(torch, load_run(run.run_dir).model, run.data, 4, 2, 32,
                            OptimizerConfig())
    ours = [float(e["test_accuracy"]) for e in run.history]
    assert len(theirs) == 2 and max(abs(a - b) for a, b in zip(theirs, ours)) <= 0.03, (
        theirs, ours)
