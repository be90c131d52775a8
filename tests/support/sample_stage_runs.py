"""The sample stage's unit tests' common ground: a tiny network, its batches, a trainer
stepped over a stage (:class:`Run`), the local run to compare with, and the distributed
one over tests/support/fake_sample_cluster.py's in-process workers."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hetconv.engine.optim import OptimizerConfig
from hetconv.engine.stage import LocalConvStage, layer_settings
from hetconv.engine.train_state import TrainingState
from hetconv.engine.training import LoopConfig, Trainer
from hetconv.master.samples.stage import SampleConvStage
from hetconv.metrics import MetricsWriter
from hetconv.model import ModelConfig, init_parameters
from hetconv.names import layer_key
from hetconv.protocol import (
    Message,
    SampleBackwardChain,
    SampleBackwardRound,
    SampleEvaluation,
    SampleForwardChain,
    SampleForwardRound,
    SampleStepChain,
    SampleUpdateRound,
)
from tests.support.fake_sample_cluster import FakeSampleCluster
from tests.support.fake_sample_stage import make_sample_stage

MODEL = ModelConfig(conv_kernels=(4, 6), input_shape=(1, 12, 12), classes=3, kernel_size=3,
                    padding=1)
OPT = OptimizerConfig(momentum=0.9, weight_decay=5e-4)
SETTINGS = layer_settings(MODEL, OPT.momentum, OPT.weight_decay)
BATCH = 8
STEPS = 20  # batches prepared (the trial of the master alone: at most 2 windows + 1)
RTOL, ATOL = 1e-5, 1e-6  # float32: the sums are cut at the slices (test_step_chain.py's)


def _batches() -> tuple[np.ndarray, np.ndarray, list[float]]:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((STEPS, BATCH, *MODEL.input_shape)).astype(np.float32)
    labels = rng.integers(0, MODEL.classes, (STEPS, BATCH))
    return x, labels, [0.05 - 0.001 * step for step in range(STEPS)]


X, LABELS, LR = _batches()

SampleForward = SampleForwardRound | SampleEvaluation | SampleForwardChain | SampleStepChain
FORWARDS = (SampleForwardRound, SampleEvaluation, SampleForwardChain, SampleStepChain)
"""The sample split's requests that run layers forward (one type per mode since protocol 13)."""
SAMPLE_REQUESTS = FORWARDS + (SampleBackwardRound, SampleBackwardChain, SampleUpdateRound)
"""Every request of the sample split."""


def forwards_of(messages: list[Message]) -> list[SampleForward]:
    """The forward requests among ``messages`` (rounds, evaluations, chains), in order."""
    return [m for m in messages if isinstance(m, FORWARDS)]


OPEN: list[Any] = []  # runs to close after each test, whatever its outcome


def close_open_runs() -> None:
    """Close every run a test opened (its worker threads ended), then raise the first
    error one raised."""
    errors = []
    while OPEN:  # every one closed (its worker threads ended), then the first error
        try:
            OPEN.pop().close()
        except Exception as error:
            errors.append(error)
    if errors:
        raise errors[0]


class Run:
    """A trainer over a stage, stepped as ``Trainer.fit`` steps it: each step's timings
    taken, a snapshot (and the re-plan point after it) where asked."""

    def __init__(self, stage: Any, run_dir: Path, name: str):
        OPEN.append(self)
        run_dir.mkdir(exist_ok=True)
        self.metrics = MetricsWriter(run_dir / f"{name}-trainer.jsonl")
        self.trainer = Trainer(MODEL, init_parameters(MODEL, 0), stage,
                               LoopConfig(epochs=1, batch=BATCH, seed=5, optimizer=OPT,
                                          progress=False, checkpoints=False),
                               self.metrics, run_dir, out=lambda line: None)
        self.step = 0
        self.losses: list[float] = []
        self.timings: list[dict[str, Any]] = []

    @property
    def stage(self) -> Any:
        return self.trainer.stage

    def train(self, steps: int = 1) -> None:
        for _ in range(steps):
            record = self.trainer.train_step(X[self.step], LABELS[self.step], self.step,
                                             LR[self.step])
            self.losses.append(record["loss"])
            self.timings.append(self.stage.end_step())
            self.step += 1

    def capture(self) -> TrainingState:
        return self.trainer.capture(self.step, 0, self.step, 0, 0, 0.0, 0.0, self.losses, [])

    def checkpoint(self) -> TrainingState:
        """A snapshot, then the stage's re-plan point (``Trainer._checkpoint``)."""
        state = self.capture()
        self.trainer.stage = self.stage.replan_point(state.conv)
        return state

    def close(self) -> None:
        try:
            self.stage.close()
        finally:
            self.metrics.close()


def local_run(tmp_path: Path, steps: int) -> Run:
    params = init_parameters(MODEL, 0)
    run = Run(LocalConvStage(MODEL, params, SETTINGS), tmp_path / "local", "local")
    run.train(steps)
    return run


def distributed_run(tmp_path: Path, **options: Any) -> tuple[Run, SampleConvStage,
                                                          FakeSampleCluster]:
    run_dir = tmp_path / "dist"
    run_dir.mkdir(exist_ok=True)
    stage, cluster = make_sample_stage(MODEL, init_parameters(MODEL, 0), run_dir,
                                       settings=SETTINGS, batch=BATCH, **options)
    return Run(stage, run_dir, "dist"), stage, cluster


def assert_same_run(dist: Run, local: Run, atol: float = ATOL) -> None:
    """The same losses, conv layers (the master's replicas, velocities and running
    statistics too) and dense part as the local run, which trained."""
    assert dist.step == local.step
    np.testing.assert_allclose(dist.losses, local.losses, rtol=RTOL, atol=atol)
    mine, theirs = dist.stage.snapshot(), local.stage.snapshot()
    assert sorted(mine) == sorted(theirs)
    initial = init_parameters(MODEL, 0)
    assert np.max(np.abs(theirs["conv1.weight"] - initial["conv1.weight"])) > 100 * atol
    for key in theirs:
        np.testing.assert_allclose(mine[key], theirs[key], rtol=RTOL, atol=atol, err_msg=key)
    for key, value in local.trainer.dense.items():
        np.testing.assert_allclose(dist.trainer.dense[key], value, rtol=RTOL, atol=atol,
                                   err_msg=key)


def assert_workers_hold(cluster: FakeSampleCluster, names: list[str],
                        state: dict[str, np.ndarray]) -> None:
    """Every layer of ``state`` whole on each named worker, bit for bit."""
    for name in names:
        shards = cluster.service(name).shards
        assert sorted(shards) == list(range(len(MODEL.conv_kernels))), name
        for layer, shard in shards.items():
            assert (shard.kernel_start, shard.kernel_stop) == (0, MODEL.conv_kernels[layer])
            for key, value in shard.snapshot().items():
                np.testing.assert_array_equal(value, state[layer_key(layer, key)],
                                              err_msg=f"{name} {layer_key(layer, key)}")


def samples_of(stage: Any) -> dict[str, int]:
    return {piece.participant: piece.samples for piece in stage.state.slices}
