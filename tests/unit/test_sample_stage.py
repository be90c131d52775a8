"""The sample split's distributed conv stage (master/samples/stage.py) driven by the real
trainer over a fake cluster whose workers are real ``WorkerService`` objects computed
in-process (tests/support/fake_sample_cluster.py): its steps give the local run's
numbers, under the star data plane (rounds) and the peer one (chains); a worker lost
mid-step is a fault the stage recovers from over the survivor; re-slicing from measured
compute, a join at a snapshot and the trial of the master alone (both verdicts) keep
the numbers the local run's."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetconv.engine.optim import OptimizerConfig
from hetconv.engine.stage import LocalConvStage, StageFault, layer_settings
from hetconv.engine.train_state import TrainingState
from hetconv.engine.training import LoopConfig, Trainer
from hetconv.master.cluster import WorkerLost
from hetconv.master.samples.stage import SampleConvStage
from hetconv.master.samples.trial_alone import TrialAloneStage
from hetconv.metrics import MetricsWriter
from hetconv.model import ModelConfig, init_parameters
from hetconv.names import layer_key
from hetconv.protocol import (
    AssignShard,
    CalibrateRequest,
    Message,
    SampleBackwardRequest,
    SampleForwardRequest,
)
from tests.support.fake_sample_cluster import FakeSampleCluster, SlowLocalStage, make_sample_stage
from tests.support.faulty_worker import WorkerFaults

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


OPEN: list[Run] = []  # closed after each test, whatever its outcome


@pytest.fixture(autouse=True)
def _close_runs() -> Iterator[None]:
    yield
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


def _local(tmp_path: Path, steps: int) -> Run:
    params = init_parameters(MODEL, 0)
    run = Run(LocalConvStage(MODEL, params, SETTINGS), tmp_path / "local", "local")
    run.train(steps)
    return run


def _distributed(tmp_path: Path, **options: Any) -> tuple[Run, SampleConvStage,
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


def _samples(stage: Any) -> dict[str, int]:
    return {piece.participant: piece.samples for piece in stage.state.slices}


# --- 1. a training step ----------------------------------------------------------------
@pytest.mark.parametrize("plane,master_computes", [("star", True), ("peer", True),
                                                   ("star", False), ("peer", False)],
                         ids=["star", "peer", "star-workers-only", "peer-workers-only"])
def test_steps_over_two_workers_equal_the_local_run(tmp_path: Path, plane: str,
                                                    master_computes: bool) -> None:
    """Three steps (the first without an update pending, the others carrying the one
    before): the losses, every conv layer and the dense part are the local run's, and
    every worker holds the master's replicas exactly. Each worker computed its own
    slice: star, 2L + 2 rounds a step; peer, one forward and one backward chain."""
    local = _local(tmp_path, 3)
    dist, stage, cluster = _distributed(tmp_path, data_plane=plane,
                                        master_computes=master_computes)
    dist.train(3)
    expected = {"master": 3, "w1": 3, "w2": 2} if master_computes else {"w1": 4, "w2": 4}
    assert _samples(stage) == expected
    assert_same_run(dist, local)
    assert_workers_hold(cluster, ["w1", "w2"], dist.stage.snapshot())
    start = expected.get("master", 0)  # the slices in participant order
    for name in ("w1", "w2"):
        forwards = cluster.served(name, SampleForwardRequest)
        backwards = cluster.served(name, SampleBackwardRequest)
        inputs = [m.x for m in forwards if m.x is not None]
        assert [x.shape[0] for x in inputs] == [expected[name]] * 3
        np.testing.assert_array_equal(inputs[0], X[0][start:start + expected[name]])
        start += expected[name]
        chained = ([m.step for m in forwards if m.sync_id > 0],
                   [m.step for m in backwards if m.sync_id > 0])
        if plane == "peer":  # one chain each way a step
            assert chained == ([0, 1, 2], [0, 1, 2])
        else:  # L + 1 rounds each way a step
            assert chained == ([], [])
            assert [m.step for m in forwards] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    timings = dist.timings[-1]["layers"]
    assert {d["participant"]: d["samples"] for d in timings[0]["devices"]} == expected


# --- 2. a worker lost mid-step ---------------------------------------------------------
def _mid_step(plane: str) -> Any:
    """w1's request of step 1 that loses it: star, the forward round of layer 2; peer,
    the step's forward chain."""
    def when(message: Message) -> bool:
        if not isinstance(message, SampleForwardRequest) or message.step != 1:
            return False
        return plane == "peer" or message.start_layer == 1
    return when


@pytest.mark.parametrize("plane", ["star", "peer"])
@pytest.mark.parametrize("at", ["send", "gather"])
def test_a_worker_lost_mid_step_is_a_fault_recovered_over_the_survivor(
        tmp_path: Path, plane: str, at: str) -> None:
    """w1 is lost in step 1 (its send fails, or it never answers): the step raises a
    StageFault naming it as gone; the recovery evicts it, slices the batch over the
    master and w2, hands w2 the snapshot's layers, and the replayed steps are the
    local run's. Nothing is sent to w1 any more."""
    local = _local(tmp_path, 3)
    dist, stage, cluster = _distributed(tmp_path, data_plane=plane)
    dist.train(1)
    state = dist.capture()
    cue = cluster.lose("w1", _mid_step(plane), at=at)
    with pytest.raises(StageFault) as caught:
        dist.train(1)
    fault = caught.value
    assert cue.fired and isinstance(fault, WorkerLost)
    assert (fault.participant, fault.gone) == ("w1", True)
    before = len(cluster.sent)
    dist.trainer.stage = stage.recover(fault, state.conv)  # Trainer._recover's order
    dist.trainer.restore(state)
    assert dist.stage is stage and stage.control.active == {"w2"}
    assert cluster.dropped == []  # gone: nobody to tell
    assert any("re-plan (recovery from: worker w1" in line for line in cluster.lines)
    assert {m.layer for m in cluster.sent_to("w2", AssignShard, before)} == {0, 1}
    assert_workers_hold(cluster, ["w2"], state.conv)
    dist.step, dist.losses = state.step, list(state.losses)  # replay from the snapshot
    dist.train(2)
    assert _samples(stage) == {"master": 4, "w2": 4}
    assert not cluster.sent_to("w1", Message, before)
    assert_same_run(dist, local)
    assert_workers_hold(cluster, ["w2"], dist.stage.snapshot())


def test_the_last_worker_lost_while_re_slicing_leaves_the_master_alone(tmp_path: Path) -> None:
    """w1 is lost mid-step, then w2 while it takes the snapshot's layers: the state
    machine gives the run to the master alone, which replays the local run's steps."""
    local = _local(tmp_path, 3)
    dist, stage, cluster = _distributed(tmp_path)
    dist.train(1)
    state = dist.capture()
    cluster.lose("w1", _mid_step("star"))
    cluster.lose("w2", lambda message: isinstance(message, AssignShard))
    with pytest.raises(StageFault) as caught:
        dist.train(1)
    dist.trainer.stage = stage.recover(caught.value, state.conv)
    dist.trainer.restore(state)
    assert isinstance(dist.stage, LocalConvStage)
    assert stage.control.active == set() and stage.control.evictions == {"w1": 1, "w2": 1}
    dist.step, dist.losses = state.step, list(state.losses)
    dist.train(2)
    assert_same_run(dist, local)


# --- 3. re-slicing from measured compute -----------------------------------------------
@pytest.mark.parametrize("plane", ["star", "peer"])
def test_re_slicing_from_measured_compute_keeps_the_local_numbers(tmp_path: Path,
                                                                  plane: str) -> None:
    """w1 calibrated as fast as the rest but trains far slower (tests/support/faulty_worker.py's
    delay, inside its measured compute): after the first window of steps the stage
    re-slices the batch with fewer samples for w1, and the steps before and after the
    re-slice are the local run's."""
    from hetconv.master.samples.balance import REBALANCE_WINDOW

    steps = REBALANCE_WINDOW + 2
    local = _local(tmp_path, steps)
    dist, stage, cluster = _distributed(
        tmp_path, data_plane=plane, rebalancing=True,
        faults={"w1": WorkerFaults(delay_per_kernel_s=0.0015)})
    dist.train(REBALANCE_WINDOW - 1)
    assert _samples(stage) == {"master": 3, "w1": 3, "w2": 2}
    dist.train(1)  # the window is full: its timings re-slice
    after = _samples(stage)
    assert sum(after.values()) == BATCH and after["w1"] < 3, after
    assert any("re-sliced the batch from measured compute" in line for line in cluster.lines)
    dist.train(steps - REBALANCE_WINDOW)
    assert _samples(stage) == after
    inputs = [m.x.shape[0] for m in cluster.served("w2", SampleForwardRequest)
              if m.x is not None]
    assert inputs[-1] == after["w2"]
    assert_same_run(dist, local)
    assert_workers_hold(cluster, ["w1", "w2"], dist.stage.snapshot())


# --- 4. a join at a snapshot -----------------------------------------------------------
@pytest.mark.parametrize("plane", ["star", "peer"])
def test_a_worker_waiting_at_a_snapshot_joins_with_the_layers_and_a_slice(
        tmp_path: Path, plane: str) -> None:
    """At a snapshot with nobody waiting nothing changes; with w3 waiting, it is
    calibrated, gets every whole layer of the snapshot (nothing rolls back) and a slice
    of the next steps, which are the local run's."""
    local = _local(tmp_path, 3)
    dist, stage, cluster = _distributed(tmp_path, data_plane=plane)
    dist.train(1)
    before = len(cluster.sent)
    dist.checkpoint()
    assert dist.stage is stage and not cluster.sent_to("w1", AssignShard, before)
    cluster.add_worker("w3", calibrated_s=1.0)
    before = len(cluster.sent)
    state = dist.checkpoint()
    assert dist.stage is stage and stage.control.active == {"w1", "w2", "w3"}
    assert len(cluster.sent_to("w3", CalibrateRequest, before)) == len(MODEL.conv_kernels)
    assert {m.layer for m in cluster.sent_to("w3", AssignShard, before)} == {0, 1}
    assert_workers_hold(cluster, ["w1", "w2", "w3"], state.conv)
    assert "w3" in cluster.members
    dist.train(2)
    assert _samples(stage) == {"master": 2, "w1": 2, "w2": 2, "w3": 2}
    assert [m.x.shape[0] for m in cluster.served("w3", SampleForwardRequest)
            if m.x is not None] == [2, 2]
    assert_same_run(dist, local)
    assert_workers_hold(cluster, ["w1", "w2", "w3"], dist.stage.snapshot())


# --- 5. the trial of the master alone --------------------------------------------------
@pytest.mark.parametrize("verdict", ["stay alone", "go back"])
def test_the_trial_of_the_master_alone_stays_alone_or_goes_back(tmp_path: Path,
                                                                verdict: str) -> None:
    """Workers far slower in training than the master's estimate of itself alone: at
    the snapshot after the first window the master trains alone on trial (the workers
    wait); once the trial can decide, a snapshot there keeps the master alone when it
    was faster, or hands the workers the trial's state and trains on with them when it
    was slower (the setup's master alone made slow). Either way the steps are the
    local run's."""
    from hetconv.master.samples.fall_back import ALONE_WINDOW, EARLY_STEPS

    slow_alone = verdict == "go back"
    dist, stage, cluster = _distributed(
        tmp_path, fall_back=True, local_delay_s=0.02 if slow_alone else 0.0,
        faults={name: WorkerFaults(delay_per_kernel_s=0.001) for name in ("w1", "w2")})
    dist.train(ALONE_WINDOW)
    dist.checkpoint()
    trial = dist.stage
    assert isinstance(trial, TrialAloneStage) and trial.waiting is stage
    assert any("trying the master alone" in line for line in cluster.lines)
    before = len(cluster.sent)
    while not trial.wants_replan_point():
        dist.train(1)
        assert dist.step <= 2 * ALONE_WINDOW
    assert EARLY_STEPS <= dist.step - ALONE_WINDOW <= ALONE_WINDOW
    assert not cluster.sent_to("w1", SampleForwardRequest, before)
    assert not cluster.sent_to("w1", SampleBackwardRequest, before)
    state = dist.checkpoint()
    if slow_alone:
        assert dist.stage is stage
        assert any("the master alone was slower" in line for line in cluster.lines)
        assert_workers_hold(cluster, ["w1", "w2"], state.conv)
    else:
        assert isinstance(dist.stage, LocalConvStage) and not isinstance(dist.stage,
                                                                         SlowLocalStage)
        assert any("slower than the master alone" in line for line in cluster.lines)
        assert cluster.closed  # the sample stage was closed: the workers released
        assert not cluster.service("w1").shards and not cluster.service("w2").shards
    dist.train(1)
    if slow_alone:  # with the workers again
        assert _samples(stage) == {"master": 3, "w1": 3, "w2": 2}
        assert [m.step for m in cluster.sent_to("w1", SampleForwardRequest, before)
                if m.x is not None] == [dist.step - 1]
    local = _local(tmp_path, dist.step)
    assert_same_run(dist, local, atol=1e-5)
