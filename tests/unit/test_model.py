"""Model description, initialisation, optimizer and checkpoint files."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hetconv.engine.checkpoint import load_weights, save_json, save_weights
from hetconv.engine.optim import OptimizerConfig, learning_rate_at, sgd_update
from hetconv.errors import UserError
from hetconv.metrics import MetricsWriter, read_metrics
from hetconv.model import (
    ModelConfig,
    conv_layer_shapes,
    dense_features,
    init_parameters,
    parse_arch,
)

PAPER_ARCHS = ["50:500", "150:800", "300:1000", "500:1500"]


@pytest.mark.parametrize("arch", PAPER_ARCHS)
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_paper_architectures_build(arch: str, shape: tuple[int, int, int]) -> None:
    config = ModelConfig(conv_kernels=parse_arch(arch), input_shape=shape)
    layers = conv_layer_shapes(config)
    assert [layer.kernels for layer in layers] == list(parse_arch(arch))
    assert layers[1].in_channels == layers[0].kernels
    side = shape[1]
    assert layers[0].conv_height == side - 4 and layers[0].pooled_height == (side - 4) // 2
    assert layers[1].height == layers[0].pooled_height
    assert dense_features(config) == layers[1].kernels * layers[1].pooled_height ** 2


def test_cifar_c2_shape_matches_the_paper_layer() -> None:
    layers = conv_layer_shapes(ModelConfig((50, 500), (3, 32, 32)))
    assert layers[1].input_shape(64) == (64, 50, 14, 14)
    assert layers[1].output_shape(64) == (64, 500, 5, 5)


def test_padding_option_keeps_size() -> None:
    layers = conv_layer_shapes(ModelConfig((8, 8, 8), (1, 28, 28), padding=2))
    assert [layer.conv_height for layer in layers] == [28, 14, 7]


@pytest.mark.parametrize("text", ["", "a:b", "50:", "0:10", "-1"])
def test_bad_arch_is_a_user_error(text: str) -> None:
    with pytest.raises(UserError):
        parse_arch(text)


def test_too_deep_is_a_user_error() -> None:
    with pytest.raises(UserError, match="too small"):
        conv_layer_shapes(ModelConfig((4, 4, 4), (1, 28, 28)))


def test_seeded_init_is_reproducible_and_he_scaled() -> None:
    config = ModelConfig((50, 500), (1, 28, 28))
    a, b, c = init_parameters(config, 1), init_parameters(config, 1), init_parameters(config, 2)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["conv0.weight"], c["conv0.weight"])
    assert all(v.dtype == np.float32 for v in a.values())
    std = a["conv1.weight"].std()
    assert std == pytest.approx(np.sqrt(2 / (50 * 25)), rel=0.05)


def test_sgd_update_matches_torch_semantics() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    p, g = rng.standard_normal(10).astype(np.float32), rng.standard_normal(10).astype(np.float32)
    tp = torch.tensor(p.copy(), requires_grad=True)
    opt = torch.optim.SGD([tp], lr=0.1, momentum=0.9, weight_decay=0.01)
    v = np.zeros_like(p)
    for _ in range(3):
        opt.zero_grad()
        tp.grad = torch.tensor(g)
        opt.step()
        sgd_update(p, g, v, 0.1, 0.9, 0.01)
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_learning_rate_schedules() -> None:
    cosine = OptimizerConfig(learning_rate=1.0, schedule="cosine")
    assert learning_rate_at(cosine, 0, 10, 2) == pytest.approx(1.0)
    assert learning_rate_at(cosine, 10, 10, 2) == pytest.approx(0.5)
    step = OptimizerConfig(learning_rate=1.0, schedule="step", step_epochs=1, step_gamma=0.1)
    assert learning_rate_at(step, 25, 10, 5) == pytest.approx(0.01)
    assert learning_rate_at(OptimizerConfig(schedule="constant"), 99, 10, 2) == 0.05
    warm = OptimizerConfig(learning_rate=1.0, schedule="constant", warmup_steps=4)
    assert learning_rate_at(warm, 1, 10, 2) == pytest.approx(0.5)


def test_weights_round_trip_without_pickle(tmp_path: Path) -> None:
    arrays = {"conv0.weight": np.ones((2, 1, 3, 3), np.float32), "fc.bias": np.zeros(3)}
    save_weights(tmp_path / "w.npz", arrays)
    loaded = load_weights(tmp_path / "w.npz")
    assert sorted(loaded) == sorted(arrays)
    assert not list(tmp_path.glob(".w.npz.*"))  # no temp file left behind
    with pytest.raises(TypeError):
        save_weights(tmp_path / "bad.npz", {"x": np.array([object()])})
    save_json(tmp_path / "c.json", {"a": 1})
    assert json.loads((tmp_path / "c.json").read_text()) == {"a": 1}


def test_metrics_reader_skips_a_cut_off_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as writer:
        writer.write("step", step=0, loss=1.0)
        writer.write("step", step=1, loss=0.5)
    with open(path, "a") as handle:
        handle.write('{"type":"step","step":2,"lo')
    records = read_metrics(path)
    assert [r["step"] for r in records] == [0, 1]
    assert "cut off" in caplog.text
