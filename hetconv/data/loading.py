"""Datasets for training: Fashion-MNIST (IDX files), CIFAR-10 (binary batches), synthetic.

Every loader returns a :class:`Dataset` whose images are float32 (N, C, H, W),
normalized per channel with the *training* set's mean and standard deviation
(measured on the whole training set, pixels scaled to [0, 1]), and whose labels
are int64 (N,). Files are parsed by hand from their documented binary layouts
and checked as they are read (magic numbers, dimensions, lengths, label range);
nothing is unpickled. A missing or damaged dataset raises :class:`DatasetError`
with one line saying which file is wrong or what to install. Batches come from
:func:`iterate_batches` (or :class:`hetconv.data.batches.BatchSource` while training),
whose shuffling depends only on (seed, epoch).

The user's own images (``--data folder``) are PNG or JPEG files in one sub-folder
per class, read with Pillow (:func:`load_image_folder`); an unreadable file is
skipped and counted in one warning line.

The :class:`Dataset` and its normalisation are in :mod:`hetconv.data.dataset`, the binary
readers in :mod:`hetconv.data.binary`, the image folder in :mod:`hetconv.data.folder`;
this module picks a dataset by name, makes the synthetic one, yields batches, and
re-exports the names callers use.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from hetconv.config import DATASETS
from hetconv.data.binary import (
    CIFAR10_CLASSES,
    CIFAR10_FOLDER,
    CIFAR10_URL,
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_DIR,
    FASHION_MNIST_FILES,
    FASHION_MNIST_PACKAGE,
    load_cifar10,
    load_fashion_mnist,
    read_idx,
)
from hetconv.data.dataset import Dataset, DatasetError, normalize_channels
from hetconv.data.folder import (
    DEFAULT_IMAGE_SIZE,
    FOLDER_TEST_FRACTION,
    IMAGE_SUFFIXES,
    MAX_IMAGE_SIZE,
    decode_image,
    load_image_folder,
    warn_to_stderr,
)

__all__ = [
    "CIFAR10_CLASSES", "CIFAR10_FOLDER", "CIFAR10_URL", "DATASET_NAMES", "DEFAULT_IMAGE_SIZE",
    "FASHION_MNIST_CLASSES", "FASHION_MNIST_DIR", "FASHION_MNIST_FILES",
    "FASHION_MNIST_PACKAGE", "FOLDER_TEST_FRACTION", "IMAGE_SUFFIXES", "MAX_IMAGE_SIZE",
    "SYNTHETIC_TEST_IMAGES", "SYNTHETIC_TRAIN_IMAGES", "Dataset", "DatasetError",
    "decode_image", "iterate_batches", "load_cifar10", "load_dataset", "load_fashion_mnist",
    "load_image_folder", "make_synthetic", "read_idx"]

SYNTHETIC_TRAIN_IMAGES = 2048
SYNTHETIC_TEST_IMAGES = 512
DATASET_NAMES = DATASETS  # defined once, in hetconv.config


def make_synthetic(n_train: int, n_test: int, shape: tuple[int, int, int] = (1, 28, 28),
                   classes: int = 10, seed: int = 0) -> Dataset:
    """A small learnable dataset: one blocky random pattern per class plus noise.

    Each class has a prototype made of 4x4-pixel blocks of random intensity; an
    image is its class prototype plus unit Gaussian noise per pixel, so a small
    CNN separates the classes within an epoch. Deterministic in all arguments.
    """
    if n_train < 1 or n_test < 0 or classes < 1 or len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"make_synthetic: bad sizes n_train={n_train} n_test={n_test} "
                         f"shape={shape} classes={classes}")
    channels, height, width = shape
    block = 4
    coarse = np.random.default_rng([seed, 0]).normal(
        0.0, 1.5, size=(classes, channels, -(-height // block), -(-width // block)))
    prototypes = coarse.repeat(block, axis=2).repeat(block, axis=3)[:, :, :height, :width]

    def draw(split: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        labels = np.random.default_rng([seed, split, 1]).integers(0, classes, count)
        noise = np.random.default_rng([seed, split, 2]).standard_normal((count, *shape))
        return prototypes[labels] + noise, labels.astype(np.int64)

    train_raw, train_labels = draw(1, n_train)
    test_raw, test_labels = draw(2, n_test)
    mean = train_raw.mean(axis=(0, 2, 3))
    std = train_raw.std(axis=(0, 2, 3))
    return Dataset(
        train_images=normalize_channels(train_raw, mean, std), train_labels=train_labels,
        test_images=normalize_channels(test_raw, mean, std), test_labels=test_labels,
        name="synthetic", classes=classes,
        mean=tuple(float(m) for m in mean), std=tuple(float(s) for s in std),
        class_names=tuple(f"class {index}" for index in range(classes)),
    )


# ----------------------------------------------------------------- entry points


def load_dataset(name: str, data_dir: str | Path | None = None,
                 limit: int | None = None, image_size: int | None = None,
                 warn: Callable[[str], None] = warn_to_stderr) -> Dataset:
    """Load a dataset by name ("fashion-mnist", "cifar10", "folder" or "synthetic").

    limit keeps the first ``limit`` training images (the normalization still uses
    the statistics of the whole training set); the test set is kept whole.
    image_size (folder only) is the side images are resized to; warn gets the one
    line about skipped files.
    """
    if limit is not None and limit < 1:
        raise DatasetError(f"--limit must be at least 1, got {limit}")
    if image_size is not None and name != "folder":
        raise DatasetError(f"--image-size applies to --data folder only, not {name}")
    if name == "fashion-mnist":
        data = load_fashion_mnist(data_dir)
    elif name == "cifar10":
        if data_dir is None:
            raise DatasetError(f"cifar10 needs --data-dir: the folder holding {CIFAR10_FOLDER}/ "
                               f"(the binary version from {CIFAR10_URL})")
        data = load_cifar10(data_dir)
    elif name == "folder":
        if data_dir is None:
            raise DatasetError("--data folder needs --data-dir DIR: a folder with one "
                               "sub-folder of PNG or JPEG images per class")
        data = load_image_folder(data_dir, image_size, warn)
    elif name == "synthetic":
        data = make_synthetic(max(SYNTHETIC_TRAIN_IMAGES, limit or 0), SYNTHETIC_TEST_IMAGES)
    else:
        raise DatasetError(f"unknown dataset {name!r}: choose one of {', '.join(DATASET_NAMES)}")
    if limit is not None and limit < len(data.train_images):
        data.train_images = data.train_images[:limit].copy()
        data.train_labels = data.train_labels[:limit].copy()
    return data


def iterate_batches(images: np.ndarray, labels: np.ndarray, batch_size: int, seed: int,
                    epoch: int, shuffle: bool = True,
                    drop_last: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (x (b, C, H, W), y (b,)) batches covering the set once.

    With shuffle, the order is the permutation drawn from
    ``np.random.default_rng([seed, epoch])``, so a run is reproducible and every
    epoch differs. The last batch is smaller unless drop_last drops it.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    count = len(images)
    order = np.random.default_rng([seed, epoch]).permutation(count) if shuffle else None
    stop = count - count % batch_size if drop_last else count
    for begin in range(0, stop, batch_size):
        end = min(begin + batch_size, count)
        if order is None:
            yield images[begin:end], labels[begin:end]
        else:
            index = order[begin:end]
            yield images[index], labels[index]
