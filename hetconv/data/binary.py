"""Readers of the published binary datasets: Fashion-MNIST from its IDX files (plain
or gzipped) and CIFAR-10 from its binary batches. Files are parsed by hand from their
documented layouts and checked as they are read (magic numbers, dimensions, lengths,
label range); nothing is unpickled. A missing or damaged file raises
:class:`~hetconv.data.dataset.DatasetError` with one line saying which file is wrong or what
to install.
"""
from __future__ import annotations

import gzip
import math
import struct
import zlib
from pathlib import Path

import numpy as np

from hetconv.data.dataset import Dataset, DatasetError, check_labels, dataset_from_uint8

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")

CIFAR10_FOLDER = "cifar-10-batches-bin"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{index}.bin" for index in range(1, 6))
CIFAR10_TEST_FILE = "test_batch.bin"
CIFAR10_SHAPE = (3, 32, 32)
CIFAR10_RECORD_BYTES = 1 + 3 * 32 * 32
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck")

# IDX type codes (third magic byte) -> big-endian numpy dtype.
IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """Parse one IDX file (gzipped or plain) into an array of its declared type and dims.

    Layout: two zero bytes, a type code, the number of dimensions, one big-endian
    uint32 per dimension, then the data in row-major order.
    """
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise DatasetError(f"{path}: cannot read ({error.strerror or error})") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as error:
            raise DatasetError(f"{path}: corrupt or truncated gzip data ({error})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in IDX_DTYPES or raw[3] == 0:
        raise DatasetError(f"{path}: not an IDX file (bad magic number {raw[:4].hex() or 'empty'})")
    ndim = raw[3]
    header_bytes = 4 + 4 * ndim
    if len(raw) < header_bytes:
        raise DatasetError(f"{path}: truncated IDX header ({len(raw)} bytes for {ndim} dims)")
    dims = struct.unpack(f">{ndim}I", raw[4:header_bytes])
    dtype = np.dtype(IDX_DTYPES[raw[2]])
    count = math.prod(dims)
    expected, actual = count * dtype.itemsize, len(raw) - header_bytes
    if actual != expected:
        what = "truncated" if actual < expected else "has trailing bytes"
        raise DatasetError(f"{path}: {what}: dims {list(dims)} need {expected} data bytes, "
                           f"the file holds {actual}")
    return np.frombuffer(raw, dtype=dtype, count=count, offset=header_bytes).reshape(dims)


def _find_idx(directory: Path, stem: str) -> Path | None:
    for candidate in (directory / f"{stem}.gz", directory / stem):
        if candidate.is_file():
            return candidate
    return None


def _read_idx_split(images_path: Path, labels_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(N, 1, H, W) uint8 images and (N,) uint8 labels from an IDX image/label pair."""
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise DatasetError(f"{images_path}: expected 3-dim unsigned byte images, got "
                           f"{images.ndim} dims of {images.dtype}")
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise DatasetError(f"{labels_path}: expected 1-dim unsigned byte labels, got "
                           f"{labels.ndim} dims of {labels.dtype}")
    if len(images) != len(labels):
        raise DatasetError(f"{labels_path}: {len(labels)} labels for {len(images)} images "
                           f"in {images_path.name}")
    check_labels(labels, len(FASHION_MNIST_CLASSES), labels_path)
    return images[:, None, :, :], labels


def load_fashion_mnist(data_dir: str | Path | None = None) -> Dataset:
    """Fashion-MNIST from its four IDX files (``*-idx?-ubyte`` or ``.gz``).

    data_dir defaults to where Debian's ``dataset-fashion-mnist`` installs them.
    Returns 60000 train / 10000 test images of (1, 28, 28) for the real files.
    """
    directory = Path(data_dir) if data_dir is not None else FASHION_MNIST_DIR
    found = {key: _find_idx(directory, stem) for key, stem in FASHION_MNIST_FILES.items()}
    missing = [FASHION_MNIST_FILES[key] + "[.gz]" for key, path in found.items() if path is None]
    if missing:
        raise DatasetError(
            f"Fashion-MNIST not found in {directory} (missing {', '.join(missing)}): "
            f"install it with `apt-get install {FASHION_MNIST_PACKAGE}` or pass --data-dir"
        )
    paths = {key: path for key, path in found.items() if path is not None}
    train_u8, train_labels = _read_idx_split(paths["train_images"], paths["train_labels"])
    test_u8, test_labels = _read_idx_split(paths["test_images"], paths["test_labels"])
    if train_u8.shape[1:] != test_u8.shape[1:]:
        raise DatasetError(f"{paths['test_images']}: images of {test_u8.shape[2:]} do not "
                           f"match the training images of {train_u8.shape[2:]}")
    return dataset_from_uint8("fashion-mnist", train_u8, train_labels, test_u8, test_labels,
                               FASHION_MNIST_CLASSES)


# ---------------------------------------------------------------------- CIFAR-10


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(N, 3, 32, 32) uint8 images and (N,) labels from one binary CIFAR-10 batch."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise DatasetError(f"{path}: cannot read ({error.strerror or error})") from None
    if not raw or len(raw) % CIFAR10_RECORD_BYTES:
        raise DatasetError(
            f"{path}: {len(raw)} bytes is not a whole number of {CIFAR10_RECORD_BYTES}-byte "
            "records (1 label byte + 3072 pixel bytes); truncated or not binary CIFAR-10"
        )
    records = np.frombuffer(raw, dtype=np.uint8).reshape(-1, CIFAR10_RECORD_BYTES)
    labels = records[:, 0]
    check_labels(labels, len(CIFAR10_CLASSES), path)
    return records[:, 1:].reshape(-1, *CIFAR10_SHAPE), labels


def load_cifar10(data_dir: str | Path) -> Dataset:
    """CIFAR-10 from the binary distribution.

    data_dir is the ``cifar-10-batches-bin`` folder or its parent. Reads
    ``data_batch_1..5.bin`` (50000 train images) and ``test_batch.bin`` (10000).
    """
    given = Path(data_dir)
    folder = given if (given / CIFAR10_TRAIN_FILES[0]).is_file() else given / CIFAR10_FOLDER
    names = (*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE)
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise DatasetError(
            f"CIFAR-10 not found in {given}: expected {CIFAR10_FOLDER}/data_batch_1.bin ... "
            f"data_batch_5.bin and {CIFAR10_TEST_FILE} (missing {', '.join(missing)}); "
            f"unpack the binary version from {CIFAR10_URL}"
        )
    train_parts = [_read_cifar_batch(folder / name) for name in CIFAR10_TRAIN_FILES]
    test_u8, test_labels = _read_cifar_batch(folder / CIFAR10_TEST_FILE)
    train_u8 = np.concatenate([images for images, _ in train_parts])
    train_labels = np.concatenate([labels for _, labels in train_parts])
    return dataset_from_uint8("cifar10", train_u8, train_labels, test_u8, test_labels,
                               CIFAR10_CLASSES)
