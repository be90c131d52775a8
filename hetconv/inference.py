"""Use a trained run: load it, classify images, measure it on its test set.

A run directory (``hetconv train --run-dir RUN``) holds ``config.json`` (the data,
the network spec, the input shape, the classes) and ``weights.npz`` (every array in
the local-run layout, :mod:`hetconv.names`). :func:`load_run` rebuilds the
:class:`~hetconv.model.ModelConfig` from the config and checks every array's shape
against it; :class:`Classifier` runs the network in eval mode through a
:class:`~hetconv.stage.LocalConvStage` (the training code's own conv blocks, batch
norm on its running statistics) and the dense layers with the training code's ops
(dropout is the identity in eval mode), so its outputs are the training code's.

Images from files (:func:`read_image`) are converted the way ``--data folder`` reads
its images (RGB, bilinear resize to the run's size, grey from the red channel when
the image has no colour, luminance when a grey run gets a colour image) and
normalised with the training set's per-channel statistics (:class:`Preprocessing`).
Every bad input is a one-line :class:`~hetconv.errors.UserError`.
"""
from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hetconv.checkpoint import save_json
from hetconv.data import Dataset, DatasetError, decode_image, load_dataset
from hetconv.errors import UserError
from hetconv.model import (
    ModelConfig,
    conv_layer_shapes,
    dense_parameter_names,
    dense_shapes,
    model_config,
    parse_network,
)
from hetconv.names import DENSE_BIAS, DENSE_WEIGHT, PARAMETER_NAMES, hidden_prefix, layer_key
from hetconv.ops.activation import relu
from hetconv.ops.linear import linear
from hetconv.ops.loss import softmax_cross_entropy
from hetconv.stage import LocalConvStage, layer_settings

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.npz"
PREPROCESSING_FILE = "preprocessing.json"
"""Written beside the weights the first time a run is used: the training set's
per-channel mean/std and the class names, so that later uses need not read the data."""
EVALUATION_FILE = "evaluation.html"
DEFAULT_BATCH = 500


@dataclass(frozen=True)
class Preprocessing:
    """How training normalised its images, and what the outputs mean.

    A pixel ``p`` (0..255) of channel ``c`` becomes ``(p / 255 - mean[c]) / std[c]``
    as float32 (a std of 0 counts as 1). ``mean``/``std`` are in [0, 1] pixel units
    (the raw units of the synthetic set); ``class_names[i]`` names output ``i``.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: tuple[str, ...]

    def record(self) -> dict[str, Any]:
        return {"mean": list(self.mean), "std": list(self.std),
                "class_names": list(self.class_names)}


@dataclass(frozen=True)
class TrainedRun:
    """A run directory's network and weights, checked against each other.

    params: every array of weights.npz (float32), by ``hetconv.names`` key.
    network: the canonical spec text (``32:64`` or ``c32k3p1,pool,...``).
    """

    run_dir: Path
    config: dict[str, Any]
    model: ModelConfig
    params: dict[str, np.ndarray]
    network: str

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one input image."""
        return self.model.input_shape

    @property
    def classes(self) -> int:
        return self.model.classes


# --- loading ---------------------------------------------------------------------------
def read_run_config(run_dir: Path, flag: str = "") -> dict[str, Any]:
    """A run directory's ``config.json``; UserError with one line (led by ``flag``,
    e.g. ``--resume``) when it is missing, unreadable or not a run's."""
    path = run_dir / CONFIG_FILE
    lead = f"{flag} " if flag else ""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{lead}{run_dir}: no {CONFIG_FILE}; is it a run directory of "
                        "'hetconv train'?") from None
    except (OSError, ValueError) as error:
        raise UserError(f"{lead}{path}: unreadable ({error})") from None
    if not isinstance(config, dict):
        raise UserError(f"{lead}{path}: not a run's configuration")
    return config


def run_model_config(config: dict[str, Any], where: str = CONFIG_FILE) -> tuple[ModelConfig, str]:
    """(ModelConfig, canonical spec text) of a run's ``config.json`` record."""
    try:
        shape = tuple(int(v) for v in config["input_shape"])
        classes = int(config["classes"])
        kernel_size = int(config.get("kernel_size", 5))
        padding = int(config.get("padding", 0))
        arch = config.get("arch")
        text = config.get("network") or (":".join(str(k) for k in arch)
                                         if isinstance(arch, list) else str(arch))
    except (KeyError, TypeError, ValueError) as error:
        raise UserError(f"{where}: missing or bad network field ({error}); is it a run's "
                        "configuration?") from None
    if len(shape) != 3 or min(shape) < 1 or classes < 1:
        raise UserError(f"{where}: bad input_shape {list(shape)} or classes {classes}")
    spec = parse_network(text, kernel_size, padding, where=f"{where} network")
    input_shape = (shape[0], shape[1], shape[2])
    return model_config(spec, input_shape, classes, kernel_size, padding), spec.text


def expected_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every array a run's ``weights.npz`` must hold, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in conv_layer_shapes(model):
        k = layer.kernel_size
        shapes[layer_key(layer.index, "weight")] = (layer.kernels, layer.in_channels, k, k)
        for name in PARAMETER_NAMES[1:]:
            shapes[layer_key(layer.index, name)] = (layer.kernels,)
    for prefix, features, units in dense_shapes(model):
        shapes[f"{prefix}.weight"] = (units, features)
        shapes[f"{prefix}.bias"] = (units,)
    return shapes


def check_parameters(model: ModelConfig, params: dict[str, np.ndarray], where: str) -> None:
    """UserError naming the first array that is missing, misshapen or not finite."""
    for name, shape in expected_shapes(model).items():
        if name not in params:
            raise UserError(f"{where}: no array {name!r}; the weights do not belong to "
                            "this run's network")
        if tuple(params[name].shape) != shape:
            raise UserError(f"{where}: {name} has shape {tuple(params[name].shape)}, the "
                            f"network needs {shape}")
        if not np.isfinite(params[name]).all():
            raise UserError(f"{where}: {name} holds NaN or infinite values")


def load_run(run_dir: str | Path) -> TrainedRun:
    """The network and weights of a run directory; UserError with one line when the
    directory, its config.json or its weights.npz is missing or does not fit."""
    path = Path(run_dir)
    if not path.is_dir():
        raise UserError(f"{path}: no such run directory")
    config = read_run_config(path)
    model, text = run_model_config(config, str(path / CONFIG_FILE))
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise UserError(f"{path}: no {WEIGHTS_FILE} (the run ends an epoch before it "
                        "writes one); train it to the end of an epoch first")
    try:
        with open(weights, "rb") as handle, np.load(handle, allow_pickle=False) as data:
            params = {k: np.asarray(data[k], dtype=np.float32) for k in data.files}
    except Exception as error:  # zip/npy errors of a damaged file: one line, no traceback
        raise UserError(f"{weights}: unreadable ({type(error).__name__}: {error})") from None
    check_parameters(model, params, str(weights))
    return TrainedRun(path, config, model, params, text)


def load_run_data(run: TrainedRun, test_limit: int | None = None,
                  load: Callable[..., Dataset] = load_dataset) -> Dataset:
    """The run's dataset, loaded exactly as training loaded it (same data, directory,
    limit, image size: the same normalisation); the test set cut to ``test_limit``
    (default: the run's ``--test-limit``). Checks that its shape fits the network."""
    config = run.config
    try:
        data = load(str(config.get("data")), config.get("data_dir"),
                    limit=config.get("limit"), image_size=config.get("image_size"))
    except DatasetError as error:
        raise UserError(f"{run.run_dir}: cannot load the run's data: {error}") from None
    limit = test_limit if test_limit is not None else config.get("test_limit")
    if limit:
        data.test_images = data.test_images[:limit]
        data.test_labels = data.test_labels[:limit]
    if data.image_shape != run.input_shape or data.classes != run.classes:
        raise UserError(f"{run.run_dir}: the data now has {data.classes} classes of "
                        f"{'x'.join(map(str, data.image_shape))} images; the run was trained "
                        f"on {run.classes} of {'x'.join(map(str, run.input_shape))}")
    return data


def class_names_of(data: Dataset) -> tuple[str, ...]:
    """The dataset's class names (``class i`` where it has none)."""
    names = tuple(getattr(data, "class_names", ()) or ())
    if len(names) != data.classes:
        names = tuple(f"class {index}" for index in range(data.classes))
    return names


def preprocessing_of(data: Dataset) -> Preprocessing:
    return Preprocessing(tuple(float(m) for m in data.mean), tuple(float(s) for s in data.std),
                         class_names_of(data))


def _parse_preprocessing(record: Any, run: TrainedRun) -> Preprocessing | None:
    """A :class:`Preprocessing` from a record that fits the run, else None."""
    if not isinstance(record, dict):
        return None
    try:
        mean = tuple(float(v) for v in record["mean"])
        std = tuple(float(v) for v in record["std"])
        names = tuple(str(v) for v in record["class_names"])
    except (KeyError, TypeError, ValueError):
        return None
    channels = run.input_shape[0]
    if len(mean) != channels or len(std) != channels or len(names) != run.classes:
        return None
    return Preprocessing(mean, std, names)


def run_preprocessing(run: TrainedRun, data: Dataset | None = None,
                      load: Callable[..., Dataset] = load_dataset) -> Preprocessing:
    """The run's normalisation and class names: from ``config.json`` when it records
    them, else from ``preprocessing.json`` beside the weights, else from the data
    (``data``, or the run's dataset loaded as training loaded it), then kept in
    ``preprocessing.json`` (when the directory is writable) for the next use."""
    for record in (run.config, _read_json(run.run_dir / PREPROCESSING_FILE)):
        found = _parse_preprocessing(record, run)
        if found is not None:
            return found
    found = preprocessing_of(data if data is not None else load_run_data(run, load=load))
    try:
        save_json(run.run_dir / PREPROCESSING_FILE, {"data": run.config.get("data"),
                                                     **found.record()})
    except OSError:
        pass  # a read-only run directory: the data is read again next time
    return found


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


# --- the forward pass --------------------------------------------------------------------
def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax of (B, O) logits (max subtracted first), same dtype."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp: np.ndarray = np.exp(shifted)
    exp /= exp.sum(axis=1, keepdims=True)
    return exp


class Classifier:
    """A trained network in eval mode: images (B, C, H, W) float32, normalised ->
    logits or probabilities (B, classes). The conv layers run in a LocalConvStage
    (the training code's blocks); the dense layers use the training code's ops."""

    def __init__(self, model: ModelConfig, params: dict[str, np.ndarray], device: str = "cpu"):
        self.model = model
        self.stage = LocalConvStage(model, params, layer_settings(model, 0.0, 0.0), device)
        self.layers = len(conv_layer_shapes(model))
        self.dense = {name: np.asarray(params[name], np.float32)
                      for name in dense_parameter_names(model)}

    def logits(self, images: np.ndarray) -> np.ndarray:
        """(B, C, H, W) -> (B, classes) float32 logits of one batch."""
        x = np.ascontiguousarray(images, dtype=np.float32)
        for layer in range(self.layers):
            x = self.stage.forward(layer, x, False, -1)
        h = x.reshape(x.shape[0], -1)
        hidden = 0
        for spec in self.model.dense:  # dropout: the identity in eval mode
            if spec.kind == "fc":
                prefix = hidden_prefix(hidden)
                hidden += 1
                h = relu(linear(h, self.dense[f"{prefix}.weight"], self.dense[f"{prefix}.bias"]))
        out: np.ndarray = linear(h, self.dense[DENSE_WEIGHT], self.dense[DENSE_BIAS])
        return out

    def probabilities(self, images: np.ndarray, batch: int = DEFAULT_BATCH) -> np.ndarray:
        """(N, C, H, W) -> (N, classes) softmax probabilities, ``batch`` images at a time."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        parts = [softmax(self.logits(images[begin:begin + batch]))
                 for begin in range(0, len(images), batch)]
        if not parts:
            return np.zeros((0, self.model.classes), np.float32)
        return np.concatenate(parts)

    def close(self) -> None:
        self.stage.close()


# --- evaluation ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Evaluation:
    """Results on a labelled set.

    confusion: int64 (classes, classes), row = true class, column = predicted class.
    per_class: accuracy of each true class (NaN for a class with no image).
    loss: mean softmax cross-entropy (the training code's).
    """

    images: int
    accuracy: float
    loss: float
    per_class: tuple[float, ...]
    confusion: np.ndarray
    class_names: tuple[str, ...]


def confusion_matrix(labels: np.ndarray, predicted: np.ndarray, classes: int) -> np.ndarray:
    """int64 (classes, classes): counts of (true, predicted) pairs."""
    matrix = np.zeros((classes, classes), dtype=np.int64)
    np.add.at(matrix, (labels.astype(np.int64), predicted.astype(np.int64)), 1)
    return matrix


def evaluate_probabilities(probabilities: np.ndarray, labels: np.ndarray,
                           class_names: Sequence[str]) -> Evaluation:
    """An :class:`Evaluation` from (N, classes) probabilities and (N,) true labels."""
    classes = len(class_names)
    if probabilities.ndim != 2 or probabilities.shape != (len(labels), classes):
        raise ValueError(f"probabilities {probabilities.shape} do not fit {len(labels)} "
                         f"labels of {classes} classes")
    if len(labels) == 0:
        raise UserError("the test set is empty: nothing to evaluate")
    predicted = probabilities.argmax(axis=1)
    matrix = confusion_matrix(labels, predicted, classes)
    totals = matrix.sum(axis=1)
    per_class = tuple(float(matrix[i, i] / totals[i]) if totals[i] else float("nan")
                      for i in range(classes))
    rows = np.arange(len(labels))
    loss = -float(np.log(np.maximum(probabilities[rows, labels], np.finfo(np.float32).tiny),
                         dtype=np.float64).mean())
    return Evaluation(len(labels), float(np.trace(matrix) / len(labels)), loss, per_class,
                      matrix, tuple(class_names))


def evaluate_classifier(classifier: Classifier, images: np.ndarray, labels: np.ndarray,
                        class_names: Sequence[str], batch: int = DEFAULT_BATCH) -> Evaluation:
    """Run ``classifier`` over a labelled set; the loss is the training code's
    :func:`~hetconv.ops.loss.softmax_cross_entropy`, batch by batch."""
    parts, loss_sum = [], 0.0
    for begin in range(0, len(images), batch):
        logits = classifier.logits(images[begin:begin + batch])
        y = labels[begin:begin + batch]
        loss, probs = softmax_cross_entropy(logits, y)
        loss_sum += loss * len(y)
        parts.append(probs)
    if not parts:
        raise UserError("the test set is empty: nothing to evaluate")
    result = evaluate_probabilities(np.concatenate(parts), labels, class_names)
    return Evaluation(result.images, result.accuracy, loss_sum / len(labels), result.per_class,
                      result.confusion, result.class_names)


def evaluation_lines(result: Evaluation) -> list[str]:
    """The terminal report: accuracy, per-class accuracy, the confusion matrix."""
    names = result.class_names
    lines = [f"test accuracy {result.accuracy:.4f} ({int(np.trace(result.confusion))} of "
             f"{result.images} images), loss {result.loss:.4f}", "", "per-class accuracy:"]
    width = max(len(n) for n in names)
    totals = result.confusion.sum(axis=1)
    for index, name in enumerate(names):
        accuracy = result.per_class[index]
        shown = "   n/a" if np.isnan(accuracy) else f"{accuracy:.4f}"
        lines.append(f"  {index:>2} {name:<{width}}  {shown}  ({int(totals[index])} images)")
    lines += ["", "confusion matrix (rows: true class, columns: predicted class):"]
    cell = max(len(str(int(result.confusion.max()))), 2) + 1
    lines.append("    " + "".join(f"{j:>{cell}}" for j in range(len(names))))
    for index, row in enumerate(result.confusion):
        lines.append(f"  {index:>2}" + "".join(f"{int(v):>{cell}}" for v in row)
                     + f"  {names[index]}")
    return lines


def confusion_png(result: Evaluation) -> bytes:
    """The confusion matrix as a PNG heat map (counts in the cells)."""
    from matplotlib.figure import Figure  # only when a page is written

    classes = len(result.class_names)
    side = min(max(4.0, 0.6 * classes + 2.5), 16.0)
    figure = Figure(figsize=(side + 1.5, side), layout="constrained")
    axes = figure.add_subplot()
    matrix = result.confusion
    totals = np.maximum(matrix.sum(axis=1, keepdims=True), 1)
    image = axes.imshow(matrix / totals, cmap="Blues", vmin=0.0, vmax=1.0)
    figure.colorbar(image, ax=axes, label="share of the true class")
    ticks = list(range(classes))
    axes.set_xticks(ticks, labels=list(result.class_names), rotation=45, ha="right")
    axes.set_yticks(ticks, labels=list(result.class_names))
    axes.set_xlabel("predicted class")
    axes.set_ylabel("true class")
    if classes <= 30:
        for i in range(classes):
            for j in range(classes):
                share = matrix[i, j] / totals[i, 0]
                axes.text(j, i, str(int(matrix[i, j])), ha="center", va="center", fontsize=8,
                          color="white" if share > 0.5 else "black")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def evaluation_html(result: Evaluation, title: str) -> str:
    """A self-contained page: accuracy, per-class table, the confusion matrix plot."""
    esc = html.escape
    rows = "\n".join(
        f"<tr><td>{i}</td><td>{esc(name)}</td><td>{int(result.confusion[i].sum())}</td>"
        f"<td>{'n/a' if np.isnan(acc) else f'{acc:.4f}'}</td></tr>"
        for i, (name, acc) in enumerate(zip(result.class_names, result.per_class)))
    picture = base64.b64encode(confusion_png(result)).decode("ascii")
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{esc(title)}</title>\n<style>body{{font:15px/1.45 system-ui,sans-serif;"
            "max-width:1040px;margin:1em auto;padding:0 1.5em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ddd;padding:0.2em 0.6em;text-align:right}"
            "img{max-width:100%}</style>\n</head>\n<body>\n"
            f"<h1>{esc(title)}</h1>\n<p>Test accuracy <b>{result.accuracy:.4f}</b> "
            f"({int(np.trace(result.confusion))} of {result.images} images), mean loss "
            f"{result.loss:.4f}.</p>\n<h2>Per-class accuracy</h2>\n<table>\n<tr><th>#</th>"
            f"<th>class</th><th>images</th><th>accuracy</th></tr>\n{rows}\n</table>\n"
            "<h2>Confusion matrix</h2>\n<p>Rows: true class; columns: predicted class; "
            "cells: image counts, coloured by the share of the true class.</p>\n"
            f"<img src=\"data:image/png;base64,{picture}\" alt=\"confusion matrix\">\n"
            "</body>\n</html>\n")


# --- images from files ----------------------------------------------------------------------
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
