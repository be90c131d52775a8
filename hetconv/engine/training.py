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

from hetconv.data.batches import Augmentation, BatchSource, augment_padding
from hetconv.data.loading import Dataset
from hetconv.engine.checkpoint import save_weights
from hetconv.engine.dense_part import DensePart
from hetconv.engine.loss_guard import LossJumpGuard
from hetconv.engine.optim import OptimizerConfig, learning_rate_at
from hetconv.engine.routing import ForwardTape, Routing, run_backward, run_forward
from hetconv.engine.stage import (
    ConvStage,
    EarlyReplanStage,
    RoutingStage,
    StageFault,
    WholeStepStage,
    split_snapshot,
)
from hetconv.engine.train_state import CHECKPOINT_NAME, TrainingState, check_finite
from hetconv.errors import UserError
from hetconv.logs import progress_bar, write_line
from hetconv.metrics import MetricsWriter
from hetconv.model import ModelConfig, conv_layer_shapes, dense_parameter_names
from hetconv.ops.loss import softmax_cross_entropy

MAX_FAULTS_WITHOUT_PROGRESS = 8
"""Faults in a row without a step beyond the failing one before the run gives up."""


@dataclass(frozen=True)
class LoopConfig:
    """How long and how to train (the model itself is a :class:`ModelConfig`)."""

    epochs: int = 3
    batch: int = 128
    eval_batch: int = 1000
    seed: int = 0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    progress: bool = True
    checkpoint_every: int = 20  # steps between snapshots (0: only at epoch ends)
    checkpoints: bool = True  # also write each snapshot to RUN_DIR/checkpoint.npz
    augment: bool = False  # random crops and flips of the training batches (hetconv.data.batches)


@dataclass
class TrainResult:
    epochs: list[dict[str, Any]]
    losses: list[float]

    @property
    def test_accuracy(self) -> float:
        return float(self.epochs[-1]["test_accuracy"]) if self.epochs else float("nan")


class Trainer:
    """Owns the dense layers (hidden fc, dropout, classifier) and their optimizer
    state; drives the conv stage."""

    def __init__(self, model: ModelConfig, params: dict[str, np.ndarray], stage: ConvStage,
                 loop: LoopConfig, metrics: MetricsWriter, run_dir: Path,
                 out: Callable[[str], None] = write_line):
        self.model = model
        self.layers = conv_layer_shapes(model)
        self.routing = Routing.of(self.layers)
        self._tape: ForwardTape | None = None  # the last training forward's joins
        # every dense array (hidden layers' dense{j}.*, then the classifier's fc.*)
        dense = {name: params[name].copy() for name in dense_parameter_names(model)}
        self.part = DensePart(model.dense, dense,
                              {name: np.zeros_like(value) for name, value in dense.items()},
                              loop.seed)
        self.stage = stage
        if isinstance(stage, WholeStepStage):  # the dense part replicated on its participants
            stage.attach_dense(self.part, loop.optimizer)
        self.loop = loop
        self.metrics = metrics
        self.run_dir = run_dir
        self.out = out
        self.last_state: TrainingState | None = None  # what a fault restores
        self.loss_guard = LossJumpGuard()  # a loss 100x its recent median: restore, replay
        self._faults_without_progress = 0
        self._last_fault_step = -1

    def _routes(self) -> bool:
        """Whether the trainer joins the shortcuts (a residual network on a stage that
        does not: hetconv/engine/routing.py)."""
        return not self.routing.straight and not (
            isinstance(self.stage, RoutingStage) and self.stage.routes_shortcuts)

    def _conv_forward(self, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        if self._routes():  # residual blocks (hetconv/engine/routing.py)
            out, tape = run_forward(
                self.routing, lambda layer, a: self.stage.forward(layer, a, train, step), x)
            self._tape = tape if train else self._tape
            return out
        for layer in range(len(self.layers)):
            x = self.stage.forward(layer, x, train, step)
        return x

    def _conv_backward(self, grad: Any, learning_rate: float, step: int) -> None:
        if self._routes():
            tape, self._tape = self._tape, None
            if tape is None:
                raise RuntimeError("a backward pass without a training forward")
            run_backward(self.routing, tape, lambda layer, dy, need_dx: self.stage.backward(
                layer, dy, need_dx, learning_rate, step), grad)
            return
        for layer in reversed(range(len(self.layers))):
            grad = self.stage.backward(layer, grad, layer > 0, learning_rate, step)

    # the dense arrays live in ``self.part`` (shared with a stage that replicates them)
    @property
    def dense(self) -> dict[str, np.ndarray]:
        return self.part.arrays

    @dense.setter
    def dense(self, arrays: dict[str, np.ndarray]) -> None:
        self.part.arrays = arrays

    @property
    def velocity(self) -> dict[str, np.ndarray]:
        return self.part.velocity

    @velocity.setter
    def velocity(self, arrays: dict[str, np.ndarray]) -> None:
        self.part.velocity = arrays

    def _dense_forward(self, flat: np.ndarray, train: bool, step: int
                       ) -> tuple[np.ndarray, list[tuple[str, str, np.ndarray, np.ndarray]]]:
        """flat (B, D) through the hidden dense layers (hetconv/engine/dense_part.py)."""
        return self.part.forward(flat, train, step)

    def _dense_backward(self, tape: list[tuple[str, str, np.ndarray, np.ndarray]],
                        grad: np.ndarray, grads: dict[str, np.ndarray]) -> np.ndarray:
        """Back through the hidden dense layers (hetconv/engine/dense_part.py)."""
        return self.part.backward(tape, grad, grads)

    def runs_whole_steps(self) -> bool:
        """Whether the stage runs whole steps, the dense part replicated (the sample
        split's step chain over workers)."""
        return isinstance(self.stage, WholeStepStage) and self.stage.replicates_dense

    def runs_ahead(self) -> bool:
        """Whether the stage takes the next step before this one ends (two in flight)."""
        return isinstance(self.stage, WholeStepStage) and self.stage.replicates_dense \
            and self.stage.runs_ahead

    def train_step(self, x: np.ndarray, labels: np.ndarray, step: int,
                   learning_rate: float,
                   ahead: tuple[np.ndarray, np.ndarray, int, float] | None = None
                   ) -> dict[str, Any]:
        """One SGD step on a batch x (B, C, H, W), labels (B,); returns the step record.
        ``ahead``: the next step (x, labels, step, learning rate), for a stage that
        :meth:`runs_ahead` only."""
        if isinstance(self.stage, WholeStepStage) and self.stage.replicates_dense:
            return self.stage.train_step(x, labels, step, learning_rate,  # on the replicas
                                         ahead=ahead)
        start = time.perf_counter()
        features = self._conv_forward(x, True, step)
        conv_forward_done = time.perf_counter()
        flat = features.reshape(features.shape[0], -1)
        dense = self.part.train_pass(flat, labels, step)
        opt = self.loop.optimizer
        self.part.apply(dense.grads, learning_rate, opt.momentum, opt.weight_decay)
        dense_done = time.perf_counter()
        self._conv_backward(dense.dflat.reshape(features.shape), learning_rate, step)
        end = time.perf_counter()
        conv_s = (conv_forward_done - start) + (end - dense_done)
        return {"loss": dense.loss, "correct": dense.correct, "images": int(x.shape[0]),
                "step_s": end - start, "conv_s": conv_s, "dense_s": dense_done - conv_forward_done}

    def evaluate(self, images: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
        """(mean loss, accuracy) over a whole set, in eval mode."""
        total_loss, correct = 0.0, 0
        for begin in range(0, len(images), self.loop.eval_batch):
            x = images[begin:begin + self.loop.eval_batch]
            y = labels[begin:begin + self.loop.eval_batch]
            features = self._conv_forward(x, False, -1)
            hidden, _ = self._dense_forward(features.reshape(len(x), -1), False, -1)
            logits = self.part.logits(hidden)
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

    # --- snapshots -------------------------------------------------------------------
    def capture(self, step: int, epoch: int, position: int, seen: int, correct: int,
                loss_sum: float, train_s: float, losses: list[float],
                epochs: list[dict[str, Any]]) -> TrainingState:
        """A snapshot of everything (the conv stage's state pulled from its shards);
        ValueError when any array is non-finite (a diverged model is never saved)."""
        conv = self.stage.snapshot()
        check_finite(conv, f"snapshot at step {step}")
        check_finite(self.dense, f"snapshot at step {step}")
        return TrainingState(
            step=step, epoch=epoch, position=position, conv=conv,
            dense={k: v.copy() for k, v in self.dense.items()},
            velocity={k: v.copy() for k, v in self.velocity.items()}, seen=seen,
            correct=correct, loss_sum=loss_sum, train_s=train_s, losses=list(losses),
            epochs=[dict(e) for e in epochs])

    def restore(self, state: TrainingState) -> None:
        """Put the dense layer and every conv shard back to ``state``."""
        self._restore_dense(state)
        self.stage.restore(state.conv)

    def _restore_dense(self, state: TrainingState) -> None:
        self.dense = {k: v.copy() for k, v in state.dense.items()}
        self.velocity = {k: v.copy() for k, v in state.velocity.items()}

    def _checkpoint(self, state: TrainingState, started: float) -> None:
        """Keep ``state`` as the one to restore, write it to the run directory, and let
        the stage take in joined participants (a re-plan point)."""
        self.last_state = state
        size = state.save(self.run_dir / CHECKPOINT_NAME) if self.loop.checkpoints else 0
        self.metrics.write("checkpoint", step=state.step, epoch=state.epoch,
                           position=state.position, state_bytes=state.nbytes(),
                           file_bytes=size, seconds=time.perf_counter() - started)
        self.stage = self.stage.replan_point(state.conv)

    def _recover(self, fault: StageFault, step: int) -> TrainingState:
        """Hand the fault to the stage (which drops what failed and re-plans), restore
        the last snapshot and return it: training goes on from there."""
        state = self.last_state
        if state is None:
            raise fault
        self._faults_without_progress = (self._faults_without_progress + 1
                                         if step <= self._last_fault_step else 1)
        self._last_fault_step = step
        if self._faults_without_progress > MAX_FAULTS_WITHOUT_PROGRESS:
            raise UserError(f"step {step} failed {self._faults_without_progress} times in a "
                            f"row; giving up: {fault}")
        started = time.perf_counter()
        self._restore_dense(state)  # first: a stage replicating it hands it out
        self.stage = self.stage.recover(fault, state.conv)
        self.restore(state)
        self.loss_guard.rewind()
        seconds = time.perf_counter() - started
        self.metrics.write("recovery", failed_step=step, resumed_step=state.step,
                           participant=fault.participant, gone=fault.gone, reason=str(fault),
                           seconds=seconds)
        self.out(f"hetconv: {fault}; restored the snapshot of step {state.step} in "
                 f"{seconds:.2f} s, replaying {step - state.step} step(s)")
        return state

    def _stage_wants_replan(self) -> bool:
        """Whether the stage asks for a snapshot after this step though none is due (a
        trial that can decide: :class:`hetconv.engine.stage.EarlyReplanStage`)."""
        return isinstance(self.stage, EarlyReplanStage) and self.stage.wants_replan_point()

    def _may_run_ahead(self, step: int, position: int, steps_per_epoch: int) -> bool:
        """Whether step + 1 may start before step ends: the stage runs ahead and nothing
        reads its state between the two (no snapshot after step, no epoch end)."""
        every = self.loop.checkpoint_every
        return (self.runs_ahead() and position + 1 < steps_per_epoch
                and not (every and (step + 1) % every == 0))

    def fit(self, data: Dataset, start: TrainingState | None = None) -> TrainResult:
        """Train ``loop.epochs`` epochs from the beginning or from ``start`` (a resumed
        checkpoint). A :class:`StageFault` restores the last snapshot and replays."""
        loop = self.loop
        _, height, width = data.image_shape
        source = BatchSource(data.train_images, data.train_labels, loop.batch, loop.seed,
                             Augmentation(augment_padding(height, width)) if loop.augment
                             else None)
        steps_per_epoch = source.steps_per_epoch
        if start is not None:
            self.restore(start)
            state = start
            self.last_state = start
        else:
            state = self.capture(0, 0, 0, 0, 0, 0.0, 0.0, [], [])
            self._checkpoint(state, time.perf_counter())
        while True:
            step, epoch, position = state.step, state.epoch, state.position
            seen, correct, loss_sum = state.seen, state.correct, state.loss_sum
            losses, epochs = list(state.losses), [dict(e) for e in state.epochs]
            if epoch >= loop.epochs:
                return TrainResult(epochs=epochs, losses=losses)
            train_s = state.train_s
            try:
                bar = progress_bar(steps_per_epoch, position, f"epoch {epoch + 1}/{loop.epochs}",
                                   disable=not loop.progress)  # lines when not a terminal
                batches = source.prefetch(epoch, position)  # the thread ends in `finally`
                upcoming: tuple[np.ndarray, np.ndarray, float] | None = None
                try:
                    while position < steps_per_epoch:
                        if upcoming is None:
                            data_start = time.perf_counter()
                            x, labels = next(batches)
                            data_s = time.perf_counter() - data_start
                        else:  # taken ahead: already in flight
                            (x, labels, data_s), upcoming = upcoming, None
                        lr = learning_rate_at(loop.optimizer, step, steps_per_epoch,
                                              loop.epochs)
                        ahead = None
                        if self._may_run_ahead(step, position, steps_per_epoch):
                            data_start = time.perf_counter()
                            x_next, labels_next = next(batches)
                            upcoming = (x_next, labels_next, time.perf_counter() - data_start)
                            ahead = (x_next, labels_next, step + 1, learning_rate_at(
                                loop.optimizer, step + 1, steps_per_epoch, loop.epochs))
                        record = self.train_step(x, labels, step, lr, ahead=ahead)
                        if not np.isfinite(record["loss"]):
                            raise UserError(f"the model diverged at step {step}: the loss is "
                                            f"{record['loss']}; lower --lr")
                        jump = self.loss_guard.check(step, float(record["loss"]))
                        # the sample split's step chain only: under the kernel split the
                        # restore re-splits the kernels and can hide a bad worker from the
                        # audit that would name it (CI: kernels-peer-scale)
                        if jump is not None and self.runs_whole_steps():
                            if jump.restore:  # the last audited snapshot, then a replay
                                raise StageFault(jump.line)
                            self.out(f"hetconv: warning: {jump.line}")
                        seen += record["images"]
                        correct += record["correct"]
                        loss_sum += record["loss"] * record["images"]
                        train_s += record["step_s"] + data_s
                        losses.append(record["loss"])
                        timings = self.stage.end_step()
                        self.metrics.write(
                            "step", epoch=epoch, step=step, loss=record["loss"],
                            accuracy=record["correct"] / record["images"],
                            images=record["images"], learning_rate=lr,
                            step_s=record["step_s"], conv_s=record["conv_s"],
                            dense_s=record["dense_s"], comm_s=timings["comm_s"],
                            data_s=data_s, sent_ahead=bool(timings.get("sent_ahead")),
                            layers=timings["layers"])
                        bar.set_postfix(loss=f"{loss_sum / seen:.4f}",
                                        acc=f"{correct / seen:.3f}",
                                        img_s=f"{seen / max(train_s, 1e-9):.0f}", refresh=False)
                        bar.update(1)
                        step += 1
                        position += 1
                        due = bool(loop.checkpoint_every
                                   and step % loop.checkpoint_every == 0)
                        if (due or self._stage_wants_replan()) and position < steps_per_epoch:
                            started = time.perf_counter()
                            self._checkpoint(self.capture(
                                step, epoch, position, seen, correct, loss_sum, train_s,
                                losses, epochs), started)
                finally:
                    batches.close()
                    bar.close()
                if state.position < steps_per_epoch or state.step != step:
                    started = time.perf_counter()  # training of the epoch done: keep it
                    self._checkpoint(self.capture(step, epoch, position, seen, correct,
                                                  loss_sum, train_s, losses, epochs), started)
                eval_start = time.perf_counter()
                test_loss, test_accuracy = self.evaluate(data.test_images, data.test_labels)
                self.save()
            except StageFault as fault:
                state = self._recover(fault, step)
                continue
            summary = {"epoch": epoch, "train_loss": loss_sum / max(1, seen),
                       "train_accuracy": correct / max(1, seen), "test_loss": test_loss,
                       "test_accuracy": test_accuracy, "train_s": train_s,
                       "epoch_s": train_s + time.perf_counter() - eval_start,
                       "images_per_s": seen / max(train_s, 1e-9)}
            self.metrics.write("epoch", **summary)
            epochs.append(summary)
            self.out(f"epoch {epoch + 1}/{loop.epochs}: train loss {summary['train_loss']:.4f} "
                     f"acc {summary['train_accuracy']:.4f} | test loss {test_loss:.4f} "
                     f"acc {test_accuracy:.4f} | {summary['images_per_s']:.0f} images/s")
            try:
                started = time.perf_counter()
                state = self.capture(step, epoch + 1, 0, 0, 0, 0.0, 0.0, losses, epochs)
                self._checkpoint(state, started)
            except StageFault as fault:  # the epoch is done; its end is replayed cheaply
                state = self._recover(fault, step)
