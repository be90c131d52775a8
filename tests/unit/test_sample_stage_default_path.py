"""What ``hetconv train`` runs by default under the sample split (the dense part
replicated, two steps in flight, driven by ``Trainer.fit``) over the fake cluster of real
worker services (tests/support/fake_sample_cluster.py): the local run's numbers through
an epoch end and snapshots, a worker lost while a step is in flight ahead, and a wrong
result evicted."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetconv.data.loading import make_synthetic
from hetconv.engine.stage import LocalConvStage
from hetconv.engine.training import LoopConfig, Trainer, TrainResult
from hetconv.master.samples.stage import SampleConvStage
from hetconv.metrics import MetricsWriter
from hetconv.model import dense_parameter_names, init_parameters
from hetconv.protocol import (
    AssignDense,
    EndRun,
    Message,
    SampleBackwardChain,
    SampleBackwardRound,
    SampleForwardChain,
    SampleForwardReply,
    SampleForwardRound,
    SampleStepChain,
    SampleUpdateRound,
)
from tests.support.fake_sample_cluster import FakeSampleCluster
from tests.support.fake_sample_stage import make_sample_stage
from tests.support.sample_stage_runs import (
    ATOL,
    BATCH,
    FORWARDS,
    MODEL,
    OPEN,
    OPT,
    RTOL,
    SETTINGS,
    assert_same_run,
    assert_workers_hold,
    close_open_runs,
)


@pytest.fixture(autouse=True)
def _close_runs() -> Iterator[None]:
    yield
    close_open_runs()


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
