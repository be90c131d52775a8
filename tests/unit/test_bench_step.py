"""``hetconv bench step``: the roofline arithmetic, the tables, the settings and their
errors, the command line it records, a missing PyTorch, and a one-repeat smoke run."""
from __future__ import annotations

import builtins
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetconv.bench import step
from hetconv.bench.step import (
    Setting,
    StepResult,
    StepWork,
    parse_settings,
    roofline_seconds,
    spread,
    step_work,
)
from hetconv.bench.step_torch import torch_row
from hetconv.commands.bench import command_line
from hetconv.commands.cli import build_parser, main
from hetconv.errors import UserError
from hetconv.model import model_config, parse_network
from tests.unit.test_docs import check_figure_file, tables


def test_step_work_counts_every_product_and_the_compulsory_bytes() -> None:
    # one 5x5 conv of 4 kernels on 1x8x8 (4x4 out, pooled 2x2), then the classifier
    model = model_config(parse_network("4"), (1, 8, 8), classes=3)
    work = step_work(model, batch=2)
    conv_forward = 2 * 2 * 4 * 1 * 25 * 16  # 2 B K C kh kw Ho Wo
    dense = 2 * 2 * 16 * 3  # 2 B D O, D = 4 * 2 * 2
    assert work.gemm_flop == conv_forward * 2 + dense * 3  # no dx for the first conv
    conv_out, x_in, y_out = 2 * 4 * 16, 2 * 1 * 64, 2 * 4 * 4
    numbers = 5 * conv_out + 2 * x_in + 2 * y_out + 2 * 2 * (16 + 3)
    assert work.bytes_moved == numbers * 4


def test_roofline_seconds_and_spread() -> None:
    assert roofline_seconds(StepWork(2e9, 3e6), 1e11, 1e9) == (0.02, 0.003)
    with pytest.raises(ValueError):
        roofline_seconds(StepWork(1.0, 1.0), 0.0, 1.0)
    assert spread([3.0, 1.0, 2.0, 10.0]) == (2.5, 1.0, 10.0)
    with pytest.raises(ValueError):
        spread([])


def test_settings_pair_threads_with_quotas_and_refuse_bad_ones() -> None:
    assert parse_settings([1, 2], ["0.45", "none"]) == [Setting(1, 0.45), Setting(2)]
    assert parse_settings([1, 1], ["0.5"]) == [Setting(1, 0.5), Setting(1, 0.5)]
    assert parse_settings([3], None) == [Setting(3)]
    assert len(parse_settings(None, None)) == 1
    with pytest.raises(UserError, match="one per --threads"):
        parse_settings([1, 2, 4], ["0.45", "none"])
    with pytest.raises(UserError, match="fraction of a core"):
        parse_settings([1], ["half"])
    with pytest.raises(UserError, match="0.01..64"):
        parse_settings([1], ["0"])
    assert Setting(1, 0.45).label == "1 thread at 0.45 core"
    assert Setting(2).label == "2 threads"


def test_torch_ops_land_in_the_breakdown_rows() -> None:
    assert torch_row("aten::mkldnn_convolution") == "conv forward"
    assert torch_row("aten::convolution_backward") == "conv backward"
    assert torch_row("aten::native_batch_norm") == "BN+ReLU+pool forward"
    assert torch_row("aten::native_batch_norm_backward") == "BN+ReLU+pool backward"
    assert torch_row("aten::max_pool2d_with_indices_backward") == "BN+ReLU+pool backward"
    assert torch_row("aten::threshold_backward") == "BN+ReLU+pool backward"
    assert torch_row("autograd::engine::evaluate_function: ReluBackward0") == \
        "BN+ReLU+pool backward"
    assert torch_row("aten::addmm") == "dense"
    assert torch_row("aten::nll_loss_backward") == "loss"
    assert torch_row("Optimizer.step#SGD.step") == "SGD update"
    assert torch_row("aten::fill_") == "other"


def fake_result(arch: str, threads: int, quota: float | None, ours: float,
                theirs: float) -> StepResult:
    rows = {row: 0.001 for row in step.ROWS}
    return StepResult(arch, Setting(threads, quota), 128, [ours, ours * 1.1, ours * 0.9],
                      [theirs * 0.8, theirs, theirs * 1.2], hetconv_ops=rows, torch_ops=rows,
                      torch_top=[("aten::mm", 0.002)], gemm_flop_per_s=1e11,
                      bytes_per_s=1e10, work=StepWork(1e9, 1e8))


def test_tables_are_well_formed_markdown_with_ratios_and_speedups() -> None:
    results = [fake_result("32:64", 1, 0.45, 0.2, 0.1), fake_result("32:64", 1, None, 0.1,
                                                                     0.05),
               fake_result("32:64", 2, None, 0.05, 0.025)]
    text = "\n".join(step.markdown_lines(results, ["A note."]))
    found = tables(text)
    summary = found[0]
    assert len(summary) == 3 and summary[0]["hetconv / PyTorch"] == "2.00"
    assert summary[0]["roofline ms: GEMM + memory"] == "20.0: 10.0 + 10.0"
    assert summary[0]["hetconv ms (min-max)"] == "200.0 (180.0-220.0)"
    assert summary[0]["PyTorch ms (min-max)"] == "100.0 (80.0-120.0)"
    speedups = found[1]
    assert speedups == [{"network": "`32:64`", "threads": "1 -> 2", "hetconv speed-up": "2.00",
                         "PyTorch speed-up": "2.00"}]
    breakdown = found[2]
    assert [row["op"] for row in breakdown] == [*step.ROWS, "total"]
    assert "### `32:64`, 1 thread at 0.45 core" in text
    assert step.speedup_table(results[:1]) == []


def test_the_command_line_spells_out_every_setting(tmp_path: Path) -> None:
    target = tmp_path / "step.md"
    args = build_parser().parse_args(["bench", "step", "--arch", "32:64", "--arch", "64:256",
                                      "--threads", "1", "--quota", "0.45", "--threads", "2",
                                      "--quota", "none", "--markdown", str(target)])
    assert command_line(args) == (
        f"hetconv bench step --arch 32:64 --arch 64:256 --batch 128 --repeats 7 --ops fused "
        f"--threads 1 --quota 0.45 --threads 2 --quota none --markdown {target}")


def test_without_torch_it_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    real_import = builtins.__import__

    def no_torch(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "torch" or name.startswith("torch."):
            raise ImportError("no torch here")
        return real_import(name, *args, **kwargs)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_torch)
    assert main(["bench", "step", "--arch", "4", "--repeats", "1", "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hetconv: error: hetconv bench step needs PyTorch (the other side of the "
                   "comparison): pip install '.[bench]'"]


@pytest.mark.parametrize("argv,message", [
    (["--arch", "c4k3,fc"], "token 2"),
    (["--repeats", "0"], "--repeats"),
    (["--threads", "1", "--threads", "2", "--quota", "0.5", "--quota", "0.5",
      "--quota", "0.5"], "one per --threads"),
])
def test_bad_arguments_are_one_line(argv: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "step", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hetconv: error:") and message in err[0]


@pytest.mark.slow
def test_a_tiny_network_runs_one_repeat_and_writes_its_figure(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    target = tmp_path / "step.md"
    assert main(["bench", "step", "--arch", "c4k3p1,pool,fc8", "--batch", "8",
                 "--repeats", "1", "--threads", "1", "--markdown", str(target)]) == 0
    text = target.read_text(encoding="utf-8")
    check_figure_file(target)
    summary = tables(text)[0]
    assert summary[0]["network"] == "`c4k3p1,pool,fc8`" and summary[0]["setting"] == "1 thread"
    assert float(summary[0]["hetconv / PyTorch"]) > 0
    assert np.isfinite(float(summary[0]["hetconv / roofline"]))
    assert "- command: `hetconv bench step --arch c4k3p1,pool,fc8 --batch 8 --repeats 1 --ops fused " \
           f"--threads 1 --quota none --markdown {target}`" in text
    assert "wrote" in capsys.readouterr().out


@pytest.mark.slow
def test_the_separate_ops_can_be_timed_too(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    assert main(["bench", "step", "--arch", "c4k3p1,pool", "--batch", "4", "--repeats", "1",
                 "--threads", "1", "--ops", "separate"]) == 0
    assert "--ops separate" in capsys.readouterr().out
