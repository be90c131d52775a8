"""The sample split's distributed conv stage (master/samples/stage.py) driven by the real
trainer over a fake cluster whose workers are real ``WorkerService`` objects computed
in-process (tests/support/fake_sample_cluster.py): its steps give the local run's
numbers, under the star data plane (rounds) and the peer one (chains); a worker lost
mid-step is a fault the stage recovers from over the survivor; re-slicing from measured
compute, a join at a snapshot and the trial of the master alone (both verdicts) keep
the numbers the local run's. What ``hetconv train`` runs by default (the dense part
replicated, two steps in flight, driven by ``Trainer.fit``) gives the local run's
numbers too, through an epoch end, snapshots, a worker lost while a step is in flight
ahead and a wrong result evicted."""
from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetconv.data.loading import make_synthetic
from hetconv.engine.optim import OptimizerConfig
from hetconv.engine.stage import LocalConvStage, StageFault, layer_settings
from hetconv.engine.train_state import TrainingState
from hetconv.engine.training import LoopConfig, Trainer, TrainResult
from hetconv.master.cluster import WorkerLost
from hetconv.master.samples.stage import SampleConvStage
from hetconv.master.samples.trial_alone import TrialAloneStage
from hetconv.metrics import MetricsWriter
from hetconv.model import ModelConfig, dense_parameter_names, init_parameters
from hetconv.names import layer_key
from hetconv.protocol import (
    AssignDense,
    AssignShard,
    CalibrateRequest,
    EndRun,
    Message,
    SampleBackwardChain,
    SampleBackwardRound,
    SampleEvaluation,
    SampleForwardChain,
    SampleForwardReply,
    SampleForwardRound,
    SampleStepChain,
    SampleUpdateRound,
)
from tests.support.fake_sample_cluster import (
    FakeSampleCluster,
    SlowLocalStage,
    make_sample_stage,
)
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

SampleForward = SampleForwardRound | SampleEvaluation | SampleForwardChain | SampleStepChain
FORWARDS = (SampleForwardRound, SampleEvaluation, SampleForwardChain, SampleStepChain)
"""The sample split's requests that run layers forward (one type per mode since protocol 13)."""
SAMPLE_REQUESTS = FORWARDS + (SampleBackwardRound, SampleBackwardChain, SampleUpdateRound)
"""Every request of the sample split."""


def _forwards(messages: list[Message]) -> list[SampleForward]:
    """The forward requests among ``messages`` (rounds, evaluations, chains), in order."""
    return [m for m in messages if isinstance(m, FORWARDS)]


OPEN: list[Run | Fit] = []  # closed after each test, whatever its outcome


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
        forwards = _forwards(cluster.served(name, Message))
        inputs = [m.x for m in forwards if m.x is not None]
        assert [x.shape[0] for x in inputs] == [expected[name]] * 3
        np.testing.assert_array_equal(inputs[0], X[0][start:start + expected[name]])
        start += expected[name]
        chained = ([m.step for m in cluster.served(name, SampleForwardChain)],
                   [m.step for m in cluster.served(name, SampleBackwardChain)])
        if plane == "peer":  # one chain each way a step
            assert chained == ([0, 1, 2], [0, 1, 2])
            assert [m.step for m in forwards] == [0, 1, 2]
        else:  # L + 1 rounds each way a step
            assert chained == ([], [])
            assert [m.step for m in forwards] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
            assert all(isinstance(m, SampleForwardRound) for m in forwards)
    timings = dist.timings[-1]["layers"]
    assert {d["participant"]: d["samples"] for d in timings[0]["participants"]} == expected


# --- 2. a worker lost mid-step ---------------------------------------------------------
def _mid_step(plane: str) -> Any:
    """w1's request of step 1 that loses it: star, the forward round of layer 2; peer,
    the step's forward chain."""
    def when(message: Message) -> bool:
        if plane == "peer":
            return isinstance(message, SampleForwardChain) and message.step == 1
        return isinstance(message, SampleForwardRound) and message.step == 1 \
            and message.start_layer == 1
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
    final = _samples(stage)  # measured under whatever else the host runs: may move again
    assert sum(final.values()) == BATCH and final["w1"] < 3, final
    inputs = [m.x.shape[0] for m in _forwards(cluster.served("w2", Message))
              if m.x is not None]
    assert inputs[-1] == final["w2"]
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
    assert [m.x.shape[0] for m in _forwards(cluster.served("w3", Message))
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
    assert not [m for m in cluster.sent_to("w1", Message, before)
                if isinstance(m, SAMPLE_REQUESTS)]
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
    replans = [json.loads(line) for line in
               (tmp_path / "dist" / "metrics.jsonl").read_text().splitlines()
               if '"type":"replan"' in line]
    assert [r["reason"].split(":")[0] for r in replans] == [
        "trying the master alone",
        "the master alone was slower" if slow_alone else "slower than the master alone"]
    if slow_alone:
        assert replans[1]["alone_step_s"] > replans[1]["measured_step_s"]
    else:
        assert replans[1]["measured_step_s"] > replans[1]["alone_step_s"]
    dist.train(1)
    if slow_alone:  # with the workers again
        assert _samples(stage) == {"master": 3, "w1": 3, "w2": 2}
        assert [m.step for m in _forwards(cluster.sent_to("w1", Message, before))
                if m.x is not None] == [dist.step - 1]
    local = _local(tmp_path, dist.step)
    assert_same_run(dist, local, atol=1e-5)


# --- 5b. the trial without a worker too slow for its slice -----------------------------
@dataclasses.dataclass(frozen=True)
class BusyWorker(WorkerFaults):
    """A worker whose every request costs ``per_request_s`` more (its machine busy
    with something else): its per-step work holds every barrier, whatever its slice."""

    per_request_s: float = 0.0

    def any(self) -> bool:
        return True

    def at_step(self, step: int, shards: Any) -> None:
        time.sleep(self.per_request_s)
        super().at_step(step, shards)


@pytest.mark.parametrize("plane", ["star", "peer"])
def test_a_worker_too_slow_for_its_slice_is_tried_without_and_left_out(tmp_path: Path,
                                                                        plane: str) -> None:
    """The master computes nothing (``--no-local``: no master-alone estimate); w3 is
    calibrated so slow that its slice is empty, yet it applies every update, and busy
    with something else it holds every step. At the snapshot after a window of steps the
    run goes on without it (set aside, waiting); at the next one, shorter without, it is
    left out for the run, said and recorded; it is not taken in again as a joiner. Every
    step is the local run's."""
    from hetconv.master.samples.trial_without import WITHOUT_WINDOW

    dist, stage, cluster = _distributed(
        tmp_path, workers=("w1", "w2", "w3"), master_computes=False, fall_back=True,
        data_plane=plane, seconds={"w1": 1.0, "w2": 1.0, "w3": 100.0},
        faults={"w3": BusyWorker(per_request_s=0.02)})
    dist.train(WITHOUT_WINDOW + 1)  # the first step after a snapshot gives no period
    assert _samples(stage) == {"w1": 4, "w2": 4, "w3": 0}
    dist.checkpoint()
    assert any(line.startswith("hetconv: trying without w3: its slice is 0 of 8 samples")
               for line in cluster.lines), cluster.lines
    before = len(cluster.sent)
    dist.train(WITHOUT_WINDOW + 1)
    assert _samples(stage) == {"w1": 4, "w2": 4}
    assert not [m for m in cluster.sent_to("w3", Message, before)
                if isinstance(m, SAMPLE_REQUESTS)]  # it waits
    dist.checkpoint()
    assert any(line.startswith("hetconv: not used from now on: w3 (the step measured")
               for line in cluster.lines), cluster.lines
    replans = [json.loads(line) for line in
               (tmp_path / "dist" / "metrics.jsonl").read_text().splitlines()
               if '"type":"replan"' in line]
    kept_out = [r for r in replans if r.get("left_out") == ["w3"]]
    assert len(kept_out) == 1 and kept_out[0]["measured_step_s"] < kept_out[0]["with_step_s"]
    dist.checkpoint()  # w3 still connected, never taken in again
    assert _samples(stage) == {"w1": 4, "w2": 4} and dist.stage is stage
    assert not cluster.sent_to("w3", AssignShard, before)
    assert_same_run(dist, _local(tmp_path, dist.step))


# --- 6. the default path: the dense part replicated, two steps in flight ---------------
FIT_DATA = make_synthetic(5 * BATCH, 16, MODEL.input_shape, MODEL.classes, seed=3)
FIT_LOOP = LoopConfig(epochs=2, batch=BATCH, seed=5, optimizer=OPT, progress=False,
                      checkpoint_every=3, checkpoints=False)
FIT_STEPS = 10  # 5 steps an epoch, 2 epochs
SNAPSHOTS = [0, 3, 5, 5, 6, 9, 10, 10]
"""The steps of ``Trainer.fit``'s snapshots: the start, every 3 steps within an epoch, and
each epoch's end (once its training is done, once after its summary)."""
SENT_AHEAD = [1, 2, 4, 7, 8]
"""The steps ``Trainer.fit`` sends ahead (``_may_run_ahead``): every step but the first
of an epoch (0, 5) and those right after a snapshot (3, 6, 9)."""


class Fit:
    """``Trainer.fit`` (what ``hetconv train`` runs) over a stage, on FIT_DATA; its
    records and console lines kept."""

    def __init__(self, stage: Any, run_dir: Path, name: str):
        OPEN.append(self)
        run_dir.mkdir(exist_ok=True)
        self.metrics = MetricsWriter(run_dir / f"{name}-trainer.jsonl")
        self.records: list[dict[str, Any]] = []
        self.metrics.observers.append(self.records.append)
        self.lines: list[str] = []
        self.trainer = Trainer(MODEL, init_parameters(MODEL, 0), stage, FIT_LOOP,
                               self.metrics, run_dir, out=self.lines.append)
        self.result = TrainResult([], [])

    @property
    def stage(self) -> Any:
        return self.trainer.stage

    @property
    def step(self) -> int:
        return len(self.result.losses)

    @property
    def losses(self) -> list[float]:
        return self.result.losses

    def fit(self) -> None:
        self.result = self.trainer.fit(FIT_DATA)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["type"] == kind]

    def close(self) -> None:
        try:
            self.stage.close()
        finally:
            self.metrics.close()


def _fit_local(tmp_path: Path) -> Fit:
    fit = Fit(LocalConvStage(MODEL, init_parameters(MODEL, 0), SETTINGS),
              tmp_path / "local-fit", "local")
    fit.fit()
    return fit


def _fit_default(tmp_path: Path) -> tuple[Fit, SampleConvStage, FakeSampleCluster]:
    """The default path: the peer data plane, the dense part replicated, two steps in
    flight; the Trainer attaches its dense part (AssignDense to every worker)."""
    run_dir = tmp_path / "dist-fit"
    run_dir.mkdir(exist_ok=True)
    stage, cluster = make_sample_stage(MODEL, init_parameters(MODEL, 0), run_dir,
                                       settings=SETTINGS, batch=BATCH, data_plane="peer",
                                       dense_replicas=True, steps_in_flight=2)
    return Fit(stage, run_dir, "dist"), stage, cluster


def assert_same_fit(dist: Fit, local: Fit) -> None:
    """The same run as the local one (assert_same_run) and the same epoch summaries
    (the evaluation on the test set included)."""
    assert dist.step == FIT_STEPS
    assert_same_run(dist, local)  # type: ignore[arg-type]
    assert len(dist.result.epochs) == len(local.result.epochs) == FIT_LOOP.epochs
    for mine, theirs in zip(dist.result.epochs, local.result.epochs):
        for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy"):
            np.testing.assert_allclose(mine[key], theirs[key], rtol=RTOL, atol=ATOL,
                                       err_msg=key)


def assert_workers_hold_dense(cluster: FakeSampleCluster, names: list[str],
                              dense: dict[str, np.ndarray]) -> None:
    """Each named worker's replica of the dense part is ``dense``, bit for bit."""
    for name in names:
        replica = cluster.service(name).sample.layers.dense
        assert replica is not None, name
        assert sorted(replica.part.arrays) == sorted(dense), name
        for key, value in dense.items():
            np.testing.assert_array_equal(replica.part.arrays[key], value,
                                          err_msg=f"{name} {key}")


def _step_samples(fit: Fit, step: int) -> dict[str, int]:
    """The slices of ``step`` by its (last) step record."""
    record = [r for r in fit.of("step") if r["step"] == step][-1]
    return {d["participant"]: d["samples"] for d in record["layers"][0]["participants"]}


def _chain_requests(cluster: FakeSampleCluster, name: str, step: int,
                    since: int = 0) -> list[tuple[int, SampleStepChain]]:
    """(index in ``cluster.sent``, request) of the step chains of ``step`` sent to
    ``name`` from ``sent[since]`` on."""
    return [(index, m) for index, (who, m) in enumerate(cluster.sent)
            if index >= since and who == name and isinstance(m, SampleStepChain)
            and m.step == step]


def _chain_gathered(cluster: FakeSampleCluster, step: int) -> int:
    """``len(cluster.sent)`` when the first gather of step ``step``'s chain began."""
    return next(at for at, what in cluster.gathers if what == f"step chain (step {step})")


def test_the_default_path_over_two_workers_equals_the_local_run(tmp_path: Path) -> None:
    """``hetconv train``'s default: every worker gets the dense part (AssignDense) and
    the peers' plan a layer for it; ``Trainer.fit`` runs two epochs as step chains
    (nothing layer by layer), each step but the first of an epoch and those after a
    snapshot sent before the one before it was gathered; its snapshots and epoch ends
    read the replicas in between. The losses, epoch summaries, conv layers and dense
    part are the local run's; every worker holds them; nothing was abandoned."""
    local = _fit_local(tmp_path)
    dist, stage, cluster = _fit_default(tmp_path)
    assert stage.replicates_dense and stage.runs_ahead and dist.trainer.runs_ahead()
    dense_values = sum(int(dist.trainer.dense[n].size) for n in dense_parameter_names(MODEL))
    layers = len(MODEL.conv_kernels)
    for name in ("w1", "w2"):
        assert len(cluster.served(name, AssignDense)) == 1
        exchange = cluster.service(name).sample.layers.exchange
        assert exchange is not None
        plan = exchange.plan
        assert len(plan.layers) == layers + 1
        assert sum(r.stop - r.start for r in plan.layers[layers]) == dense_values
    peers: Any = stage.peers  # FakeSamplePeers
    assert len(peers.plans[-1].layers) == layers + 1  # the master's plan alike
    assert_workers_hold_dense(cluster, ["w1", "w2"], dist.trainer.dense)

    dist.fit()

    assert_same_fit(dist, local)
    assert [r["step"] for r in dist.of("checkpoint")] == SNAPSHOTS
    assert [r["step"] for r in dist.of("step") if r["sent_ahead"]] == SENT_AHEAD
    assert not dist.of("recovery")
    assert _step_samples(dist, FIT_STEPS - 1) == {"master": 3, "w1": 3, "w2": 2}
    for name in ("w1", "w2"):
        chains = cluster.served(name, SampleStepChain)
        assert [m.step for m in chains] == list(range(FIT_STEPS))
        flushes = cluster.served(name, SampleUpdateRound)  # update-only, at snapshots
        assert [m.step for m in flushes] == [s - 1 for s in (3, 5, 6, 9, 10)]
        assert cluster.served(name, SampleBackwardRound) == []  # nothing layer by layer
        assert cluster.served(name, SampleBackwardChain) == []
        assert cluster.served(name, SampleForwardRound) == []
        assert cluster.served(name, SampleForwardChain) == []
    for step in range(1, FIT_STEPS):  # on the wire: sent before the step before gathered
        sent_at = _chain_requests(cluster, "w1", step)[0][0]
        assert (sent_at < _chain_gathered(cluster, step - 1)) == (step in SENT_AHEAD), step
    assert_workers_hold(cluster, ["w1", "w2"], dist.stage.snapshot())
    assert_workers_hold_dense(cluster, ["w1", "w2"], dist.trainer.dense)
    assert cluster.membership.abandoned == [] and cluster.stray_errors() == []


FAULT_STEP = 7
"""The step that fails: sent ahead itself (from step 6), and step 8 is sent ahead of it;
the last snapshot before it is at step 6."""


def _chain_of(step: int) -> Any:
    def when(message: Message) -> bool:
        return isinstance(message, SampleStepChain) and message.step == step
    return when


def _recovery_began(cluster: FakeSampleCluster) -> int:
    """``len(cluster.sent)`` when the recovery's first gather began: every step chain
    sent before it was sent before the fault."""
    return next(at for at, what in cluster.gathers if what.startswith("recovery from"))


def assert_abandoned(cluster: FakeSampleCluster, survivors: list[str],
                     in_flight: list[tuple[str, int]]) -> None:
    """The step chains of the failed step and the one ahead sent before the recovery
    are ``in_flight`` (worker, step); each was abandoned (its late answer dropped
    quietly), and no request is stray (sent, never awaited nor abandoned:
    ``Membership`` would make its late error a fault); the survivors answered theirs
    (their chains of the abandoned steps ended)."""
    before = _recovery_began(cluster)
    sent = [(who, m) for who, m in cluster.sent[:before]
            if isinstance(m, SampleStepChain) and m.step >= FAULT_STEP]
    assert sorted((who, m.step) for who, m in sent) == in_flight
    assert [(who, m.step) for who, m in sent
            if m.request_id not in cluster.membership.abandoned] == []
    assert cluster.stray_errors() == []
    for who, m in sent:
        if who in survivors:
            cluster.answer(m.request_id)


@pytest.mark.parametrize("lost,at,step,in_flight", [
    pytest.param("w1", "gather", FAULT_STEP, [("w1", 7), ("w1", 8), ("w2", 7), ("w2", 8)],
                 id="never-answers-the-step-in-flight"),
    pytest.param("w1", "send", FAULT_STEP + 1, [("w1", 7), ("w2", 7)],
                 id="lost-sending-the-step-ahead"),
    pytest.param("w2", "send", FAULT_STEP + 1, [("w1", 7), ("w1", 8), ("w2", 7)],
                 id="lost-sending-the-step-ahead-after-w1")])
def test_a_worker_lost_while_a_step_is_in_flight_ahead_is_recovered_over_the_survivor(
        tmp_path: Path, lost: str, at: str, step: int,
        in_flight: list[tuple[str, int]]) -> None:
    """In step 7 (itself sent ahead), a worker is lost while step 8 is in flight ahead:
    w1 never answers step 7 (step 8 went out meanwhile), or a worker is lost as step 8
    is sent ahead (w1 first in slice order: nothing of step 8 left; w2: after w1's
    request left). The stage raises the fault (the trainer's recovery record names
    it, gone, at step 7); every request of steps 7 and 8 sent before the recovery is
    abandoned and none stray (a late answer breaks nothing); the recovery gives the
    survivor the snapshot of step 6 (layers and dense part) and the replayed steps over
    the master and the survivor, sent ahead again, are the local run's; nothing is
    sent to the lost worker any more."""
    local = _fit_local(tmp_path)
    dist, stage, cluster = _fit_default(tmp_path)
    survivor = "w2" if lost == "w1" else "w1"
    cluster.lose(lost, _chain_of(step), at=at)

    dist.fit()

    [recovery] = dist.of("recovery")
    assert (recovery["failed_step"], recovery["resumed_step"]) == (FAULT_STEP, 6)
    assert (recovery["participant"], recovery["gone"]) == (lost, True)
    assert any(line.startswith(f"hetconv: worker {lost}") and "replaying 1 step" in line
               for line in dist.lines)
    assert stage.control.active == {survivor} and cluster.dropped == []
    assert_same_fit(dist, local)
    assert _step_samples(dist, FIT_STEPS - 1) == {"master": 4, survivor: 4}
    steps = [r["step"] for r in dist.of("step")]
    assert steps == list(range(FAULT_STEP)) + list(range(6, FIT_STEPS))
    assert [r["step"] for r in dist.of("step") if r["sent_ahead"]] == SENT_AHEAD
    assert_abandoned(cluster, [survivor], in_flight)
    assert not [m for who, m in cluster.sent[_recovery_began(cluster):] if who == lost]
    assert len(cluster.served(survivor, AssignDense)) >= 2  # again at the recovery
    assert_workers_hold(cluster, [survivor], dist.stage.snapshot())
    assert_workers_hold_dense(cluster, [survivor], dist.trainer.dense)


def _wrong_loss(reply: Message) -> Message:
    assert isinstance(reply, SampleForwardReply), reply
    return replace(reply, loss_sum=-1.0 - reply.loss_sum)


def _wrong_count(reply: Message) -> Message:
    assert isinstance(reply, SampleForwardReply), reply
    return replace(reply, correct=reply.correct + BATCH)


@pytest.mark.parametrize("wrong", [_wrong_loss, _wrong_count],
                         ids=["negative-loss", "more-correct-than-samples"])
def test_a_wrong_result_on_the_default_path_is_evicted(tmp_path: Path, wrong: Any) -> None:
    """w1 answers step 7's chain (step 8 already sent ahead) with a negative loss, or
    more correct answers than its samples: the stage raises a fault naming it to be
    evicted (not gone); the step sent ahead is abandoned; the recovery drops w1 (it
    is told the run is over, and nothing more is sent to it), gives w2 the snapshot of
    step 6, and the replayed steps are the local run's."""
    local = _fit_local(tmp_path)
    dist, stage, cluster = _fit_default(tmp_path)
    cue = cluster.tamper("w1", _chain_of(FAULT_STEP), wrong)

    dist.fit()

    assert cue.fired
    [recovery] = dist.of("recovery")
    assert (recovery["failed_step"], recovery["resumed_step"]) == (FAULT_STEP, 6)
    assert (recovery["participant"], recovery["gone"]) == ("w1", False)
    assert "sent a loss of" in recovery["reason"] and "evicting it" in recovery["reason"]
    assert stage.control.active == {"w2"} and stage.control.evictions == {"w1": 1}
    assert cluster.dropped == ["w1"]
    last, ahead = max((i, m) for i, (who, m) in enumerate(cluster.sent)
                      if who == "w1" and isinstance(m, FORWARDS))
    assert ahead.step == FAULT_STEP + 1  # the step sent ahead, then
    assert [type(m) for who, m in cluster.sent[last + 1:] if who == "w1"] == [EndRun]
    assert_same_fit(dist, local)
    assert _step_samples(dist, FIT_STEPS - 1) == {"master": 4, "w2": 4}
    assert [r["step"] for r in dist.of("step") if r["sent_ahead"]] == SENT_AHEAD
    assert_abandoned(cluster, ["w2"], [("w1", 7), ("w1", 8), ("w2", 7), ("w2", 8)])
    assert_workers_hold(cluster, ["w2"], dist.stage.snapshot())
    assert_workers_hold_dense(cluster, ["w2"], dist.trainer.dense)
