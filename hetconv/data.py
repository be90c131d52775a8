"""Datasets for training: Fashion-MNIST (IDX files), CIFAR-10 (binary batches), synthetic.

Every loader returns a :class:`Dataset` whose images are float32 (N, C, H, W),
normalized per channel with the *training* set's mean and standard deviation
(measured on the whole training set, pixels scaled to [0, 1]), and whose labels
are int64 (N,). Files are parsed by hand from their documented binary layouts
and checked as they are read (magic numbers, dimensions, lengths, label range);
nothing is unpickled. A missing or damaged dataset raises :class:`DatasetError`
with one line saying which file is wrong or what to install. Batches come from
:func:`iterate_batches` (or :class:`hetconv.batches.BatchSource` while training),
whose shuffling depends only on (seed, epoch).

The user's own images (``--data folder``) are PNG or JPEG files in one sub-folder
per class, read with Pillow (:func:`load_image_folder`); an unreadable file is
skipped and counted in one warning line.
"""
from __future__ import annotations

import gzip
import math
import struct
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetconv.config import DATASETS
from hetconv.errors import UserError

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

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
"""Files of a class folder that are read (case does not matter); others are ignored."""
DEFAULT_IMAGE_SIZE = 32
"""Side of the images when --image-size is not given and the images differ in size."""
MAX_IMAGE_SIZE = 1024
FOLDER_TEST_FRACTION = 1 / 6
"""Share of each class held out as the test set when the folder has no test/."""
FOLDER_SPLIT_SEED = 0
"""Seed of the held-out split and of the image order: the same for every --seed."""
SKIPPED_NAMES_SHOWN = 3

SYNTHETIC_TRAIN_IMAGES = 2048
SYNTHETIC_TEST_IMAGES = 512
DATASET_NAMES = DATASETS  # defined once, in hetconv.config

# IDX type codes (third magic byte) -> big-endian numpy dtype.
IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


class DatasetError(UserError):
    """A dataset is missing, truncated or malformed; the message is one actionable line."""


@dataclass(eq=False)
class Dataset:
    """A labelled train/test split ready for training.

    train_images: float32 (N, C, H, W), normalized with the training set's mean/std.
    train_labels: int64 (N,) in [0, classes).
    test_images: float32 (M, C, H, W), normalized with the *training* statistics.
    test_labels: int64 (M,).
    mean, std: per-channel statistics used, in pixel units scaled to [0, 1]
        (raw units for the synthetic set); pixel = image * std + mean.
    """

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    name: str
    classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: tuple[str, ...] = ()

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one image."""
        channels, height, width = self.train_images.shape[1:]
        return int(channels), int(height), int(width)


# --------------------------------------------------------------------------- IDX


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
    _check_labels(labels, len(FASHION_MNIST_CLASSES), labels_path)
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
    return _dataset_from_uint8("fashion-mnist", train_u8, train_labels, test_u8, test_labels,
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
    _check_labels(labels, len(CIFAR10_CLASSES), path)
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
    return _dataset_from_uint8("cifar10", train_u8, train_labels, test_u8, test_labels,
                               CIFAR10_CLASSES)


# ------------------------------------------------------------------ normalization


def _check_labels(labels: np.ndarray, classes: int, path: Path) -> None:
    if len(labels) and int(labels.max()) >= classes:
        raise DatasetError(f"{path}: label {int(labels.max())} out of range for {classes} classes")


def _uint8_channel_stats(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact per-channel mean and std (float64, pixel units 0..255) of uint8 (N, C, H, W).

    Uses a 256-bin histogram per channel, so no float copy of the images is made.
    """
    values = np.arange(256, dtype=np.float64)
    means, stds = [], []
    for channel in range(images.shape[1]):
        counts = np.bincount(images[:, channel].ravel(), minlength=256).astype(np.float64)
        total = counts.sum()
        mean = float(counts @ values / total)
        means.append(mean)
        stds.append(math.sqrt(float(counts @ (values - mean) ** 2 / total)))
    return np.array(means), np.array(stds)


def _normalize(images: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """float32 (images - mean) / std per channel, without float64 temporaries."""
    safe_std = np.where(std > 0, std, 1.0)
    out = np.empty(images.shape, dtype=np.float32)
    np.subtract(images, mean.astype(np.float32).reshape(1, -1, 1, 1), out=out, dtype=np.float32)
    out *= (1.0 / safe_std).astype(np.float32).reshape(1, -1, 1, 1)
    return out


def _dataset_from_uint8(name: str, train_u8: np.ndarray, train_labels: np.ndarray,
                        test_u8: np.ndarray, test_labels: np.ndarray,
                        class_names: tuple[str, ...]) -> Dataset:
    mean, std = _uint8_channel_stats(train_u8)
    return Dataset(
        train_images=_normalize(train_u8, mean, std),
        train_labels=train_labels.astype(np.int64),
        test_images=_normalize(test_u8, mean, std),
        test_labels=test_labels.astype(np.int64),
        name=name, classes=len(class_names),
        mean=tuple(float(m) for m in mean / 255.0), std=tuple(float(s) for s in std / 255.0),
        class_names=class_names,
    )


# ------------------------------------------------------------------ image folder


def _warn(message: str) -> None:
    print(f"hetconv: warning: {message}", file=sys.stderr, flush=True)


def _class_folders(base: Path) -> list[Path]:
    """The sub-folders of ``base`` (hidden ones left out), sorted by name."""
    return sorted((p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")),
                  key=lambda p: p.name)


def _image_files(folder: Path) -> list[Path]:
    """The PNG and JPEG files directly in ``folder``, sorted by name."""
    return sorted((p for p in folder.iterdir()
                   if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith(".")
                   and p.is_file()), key=lambda p: p.name)


def _labelled_files(base: Path, class_names: list[str]) -> list[tuple[Path, int]]:
    """(file, class index) for every image under ``base/<class name>/``."""
    files = []
    for label, name in enumerate(class_names):
        folder = base / name
        if folder.is_dir():
            files += [(path, label) for path in _image_files(folder)]
    return files


def _image_size(path: Path) -> tuple[int, int]:
    """(width, height) from the file's header (the pixels are not decoded)."""
    from PIL import Image

    with Image.open(path) as image:
        return image.size


def decode_image(path: Path, size: tuple[int, int]) -> tuple[np.ndarray, bool]:
    """uint8 (H, W, 3) pixels of an image resized to ``size`` (width, height), and
    whether it has colour (channels that differ anywhere). Alpha is dropped;
    16-bit grey is scaled to 8 bits. ``--data folder`` and ``hetconv predict`` read
    every image through this."""
    from PIL import Image

    with Image.open(path) as opened:
        opened.draft("RGB", size)  # JPEG: decode at a reduced scale when that is enough
        opened.load()
        image: Image.Image = opened
        if image.mode.startswith("I"):  # 16-bit (or 32-bit integer) grey
            wide = np.asarray(image, dtype=np.float64) / 257.0
            image = Image.fromarray(np.clip(np.rint(wide), 0, 255).astype(np.uint8))
        rgb = image.convert("RGB")
        if rgb.size != size:
            rgb = rgb.resize(size, Image.Resampling.BILINEAR)
        pixels = np.asarray(rgb, dtype=np.uint8)
    colour = bool((pixels[..., 0] != pixels[..., 1]).any()
                  or (pixels[..., 1] != pixels[..., 2]).any())
    return pixels, colour


def _held_out(labels: np.ndarray, classes: int) -> np.ndarray:
    """bool (N,): the images of a fixed-seed test split, FOLDER_TEST_FRACTION of each
    class (rounded; every class keeps at least one training image)."""
    test = np.zeros(len(labels), dtype=bool)
    for label in range(classes):
        members = np.flatnonzero(labels == label)
        count = min(int(math.floor(len(members) * FOLDER_TEST_FRACTION + 0.5)),
                    len(members) - 1)
        if count > 0:
            chosen = np.random.default_rng([FOLDER_SPLIT_SEED, label]).permutation(members)
            test[chosen[:count]] = True
    return test


def load_image_folder(data_dir: str | Path, image_size: int | None = None,
                      warn: Callable[[str], None] = _warn) -> Dataset:
    """The user's own labelled images: ``DIR/<class>/*.png|jpg`` or
    ``DIR/train/<class>/...`` and ``DIR/test/<class>/...``.

    Class names are the sub-folder names, sorted; labels are their indices. Without
    ``test/`` a fixed-seed FOLDER_TEST_FRACTION of each class is the test set. Every
    image is resized to ``image_size`` x ``image_size`` (default: the images' own
    size when they all have the same, else DEFAULT_IMAGE_SIZE) and read as RGB if
    any image has colour, else as grey (C = 3 or 1). Files that cannot be read are
    skipped and reported in one ``warn`` line. Returns float32 images normalised per
    channel with the training set's statistics, in a fixed-seed shuffled order.
    """
    root = Path(data_dir)
    if not root.is_dir():
        raise DatasetError(f"--data-dir {root}: not a folder (expected one sub-folder of "
                           "PNG or JPEG images per class)")
    if image_size is not None and not 1 <= image_size <= MAX_IMAGE_SIZE:
        raise DatasetError(f"--image-size {image_size}: expected 1 to {MAX_IMAGE_SIZE}")
    train_dir, test_dir = root / "train", root / "test"
    split = train_dir.is_dir()
    if not split and test_dir.is_dir():
        raise DatasetError(f"{root} has test/ but no train/: put the training images in "
                           f"{train_dir}/<class>/")
    base = train_dir if split else root
    class_names = [p.name for p in _class_folders(base)]
    if len(class_names) < 2:
        found = f" ({class_names[0]})" if class_names else ""
        raise DatasetError(f"{base}: found {len(class_names)} class folder(s){found}; need "
                           "at least 2: one sub-folder of PNG or JPEG images per class")
    files = _labelled_files(base, class_names)
    test_files: list[tuple[Path, int]] = []
    held_out = not (split and test_dir.is_dir())  # no test/: split the images
    if not held_out:
        unknown = [p.name for p in _class_folders(test_dir) if p.name not in class_names]
        if unknown:
            raise DatasetError(f"{test_dir}: class folder(s) {', '.join(unknown)} not in "
                               f"{train_dir}")
        test_files = _labelled_files(test_dir, class_names)

    skipped: list[Path] = []
    sizes: dict[Path, tuple[int, int]] = {}
    if image_size is None:
        for path, _ in files + test_files:
            try:
                sizes[path] = _image_size(path)
            except Exception:  # any decoder error: the file is skipped, never a traceback
                skipped.append(path)
    common = set(sizes.values())
    size = ((image_size, image_size) if image_size is not None
            else common.pop() if len(common) == 1 else (DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE))

    def read(listed: list[tuple[Path, int]]) -> tuple[list[np.ndarray], list[int], bool]:
        pixels, labels, colour = [], [], False
        for path, label in listed:
            if image_size is None and path not in sizes:
                continue
            try:
                image, has_colour = decode_image(path, size)
            except Exception:  # any decoder error: the file is skipped, never a traceback
                skipped.append(path)
                continue
            pixels.append(image)
            labels.append(label)
            colour = colour or has_colour
        return pixels, labels, colour

    train_pixels, train_labels, train_colour = read(files)
    test_pixels, test_labels, test_colour = read(test_files)
    if skipped:
        names = [str(p.relative_to(root)) for p in skipped]
        more = len(names) - SKIPPED_NAMES_SHOWN
        warn(f"skipped {len(names)} unreadable image file(s) in {root}: "
             f"{', '.join(names[:SKIPPED_NAMES_SHOWN])}" + (f" and {more} more" if more > 0
                                                            else ""))
    if not train_pixels:
        raise DatasetError(f"{base}: no readable PNG or JPEG image in its class folders "
                           f"({', '.join(class_names)})")
    present = set(train_labels)
    empty = [name for label, name in enumerate(class_names) if label not in present]
    if empty:
        raise DatasetError(f"{base}: no readable training image in class folder(s) "
                           f"{', '.join(empty)}")
    channels = 3 if train_colour or test_colour else 1

    def stack(pixels: list[np.ndarray]) -> np.ndarray:
        """uint8 (N, C, H, W) from (H, W, 3) images."""
        if not pixels:
            return np.zeros((0, channels, size[1], size[0]), dtype=np.uint8)
        return np.stack(pixels).transpose(0, 3, 1, 2)[:, :channels].copy()

    images, labels = stack(train_pixels), np.array(train_labels, dtype=np.int64)
    if not held_out:
        test_u8, test_y = stack(test_pixels), np.array(test_labels, dtype=np.int64)
        train_u8, train_y = images, labels
    else:
        test = _held_out(labels, len(class_names))
        if not test.any():
            raise DatasetError(f"{root}: {len(labels)} image(s) are too few to hold out a "
                               "test set; add more images or a test/ folder")
        train_u8, train_y = images[~test], labels[~test]
        test_u8, test_y = images[test], labels[test]
    if len(test_u8) == 0:
        raise DatasetError(f"{test_dir}: no readable PNG or JPEG image in its class folders")
    train_order = np.random.default_rng([FOLDER_SPLIT_SEED, 1]).permutation(len(train_y))
    test_order = np.random.default_rng([FOLDER_SPLIT_SEED, 2]).permutation(len(test_y))
    return _dataset_from_uint8("folder", train_u8[train_order], train_y[train_order],
                               test_u8[test_order], test_y[test_order], tuple(class_names))


# --------------------------------------------------------------------- synthetic


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
        train_images=_normalize(train_raw, mean, std), train_labels=train_labels,
        test_images=_normalize(test_raw, mean, std), test_labels=test_labels,
        name="synthetic", classes=classes,
        mean=tuple(float(m) for m in mean), std=tuple(float(s) for s in std),
        class_names=tuple(f"class {index}" for index in range(classes)),
    )


# ----------------------------------------------------------------- entry points


def load_dataset(name: str, data_dir: str | Path | None = None,
                 limit: int | None = None, image_size: int | None = None,
                 warn: Callable[[str], None] = _warn) -> Dataset:
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
