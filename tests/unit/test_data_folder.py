"""``--data folder``: the user's own PNG/JPEG images, built with Pillow in tmp_path.

Each folder holds a few dozen tiny images per class (class = sub-folder), written
as PNG or JPEG, plus damaged files that must be skipped with one warning line.
The class names of the other datasets are checked here too, on CIFAR-style binary
files written byte by byte.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hetconv.commands.cli import main
from hetconv.data.loading import (
    CIFAR10_CLASSES,
    CIFAR10_FOLDER,
    DEFAULT_IMAGE_SIZE,
    FASHION_MNIST_CLASSES,
    FOLDER_TEST_FRACTION,
    DatasetError,
    load_dataset,
    load_image_folder,
)
from tests.unit.test_data import write_cifar_set, write_fashion_set

CLASSES = ("dog", "cat", "bird")  # written unsorted: the labels follow the sorted names


def class_pixels(label: int, size: int, colour: bool, rng: np.random.Generator) -> np.ndarray:
    """uint8 (size, size[, 3]): a class-specific brightness plus noise."""
    base = 40 + 80 * label
    shape = (size, size, 3) if colour else (size, size)
    pixels = base + rng.integers(-30, 31, shape)
    if colour:
        pixels[..., label % 3] += 60
    return np.clip(pixels, 0, 255).astype(np.uint8)


def write_folder(root: Path, per_class: int = 24, size: int = 8, colour: bool = False,
                 seed: int = 0, classes: tuple[str, ...] = CLASSES) -> dict[str, list[Path]]:
    """``root/<class>/NNN.png|jpg`` images (every third one a JPEG); returns the files."""
    rng = np.random.default_rng(seed)
    written: dict[str, list[Path]] = {}
    for name in classes:
        label = sorted(CLASSES).index(name) if name in CLASSES else len(CLASSES)
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        written[name] = []
        for index in range(per_class):
            pixels = class_pixels(label, size, colour, rng)
            path = folder / f"{index:03d}.{'jpg' if index % 3 == 2 else 'png'}"
            Image.fromarray(pixels).save(path, quality=95)
            written[name].append(path)
    return written


def no_warning(message: str) -> None:
    raise AssertionError(f"unexpected warning: {message}")


def test_flat_folder_gray_split_and_normalisation(tmp_path: Path) -> None:
    write_folder(tmp_path, per_class=24, size=8)
    (tmp_path / "cat" / "notes.txt").write_text("not an image, ignored")
    (tmp_path / ".hidden").mkdir()  # not a class
    data = load_image_folder(tmp_path, warn=no_warning)
    assert data.name == "folder"
    assert data.class_names == ("bird", "cat", "dog") and data.classes == 3
    assert data.image_shape == (1, 8, 8)  # grey, the images' own size
    assert data.train_images.dtype == np.float32 and data.train_labels.dtype == np.int64
    held = round(24 * FOLDER_TEST_FRACTION)
    assert len(data.test_labels) == 3 * held and len(data.train_labels) == 3 * (24 - held)
    for label in range(3):  # every class in both sets
        assert (data.test_labels == label).sum() == held
    # Normalised with the training set's own statistics: mean 0, std 1 per channel.
    assert abs(float(data.train_images.mean())) < 1e-4
    assert float(data.train_images.std()) == pytest.approx(1.0, abs=1e-4)
    # The labels are right: the class brightness (bird 40, cat 120, dog 200) comes back.
    pixels = data.train_images * data.std[0] + data.mean[0]
    for label, brightness in enumerate((40, 120, 200)):
        assert float(pixels[data.train_labels == label].mean()) * 255 == pytest.approx(
            brightness, abs=5)
    # The training order is shuffled (a --limit takes every class), and fixed.
    assert len(set(data.train_labels[:12].tolist())) == 3
    again = load_image_folder(tmp_path, warn=no_warning)
    np.testing.assert_array_equal(again.train_images, data.train_images)
    np.testing.assert_array_equal(again.test_labels, data.test_labels)


def test_corrupt_files_are_skipped_with_one_warning_line(tmp_path: Path) -> None:
    files = write_folder(tmp_path, per_class=12, size=8)
    (tmp_path / "cat" / "zz-garbage.png").write_bytes(b"this is not a png")
    truncated = files["dog"][2]  # a JPEG
    truncated.write_bytes(truncated.read_bytes()[:40])
    warnings: list[str] = []
    data = load_image_folder(tmp_path, warn=warnings.append)
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith(f"skipped 2 unreadable image file(s) in {tmp_path}: ")
    assert "cat/zz-garbage.png" in warnings[0] and "dog/002.jpg" in warnings[0]
    assert len(data.train_labels) + len(data.test_labels) == 3 * 12 - 1  # one truncated
    for name in ("a", "b", "c", "d", "e"):
        (tmp_path / "bird" / f"{name}-bad.jpg").write_bytes(b"\xff\xd8\xff junk")
    warnings.clear()
    load_image_folder(tmp_path, warn=warnings.append)
    assert len(warnings) == 1 and warnings[0].count(", ") == 2  # the first 3 names
    assert warnings[0].startswith("skipped 7 ") and warnings[0].endswith(" and 4 more")


def test_colour_is_detected_and_sizes_are_unified(tmp_path: Path) -> None:
    write_folder(tmp_path, per_class=12, size=8)
    Image.fromarray(class_pixels(0, 20, True, np.random.default_rng(1))).save(
        tmp_path / "bird" / "colour.png")
    data = load_image_folder(tmp_path, warn=no_warning)
    # One colour image makes the whole set RGB; mixed sizes give the default side.
    assert data.image_shape == (3, DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE)
    assert len(data.mean) == 3 and len(data.std) == 3
    sized = load_image_folder(tmp_path, image_size=6, warn=no_warning)
    assert sized.image_shape == (3, 6, 6)
    # Grey images read as RGB have three equal channels.
    raw = sized.train_images * np.array(sized.std).reshape(1, 3, 1, 1) \
        + np.array(sized.mean).reshape(1, 3, 1, 1)
    equal = np.abs(raw[:, 0] - raw[:, 1]).max(axis=(1, 2)) < 1e-5
    assert equal.sum() >= len(raw) - 1


def test_sixteen_bit_grey_is_scaled_to_eight_bits(tmp_path: Path) -> None:
    for name, value in (("dark", 10000), ("light", 60000)):
        (tmp_path / name).mkdir()
        for index in range(6):
            Image.fromarray(np.full((4, 4), value + index, dtype=np.uint16)).save(
                tmp_path / name / f"{index}.png")
    data = load_image_folder(tmp_path, warn=no_warning)
    pixels = np.concatenate([data.train_images, data.test_images]) * data.std[0] + data.mean[0]
    assert data.image_shape == (1, 4, 4)
    assert sorted({round(float(p) * 255) for p in pixels.ravel()}) == [39, 233]


def test_train_and_test_folders(tmp_path: Path) -> None:
    write_folder(tmp_path / "train", per_class=10, size=8, colour=True)
    write_folder(tmp_path / "test", per_class=4, size=8, colour=True, seed=1,
                 classes=("cat", "dog"))  # a class may be missing from test/
    data = load_image_folder(tmp_path, warn=no_warning)
    assert data.class_names == ("bird", "cat", "dog") and data.image_shape == (3, 8, 8)
    assert len(data.train_labels) == 30 and len(data.test_labels) == 8
    assert set(data.test_labels.tolist()) == {1, 2}
    # Normalised with the training set's statistics only: the test set (no dark birds)
    # comes out brighter than 0.
    assert np.abs(data.train_images.mean(axis=(0, 2, 3))).max() < 1e-4
    assert float(data.test_images.mean()) > 0.3
    (tmp_path / "test" / "fish").mkdir()
    with pytest.raises(DatasetError, match="fish not in"):
        load_image_folder(tmp_path)
    # train/ alone: the held-out split is taken from it.
    only_train = tmp_path / "only"
    write_folder(only_train / "train", per_class=12, size=8)
    assert len(load_image_folder(only_train, warn=no_warning).test_labels) == 3 * 2


@pytest.mark.parametrize("layout, expected", [
    ("missing", "not a folder"),
    ("one-class", "found 1 class folder(s) (cat); need at least 2"),
    ("no-class", "found 0 class folder(s); need at least 2"),
    ("unreadable", "no readable PNG or JPEG image"),
    ("empty-class", "no readable training image in class folder(s) dog"),
    ("test-only", "has test/ but no train/"),
    ("too-few", "too few to hold out a test set"),
])
def test_bad_folders_are_one_clear_error(tmp_path: Path, layout: str, expected: str) -> None:
    root = tmp_path / "images"
    if layout == "one-class":
        write_folder(root, per_class=3, classes=("cat",))
    elif layout == "no-class":
        root.mkdir()
        Image.fromarray(np.zeros((4, 4), np.uint8)).save(root / "loose.png")
    elif layout == "unreadable":
        for name in ("cat", "dog"):
            (root / name).mkdir(parents=True)
            (root / name / "x.png").write_bytes(b"garbage")
    elif layout == "empty-class":
        write_folder(root, per_class=6, classes=("cat",))
        (root / "dog").mkdir()
    elif layout == "test-only":
        write_folder(root / "test", per_class=2, classes=("cat", "dog"))
    elif layout == "too-few":
        write_folder(root, per_class=1, classes=("cat", "dog"))
    with pytest.raises(DatasetError) as error:
        load_image_folder(root, warn=lambda message: None)
    message = str(error.value)
    assert "\n" not in message and expected in message, message


def test_load_dataset_folder_arguments(tmp_path: Path) -> None:
    write_folder(tmp_path, per_class=12, size=8)
    data = load_dataset("folder", tmp_path, limit=5, image_size=4, warn=no_warning)
    assert data.train_images.shape == (5, 1, 4, 4) and data.class_names == ("bird", "cat", "dog")
    with pytest.raises(DatasetError, match="--data folder needs --data-dir"):
        load_dataset("folder")
    with pytest.raises(DatasetError, match="--image-size applies to --data folder only"):
        load_dataset("synthetic", image_size=8)
    with pytest.raises(DatasetError, match="--image-size 0"):
        load_image_folder(tmp_path, image_size=0)


def test_every_dataset_names_its_classes(tmp_path: Path) -> None:
    write_cifar_set(tmp_path / CIFAR10_FOLDER)
    cifar = load_dataset("cifar10", tmp_path)
    assert cifar.class_names == CIFAR10_CLASSES and len(cifar.class_names) == cifar.classes
    write_fashion_set(tmp_path / "fashion")
    fashion = load_dataset("fashion-mnist", tmp_path / "fashion")
    assert fashion.class_names == FASHION_MNIST_CLASSES
    synthetic = load_dataset("synthetic", limit=16)
    assert len(synthetic.class_names) == synthetic.classes == 10


RUN = ["train", "--local", "--data", "folder", "--arch", "2", "--kernel-size", "3",
       "--epochs", "1", "--batch", "16", "--threads", "1", "--no-progress"]


def test_train_on_a_folder_from_the_command_line(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    images = tmp_path / "images"
    write_folder(images, per_class=20, size=10, colour=True)
    (images / "cat" / "broken.jpg").write_bytes(b"\xff\xd8 not really")
    run_dir = tmp_path / "run"
    argv = [*RUN, "--data-dir", str(images), "--image-size", "8", "--augment",
            "--run-dir", str(run_dir)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    assert warnings == [f"hetconv: warning: skipped 1 unreadable image file(s) in {images}: "
                        "cat/broken.jpg"]
    assert "Traceback" not in captured.err
    assert "hetconv: folder (" in captured.out and "images of 3x8x8" in captured.out
    config = json.loads((run_dir / "config.json").read_text())
    assert config["data"] == "folder" and config["image_size"] == 8 and config["augment"] is True
    assert config["input_shape"] == [3, 8, 8] and config["classes"] == 3
    # A resume must keep the image size and the augmentation.
    assert main(["train", "--resume", str(run_dir), "--image-size", "6", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--image-size 6 differs from the run's 8" in err[0], err
    (run_dir / "config.json").write_text(json.dumps({**config, "augment": False}))
    assert main(["train", "--resume", str(run_dir), "--augment", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--augment True differs from the run's False" in err[0], err


@pytest.mark.parametrize("argv, expected", [
    (["--data-dir", "/nonexistent/images"], "--data-dir /nonexistent/images: not a folder"),
    ([], "--data folder needs --data-dir DIR"),
])
def test_bad_folder_flags_are_one_line(tmp_path: Path, argv: list[str], expected: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*RUN, *argv, "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hetconv: error:") and expected in err[0], err


def test_image_size_needs_the_folder_dataset(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--local", "--data", "synthetic", "--image-size", "8",
            "--run-dir", str(tmp_path / "r")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hetconv: error: --image-size applies to --data folder only, not synthetic"]
