"""Dataset loaders and the batch iterator, on small hand-written files.

IDX and binary CIFAR-10 files are built byte by byte here, so the parsers are
checked against the documented layouts rather than against themselves. The real
Fashion-MNIST is loaded only where Debian's dataset-fashion-mnist is installed.
"""
from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from hetconv.data.loading import (
    CIFAR10_FOLDER,
    FASHION_MNIST_DIR,
    DatasetError,
    iterate_batches,
    load_cifar10,
    load_dataset,
    load_fashion_mnist,
    make_synthetic,
    read_idx,
)
from hetconv.errors import UserError


def idx_bytes(array: np.ndarray, type_code: int = 0x08) -> bytes:
    header = bytes([0, 0, type_code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_file(path: Path, payload: bytes, compress: bool) -> Path:
    if compress:
        path = path.with_name(path.name + ".gz")
        payload = gzip.compress(payload)
    path.write_bytes(payload)
    return path


def write_fashion_set(directory: Path, train: int = 6, test: int = 4,
                      size: tuple[int, int] = (4, 5), compress: bool = True,
                      seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (train, *size), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (test, *size), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, test, dtype=np.uint8),
    }
    directory.mkdir(parents=True, exist_ok=True)
    for index, (name, array) in enumerate(arrays.items()):
        # Mix compressed and plain files when compress is True.
        write_file(directory / name, idx_bytes(array), compress and index % 2 == 0)
    return arrays


def assert_one_line(error: pytest.ExceptionInfo[DatasetError], *parts: str) -> None:
    message = str(error.value)
    assert "\n" not in message
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"


# ------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("type_code,dtype", [(0x08, np.uint8), (0x0B, np.int16),
                                             (0x0D, np.float32)])
def test_read_idx_plain_and_gzipped(tmp_path: Path, compress: bool, type_code: int,
                                    dtype: type) -> None:
    array = (np.arange(24).reshape(2, 3, 4) * 3).astype(dtype)
    path = write_file(tmp_path / "data-idx3", idx_bytes(array, type_code), compress)
    loaded = read_idx(path)
    assert loaded.shape == (2, 3, 4)
    np.testing.assert_array_equal(loaded, array)


@pytest.mark.parametrize("compress", [False, True])
def test_load_fashion_mnist_from_hand_written_files(tmp_path: Path, compress: bool) -> None:
    arrays = write_fashion_set(tmp_path, compress=compress)
    data = load_fashion_mnist(tmp_path)
    assert data.name == "fashion-mnist" and data.classes == 10 and len(data.class_names) == 10
    assert data.train_images.shape == (6, 1, 4, 5) and data.train_images.dtype == np.float32
    assert data.test_images.shape == (4, 1, 4, 5) and data.test_images.dtype == np.float32
    assert data.train_labels.dtype == np.int64 and data.image_shape == (1, 4, 5)
    np.testing.assert_array_equal(data.train_labels, arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(data.test_labels, arrays["t10k-labels-idx1-ubyte"])
    # Normalized with the training statistics, in [0, 1] pixel units.
    raw_train = arrays["train-images-idx3-ubyte"] / 255.0
    assert data.mean[0] == pytest.approx(raw_train.mean())
    assert data.std[0] == pytest.approx(raw_train.std())
    assert float(data.train_images.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(data.train_images.std()) == pytest.approx(1.0, abs=1e-5)
    restored = data.test_images[:, 0] * data.std[0] + data.mean[0]
    np.testing.assert_allclose(restored, arrays["t10k-images-idx3-ubyte"] / 255.0, atol=1e-5)


@pytest.mark.parametrize("damage,expected", [
    (lambda raw: b"\x08\x03" + raw[2:], "bad magic"),
    (lambda raw: raw[:2] + b"\x07" + raw[3:], "bad magic"),
    (lambda raw: raw[:-3], "truncated"),
    (lambda raw: raw + b"\x00\x00", "trailing bytes"),
    (lambda raw: raw[:6], "truncated IDX header"),
    (lambda raw: b"", "bad magic"),
])
def test_damaged_idx_file_names_file_and_problem(tmp_path: Path, damage: object,
                                                 expected: str) -> None:
    write_fashion_set(tmp_path, compress=False)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    with pytest.raises(DatasetError) as error:
        load_fashion_mnist(tmp_path)
    assert_one_line(error, str(path), expected)


def test_truncated_gzip_is_reported(tmp_path: Path) -> None:
    write_fashion_set(tmp_path, compress=True)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DatasetError) as error:
        load_fashion_mnist(tmp_path)
    assert_one_line(error, str(path), "gzip")


def test_inconsistent_idx_files_are_reported(tmp_path: Path) -> None:
    arrays = write_fashion_set(tmp_path, compress=False)
    labels = tmp_path / "train-labels-idx1-ubyte"
    labels.write_bytes(idx_bytes(arrays["train-labels-idx1-ubyte"][:-1]))
    with pytest.raises(DatasetError) as error:
        load_fashion_mnist(tmp_path)
    assert_one_line(error, str(labels), "5 labels for 6 images")

    bad_labels = arrays["train-labels-idx1-ubyte"].copy()
    bad_labels[2] = 12
    labels.write_bytes(idx_bytes(bad_labels))
    with pytest.raises(DatasetError) as error:
        load_fashion_mnist(tmp_path)
    assert_one_line(error, str(labels), "label 12 out of range")

    images = tmp_path / "train-images-idx3-ubyte"
    images.write_bytes(idx_bytes(np.zeros((6, 20), np.uint8)))
    with pytest.raises(DatasetError) as error:
        load_fashion_mnist(tmp_path)
    assert_one_line(error, str(images), "3-dim")


def test_missing_fashion_mnist_names_the_debian_package(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetError) as error:
        load_fashion_mnist(missing)
    assert_one_line(error, "apt-get install dataset-fashion-mnist", str(missing))
    assert isinstance(error.value, UserError)
    write_fashion_set(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DatasetError) as error:
        load_fashion_mnist(tmp_path)
    assert_one_line(error, "t10k-labels-idx1-ubyte", "dataset-fashion-mnist")


# -------------------------------------------------------------------- CIFAR-10


def write_cifar_set(folder: Path, per_batch: int = 2, test: int = 3,
                    seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Five training batches and a test batch of random records; returns the raw arrays."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    parts = []
    for name, count in [(f"data_batch_{i}.bin", per_batch) for i in range(1, 6)] + [
            ("test_batch.bin", test)]:
        labels = rng.integers(0, 10, count, dtype=np.uint8)
        pixels = rng.integers(0, 256, (count, 3, 32, 32), dtype=np.uint8)
        # One record: the label byte, then the red, green and blue 32x32 planes row by row.
        records = b"".join(bytes([label]) + image.tobytes()
                            for label, image in zip(labels, pixels))
        (folder / name).write_bytes(records)
        parts.append((pixels, labels))
    train_images = np.concatenate([p for p, _ in parts[:5]])
    train_labels = np.concatenate([label for _, label in parts[:5]])
    return train_images, train_labels, parts[5][0], parts[5][1]


def test_load_cifar10_binary_from_folder_or_parent(tmp_path: Path) -> None:
    folder = tmp_path / CIFAR10_FOLDER
    train_images, train_labels, test_images, test_labels = write_cifar_set(folder)
    for given in (tmp_path, folder):
        data = load_cifar10(given)
        assert data.name == "cifar10" and data.classes == 10
        assert data.train_images.shape == (10, 3, 32, 32)
        assert data.test_images.shape == (3, 3, 32, 32)
        np.testing.assert_array_equal(data.train_labels, train_labels)
        np.testing.assert_array_equal(data.test_labels, test_labels)
        for channel in range(3):
            raw = train_images[:, channel] / 255.0
            assert data.mean[channel] == pytest.approx(raw.mean())
            assert data.std[channel] == pytest.approx(raw.std())
        mean = np.array(data.mean).reshape(1, 3, 1, 1)
        std = np.array(data.std).reshape(1, 3, 1, 1)
        np.testing.assert_allclose(data.test_images * std + mean, test_images / 255.0, atol=1e-5)


def test_cifar10_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as error:
        load_cifar10(tmp_path)
    assert_one_line(error, f"{CIFAR10_FOLDER}/data_batch_1.bin", str(tmp_path), "test_batch.bin")
    folder = tmp_path / CIFAR10_FOLDER
    write_cifar_set(folder)
    batch = folder / "data_batch_3.bin"
    batch.write_bytes(batch.read_bytes()[:-100])
    with pytest.raises(DatasetError) as error:
        load_cifar10(tmp_path)
    assert_one_line(error, str(batch), "3073-byte records")
    batch.write_bytes(bytes([11]) + bytes(3072))
    with pytest.raises(DatasetError) as error:
        load_cifar10(tmp_path)
    assert_one_line(error, str(batch), "label 11 out of range")
    with pytest.raises(DatasetError) as error:
        load_dataset("cifar10")
    assert_one_line(error, "--data-dir")


# ------------------------------------------------------------------- synthetic


def test_synthetic_is_deterministic_and_learnable() -> None:
    first = make_synthetic(400, 200, shape=(2, 12, 12), classes=4, seed=3)
    again = make_synthetic(400, 200, shape=(2, 12, 12), classes=4, seed=3)
    other = make_synthetic(400, 200, shape=(2, 12, 12), classes=4, seed=4)
    for name in ("train_images", "train_labels", "test_images", "test_labels"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    assert not np.array_equal(first.train_images, other.train_images)
    assert first.train_images.shape == (400, 2, 12, 12) and first.train_images.dtype == np.float32
    assert first.train_labels.dtype == np.int64
    assert set(first.train_labels.tolist()) == set(range(4))
    # Learnable: a nearest-class-mean classifier fitted on train is accurate on test.
    flat_train = first.train_images.reshape(400, -1)
    centroids = np.stack([flat_train[first.train_labels == k].mean(axis=0) for k in range(4)])
    distances = ((first.test_images.reshape(200, 1, -1) - centroids) ** 2).sum(axis=2)
    assert (distances.argmin(axis=1) == first.test_labels).mean() > 0.9


def test_load_dataset_limit_and_names() -> None:
    data = load_dataset("synthetic", limit=100)
    assert len(data.train_images) == 100 and len(data.train_labels) == 100
    assert data.train_images.shape[1:] == (1, 28, 28) and len(data.test_images) > 0
    assert len(load_dataset("synthetic", limit=5000).train_images) == 5000
    with pytest.raises(DatasetError) as error:
        load_dataset("imagenet")
    assert_one_line(error, "imagenet", "fashion-mnist", "cifar10", "synthetic")
    with pytest.raises(DatasetError):
        load_dataset("synthetic", limit=0)


# ------------------------------------------------------------------- batching


def test_iterate_batches_is_seeded_and_covers_every_image() -> None:
    images = np.arange(23, dtype=np.float32).reshape(23, 1, 1, 1)
    labels = np.arange(23)

    def epoch_order(seed: int, epoch: int, **options: bool) -> list[list[int]]:
        batches = iterate_batches(images, labels, 5, seed, epoch, **options)
        order = []
        for x, y in batches:
            np.testing.assert_array_equal(x[:, 0, 0, 0], y)  # images stay with their labels
            order.append(y.tolist())
        return order

    first = epoch_order(7, 0)
    assert first == epoch_order(7, 0)
    assert first != epoch_order(7, 1) and first != epoch_order(8, 0)
    assert [len(batch) for batch in first] == [5, 5, 5, 5, 3]
    assert sorted(sum(first, [])) == list(range(23))
    expected = np.random.default_rng([7, 0]).permutation(23).tolist()
    assert sum(first, []) == expected
    dropped = epoch_order(7, 0, drop_last=True)
    assert [len(batch) for batch in dropped] == [5, 5, 5, 5] and dropped == first[:4]
    assert sum(epoch_order(7, 0, shuffle=False), []) == list(range(23))
    with pytest.raises(ValueError):
        next(iterate_batches(images, labels, 0, 0, 0))


# ------------------------------------------------------------------ real data


@pytest.mark.skipif(not FASHION_MNIST_DIR.is_dir(),
                    reason=f"{FASHION_MNIST_DIR} missing (apt-get install dataset-fashion-mnist)")
def test_real_fashion_mnist_loads() -> None:
    data = load_dataset("fashion-mnist")
    assert data.train_images.shape == (60000, 1, 28, 28)
    assert data.test_images.shape == (10000, 1, 28, 28)
    assert data.classes == 10
    np.testing.assert_array_equal(np.bincount(data.train_labels), [6000] * 10)
    np.testing.assert_array_equal(np.bincount(data.test_labels), [1000] * 10)
    assert data.mean[0] == pytest.approx(0.2860, abs=1e-3)
    assert data.std[0] == pytest.approx(0.3530, abs=1e-3)
    limited = load_dataset("fashion-mnist", limit=1000)
    assert limited.train_images.shape == (1000, 1, 28, 28)
    np.testing.assert_array_equal(limited.train_images, data.train_images[:1000])
