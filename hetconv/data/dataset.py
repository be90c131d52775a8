"""The :class:`Dataset` every loader returns, the :class:`DatasetError` a missing or
damaged one raises, and how a dataset is built from uint8 pixels: images normalised per
channel with the *training* set's exact mean and standard deviation (pixels scaled to
[0, 1]), labels checked against the number of classes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetconv.errors import UserError


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


def check_labels(labels: np.ndarray, classes: int, path: Path) -> None:
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


def normalize_channels(images: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """float32 (images - mean) / std per channel, without float64 temporaries."""
    safe_std = np.where(std > 0, std, 1.0)
    out = np.empty(images.shape, dtype=np.float32)
    np.subtract(images, mean.astype(np.float32).reshape(1, -1, 1, 1), out=out, dtype=np.float32)
    out *= (1.0 / safe_std).astype(np.float32).reshape(1, -1, 1, 1)
    return out


def dataset_from_uint8(name: str, train_u8: np.ndarray, train_labels: np.ndarray,
                        test_u8: np.ndarray, test_labels: np.ndarray,
                        class_names: tuple[str, ...]) -> Dataset:
    mean, std = _uint8_channel_stats(train_u8)
    return Dataset(
        train_images=normalize_channels(train_u8, mean, std),
        train_labels=train_labels.astype(np.int64),
        test_images=normalize_channels(test_u8, mean, std),
        test_labels=test_labels.astype(np.int64),
        name=name, classes=len(class_names),
        mean=tuple(float(m) for m in mean / 255.0), std=tuple(float(s) for s in std / 255.0),
        class_names=class_names,
    )
