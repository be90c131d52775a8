"""``hetconv evaluate RUN_DIR``: the trained network on its test set.

Loads the run's weights and its dataset exactly as training loaded it, runs the test
set through the training code's eval-mode forward pass (:mod:`hetconv.inference.use`),
prints the test accuracy, the per-class accuracy and the confusion matrix, and
writes them with a plot of the matrix to ``RUN_DIR/evaluation.html``.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetconv.commands.options import positive_int
from hetconv.engine.checkpoint import save_text
from hetconv.inference.use import (
    DEFAULT_BATCH,
    EVALUATION_FILE,
    Classifier,
    class_names_of,
    evaluate_classifier,
    evaluation_html,
    evaluation_lines,
    load_run,
    load_run_data,
    run_preprocessing,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("evaluate", help="test accuracy, per-class accuracy and the confusion "
                       "matrix of a trained run (also RUN_DIR/evaluation.html)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of 'hetconv train'")
    p.add_argument("--test-limit", type=positive_int, default=None, metavar="N",
                   help="the first N test images (default: the run's own --test-limit, "
                   "else the whole test set)")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="images per forward pass (default: the run's --eval-batch, so the "
                   "accuracy is the one training recorded)")
    p.add_argument("--device", default="cpu", help="cpu or gpu:N (default cpu)")
    p.add_argument("--no-html", action="store_true", help=f"do not write {EVALUATION_FILE}")


def run_evaluate(run_dir: str, test_limit: int | None = None, batch: int | None = None,
                 device: str = "cpu", html: bool = True,
                 out: Callable[[str], None] = print) -> int:
    run = load_run(run_dir)
    if batch is None:
        saved = run.config.get("eval_batch")
        batch = saved if isinstance(saved, int) and saved > 0 else DEFAULT_BATCH
    data = load_run_data(run, test_limit)
    run_preprocessing(run, data)  # keep the normalisation for predict and export
    classifier = Classifier(run.model, run.params, device)
    try:
        result = evaluate_classifier(classifier, data.test_images, data.test_labels,
                                     class_names_of(data), batch)
    finally:
        classifier.close()
    out(f"run {run.run_dir}: {data.name}, network {run.network}, "
        f"{len(data.test_images)} test images")
    for line in evaluation_lines(result):
        out(line)
    if html:
        path = Path(run.run_dir) / EVALUATION_FILE
        save_text(path, evaluation_html(result, f"hetconv evaluate: {run.run_dir.name}"))
        out(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    return run_evaluate(args.run_dir, args.test_limit, args.batch, args.device,
                        not args.no_html)
