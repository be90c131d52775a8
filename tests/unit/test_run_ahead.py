"""Two steps in flight, the trainer's side (no sockets): a stage that runs ahead is
handed the next step with this one, never across a snapshot, an evaluation or an
epoch's end; what it is handed ahead is the very batch and learning rate of the next
call; a fault drops what was ahead and the replay asks for the steps again in order.
The records are the same as with a stage that does not run ahead."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetconv.data.loading import load_dataset
from hetconv.engine.optim import learning_rate_at
from hetconv.engine.stage import ConvStage, LocalConvStage, StageFault, layer_settings
from hetconv.engine.training import LoopConfig, Trainer
from hetconv.metrics import MetricsWriter, read_metrics
from hetconv.model import ModelConfig, init_parameters

MODEL = ModelConfig(conv_kernels=(4, 8), input_shape=(1, 28, 28), classes=10)
EVERY = 4  # steps between snapshots
STEPS_PER_EPOCH = 10  # 640 images at batch 64


class AheadStage(LocalConvStage):
    """A whole-step stage that checks the trainer's side of the contract: a step given
    ahead is the next one asked for, with the same arrays; nothing reads the stage
    (snapshot, evaluation) while one is ahead. Its "loss" is a function of the step
    and its batch, so a record computed from the wrong batch shows."""

    def __init__(self, ahead: bool, fail_at: list[int]):
        params = init_parameters(MODEL, 0)
        super().__init__(MODEL, params, layer_settings(MODEL, 0.9, 5e-4))
        self._runs_ahead = ahead
        self.fail_at = list(fail_at)
        self.held: tuple[np.ndarray, np.ndarray, int, float] | None = None
        self.calls: list[tuple[int, int | None]] = []  # (step, the step given ahead)
        self.events: list[str] = []

    @property
    def replicates_dense(self) -> bool:
        return True

    @property
    def runs_ahead(self) -> bool:
        return self._runs_ahead

    def attach_dense(self, part: Any, optimizer: Any) -> None:
        pass

    def train_step(self, x: np.ndarray, labels: np.ndarray, step: int,
                   learning_rate: float,
                   ahead: tuple[np.ndarray, np.ndarray, int, float] | None = None
                   ) -> dict[str, Any]:
        held, self.held = self.held, None
        if held is not None:
            assert held[2] == step, (held[2], step)
            assert held[0] is x and held[1] is labels and held[3] == learning_rate
        assert ahead is None or self._runs_ahead
        self.calls.append((step, None if ahead is None else ahead[2]))
        self.events.append(f"step {step}")
        if self.fail_at and step == self.fail_at[0]:
            self.fail_at.pop(0)
            raise StageFault(f"worker w9 stopped responding during step {step}", "w9", True)
        self.held = ahead
        loss = float(step) + float(np.abs(x).sum()) * 1e-6 + learning_rate
        return {"loss": loss, "correct": int(labels[0]), "images": int(x.shape[0]),
                "step_s": 0.0, "conv_s": 0.0, "dense_s": 0.0}

    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        assert self.held is None, "the stage was read with a step in flight"
        self.events.append("evaluate")
        return super().forward(layer, x, train, step)

    def snapshot(self) -> dict[str, np.ndarray]:
        assert self.held is None, "a snapshot with a step in flight"
        self.events.append("snapshot")
        return super().snapshot()

    def recover(self, fault: StageFault, state: dict[str, np.ndarray]) -> ConvStage:
        self.held = None  # the real stage abandons it
        self.restore(state)
        return self


def train(tmp_path: Path, stage: AheadStage) -> list[dict[str, Any]]:
    data = load_dataset("synthetic", None, limit=640)
    data.test_images, data.test_labels = data.test_images[:64], data.test_labels[:64]
    loop = LoopConfig(epochs=2, batch=64, seed=1, progress=False, checkpoint_every=EVERY)
    tmp_path.mkdir(parents=True, exist_ok=True)
    with MetricsWriter(tmp_path / "metrics.jsonl") as metrics:
        trainer = Trainer(MODEL, init_parameters(MODEL, 0), stage, loop, metrics, tmp_path,
                          out=lambda line: None)
        trainer.fit(data)
    return [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["type"] == "step"]


def test_the_next_step_goes_ahead_except_before_a_snapshot_or_an_epoch_end(
        tmp_path: Path) -> None:
    stage = AheadStage(ahead=True, fail_at=[])
    steps = train(tmp_path, stage)
    total = 2 * STEPS_PER_EPOCH
    assert [step for step, _ in stage.calls] == list(range(total))
    for step, ahead in stage.calls:
        boundary = (step + 1) % EVERY == 0 or (step + 1) % STEPS_PER_EPOCH == 0
        assert ahead == (None if boundary else step + 1), (step, ahead)
    # the learning rate handed ahead is the schedule's for that step
    assert [r["learning_rate"] for r in steps] == [
        learning_rate_at(LoopConfig().optimizer, s, STEPS_PER_EPOCH, 2) for s in range(total)]


@pytest.mark.parametrize("fail_at", [[], [2, 5, 9, 13]],
                         ids=["clean", "faults"])
def test_records_equal_those_of_a_stage_that_does_not_run_ahead(
        tmp_path: Path, fail_at: list[int]) -> None:
    """Faults with a step ahead (2, 5, 13), and right before an epoch's end (9): the
    replay asks for the steps again in order and the records end up the same."""
    ahead = AheadStage(ahead=True, fail_at=fail_at)
    plain = AheadStage(ahead=False, fail_at=fail_at)
    with_ahead, without = train(tmp_path / "ahead", ahead), train(tmp_path / "plain", plain)

    def last_of(records: list[dict[str, Any]]) -> list[tuple[int, float, int]]:
        by_step = {r["step"]: (r["step"], r["loss"], r["accuracy"]) for r in records}
        return [by_step[s] for s in sorted(by_step)]

    assert last_of(with_ahead) == last_of(without)
    assert not ahead.fail_at and not plain.fail_at  # every fault struck
    assert any(given is not None for _, given in ahead.calls)
    assert all(given is None for _, given in plain.calls)
