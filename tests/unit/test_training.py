"""The local trainer and the CLI, in process (no sockets)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hetconv.commands.cli import main
from hetconv.engine.checkpoint import load_weights
from hetconv.engine.shard import ConvShard, LayerSettings
from hetconv.engine.stage import LocalConvStage
from hetconv.model import ModelConfig, init_parameters

RUN = ["train", "--local", "--data", "synthetic", "--limit", "256", "--test-limit", "128",
       "--arch", "4:8", "--epochs", "2", "--batch", "64", "--threads", "1", "--no-progress"]


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if '"type":"step"' in line]


def test_same_seed_same_loss_trace_and_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*RUN, "--run-dir", str(tmp_path / "a")]) == 0
    assert main([*RUN, "--run-dir", str(tmp_path / "b")]) == 0
    assert main([*RUN, "--seed", "1", "--run-dir", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "epoch 2/2" in out and "test accuracy" in out
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert losses(tmp_path / "a") != losses(tmp_path / "c")
    assert len(losses(tmp_path / "a")) == 8
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["arch"] == [4, 8] and config["mode"] == "local"
    weights = load_weights(tmp_path / "a" / "weights.npz")
    assert weights["conv1.weight"].shape == (8, 4, 5, 5)
    assert weights["fc.weight"].shape == (10, 8 * 4 * 4)
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["type"] == "run_start" and records[-1]["type"] == "run_end"
    assert records[-1]["status"] == "completed"
    step = next(r for r in records if r["type"] == "step")
    assert {"loss", "step_s", "conv_s", "dense_s", "comm_s", "layers"} <= set(step)
    assert step["layers"][0]["participants"][0]["participant"] == "master"


def test_refuses_to_mix_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*RUN, "--epochs", "1", "--run-dir", str(tmp_path / "a")]) == 0
    assert main([*RUN, "--epochs", "1", "--run-dir", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hetconv: error: --run-dir {tmp_path / 'a'} already holds a run; choose "
                   "another directory or pass --overwrite"]


@pytest.mark.parametrize("argv, expected", [
    (["train", "--epochs", "0"], "expected a positive integer"),
    (["train", "--arch", "5:x"], "--arch '5:x'"),
    (["train", "--data", "mnist"], "invalid choice"),
    (["train", "--lr", "nan"], "finite number"),
    (["train", "--data", "cifar10", "--data-dir", "/nonexistent"], "cifar-10-batches-bin"),
    (["train", "--data", "fashion-mnist", "--data-dir", "/nonexistent"], "dataset-fashion-mnist"),
    (["worker", "--master", "localhost:5555"], "expected an endpoint"),
    (["worker", "--master", "tcp://127.0.0.1:1", "--device", "tpu"], "unknown device"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_line(argv: list[str], expected: str, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, *(["--run-dir", str(tmp_path / "r")] if argv[0] == "train" else [])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hetconv: error:") and expected in err[0], err


def test_stage_snapshot_has_full_layers() -> None:
    model = ModelConfig((3, 5), (1, 16, 16))
    params = init_parameters(model, 0)
    stage = LocalConvStage(model, params, LayerSettings())
    snap = stage.snapshot()
    assert snap["conv1.weight"].shape == (5, 3, 5, 5)
    np.testing.assert_array_equal(snap["conv0.weight"], params["conv0.weight"])
    assert snap["conv0.velocity_weight"].shape == (3, 1, 5, 5)


def test_shards_of_a_block_reproduce_the_whole_block() -> None:
    """Two shards (one empty) updated through a step equal one whole shard."""
    rng = np.random.default_rng(0)
    model = ModelConfig((6,), (2, 10, 10))
    params = init_parameters(model, 0)
    state = {k.split(".", 1)[1]: v for k, v in params.items() if k.startswith("conv0.")}
    whole = ConvShard(0, 0, 6, LayerSettings(), state)
    parts = [ConvShard(0, a, b, LayerSettings(), {k: v[a:b] for k, v in state.items()})
             for a, b in [(0, 4), (4, 4), (4, 6)]]
    x = rng.standard_normal((3, 2, 10, 10)).astype(np.float32)
    for _ in range(2):
        y = whole.forward(x, True)
        ys = [p.forward(x, True) for p in parts]
        np.testing.assert_allclose(np.concatenate(ys, axis=1), y, rtol=1e-5, atol=1e-5)
        dy = rng.standard_normal(y.shape).astype(np.float32)
        dx = whole.backward(dy, True, 0.1)
        dxs = [p.backward(np.ascontiguousarray(dy[:, p.kernel_start:p.kernel_stop]), True, 0.1)
               for p in parts]
        np.testing.assert_allclose(sum(dxs), dx, rtol=1e-4, atol=1e-5)
    for name in whole.state:
        joined = np.concatenate([p.snapshot()[name] for p in parts])
        np.testing.assert_allclose(joined, whole.snapshot()[name], rtol=1e-4, atol=1e-6)


def test_metrics_writer_drops_a_killed_writer_s_half_line(tmp_path: Path) -> None:
    from hetconv.metrics import MetricsWriter, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"type":"step","step":0}\n{"type":"step","st')  # killed mid-line
    with MetricsWriter(path) as writer:
        writer.write("run_start", resumed_from=1)
    lines = path.read_text().splitlines()
    assert lines[0] == '{"type":"step","step":0}' and len(lines) == 2
    assert [r["type"] for r in read_metrics(path)] == ["step", "run_start"]
    path.write_text("")  # an empty file stays empty until the first record
    with MetricsWriter(path) as writer:
        writer.write("run_start")
    assert len(path.read_text().splitlines()) == 1
