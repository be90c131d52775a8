"""Use a trained run: load it, classify images, measure it on its test set.

A run directory (``hetconv train --run-dir RUN``) holds ``config.json`` (the data,
the network spec, the input shape, the classes) and ``weights.npz`` (every array in
the local-run layout, :mod:`hetconv.names`). :func:`load_run` rebuilds the
:class:`~hetconv.model.ModelConfig` from the config and checks every array's shape
against it; :class:`Classifier` runs the network in eval mode through a
:class:`~hetconv.engine.stage.LocalConvStage` (the training code's own conv blocks, batch
norm on its running statistics) and the dense layers with the training code's ops
(dropout is the identity in eval mode), so its outputs are the training code's.

Images from files (:func:`read_image`) are converted the way ``--data folder`` reads
its images (RGB, bilinear resize to the run's size, grey from the red channel when
the image has no colour, luminance when a grey run gets a colour image) and
normalised with the training set's per-channel statistics (:class:`Preprocessing`).
Every bad input is a one-line :class:`~hetconv.errors.UserError`.
The run directory is loaded in :mod:`hetconv.inference.trained_run`, the network runs in
:mod:`hetconv.inference.classifier`, a labelled set is measured in :mod:`hetconv.inference.evaluation`;
this module reads and normalises image files, picks the top classes, and re-exports
the names callers use.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetconv.data.loading import decode_image
from hetconv.errors import UserError
from hetconv.inference.classifier import DEFAULT_BATCH, Classifier, softmax
from hetconv.inference.evaluation import (
    EVALUATION_FILE,
    Evaluation,
    confusion_matrix,
    confusion_png,
    evaluate_classifier,
    evaluate_probabilities,
    evaluation_html,
    evaluation_lines,
)
from hetconv.inference.trained_run import (
    CONFIG_FILE,
    PREPROCESSING_FILE,
    WEIGHTS_FILE,
    Preprocessing,
    TrainedRun,
    check_parameters,
    class_names_of,
    expected_shapes,
    load_run,
    load_run_data,
    preprocessing_of,
    read_run_config,
    run_model_config,
    run_preprocessing,
)

__all__ = [
    "CONFIG_FILE", "DEFAULT_BATCH", "EVALUATION_FILE", "PREPROCESSING_FILE", "WEIGHTS_FILE",
    "Classifier", "Evaluation", "Prediction", "Preprocessing", "TrainedRun",
    "check_parameters", "class_names_of", "confusion_matrix", "confusion_png",
    "evaluate_classifier", "evaluate_probabilities", "evaluation_html", "evaluation_lines",
    "expected_shapes", "load_run", "load_run_data", "normalize", "preprocessing_of",
    "read_image", "read_run_config", "run_model_config", "run_preprocessing", "softmax",
    "top_classes"]


def read_image(path: str | Path, shape: tuple[int, int, int]) -> np.ndarray:
    """uint8 (C, H, W) pixels of an image file for a network taking ``shape`` (C, H, W).

    Read as ``--data folder`` reads its images: Pillow, 16-bit grey scaled to 8 bits,
    alpha dropped, RGB, bilinear resize to W x H. C = 1 takes the red channel of a
    grey image (as training did) and Pillow's luminance ("L") of a colour one; C = 3
    keeps RGB. UserError with one line when the file cannot be read as an image.
    """
    from PIL import Image

    channels, height, width = shape
    if channels not in (1, 3):
        raise UserError(f"the network takes {channels}-channel images; only 1 (grey) and 3 "
                        "(RGB) can be read from image files")
    size = (width, height)
    try:
        pixels, colour = decode_image(Path(path), size)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except Exception as error:  # any decoder error: one line, never a traceback
        raise UserError(f"{path}: cannot read it as an image ({type(error).__name__}: "
                        f"{error})") from None
    if channels == 3:
        return pixels.transpose(2, 0, 1).copy()
    grey = (np.asarray(Image.fromarray(pixels).convert("L"), dtype=np.uint8) if colour
            else pixels[..., 0])
    return grey[None].copy()


def normalize(pixels: np.ndarray, preprocessing: Preprocessing) -> np.ndarray:
    """uint8 (N, C, H, W) -> float32 (N, C, H, W), normalised as training normalised
    its data: ``(p - 255 mean) * (1 / (255 std))`` per channel (std 0 counts as 1)."""
    mean = np.asarray(preprocessing.mean, np.float64) * 255.0
    std = np.asarray(preprocessing.std, np.float64) * 255.0
    if pixels.ndim != 4 or pixels.shape[1] != len(mean):
        raise ValueError(f"pixels {pixels.shape} do not fit {len(mean)} channels")
    safe = np.where(std > 0, std, 1.0)
    out = np.empty(pixels.shape, dtype=np.float32)
    np.subtract(pixels, mean.astype(np.float32).reshape(1, -1, 1, 1), out=out,
                dtype=np.float32)
    out *= (1.0 / safe).astype(np.float32).reshape(1, -1, 1, 1)
    return out


@dataclass(frozen=True)
class Prediction:
    """The top classes of one image: (class index, class name, probability), best first."""

    source: str
    top: tuple[tuple[int, str, float], ...]


def top_classes(probabilities: np.ndarray, class_names: Sequence[str], sources: Sequence[str],
                k: int) -> list[Prediction]:
    """The ``k`` most probable classes of every row of (N, classes) probabilities
    (ties: the lower class index first)."""
    out = []
    for source, row in zip(sources, probabilities):
        order = np.argsort(-row, kind="stable")[:max(1, k)]
        out.append(Prediction(source, tuple((int(i), class_names[int(i)], float(row[i]))
                                            for i in order)))
    return out
