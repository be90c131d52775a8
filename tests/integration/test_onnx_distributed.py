"""A PyTorch ResNet read from ONNX trains over two real workers as it trains locally (the
same losses: the file's weights are the starting point of both), and its export loads back
into the PyTorch module with a strict ``load_state_dict``, predicting what hetconv does."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetconv.api import Run, load_data
from tests.conftest import run_hetconv, step_losses
from tests.unit.test_onnx_import import exported

pytestmark = [pytest.mark.integration]
RUN = ["--data", "synthetic", "--limit", "640", "--test-limit", "64", "--epochs", "1",
       "--batch", "64", "--threads", "1", "--no-progress", "--seed", "1"]


@pytest.mark.timeout(300)
def test_an_onnx_resnet_over_two_workers(endpoint: str, workers: Any, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    module, path = exported(torch, "resnet", tmp_path, size=28)
    local = run_hetconv("train", "--local", "--model", str(path), *RUN,
                        "--run-dir", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    workers("w1", "w2")
    dist = run_hetconv("train", "--listen", endpoint, "--min-workers", "2", "--wait", "30",
                       "--split", "equal", "--wire-dtype", "float32", "--model", str(path),
                       *RUN, "--run-dir", str(tmp_path / "dist"))
    assert dist.returncode == 0, dist.stderr
    assert "arch c8k3p1,res8,res16s2,gap" in dist.stdout
    np.testing.assert_allclose(step_losses(tmp_path / "dist"), step_losses(tmp_path / "local"),
                               rtol=1e-4)
    run = Run.open(tmp_path / "dist")
    module.load_state_dict(load_file(str(run.export("safetensors"))))
    module.eval()
    images = load_data("synthetic", limit=640).test_images[:64]
    with torch.no_grad():
        theirs = torch.softmax(module(torch.from_numpy(images)), dim=1).numpy()
    np.testing.assert_allclose(theirs, run.predict(images), atol=2e-5, rtol=0)
