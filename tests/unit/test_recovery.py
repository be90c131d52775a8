"""Snapshots, faults and replays in the trainer, over a local stage that fails on cue
(no sockets): a fault costs replayed steps, never a different result."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetconv.data.loading import load_dataset
from hetconv.engine.stage import ConvStage, LocalConvStage, StageFault, layer_settings
from hetconv.engine.train_state import CHECKPOINT_NAME, CheckpointError, TrainingState
from hetconv.engine.training import LoopConfig, Trainer
from hetconv.metrics import MetricsWriter, read_metrics
from hetconv.model import ModelConfig, init_parameters

MODEL = ModelConfig(conv_kernels=(4, 8), input_shape=(1, 28, 28), classes=10)


class FlakyStage(LocalConvStage):
    """Raises a StageFault in the forward of the given steps (each once)."""

    def __init__(self, fail_at: list[int]):
        params = init_parameters(MODEL, 0)
        super().__init__(MODEL, params, layer_settings(MODEL, 0.9, 5e-4))
        self.fail_at = list(fail_at)
        self.recovered: list[str] = []

    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        if train and layer == 1 and self.fail_at and step == self.fail_at[0]:
            self.fail_at.pop(0)
            raise StageFault(f"worker w9 stopped responding during step {step}", "w9", True)
        return super().forward(layer, x, train, step)

    def recover(self, fault: StageFault, state: dict[str, np.ndarray]) -> ConvStage:
        self.recovered.append(str(fault.participant))
        self.restore(state)
        return self


def train(tmp_path: Path, stage: LocalConvStage, every: int = 5, epochs: int = 2,
          start: TrainingState | None = None) -> tuple[Any, Trainer]:
    data = load_dataset("synthetic", None, limit=640)
    data.test_images, data.test_labels = data.test_images[:64], data.test_labels[:64]
    loop = LoopConfig(epochs=epochs, batch=64, seed=1, progress=False, checkpoint_every=every)
    tmp_path.mkdir(parents=True, exist_ok=True)
    with MetricsWriter(tmp_path / "metrics.jsonl") as metrics:
        trainer = Trainer(MODEL, init_parameters(MODEL, 0), stage, loop, metrics, tmp_path,
                          out=lambda line: None)
        result = trainer.fit(data, start)
    return result, trainer


def final_losses(run_dir: Path) -> list[float]:
    by_step = {int(r["step"]): float(r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl")
               if r["type"] == "step"}
    return [by_step[s] for s in sorted(by_step)]


def test_faults_replay_to_the_same_result_bit_for_bit(tmp_path: Path) -> None:
    clean, _ = train(tmp_path / "clean", FlakyStage([]))
    stage = FlakyStage([3, 7, 10, 14])  # mid-snapshot, right after one, epoch 2's first
    faulty, trainer = train(tmp_path / "faulty", stage)
    assert stage.recovered == ["w9"] * 4
    assert faulty.losses == clean.losses  # bit for bit: same batches, same state
    assert final_losses(tmp_path / "faulty") == clean.losses
    assert faulty.epochs[-1]["test_accuracy"] == clean.epochs[-1]["test_accuracy"]
    recoveries = [r for r in read_metrics(tmp_path / "faulty" / "metrics.jsonl")
                  if r["type"] == "recovery"]
    assert [(r["failed_step"], r["resumed_step"]) for r in recoveries] == [
        (3, 0), (7, 5), (10, 10), (14, 10)]
    clean_w = np.load(tmp_path / "clean" / "weights.npz")
    faulty_w = np.load(tmp_path / "faulty" / "weights.npz")
    for name in clean_w.files:
        assert np.array_equal(clean_w[name], faulty_w[name]), name


def test_a_fault_that_keeps_coming_gives_up_with_one_line(tmp_path: Path) -> None:
    stage = FlakyStage([4] * 20)
    with pytest.raises(Exception, match="failed 9 times in a row"):
        train(tmp_path, stage)


class KilledStage(FlakyStage):
    """Dies (as a killed master would stop) in the forward of step ``kill_at``."""

    def __init__(self, kill_at: int):
        super().__init__([])
        self.kill_at = kill_at

    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        if train and step == self.kill_at:
            raise KeyboardInterrupt
        return super().forward(layer, x, train, step)


@pytest.mark.parametrize("kill_at", [7, 10, 12])
def test_resume_from_the_last_checkpoint_gives_the_same_trace(tmp_path: Path,
                                                              kill_at: int) -> None:
    clean, _ = train(tmp_path / "clean", FlakyStage([]))
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(run, KilledStage(kill_at))
    state = TrainingState.load(run / CHECKPOINT_NAME)
    assert state.step == (kill_at // 5) * 5  # the last snapshot before the kill
    assert state.losses == clean.losses[:state.step]
    resumed, _ = train(run, FlakyStage([]), start=state)
    assert resumed.losses == clean.losses  # bit for bit
    assert resumed.epochs == clean.epochs or [
        e["test_accuracy"] for e in resumed.epochs] == [e["test_accuracy"] for e in clean.epochs]


def test_a_corrupt_or_truncated_checkpoint_is_one_clear_error(tmp_path: Path) -> None:
    train(tmp_path / "run", FlakyStage([]), epochs=1)
    path = tmp_path / "run" / CHECKPOINT_NAME
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="unreadable checkpoint"):
        TrainingState.load(path)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        TrainingState.load(tmp_path / "nothing.npz")
    assert not list((tmp_path / "run").glob(".*.tmp"))  # no temporary left behind


class EarlyReplanLocal(LocalConvStage):
    """Asks for a re-plan point after the given steps (as the master-alone trial does
    once it can decide); records the steps whose snapshot it was handed."""

    def __init__(self, want_after: set[int]):
        super().__init__(MODEL, init_parameters(MODEL, 0), layer_settings(MODEL, 0.9, 5e-4))
        self.want_after = want_after
        self.steps_done = 0
        self.points: list[int] = []

    def end_step(self) -> dict[str, Any]:
        self.steps_done += 1
        return super().end_step()

    def wants_replan_point(self) -> bool:
        return self.steps_done in self.want_after

    def replan_point(self, state: dict[str, np.ndarray]) -> ConvStage:
        self.points.append(self.steps_done)
        return self


def test_a_stage_that_asks_gets_a_snapshot_before_the_next_one_due(tmp_path: Path) -> None:
    """A trial that can decide after 3 steps does not wait for the snapshot every 5:
    the trainer takes one after step 3 (a checkpoint record, the stage's re-plan point),
    and the result is the same bits as without it."""
    clean, _ = train(tmp_path / "clean", EarlyReplanLocal(set()))
    stage = EarlyReplanLocal({3, 5})  # 5: one due anyway, not taken twice
    asked, _ = train(tmp_path / "asked", stage)
    assert stage.points == [0, 3, 5, 10, 10, 15, 20, 20]  # start, 3, due ones, epoch ends
    checkpoints = [r["step"] for r in read_metrics(tmp_path / "asked" / "metrics.jsonl")
                   if r["type"] == "checkpoint"]
    assert checkpoints == [0, 3, 5, 10, 10, 15, 20, 20]
    assert asked.losses == clean.losses
