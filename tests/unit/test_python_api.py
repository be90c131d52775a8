"""The Python API (hetconv.api, docs/python-api.md): data from arrays, a local run that
returns what the run directory says, predict / evaluate / export / report on it, and one
error line (a UserError, never an exit) for bad input."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import hetconv
from hetconv import api

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"


def small_arrays(count: int = 384, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images (count, 1, 12, 12) whose class is which quarter is brightest."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 120, (count, 1, 12, 12), dtype=np.uint8)
    y = rng.integers(0, 4, count)
    for index, label in enumerate(y):
        row, col = divmod(int(label), 2)
        x[index, 0, row * 6:row * 6 + 6, col * 6:col * 6 + 6] += 120
    return x, y


def test_a_local_run_from_arrays(tmp_path: Path) -> None:
    x, y = small_arrays()
    data = hetconv.arrays(x, y, class_names=["nw", "ne", "sw", "se"])
    assert data.train_images.dtype == np.float32 and len(data.test_images) == 38
    run = hetconv.train("c8k3p1,pool,c8k3p1,gap", data, epochs=2, batch=32, lr=0.1,
                        run_dir=tmp_path / "run", quiet=True, threads=1)
    assert isinstance(run, hetconv.Run) and run.run_dir == tmp_path / "run"
    assert len(run.history) == 2 and len(run.losses) == 2 * 11
    assert run.test_accuracy == run.history[-1]["test_accuracy"] > 0.5
    probabilities = run.predict(data.test_images)
    assert probabilities.shape == (38, 4)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
    result = run.evaluate()
    assert result.accuracy == pytest.approx(run.test_accuracy)
    assert run.export("onnx").suffix == ".onnx"
    assert "median step time" in run.report(html=False)
    reopened = hetconv.Run.open(tmp_path / "run")
    assert reopened.history == run.history
    with pytest.raises(hetconv.UserError, match="trained on arrays in memory"):
        reopened.evaluate()
    assert reopened.evaluate(data.test_images, data.test_labels).accuracy == result.accuracy


@pytest.mark.parametrize("call, words", [
    (lambda: hetconv.arrays(np.zeros((4, 2)), np.zeros(4, int)), "x must be images"),
    (lambda: hetconv.arrays(np.zeros((4, 1, 8, 8)), np.zeros(3, int)), "y must be 4 class ids"),
    (lambda: hetconv.arrays(np.full((4, 1, 8, 8), np.nan), np.zeros(4, int)), "NaN or Inf"),
    (lambda: hetconv.Network("c8k3p1,res8,pool"), "token 3 'pool'"),
    (lambda: hetconv.train("c8k3p1", "synthetic", split_by="samples"),
     "split_by apply to a distributed run"),
    (lambda: hetconv.train("c8k3p1", "synthetic", listen="tcp://127.0.0.1:1", bogus=1),
     "unknown setting\\(s\\) bogus"),
    (lambda: hetconv.Run.open("/nonexistent/run"), "no such run"),
])
def test_bad_input_is_one_user_error(call: object, words: str) -> None:
    with pytest.raises(hetconv.UserError, match=words) as caught:
        call()  # type: ignore[operator]
    assert "\n" not in str(caught.value)


def test_the_reference_names_every_public_name() -> None:
    text = REFERENCE.read_text(encoding="utf-8")
    documented = set(re.findall(r"^### `hetconv\.(\w+)", text, re.M))
    public = {name for name in hetconv.__all__ if name != "__version__"}
    assert documented == public
    assert set(api.__all__) == public
    for name in public:
        assert getattr(hetconv, name) is not None
