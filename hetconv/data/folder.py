"""The user's own labelled images (``--data folder``): PNG or JPEG files in one
sub-folder per class (or under ``train/`` and ``test/``), read with Pillow
(:func:`load_image_folder`, :func:`decode_image`, which ``hetconv predict`` uses too),
resized to one size, held out as a fixed-seed test split where there is no ``test/``.
An unreadable file is skipped and counted in one warning line.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hetconv.data.dataset import Dataset, DatasetError, dataset_from_uint8

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


def warn_to_stderr(message: str) -> None:
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
                      warn: Callable[[str], None] = warn_to_stderr) -> Dataset:
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
    return dataset_from_uint8("folder", train_u8[train_order], train_y[train_order],
                               test_u8[test_order], test_y[test_order], tuple(class_names))
