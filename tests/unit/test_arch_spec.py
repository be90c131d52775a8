"""The network description: ``--arch`` tokens and ``--model`` files, every error line,
the shapes they give, the parameters they draw, and the per-layer settings."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from hetconv.commands.cli import main
from hetconv.engine.stage import LocalConvStage, layer_settings
from hetconv.engine.training import LoopConfig, Trainer
from hetconv.errors import UserError
from hetconv.metrics import MetricsWriter
from hetconv.model import (
    ConvSpec,
    DenseSpec,
    ModelConfig,
    conv_layer_shapes,
    dense_features,
    dense_parameter_names,
    init_parameters,
    load_network_file,
    model_config,
    parse_arch,
    parse_network,
)
from tests.unit.test_layers_variants import numerical_gradient

VGG = "c64k3p1,c64k3p1,pool,c128k3p1,c128k3p1,pool,fc256,drop0.5"
SMALL = "c8k3p1,c8k3p1,pool,c16k3p1,pool,fc32,drop0.25"


def test_the_issue_s_example_parses() -> None:
    spec = parse_network(VGG)
    assert [(c.kernels, c.kernel_size, c.padding, c.stride, c.batch_norm, c.pool)
            for c in spec.convs] == [(64, 3, 1, 1, True, "none"), (64, 3, 1, 1, True, "max"),
                                     (128, 3, 1, 1, True, "none"), (128, 3, 1, 1, True, "max")]
    assert spec.dense == (DenseSpec("fc", units=256, token="fc256"),
                          DenseSpec("dropout", rate=0.5, token="drop0.5"))
    assert spec.text == VGG and not spec.paper
    assert parse_arch(VGG) == (64, 64, 128, 128)


def test_every_token_form() -> None:
    spec = parse_network(" c4k5 , c6k3p2s2nobn, avgpool, c2k1s1, drop0")
    a, b, c = spec.convs
    assert (a.kernels, a.kernel_size, a.padding, a.stride, a.batch_norm, a.pool) == (
        4, 5, 0, 1, True, "none")
    assert (b.kernels, b.kernel_size, b.padding, b.stride, b.batch_norm, b.pool) == (
        6, 3, 2, 2, False, "avg")
    assert (c.kernel_size, c.stride, c.pool) == (1, 1, "none")
    assert spec.dense == (DenseSpec("dropout", rate=0.0, token="drop0"),)
    assert spec.text == "c4k5,c6k3p2s2nobn,avgpool,c2k1s1,drop0"
    assert parse_network(["c4k3", "pool", "fc10", "drop.5", "fc5"]).dense[1].rate == 0.5


def test_the_paper_form_is_the_paper_s_blocks() -> None:
    spec = parse_network("32:64", kernel_size=3, padding=1)
    assert spec.paper and spec.text == "32:64"
    assert [(c.kernels, c.kernel_size, c.padding, c.pool, c.batch_norm) for c in spec.convs] == [
        (32, 3, 1, "max", True), (64, 3, 1, "max", True)]
    model = model_config(spec, (1, 28, 28), 10, 3, 1)
    assert model == ModelConfig((32, 64), (1, 28, 28), 10, 3, 1)  # no convs: exactly as before
    assert parse_network("50").convs[0].kernels == 50


ERRORS = [
    ("pool,c8k3", "token 1 'pool': a pooling with nothing to pool (at the start)"),
    ("avgpool", "token 1 'avgpool': a pooling with nothing to pool (at the start)"),
    ("c8k3,pool,pool", "token 3 'pool': a pooling with nothing to pool (right after another"),
    ("c8k3,avgpool,pool", "token 3 'pool': a pooling with nothing to pool"),
    ("c8k3,fc10,pool", "token 3 'pool': a pooling with nothing to pool (after a dense layer)"),
    ("c8k3,fc10,c8k3", "token 3 'c8k3': a conv layer after a dense layer"),
    ("c8k3,drop0.5,c8k3", "token 2 'drop0.5': dropout goes right after an fc layer or last"),
    ("c8k3,bogus", "token 2 'bogus': unknown token"),
    ("c8k3,pool,", "token 3 '': empty token"),
    ("c8k3,maxpool", "token 2 'maxpool': unknown token"),
    ("c8", "token 1 'c8': unknown token"),
    ("c0k3", "token 1 'c0k3': kernels, kernel size and stride must be at least 1"),
    ("c8k3s0", "token 1 'c8k3s0': kernels, kernel size and stride must be at least 1"),
    ("c8k3,fc0", "token 2 'fc0': a dense layer needs at least 1 unit"),
    ("c8k3,drop1", "token 2 'drop1': the drop probability must be in [0, 1)"),
    ("c8k3,drop1.5", "token 2 'drop1.5': the drop probability must be in [0, 1)"),
    ("c8k3,drop-0.1", "token 2 'drop-0.1': unknown token"),
    ("c8k3,fc10,drop0.1,drop0.2", "token 4 'drop0.2': two dropouts in a row"),
    ("drop0.5", "token 1 'drop0.5': dropout before any conv layer"),
    ("fc10", "the network needs at least one conv layer"),
    ("", "empty network"),
]


@pytest.mark.parametrize("text,message", ERRORS, ids=[e[0] or "empty" for e in ERRORS])
def test_every_spec_error_is_one_line_naming_the_token(text: str, message: str) -> None:
    with pytest.raises(UserError) as caught:
        parse_network(text)
    line = str(caught.value)
    assert "\n" not in line and line.startswith("--arch: ")
    assert message in line


SHAPE_ERRORS = [
    ("c8k30", (1, 28, 28), "token 1 'c8k30' (conv layer 1) gets a 28x28 map, too small for "
     "a 30x30 kernel with padding 0"),
    ("c8k3,pool,c8k3,pool,c8k3,pool,c8k3", (1, 28, 28),
     "token 7 'c8k3' (conv layer 4) gets a 1x1 map"),
    ("c8k3p1,pool,c8k3p1,pool,c8k3p1,pool,c8k3p1,pool,c8k3p1,pool", (1, 28, 28),
     "token 10 'pool' after conv layer 5 (c8k3p1) gets a 1x1 map: 2x2 pooling"),
    ("c4k3s4,avgpool", (3, 6, 6), "token 2 'avgpool' after conv layer 1 (c4k3s4) gets a 1x1"),
]


@pytest.mark.parametrize("text,shape,message", SHAPE_ERRORS)
def test_impossible_shapes_name_the_token(text: str, shape: tuple[int, int, int],
                                          message: str) -> None:
    model = model_config(parse_network(text), shape)
    with pytest.raises(UserError) as caught:
        conv_layer_shapes(model)
    assert "\n" not in str(caught.value) and message in str(caught.value)


def test_shapes_at_the_limit_fit() -> None:
    model = model_config(parse_network("c4k3s4,avgpool"), (3, 8, 8))  # 8 -> 2 -> 1
    assert conv_layer_shapes(model)[-1].pooled_height == 1
    model = model_config(parse_network("c4k28"), (1, 28, 28))  # 28 -> 1
    assert conv_layer_shapes(model)[-1].pooled_height == 1


def test_shapes_of_a_spec() -> None:
    model = model_config(parse_network("c8k3p1,c8k3p1nobn,pool,c16k3p1,avgpool,c4k3s2,fc32"),
                         (3, 32, 32), classes=7)
    shapes = conv_layer_shapes(model)
    assert [(s.in_channels, s.height, s.kernels, s.conv_height, s.pooled_height, s.pool,
             s.batch_norm, s.stride) for s in shapes] == [
        (3, 32, 8, 32, 32, "none", True, 1), (8, 32, 8, 32, 16, "max", False, 1),
        (8, 16, 16, 16, 8, "avg", True, 1), (16, 8, 4, 3, 3, "none", True, 2)]
    assert shapes[1].output_shape(5) == (5, 8, 16, 16)
    assert shapes[3].input_shape(5) == (5, 16, 8, 8)
    assert dense_features(model) == 4 * 3 * 3
    assert dense_parameter_names(model) == ["dense0.weight", "dense0.bias", "fc.weight",
                                            "fc.bias"]


def test_parameters_of_a_spec_are_seeded_and_shaped() -> None:
    model = model_config(parse_network(SMALL), (1, 28, 28))
    params = init_parameters(model, 3)
    assert params["dense0.weight"].shape == (32, 16 * 7 * 7)
    assert params["dense0.bias"].shape == (32,) and params["fc.weight"].shape == (10, 32)
    assert params["conv2.weight"].shape == (16, 8, 3, 3)
    assert all(v.dtype == np.float32 for v in params.values())
    again = init_parameters(model, 3)
    assert all(np.array_equal(params[k], again[k]) for k in params)
    assert not np.array_equal(params["dense0.weight"], init_parameters(model, 4)["dense0.weight"])
    # the paper network draws exactly what it drew before hidden layers existed
    paper = ModelConfig((4, 8), (1, 28, 28))
    assert sorted(init_parameters(paper, 0)) == sorted(
        [f"conv{i}.{n}" for i in range(2) for n in
         ("weight", "gamma", "beta", "running_mean", "running_var")] + ["fc.weight", "fc.bias"])


def test_layer_settings_follow_the_spec() -> None:
    model = model_config(parse_network("c4k3p1nobn,avgpool,c4k5p2s2,pool"), (1, 16, 16))
    settings = layer_settings(model, 0.8, 1e-4)
    first, second = settings.for_layer(0), settings.for_layer(1)
    assert (first.padding, first.stride, first.pool, first.batch_norm) == (1, 1, "avg", False)
    assert (second.padding, second.stride, second.pool, second.batch_norm) == (2, 2, "max", True)
    assert first.momentum == second.momentum == 0.8 and second.weight_decay == 1e-4
    paper = layer_settings(ModelConfig((4, 8), (1, 28, 28), padding=2), 0.9, 5e-4)
    assert paper.per_layer == () and paper.padding == 2 and paper.pool == "max"


def test_conv_kernels_must_agree_with_the_convs() -> None:
    with pytest.raises(ValueError):
        ModelConfig((4,), (1, 8, 8), convs=(ConvSpec(5, 3),))


def test_model_files_json_and_toml(tmp_path: Path) -> None:
    listed = tmp_path / "net.json"
    listed.write_text(json.dumps(["c8k3p1", "pool", "fc16"]))
    wrapped = tmp_path / "vgg.json"
    wrapped.write_text(json.dumps({"layers": SMALL.split(",")}))
    toml = tmp_path / "vgg.toml"
    toml.write_text("# a VGG-style net\nlayers = [" + ", ".join(
        f'"{t}"' for t in SMALL.split(",")) + "]\n")
    assert load_network_file(listed) == ["c8k3p1", "pool", "fc16"]
    assert parse_network(load_network_file(wrapped)).text == SMALL
    assert parse_network(load_network_file(toml)).text == SMALL


@pytest.mark.parametrize("name,content,message", [
    ("bad.json", "{not json", "not valid JSON"),
    ("bad.toml", "layers = [", "not valid TOML"),
    ("num.json", '{"layers": [1, 2]}', "expected a list of layer tokens"),
    ("none.toml", 'arch = "c8k3"', "expected a list of layer tokens"),
])
def test_bad_model_files_are_one_line(tmp_path: Path, name: str, content: str,
                                      message: str) -> None:
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(UserError) as caught:
        load_network_file(path)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(UserError, match="cannot read"):
        load_network_file(tmp_path / "missing.json")


def test_the_command_line_stops_before_anything_starts(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    run_dir = tmp_path / "run"
    common = ["train", "--local", "--data", "synthetic", "--limit", "64", "--no-progress",
              "--run-dir", str(run_dir)]
    assert main([*common, "--arch", "c8k3,pool,pool"]) == 2
    assert capsys.readouterr().err.strip() == (
        "hetconv: error: --arch: token 3 'pool': a pooling with nothing to pool (right "
        "after another pool); a pool follows a conv")
    model = tmp_path / "net.json"
    model.write_text(json.dumps({"layers": ["c8k3", "fc10", "c4k3"]}))
    assert main([*common, "--model", str(model)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--model {model}: token 3 'c4k3'" in err[0]
    assert main([*common, "--model", str(model), "--arch", "8:16"]) == 2
    assert "give one of them" in capsys.readouterr().err
    assert main([*common, "--arch", "c8k3p1,pool,c8k3p1,pool,c8k3p1,pool,c8k3p1,pool,c8k3,"
                 "pool"]) == 2
    assert "token 9 'c8k3' (conv layer 5) gets a 1x1 map" in capsys.readouterr().err
    assert not (run_dir / "metrics.jsonl").exists()


# --- the dense part on the master ------------------------------------------------------
@pytest.fixture
def make_trainer(tmp_path: Path) -> Iterator[Callable[..., Trainer]]:
    """Trainers of a spec on 1x12x12 images, 5 classes, over a local stage."""
    writers: list[MetricsWriter] = []

    def make(spec: str, seed: int = 1) -> Trainer:
        model = model_config(parse_network(spec), (1, 12, 12), classes=5)
        params = init_parameters(model, 0)
        stage = LocalConvStage(model, params, layer_settings(model, 0.9, 5e-4))
        loop = LoopConfig(epochs=1, batch=8, seed=seed, progress=False)
        writers.append(MetricsWriter(tmp_path / f"metrics{len(writers)}.jsonl"))
        return Trainer(model, params, stage, loop, writers[-1], tmp_path, out=lambda line: None)

    yield make
    for writer in writers:
        writer.close()


def test_dense_backward_matches_finite_differences(make_trainer: Callable[..., Trainer]
                                                   ) -> None:
    trainer = make_trainer("c2k3p1,pool,fc6,drop0.3,fc4,drop0.5")
    trainer.dense = {k: v.astype(np.float64) for k, v in trainer.dense.items()}
    rng = np.random.default_rng(5)
    flat = rng.standard_normal((3, 2 * 6 * 6))
    weights = rng.standard_normal((3, 4))

    def loss() -> float:
        hidden, _ = trainer._dense_forward(flat, True, 7)
        return float((hidden * weights).sum())

    hidden, tape = trainer._dense_forward(flat, True, 7)
    assert [entry[0] for entry in tape] == ["fc", "dropout", "fc", "dropout"]
    assert not np.array_equal(hidden, trainer._dense_forward(flat, True, 8)[0])  # new mask
    np.testing.assert_array_equal(hidden, trainer._dense_forward(flat, True, 7)[0])
    grads: dict[str, np.ndarray] = {}
    dflat = trainer._dense_backward(tape, weights, grads)
    assert sorted(grads) == ["dense0.bias", "dense0.weight", "dense1.bias", "dense1.weight"]
    for name in ("dense0.weight", "dense1.weight", "dense0.bias"):
        np.testing.assert_allclose(grads[name], numerical_gradient(loss, trainer.dense[name]),
                                   atol=1e-6)
    np.testing.assert_allclose(dflat, numerical_gradient(loss, flat), atol=1e-6)
    evaluated, no_tape = trainer._dense_forward(flat, False, -1)  # no dropout when evaluating
    assert not [e for e in no_tape if e[0] == "dropout"]
    assert evaluated.shape == (3, 4)


def test_a_replayed_step_draws_the_same_dropout(make_trainer: Callable[..., Trainer]) -> None:
    trainer = make_trainer("c3k3p1,avgpool,c4k3nobn,fc8,drop0.5")
    rng = np.random.default_rng(6)
    x = rng.standard_normal((8, 1, 12, 12)).astype(np.float32)
    labels = rng.integers(0, 5, 8)
    state = trainer.capture(0, 0, 0, 0, 0, 0.0, 0.0, [], [])
    assert {"dense0.weight", "dense0.bias", "fc.weight", "fc.bias"} == set(state.dense)
    first = [trainer.train_step(x, labels, step, 0.05)["loss"] for step in range(3)]
    trainer.restore(state)
    again = [trainer.train_step(x, labels, step, 0.05)["loss"] for step in range(3)]
    assert first == again
    trainer.restore(state)
    other = make_trainer("c3k3p1,avgpool,c4k3nobn,fc8,drop0.5", seed=2)
    assert [other.train_step(x, labels, step, 0.05)["loss"] for step in range(3)] != first
    assert first[2] < first[0]  # it learns


def test_resume_keeps_the_run_s_network(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    run_dir = tmp_path / "run"
    spec = "c4k3p1,pool,fc8,drop0.5"
    assert main(["train", "--local", "--data", "synthetic", "--limit", "64", "--test-limit",
                 "16", "--batch", "32", "--epochs", "1", "--no-progress", "--arch", spec,
                 "--run-dir", str(run_dir)]) == 0
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["network"] == spec and saved["arch"] == [4]
    capsys.readouterr()
    same = tmp_path / "same.toml"
    same.write_text('layers = ["c4k3p1", "pool", "fc8", "drop0.5"]\n')
    other = tmp_path / "other.json"
    other.write_text('["c4k3p1", "pool", "fc9"]')
    for extra, message in (([], "nothing left to do"), (["--arch", spec], "nothing left to do"),
                           (["--model", str(same)], "nothing left to do"),
                           (["--arch", "c4k3p1,avgpool,fc8,drop0.5"], "--arch c4k3p1,avgpool"),
                           (["--arch", "4"], "differs from the run's c4k3p1,pool,fc8"),
                           (["--model", str(other)], f"--model {other} differs")):
        assert main(["train", "--resume", str(run_dir), "--no-progress", *extra]) == 2
        assert message in capsys.readouterr().err, extra
