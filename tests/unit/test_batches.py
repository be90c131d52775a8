"""BatchSource: the seeded order, deterministic augmentation, the prefetching thread,
and the trainer taking its batches from it (replays and resumes see the same batches)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hetconv.data.batches import Augmentation, BatchSource, augment_padding
from hetconv.data.loading import load_dataset
from hetconv.engine.stage import ConvStage, LocalConvStage, StageFault, layer_settings
from hetconv.engine.train_state import CHECKPOINT_NAME, TrainingState
from hetconv.engine.training import LoopConfig, Trainer
from hetconv.metrics import MetricsWriter
from hetconv.model import ModelConfig, init_parameters


def batch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hetconv-batches")]


def make_set(count: int = 50, shape: tuple[int, int, int] = (2, 6, 5),
             seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((count, *shape)).astype(np.float32)
    return images, rng.integers(0, 10, count).astype(np.int64)


def test_batches_without_augmentation_are_the_training_loop_s_slices() -> None:
    images, labels = make_set()
    source = BatchSource(images, labels, batch=16, seed=3)
    assert source.steps_per_epoch == 4
    for epoch in (0, 1, 5):
        order = np.random.default_rng([3, epoch]).permutation(50)  # the loop's own order
        seen = []
        for position in range(4):
            x, y = source.batch(epoch, position)
            index = order[position * 16:(position + 1) * 16]
            assert x.dtype == np.float32 and y.dtype == np.int64
            np.testing.assert_array_equal(x, images[index])  # bit for bit
            np.testing.assert_array_equal(y, labels[index])
            seen += index.tolist()
        assert sorted(seen) == list(range(50))
    with pytest.raises(IndexError):
        source.batch(0, 4)


def test_augmentation_is_a_padded_crop_and_flip_fixed_by_seed_epoch_position() -> None:
    images, labels = make_set(shape=(2, 8, 8))
    assert augment_padding(8, 8) == 1 and augment_padding(32, 32) == 4
    assert augment_padding(28, 28) == 3 and augment_padding(4, 4) == 1
    plain = BatchSource(images, labels, batch=16, seed=3)
    source = BatchSource(images, labels, batch=16, seed=3, augmentation=Augmentation(2))
    x, y = source.batch(1, 2)
    original, same_labels = plain.batch(1, 2)
    np.testing.assert_array_equal(y, same_labels)
    np.testing.assert_array_equal(x, source.batch(1, 2)[0])  # the same on every call
    assert not np.array_equal(x, source.batch(1, 1)[0][:len(x)])
    assert not np.array_equal(x, source.batch(2, 2)[0])
    assert not np.array_equal(x, original)
    # Every image is one of the 5x5 crops of its zero-padded original, maybe flipped.
    flipped = 0
    for image, base in zip(x, original):
        padded = np.pad(base, ((0, 0), (2, 2), (2, 2)))
        candidates = [(flip, padded[:, top:top + 8, left:left + 8])
                      for top in range(5) for left in range(5) for flip in (False, True)]
        matches = [flip for flip, crop in candidates
                   if np.array_equal(image, crop[:, :, ::-1] if flip else crop)]
        assert matches, "not a crop of the padded image"
        flipped += all(matches)
    assert 0 < flipped < len(x)
    # The draws depend on the position (and epoch, seed): identical images come out
    # differently in every batch.
    same = np.repeat(images[:1], 48, axis=0)
    twins = BatchSource(same, labels[:48], batch=16, seed=3, augmentation=Augmentation(2))
    draws = [twins.batch(epoch, position)[0] for epoch in (0, 1) for position in (0, 1, 2)]
    draws.append(BatchSource(same, labels[:48], batch=16, seed=4,
                             augmentation=Augmentation(2)).batch(0, 0)[0])
    for first in range(len(draws)):
        for second in range(first):
            assert not np.array_equal(draws[first], draws[second]), (first, second)


def test_prefetch_yields_the_batches_from_any_position() -> None:
    images, labels = make_set()
    source = BatchSource(images, labels, batch=8, seed=1, augmentation=Augmentation(1))
    for start in (0, 3, 7):
        with source.prefetch(2, start) as batches:
            got = list(batches)
        assert len(got) == source.steps_per_epoch - start
        for position, (x, y) in enumerate(got, start):
            expected_x, expected_y = source.batch(2, position)
            np.testing.assert_array_equal(x, expected_x)
            np.testing.assert_array_equal(y, expected_y)
    assert list(source.prefetch(0, source.steps_per_epoch)) == []
    assert not batch_threads()


def test_the_thread_stops_when_the_consumer_stops_early() -> None:
    images, labels = make_set(count=400)
    source = BatchSource(images, labels, batch=4, seed=0)
    batches = source.prefetch(0, 0, depth=1)
    next(batches)
    time.sleep(0.05)  # the producer is now blocked on its full queue
    assert batch_threads()
    batches.close()
    assert not batch_threads()
    batches.close()  # twice is fine
    with pytest.raises(StopIteration):
        next(batches)
    with pytest.raises(RuntimeError, match="consumer"):
        with source.prefetch(0, 0) as batches:
            next(batches)
            raise RuntimeError("the consumer failed")
    assert not batch_threads()


class FailingSource(BatchSource):
    def batch(self, epoch: int, position: int) -> tuple[np.ndarray, np.ndarray]:
        if position == 2:
            raise ValueError(f"cannot make batch {position}")
        return super().batch(epoch, position)


def test_an_error_in_the_thread_is_raised_at_its_batch() -> None:
    images, labels = make_set()
    batches = FailingSource(images, labels, batch=8, seed=0).prefetch(0, 0)
    next(batches)
    next(batches)
    with pytest.raises(ValueError, match="cannot make batch 2"):
        next(batches)
    assert not batch_threads()


class SlowSource(BatchSource):
    """Each batch takes `seconds` to make (as a big augmented batch would)."""

    seconds = 0.03

    def batch(self, epoch: int, position: int) -> tuple[np.ndarray, np.ndarray]:
        time.sleep(self.seconds)
        return super().batch(epoch, position)


@pytest.mark.serial  # times the consumer's waits
def test_batches_are_ready_while_the_consumer_works() -> None:
    images, labels = make_set(count=80)
    source = SlowSource(images, labels, batch=8, seed=0)
    waits = []
    with source.prefetch(0, 0) as batches:
        while True:
            started = time.perf_counter()
            try:
                next(batches)
            except StopIteration:
                break
            waits.append(time.perf_counter() - started)
            time.sleep(2 * SlowSource.seconds)  # a training step longer than a batch
    assert len(waits) == 10
    # Apart from the first batch, the consumer hardly waits: far less than making them.
    assert sum(waits[1:]) < 0.5 * SlowSource.seconds * 9


# ----------------------------------------------------------------- in the trainer

MODEL = ModelConfig(conv_kernels=(3,), input_shape=(1, 28, 28), classes=10, kernel_size=3)


class FlakyStage(LocalConvStage):
    """Raises a StageFault in the forward of the given steps (each once)."""

    def __init__(self, fail_at: list[int]):
        super().__init__(MODEL, init_parameters(MODEL, 0), layer_settings(MODEL, 0.9, 5e-4))
        self.fail_at = list(fail_at)

    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        if train and self.fail_at and step == self.fail_at[0]:
            self.fail_at.pop(0)
            raise StageFault(f"worker w9 stopped responding during step {step}", "w9", True)
        return super().forward(layer, x, train, step)

    def recover(self, fault: StageFault, state: dict[str, np.ndarray]) -> ConvStage:
        self.restore(state)
        return self


def train(run_dir: Path, stage: LocalConvStage, augment: bool, epochs: int = 2,
          start: TrainingState | None = None) -> tuple[list[float], Trainer]:
    data = load_dataset("synthetic", None, limit=320)
    data.test_images, data.test_labels = data.test_images[:32], data.test_labels[:32]
    loop = LoopConfig(epochs=epochs, batch=64, seed=1, progress=False, checkpoint_every=3,
                      augment=augment)
    run_dir.mkdir(parents=True, exist_ok=True)
    with MetricsWriter(run_dir / "metrics.jsonl") as metrics:
        trainer = Trainer(MODEL, init_parameters(MODEL, 0), stage, loop, metrics, run_dir,
                          out=lambda line: None)
        result = trainer.fit(data, start)
    return result.losses, trainer


def test_augmented_training_replays_and_resumes_the_same_batches(tmp_path: Path) -> None:
    clean, _ = train(tmp_path / "clean", FlakyStage([]), augment=True)
    plain, _ = train(tmp_path / "plain", FlakyStage([]), augment=False)
    assert len(clean) == 10 and clean != plain  # augmentation changes the batches
    faulty, _ = train(tmp_path / "faulty", FlakyStage([4, 7, 8]), augment=True)
    assert faulty == clean  # replays from a mid-epoch snapshot, bit for bit
    assert not batch_threads()


class KilledStage(FlakyStage):
    """Interrupted (as by Ctrl-C) in the forward of step ``kill_at``."""

    def __init__(self, kill_at: int):
        super().__init__([])
        self.kill_at = kill_at

    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        if train and step == self.kill_at:
            raise KeyboardInterrupt
        return super().forward(layer, x, train, step)


@pytest.mark.parametrize("kill_at", [4, 7])
def test_an_augmented_run_resumes_with_the_same_batches(tmp_path: Path, kill_at: int) -> None:
    clean, _ = train(tmp_path / "clean", FlakyStage([]), augment=True)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(run, KilledStage(kill_at), augment=True)
    assert not batch_threads()  # the interrupted run left no thread behind
    state = TrainingState.load(run / CHECKPOINT_NAME)
    assert 0 < state.position < 5  # in the middle of an epoch
    resumed, _ = train(run, FlakyStage([]), augment=True, start=state)
    assert resumed == clean  # bit for bit
    assert not batch_threads()
