"""hetconv.inference.use: a run directory loaded back, classified and evaluated exactly as
training evaluated it; image files read and normalised exactly as ``--data folder``
reads and normalises its images; every bad input one line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from hetconv.commands.cli import main
from hetconv.data.loading import load_dataset
from hetconv.errors import UserError
from hetconv.inference.use import (
    PREPROCESSING_FILE,
    WEIGHTS_FILE,
    Classifier,
    Preprocessing,
    class_names_of,
    confusion_matrix,
    evaluate_classifier,
    evaluate_probabilities,
    evaluation_html,
    evaluation_lines,
    expected_shapes,
    load_run,
    load_run_data,
    normalize,
    preprocessing_of,
    read_image,
    run_preprocessing,
    softmax,
    top_classes,
)

SPECS = {"paper": "4:8", "tokens": "c4k3p1,pool,c8k3p1,pool,fc16,drop0.1",
         "variants": "c4k3p1s2nobn,avgpool,c6k3,fc8"}


def train_run(run_dir: Path, arch: str) -> Path:
    """A tiny finished local run (synthetic data, one epoch)."""
    status = main(["train", "--local", "--data", "synthetic", "--limit", "256", "--arch", arch,
                   "--epochs", "1", "--no-progress", "--threads", "1", "--run-dir", str(run_dir)])
    assert status == 0
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("inference")
    return {name: train_run(base / name, spec) for name, spec in SPECS.items()}


def last_epoch(run_dir: Path) -> dict[str, Any]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["type"] == "epoch"][-1]


# --- the forward pass is the training code's ---------------------------------------------
@pytest.mark.parametrize("name", sorted(SPECS))
def test_evaluation_equals_what_training_measured(runs: dict[str, Path], name: str) -> None:
    run = load_run(runs[name])
    assert run.network == SPECS[name]
    data = load_run_data(run)
    classifier = Classifier(run.model, run.params)
    result = evaluate_classifier(classifier, data.test_images, data.test_labels,
                                 class_names_of(data), batch=1000)  # the run's eval batch
    epoch = last_epoch(runs[name])
    assert result.images == len(data.test_labels) == 512
    assert result.accuracy == epoch["test_accuracy"]
    assert result.loss == pytest.approx(epoch["test_loss"], rel=1e-6)
    assert int(result.confusion.sum()) == 512
    assert result.class_names == tuple(f"class {i}" for i in range(10))


def test_probabilities_do_not_depend_on_the_batch(runs: dict[str, Path]) -> None:
    run = load_run(runs["tokens"])
    images = load_run_data(run).test_images[:50]
    classifier = Classifier(run.model, run.params)
    whole, pieces = classifier.probabilities(images, 50), classifier.probabilities(images, 7)
    assert whole.shape == (50, 10) and whole.dtype == np.float32
    np.testing.assert_allclose(whole.sum(axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(pieces, whole, atol=1e-6)
    assert classifier.probabilities(images[:0]).shape == (0, 10)


def test_dropout_is_the_identity_at_inference(runs: dict[str, Path]) -> None:
    run = load_run(runs["tokens"])
    x = load_run_data(run).test_images[:8]
    classifier = Classifier(run.model, run.params)
    first, second = classifier.logits(x), classifier.logits(x)
    np.testing.assert_array_equal(first, second)
    # by hand: the conv features through fc16 + ReLU and the classifier, no dropout mask
    features = x
    for layer in range(2):
        features = classifier.stage.forward(layer, features, False, -1)
    hidden = np.maximum(features.reshape(8, -1) @ run.params["dense0.weight"].T
                        + run.params["dense0.bias"], 0)
    expected = hidden @ run.params["fc.weight"].T + run.params["fc.bias"]
    np.testing.assert_allclose(first, expected, rtol=1e-5, atol=1e-5)


# --- evaluation arithmetic ------------------------------------------------------------------
def test_confusion_matrix_and_per_class_accuracy() -> None:
    labels = np.array([0, 0, 1, 1, 1, 2])
    probabilities = np.eye(4, dtype=np.float32)[[0, 1, 1, 1, 0, 3]]
    result = evaluate_probabilities(probabilities, labels, ["a", "b", "c", "d"])
    expected = np.zeros((4, 4), np.int64)
    for true, predicted in zip(labels, [0, 1, 1, 1, 0, 3]):
        expected[true, predicted] += 1
    np.testing.assert_array_equal(result.confusion, expected)
    np.testing.assert_array_equal(confusion_matrix(labels, np.array([0, 1, 1, 1, 0, 3]), 4),
                                  expected)
    assert result.accuracy == pytest.approx(3 / 6)
    assert result.per_class[:3] == (0.5, pytest.approx(2 / 3), 0.0)
    assert np.isnan(result.per_class[3])  # no image of class d
    lines = evaluation_lines(result)
    assert lines[0].startswith("test accuracy 0.5000 (3 of 6 images)")
    assert any("d" in line and "n/a" in line for line in lines)
    page = evaluation_html(result, "a <title>")
    assert "a &lt;title&gt;" in page and "data:image/png;base64," in page
    assert "<td>d</td>" in page


def test_an_empty_test_set_is_one_line() -> None:
    with pytest.raises(UserError, match="empty"):
        evaluate_probabilities(np.zeros((0, 2), np.float32), np.zeros(0, np.int64), ["a", "b"])


def test_softmax_and_top_classes() -> None:
    logits = np.array([[1.0, 3.0, 2.0, 3.0], [1000.0, 0.0, 0.0, 0.0]], np.float32)
    probs = softmax(logits)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-6)
    assert np.isfinite(probs).all()
    top = top_classes(probs, ["a", "b", "c", "d"], ["x.png", "y.png"], 3)
    assert [i for i, _, _ in top[0].top] == [1, 3, 2]  # a tie: the lower index first
    assert top[0].top[0][1] == "b" and top[0].source == "x.png"
    assert top[1].top[0][:2] == (0, "a") and top[1].top[0][2] == pytest.approx(1.0)


# --- images from files are read and normalised as training read them --------------------------
def write_folder(root: Path, colour: bool, rng: np.random.Generator) -> list[Path]:
    """train/<class>/ (4 images each) and test/<class>/ (one each) of 20x16 PNGs."""
    test_files = []
    for name in ("ant", "bee", "cat"):
        for split, count in (("train", 4), ("test", 1)):
            folder = root / split / name
            folder.mkdir(parents=True)
            for index in range(count):
                if colour:
                    image = Image.fromarray(rng.integers(0, 256, (16, 20, 3), dtype=np.uint8))
                else:
                    image = Image.fromarray(rng.integers(0, 256, (16, 20), dtype=np.uint8))
                path = folder / f"{index}.png"
                image.save(path)
                if split == "test":
                    test_files.append(path)
    return test_files


@pytest.mark.parametrize("colour", [False, True], ids=["grey", "rgb"])
def test_read_image_and_normalize_equal_the_folder_loader(tmp_path: Path, colour: bool) -> None:
    files = write_folder(tmp_path, colour, np.random.default_rng(5))
    data = load_dataset("folder", tmp_path, image_size=12, warn=lambda message: None)
    assert data.image_shape == ((3 if colour else 1), 12, 12)
    preprocessing = preprocessing_of(data)
    assert preprocessing.class_names == ("ant", "bee", "cat")
    for label, path in enumerate(files):  # one test image per class: the label finds it
        ours = normalize(read_image(path, data.image_shape)[None], preprocessing)[0]
        theirs = data.test_images[data.test_labels == label][0]
        np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_a_colour_image_for_a_grey_network_is_its_luminance(tmp_path: Path) -> None:
    pixels = np.random.default_rng(2).integers(0, 256, (10, 8, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "c.png")
    grey = read_image(tmp_path / "c.png", (1, 10, 8))
    assert grey.shape == (1, 10, 8) and grey.dtype == np.uint8
    np.testing.assert_array_equal(grey[0], np.asarray(Image.fromarray(pixels).convert("L")))
    rgb = read_image(tmp_path / "c.png", (3, 5, 4))
    assert rgb.shape == (3, 5, 4)


def test_normalize_is_per_channel() -> None:
    pixels = np.array([[[[0, 255]], [[51, 102]]]], np.uint8)  # (1, 2, 1, 2)
    out = normalize(pixels, Preprocessing((0.0, 0.2), (1.0, 0.4), ("a",)))
    np.testing.assert_allclose(out, [[[[0.0, 1.0]], [[0.0, 0.5]]]], atol=1e-6)
    assert out.dtype == np.float32
    zero_std = normalize(pixels, Preprocessing((0.0, 0.0), (0.0, 0.0), ("a",)))
    assert np.isfinite(zero_std).all()


@pytest.mark.parametrize("content,message", [(None, "no such file"),
                                             (b"not an image", "cannot read it as an image"),
                                             (b"\x89PNG\r\n\x1a\n" + b"\0" * 20,
                                              "cannot read it as an image")])
def test_an_unreadable_image_is_one_line(tmp_path: Path, content: bytes | None,
                                         message: str) -> None:
    path = tmp_path / "x.png"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UserError, match=message) as caught:
        read_image(path, (1, 8, 8))
    assert "\n" not in str(caught.value)


def test_only_grey_and_rgb_networks_read_files(tmp_path: Path) -> None:
    Image.new("RGB", (4, 4)).save(tmp_path / "x.png")
    with pytest.raises(UserError, match="4-channel"):
        read_image(tmp_path / "x.png", (4, 4, 4))


# --- the run directory --------------------------------------------------------------------------
def test_preprocessing_is_kept_beside_the_weights(runs: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "run"
    copy.mkdir()
    for name in ("config.json", WEIGHTS_FILE):
        (copy / name).write_bytes((runs["paper"] / name).read_bytes())
    run = load_run(copy)
    first = run_preprocessing(run)
    assert (copy / PREPROCESSING_FILE).is_file()
    data = load_run_data(run)
    assert first == preprocessing_of(data)

    def no_data(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the data was read again")

    assert run_preprocessing(run, load=no_data) == first  # from preprocessing.json
    (copy / PREPROCESSING_FILE).write_text('{"mean": [0.5]}')  # damaged: read the data again
    assert run_preprocessing(run) == first


def test_expected_shapes_cover_every_array(runs: dict[str, Path]) -> None:
    for name in SPECS:
        run = load_run(runs[name])
        shapes = expected_shapes(run.model)
        assert set(shapes) == set(run.params)
        assert all(tuple(run.params[key].shape) == shape for key, shape in shapes.items())


def one_line(run_dir: Path, match: str) -> None:
    with pytest.raises(UserError, match=match) as caught:
        load_run(run_dir)
    assert "\n" not in str(caught.value)


def test_bad_run_directories_are_one_line(runs: dict[str, Path], tmp_path: Path) -> None:
    one_line(tmp_path / "missing", "no such run directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line(empty, "no config.json")
    (empty / "config.json").write_text("[1, 2")
    one_line(empty, "unreadable")
    (empty / "config.json").write_text('{"data": "synthetic"}')
    one_line(empty, "network field")
    (empty / "config.json").write_bytes((runs["tokens"] / "config.json").read_bytes())
    one_line(empty, "no weights.npz")
    (empty / WEIGHTS_FILE).write_bytes(b"PK\x03\x04 broken")
    one_line(empty, "unreadable")
    with np.load(runs["tokens"] / WEIGHTS_FILE) as saved:
        params = dict(saved)
    np.savez(empty / WEIGHTS_FILE, **{**params, "dense0.weight": np.zeros((3, 3), np.float32)})
    one_line(empty, r"dense0.weight has shape \(3, 3\)")
    del params["fc.bias"]
    np.savez(empty / WEIGHTS_FILE, **params)
    one_line(empty, "no array 'fc.bias'")
    # the weights of another network
    (empty / WEIGHTS_FILE).write_bytes((runs["paper"] / WEIGHTS_FILE).read_bytes())
    one_line(empty, "no array|has shape")
