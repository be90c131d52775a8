"""A trained network measured on a labelled set (:class:`Evaluation`: accuracy, loss,
per-class accuracy, the confusion matrix) and its reports: the terminal lines and a
self-contained HTML page with the confusion matrix as a PNG heat map
(``RUN_DIR/evaluation.html``).
"""
from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetconv.errors import UserError
from hetconv.inference.classifier import DEFAULT_BATCH, Classifier
from hetconv.ops.loss import softmax_cross_entropy

EVALUATION_FILE = "evaluation.html"


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
