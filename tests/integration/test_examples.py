"""The examples run as a user runs them (small sizes): numpy arrays over two local worker
daemons ending with the report, and a PyTorch ResNet through ONNX and back, the module's
predictions those of hetconv (PyTorch the oracle)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hetconv.lab import free_port
from tests.conftest import child_env

pytestmark = [pytest.mark.integration]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *args: str, timeout: float = 240) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                            text=True, timeout=timeout, env=child_env(), cwd=EXAMPLES)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.timeout(300)
def test_training_on_arrays_over_two_workers() -> None:
    out = run_example("train_arrays.py", "--images", "384", "--epochs", "1",
                      "--port", str(free_port()))
    assert "split by" in out and "2/2 worker(s)" in out
    found = re.search(r"test accuracy (\d\.\d+) after 1 epoch", out)
    assert found is not None and 0.0 <= float(found[1]) <= 1.0, out
    assert "median step time" in out and "balance efficiency" in out


@pytest.mark.timeout(300)
def test_a_pytorch_resnet_through_onnx_and_back() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    out = run_example("torch_resnet_roundtrip.py", "--images", "384", "--epochs", "1")
    assert "hetconv reads it as c16k3p1,res16,res32s2,gap" in out
    found = re.search(r"hetconv test accuracy (\d\.\d+); the PyTorch module with the trained "
                      r"weights: (\d\.\d+); largest probability difference (\S+)", out)
    assert found is not None, out
    assert found[1] == found[2]  # the module classifies the test images as hetconv did
    assert float(found[3]) < 1e-4
