"""``hetconv predict RUN_DIR IMAGE...``: the most probable classes of image files.

Each image is read with Pillow, converted to the run's channels and size and
normalised as training normalised its data (:func:`hetconv.inference.use.read_image`,
:func:`hetconv.inference.use.normalize`); the network runs in eval mode. Prints one block
per image (``--json`` for one JSON document). Every image is read before any is
classified, so an unreadable one stops the command with one line naming it.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hetconv.commands.options import positive_int
from hetconv.inference.use import (
    DEFAULT_BATCH,
    Classifier,
    Prediction,
    load_run,
    normalize,
    read_image,
    run_preprocessing,
    top_classes,
)

DEFAULT_TOP = 3


def add_parser(sub: Any) -> None:
    p = sub.add_parser("predict", help="the top classes of image files (PNG, JPEG, ...) with "
                       "their probabilities, from a trained run")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of 'hetconv train'")
    p.add_argument("images", metavar="IMAGE", nargs="+", help="image files")
    p.add_argument("--top", type=positive_int, default=DEFAULT_TOP, metavar="K",
                   help=f"how many classes to show per image (default {DEFAULT_TOP})")
    p.add_argument("--json", action="store_true", help="one JSON document instead of text")
    p.add_argument("--device", default="cpu", help="cpu or gpu:N (default cpu)")


def prediction_lines(predictions: list[Prediction]) -> list[str]:
    lines = []
    for prediction in predictions:
        lines.append(f"{prediction.source}:")
        lines += [f"  {probability:.4f}  {index:>3}  {name}"
                  for index, name, probability in prediction.top]
    return lines


def prediction_json(predictions: list[Prediction]) -> str:
    return json.dumps([{"image": p.source, "top": [
        {"class": index, "name": name, "probability": probability}
        for index, name, probability in p.top]} for p in predictions], indent=2)


def predictions(run_dir: str | Path, images: list[str], top: int = DEFAULT_TOP,
                device: str = "cpu") -> list[Prediction]:
    """The ``top`` classes of each image file, as ``hetconv predict`` prints them."""
    run = load_run(run_dir)
    pixels = np.stack([read_image(path, run.input_shape) for path in images])
    preprocessing = run_preprocessing(run)
    classifier = Classifier(run.model, run.params, device)
    try:
        probabilities = classifier.probabilities(normalize(pixels, preprocessing),
                                                 DEFAULT_BATCH)
    finally:
        classifier.close()
    return top_classes(probabilities, preprocessing.class_names, images, min(top, run.classes))


def run_predict(run_dir: str, images: list[str], top: int = DEFAULT_TOP,
                json_output: bool = False, device: str = "cpu",
                out: Callable[[str], None] = print) -> int:
    found = predictions(run_dir, images, top, device)
    if json_output:
        out(prediction_json(found))
    else:
        for line in prediction_lines(found):
            out(line)
    return 0


def run(args: argparse.Namespace) -> int:
    return run_predict(args.run_dir, args.images, args.top, args.json, args.device)
