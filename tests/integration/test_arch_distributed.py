"""A network that is not the paper's (3x3 "same" convs, a conv without batch norm,
max and average pooling, a hidden dense layer with dropout), trained over two real
worker processes on loopback, reproduces the local run."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetconv.engine.checkpoint import load_weights
from tests.conftest import run_hetconv, step_losses

pytestmark = [pytest.mark.integration]

SPEC = "c8k3p1,c8k3p1nobn,pool,c16k3p1,avgpool,fc32,drop0.25"
RUN = ["--data", "synthetic", "--limit", "3200", "--test-limit", "128", "--arch", SPEC,
       "--epochs", "1", "--batch", "64", "--threads", "1", "--no-progress", "--seed", "3",
       "--wire-dtype", "float32"]  # exactness is promised for a float32 wire (auto may pick 16)
STEPS = 50  # 3200 images / batch 64


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_a_spec_over_two_workers_reproduces_the_local_run(endpoint: str, workers: Any,
                                                          tmp_path: Path) -> None:
    local_dir, dist_dir = tmp_path / "local", tmp_path / "dist"
    local = run_hetconv("train", "--local", *RUN, "--run-dir", str(local_dir))
    assert local.returncode == 0, local.stderr
    workers("w1", "w2")
    result = run_hetconv("train", "--listen", endpoint, "--split-by", "kernels", "--min-workers", "2", "--wait", "30",
                         "--split", "equal", *RUN, "--run-dir", str(dist_dir))
    assert result.returncode == 0, result.stderr
    local_losses, dist_losses = step_losses(local_dir), step_losses(dist_dir)
    assert len(local_losses) == len(dist_losses) == STEPS
    np.testing.assert_allclose(dist_losses, local_losses, rtol=1e-4)
    assert len(set(local_losses)) > 1 and local_losses[-1] < local_losses[0]

    local_w, dist_w = load_weights(local_dir / "weights.npz"), load_weights(
        dist_dir / "weights.npz")
    assert sorted(local_w) == sorted(dist_w)
    assert {"dense0.weight", "dense0.bias", "fc.weight", "conv2.weight"} <= set(local_w)
    for name in local_w:
        np.testing.assert_allclose(dist_w[name], local_w[name], rtol=1e-3, atol=1e-4,
                                   err_msg=name)

    run = records(dist_dir)
    start = next(r for r in run if r["type"] == "run_start")
    assert start["config"]["network"] == SPEC
    assert [(layer["pool"], layer["batch_norm"]) for layer in start["layers"]] == [
        ("none", True), ("max", False), ("avg", True)]
    calibrations = [r for r in run if r["type"] == "calibration"]
    assert len(calibrations) == 3
    for calibration in calibrations:  # every conv layer is spread over the workers
        held = {d["participant"] for d in calibration["participants"] if d["kernels"] > 0}
        assert {"w1", "w2"} <= held


RESIDUAL_RUN = ["--data", "synthetic", "--limit", "768", "--test-limit", "64", "--epochs", "1",
                "--batch", "64", "--threads", "1", "--no-progress", "--seed", "3"]


@pytest.mark.timeout(300)
def test_a_residual_network_over_two_workers_reproduces_the_local_run(
        endpoint: str, workers: Any, tmp_path: Path) -> None:
    """A PyTorch ResNet read from ONNX (its weights the starting point), split by samples
    (the participants' chains join the shortcuts) and by kernels (the master joins them,
    over the star plane, and says so), a float32 wire and an equal split (so both workers
    compute): the local run's losses and weights; the sample split's weights load back
    into the PyTorch module (strict) and predict what hetconv does."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    from hetconv.api import Run, load_data
    from tests.unit.test_onnx_import import exported

    module, path = exported(torch, "resnet", tmp_path, size=28)
    network = ["--model", str(path)]
    local_dir = tmp_path / "local"
    local = run_hetconv("train", "--local", *network, *RESIDUAL_RUN, "--run-dir", str(local_dir))
    assert local.returncode == 0, local.stderr
    assert "arch c8k3p1,res8,res16s2,gap" in local.stdout
    local_losses, local_w = step_losses(local_dir), load_weights(local_dir / "weights.npz")
    assert len(local_losses) == 12 and "conv5.weight" in local_w
    workers("w1", "w2")
    for split, says in (("samples", "split by samples: master"),
                        ("kernels", "data plane star: split by kernels, a residual network's "
                                    "shortcuts are joined on the master")):
        dist_dir = tmp_path / split
        result = run_hetconv("train", "--listen", endpoint, "--min-workers", "2", "--wait",
                             "30", "--split", "equal", "--wire-dtype", "float32",
                             "--split-by", split, *network, *RESIDUAL_RUN,
                             "--run-dir", str(dist_dir))
        assert result.returncode == 0, result.stderr
        assert says in result.stdout + result.stderr
        np.testing.assert_allclose(step_losses(dist_dir), local_losses, rtol=1e-4)
        dist_w = load_weights(dist_dir / "weights.npz")
        assert sorted(local_w) == sorted(dist_w)
        for name in local_w:
            np.testing.assert_allclose(dist_w[name], local_w[name], rtol=1e-3, atol=1e-4,
                                       err_msg=f"{split}: {name}")
    start = next(r for r in records(tmp_path / "samples") if r["type"] == "run_start")
    assert [(layer["input_from"], layer["shortcut_from"]) for layer in start["layers"]] == [
        (-1, -1), (-1, -1), (-1, 1), (-1, -1), (3, -1), (4, 5)]
    run = Run.open(tmp_path / "samples")
    module.load_state_dict(load_file(str(run.export("safetensors"))))  # strict
    module.eval()
    images = load_data("synthetic", limit=768).test_images[:64]
    with torch.no_grad():
        theirs = torch.softmax(module(torch.from_numpy(images)), dim=1).numpy()
    np.testing.assert_allclose(theirs, run.predict(images), atol=2e-5, rtol=0)
    refused = run_hetconv("train", "--listen", endpoint, "--split-by", "samples",
                          "--data-plane", "star", "--arch", "c8k3p1,res8", *RESIDUAL_RUN,
                          "--run-dir", str(tmp_path / "refused"))
    assert refused.returncode != 0
    assert refused.stderr.strip().splitlines()[-1].startswith(
        "hetconv: error: a residual network split by samples joins its shortcuts in the "
        "participants' chains")
