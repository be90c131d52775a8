"""The training loop: conv layers through a :class:`ConvStage`, dense part here.

One step: the conv stage runs every block forward; the master flattens the last
block output, runs the fully connected layer and the softmax loss, back-propagates
through them, updates the dense parameters with SGD, and hands the gradient back
to the conv stage block by block (which updates its own shards). After every epoch
the model is evaluated on the test set and the weights are written atomically.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from hetconv.checkpoint import save_weights
from hetconv.data import Dataset, iterate_batches
from hetconv.metrics import MetricsWriter
from hetconv.model import ModelConfig, conv_layer_shapes
from hetconv.ops.linear import linear, linear_backward
from hetconv.ops.loss import softmax_cross_entropy, softmax_cross_entropy_backward
from hetconv.optim import OptimizerConfig, learning_rate_at, sgd_update
from hetconv.stage import ConvStage, split_snapshot


@dataclass(frozen=True)
class LoopConfig:
    """How long and how to train (the model itself is a :class:`ModelConfig`)."""

    epochs: int = 3
    batch: int = 128
    eval_batch: int = 1000
    seed: int = 0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    progress: bool = True


@dataclass
class TrainResult:
    epochs: list[dict[str, Any]]
    losses: list[float]

    @property
    def test_accuracy(self) -> float:
        return float(self.epochs[-1]["test_accuracy"]) if self.epochs else float("nan")


class Trainer:
    """Owns the dense layer and its optimizer state; drives the conv stage."""

    def __init__(self, model: ModelConfig, params: dict[str, np.ndarray], stage: ConvStage,
                 loop: LoopConfig, metrics: MetricsWriter, run_dir: Path,
                 out: Callable[[str], None] = tqdm.write):
        self.model = model
        self.layers = conv_layer_shapes(model)
        self.dense = {"fc.weight": params["fc.weight"].copy(), "fc.bias": params["fc.bias"].copy()}
        self.velocity = {name: np.zeros_like(value) for name, value in self.dense.items()}
        self.stage = stage
        self.loop = loop
        self.metrics = metrics
        self.run_dir = run_dir
        self.out = out

    def _conv_forward(self, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        for layer in range(len(self.layers)):
            x = self.stage.forward(layer, x, train, step)
        return x

    def train_step(self, x: np.ndarray, labels: np.ndarray, step: int,
                   learning_rate: float) -> dict[str, Any]:
        """One SGD step on a batch x (B, C, H, W), labels (B,); returns the step record."""
        start = time.perf_counter()
        features = self._conv_forward(x, True, step)
        conv_forward_done = time.perf_counter()
        flat = features.reshape(features.shape[0], -1)
        logits = linear(flat, self.dense["fc.weight"], self.dense["fc.bias"])
        loss, probs = softmax_cross_entropy(logits, labels)
        dlogits = softmax_cross_entropy_backward(probs, labels)
        dflat, dweight, dbias = linear_backward(flat, self.dense["fc.weight"], dlogits)
        grads = {"fc.weight": dweight, "fc.bias": dbias}
        opt = self.loop.optimizer
        for name, grad in grads.items():
            decay = opt.weight_decay if name.endswith("weight") else 0.0
            sgd_update(self.dense[name], grad, self.velocity[name], learning_rate,
                       opt.momentum, decay)
        dense_done = time.perf_counter()
        grad = dflat.reshape(features.shape)
        for layer in reversed(range(len(self.layers))):
            grad = self.stage.backward(layer, grad, layer > 0, learning_rate, step)
        end = time.perf_counter()
        correct = int((probs.argmax(axis=1) == labels).sum())
        conv_s = (conv_forward_done - start) + (end - dense_done)
        return {"loss": float(loss), "correct": correct, "images": int(x.shape[0]),
                "step_s": end - start, "conv_s": conv_s, "dense_s": dense_done - conv_forward_done}

    def evaluate(self, images: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
        """(mean loss, accuracy) over a whole set, in eval mode."""
        total_loss, correct = 0.0, 0
        for begin in range(0, len(images), self.loop.eval_batch):
            x = images[begin:begin + self.loop.eval_batch]
            y = labels[begin:begin + self.loop.eval_batch]
            features = self._conv_forward(x, False, -1)
            logits = linear(features.reshape(len(x), -1), self.dense["fc.weight"],
                            self.dense["fc.bias"])
            loss, probs = softmax_cross_entropy(logits, y)
            total_loss += loss * len(x)
            correct += int((probs.argmax(axis=1) == y).sum())
        return total_loss / max(1, len(images)), correct / max(1, len(images))

    def save(self) -> dict[str, np.ndarray]:
        """Write ``weights.npz`` (model parameters, local-run layout) and return them."""
        params, _ = split_snapshot(self.stage.snapshot())
        params.update({name: value.copy() for name, value in self.dense.items()})
        save_weights(self.run_dir / "weights.npz", params)
        return params

    def fit(self, data: Dataset) -> TrainResult:
        loop = self.loop
        steps_per_epoch = -(-len(data.train_images) // loop.batch)
        result = TrainResult(epochs=[], losses=[])
        step = 0
        for epoch in range(loop.epochs):
            epoch_start = time.perf_counter()
            seen = correct = 0
            loss_sum = 0.0
            bar = tqdm(total=steps_per_epoch, desc=f"epoch {epoch + 1}/{loop.epochs}",
                       unit="batch", disable=not loop.progress, leave=True, dynamic_ncols=True)
            data_start = time.perf_counter()
            for x, labels in iterate_batches(data.train_images, data.train_labels, loop.batch,
                                             loop.seed, epoch):
                data_s = time.perf_counter() - data_start
                lr = learning_rate_at(loop.optimizer, step, steps_per_epoch, loop.epochs)
                record = self.train_step(x, labels, step, lr)
                seen += record["images"]
                correct += record["correct"]
                loss_sum += record["loss"] * record["images"]
                result.losses.append(record["loss"])
                timings = self.stage.take_step_timings()
                self.metrics.write(
                    "step", epoch=epoch, step=step, loss=record["loss"],
                    accuracy=record["correct"] / record["images"], images=record["images"],
                    learning_rate=lr, step_s=record["step_s"], conv_s=record["conv_s"],
                    dense_s=record["dense_s"], comm_s=timings["comm_s"], data_s=data_s,
                    layers=timings["layers"])
                elapsed = time.perf_counter() - epoch_start
                bar.set_postfix(loss=f"{loss_sum / seen:.4f}", acc=f"{correct / seen:.3f}",
                                img_s=f"{seen / max(elapsed, 1e-9):.0f}", refresh=False)
                bar.update(1)
                step += 1
                data_start = time.perf_counter()
            bar.close()
            train_s = time.perf_counter() - epoch_start
            test_loss, test_accuracy = self.evaluate(data.test_images, data.test_labels)
            summary = {"epoch": epoch, "train_loss": loss_sum / max(1, seen),
                       "train_accuracy": correct / max(1, seen), "test_loss": test_loss,
                       "test_accuracy": test_accuracy, "train_s": train_s,
                       "epoch_s": time.perf_counter() - epoch_start,
                       "images_per_s": seen / max(train_s, 1e-9)}
            self.metrics.write("epoch", **summary)
            result.epochs.append(summary)
            self.save()
            self.out(f"epoch {epoch + 1}/{loop.epochs}: train loss {summary['train_loss']:.4f} "
                     f"acc {summary['train_accuracy']:.4f} | test loss {test_loss:.4f} "
                     f"acc {test_accuracy:.4f} | {summary['images_per_s']:.0f} images/s")
        return result
