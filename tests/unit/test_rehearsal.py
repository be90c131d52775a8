"""Set-up's rehearsal of the first plan (master/samples/rehearsal.py): the choice is pure;
the rehearsal itself runs the default path's step chains over the fake cluster of real
worker services and leaves no trace: the run that follows is the local run, bit for bit
as the default path's test holds it, and every worker holds what the master holds."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hetconv.master.alone_first import AloneMeasure, first_choice
from hetconv.master.kernels.rehearsal import KernelRehearsal
from hetconv.master.rehearsal_steps import (
    REHEARSAL_BAND,
    REHEARSAL_MAX_STEPS,
    REHEARSAL_PRECISION,
    REHEARSAL_STEPS,
    REHEARSAL_WARMUP,
    enough_steps,
    median_error,
)
from hetconv.master.samples.rehearsal import rehearse_first_plan
from hetconv.master.samples.stage import SampleConvStage
from hetconv.master.samples.step_model import MODEL_TOLERANCE
from hetconv.metrics import MetricsWriter
from hetconv.model import init_parameters
from hetconv.protocol import SampleStepChain
from tests.support.fake_sample_cluster import FakeSampleCluster
from tests.support.fake_sample_stage import make_sample_stage
from tests.support.sample_stage_runs import (
    BATCH,
    MODEL,
    SETTINGS,
    close_open_runs,
)
from tests.unit.test_sample_stage_default_path import Fit, _fit_local, assert_same_fit


@pytest.fixture(autouse=True)
def _close_runs() -> Iterator[None]:
    yield
    close_open_runs()


def test_the_choice_holds_the_rehearsed_step_to_the_master_alone() -> None:
    def rehearsed_choice(predicted_s: float, alone_s: float, band: float) -> Any:
        return first_choice(predicted_s, alone_s, band, "the rehearsed plan predicted")

    alone = rehearsed_choice(0.050, 0.050, 0.10)
    assert alone.alone and not alone.unsure and "no slower" in alone.why
    unsure = rehearsed_choice(0.050, 0.054, 0.10)
    assert not unsure.alone and unsure.unsure and "within the model's 10% error" in unsure.why
    sure = rehearsed_choice(0.050, 0.056, 0.10)
    assert not sure.alone and not sure.unsure
    assert sure.why == ("the rehearsed plan predicted at 50.0 ms a step, the master alone "
                        "measured at 56.0 ms: faster even 10% slower than predicted")


def test_the_rehearsal_times_steps_until_their_median_is_known() -> None:
    steady = [0.050] * REHEARSAL_STEPS  # no spread: the median is known at the least
    assert median_error(steady) == 0.0 and enough_steps(steady)
    assert not enough_steps(steady[:-1])  # fewer than the least, however steady
    # the demo's swing: +-20 % around 55 ms; its error falls with the square root of n
    swing = [0.044, 0.066, 0.050, 0.060, 0.047, 0.063]
    error6 = median_error(swing)  # MAD 8 ms: 1.2533 * 1.4826 * 8 / sqrt(6) / 55 = 11 %
    assert error6 == pytest.approx(1.2533 * 1.4826 * 0.008 / 6 ** 0.5 / 0.055, rel=1e-3)
    assert not enough_steps(swing)
    assert median_error(swing * 4) == pytest.approx(error6 / 2, rel=1e-3)
    assert enough_steps(swing * 4)  # 20 and more: the most, whatever the error
    assert error6 / 2 > REHEARSAL_PRECISION and REHEARSAL_MAX_STEPS <= 24
    assert median_error([0.05]) == float("inf") and median_error([0.0, 0.0]) == float("inf")


def test_a_kernel_plans_figure_is_its_median_step_held_to_the_same_band() -> None:
    assert REHEARSAL_BAND == MODEL_TOLERANCE  # one band for both splits' rehearsals
    outcome = KernelRehearsal((0.040, 0.036, 0.052, 0.038, 0.041, 0.039, 0.044), 0.42, 0.0169)
    assert outcome.measured_s == 0.040
    assert outcome.line() == ("hetconv: rehearsed the kernel plan (7 steps at learning rate 0, "
                              "0.42 s): 40.0 ms a step (the planner predicted 16.9 from "
                              "calibration)")
    record = outcome.as_record()
    assert record["split_by"] == "kernels" and record["predicted_step_s"] == 0.040
    assert record["steps"] == 7 and record["planner_predicted_step_s"] == 0.0169
    assert "planner predicted" not in KernelRehearsal((0.04,), 0.1, None).line()


def _default_stage(tmp_path: Path) -> tuple[SampleConvStage, FakeSampleCluster, Path]:
    run_dir = tmp_path / "dist-fit"
    run_dir.mkdir(exist_ok=True)
    stage, cluster = make_sample_stage(MODEL, init_parameters(MODEL, 0), run_dir,
                                       settings=SETTINGS, batch=BATCH, data_plane="peer",
                                       dense_replicas=True, steps_in_flight=2)
    return stage, cluster, run_dir


def _rehearse(stage: SampleConvStage, tmp_path: Path, alone: AloneMeasure | None
              ) -> tuple[Any, list[dict[str, Any]], list[str]]:
    records: list[dict[str, Any]] = []
    lines: list[str] = []
    with MetricsWriter(tmp_path / "setup.jsonl") as metrics:
        metrics.observers.append(records.append)
        first = rehearse_first_plan(stage, MODEL, init_parameters(MODEL, 0), BATCH, alone,
                                    metrics, lines.append)
    return first, records, lines


@pytest.mark.parametrize("alone_s,expected", [(None, False), (1e-7, True), (1e3, False)],
                         ids=["no-alone-figure", "alone-faster", "plan-faster"])
def test_a_rehearsal_leaves_no_trace_and_the_run_is_the_local_one(
        tmp_path: Path, alone_s: float | None, expected: bool) -> None:
    """Two warm-up and six timed step chains (sent ahead as training sends them) at
    learning rate 0; then the layers are handed back and ``Trainer.fit`` gives the local
    run's numbers. The prediction is the fitted terms' for the plan's slices, and the
    choice against the master alone is the pure rule's."""
    local = _fit_local(tmp_path)
    stage, cluster, run_dir = _default_stage(tmp_path)
    alone = None if alone_s is None else AloneMeasure(alone_s, alone_s, 0.0, 3)
    first, records, lines = _rehearse(stage, tmp_path, alone)
    assert first is (None if expected else stage)
    chains = [m for who, m in cluster.sent if who == "w1" and isinstance(m, SampleStepChain)]
    assert all(m.learning_rate == 0.0 for m in chains)
    (record,) = [r for r in records if r["type"] == "rehearsal"]
    assert REHEARSAL_STEPS < record["steps"] <= REHEARSAL_MAX_STEPS
    assert len(record["rehearsed_steps_s"]) == record["steps"]
    assert len(chains) == REHEARSAL_WARMUP + record["steps"]
    timed = record["rehearsed_steps_s"]
    assert enough_steps(timed[:-1]) or len(timed) == REHEARSAL_MAX_STEPS  # no more than needed
    assert not enough_steps(timed[:-2])
    compute = record["compute_s"]
    assert record["predicted_step_s"] == pytest.approx(
        compute + record["rounds"] * record["round_s"] + record["serial_s"])
    assert record["samples"] == {"master": 3, "w1": 3, "w2": 2}
    assert stage.policy.model.setup_predicted_s == record["predicted_step_s"]
    assert stage.policy.alone.rehearsed is (alone is not None)  # trials within the band
    assert lines[0].startswith(f"hetconv: rehearsed the plan ({record['steps']} steps at "
                               "learning rate 0")
    if alone is not None:
        assert record["alone_no_slower"] is expected and len(lines) == 2
    dist = Fit(stage, run_dir, "dist")
    dist.fit()
    assert_same_fit(dist, local)


def test_a_worker_lost_in_the_rehearsal_is_the_first_steps_recovery(tmp_path: Path) -> None:
    """w2 lost at the rehearsal's third step chain: the rehearsal stops, says so, and
    recovers as a run does (the layers handed back to the master and w1, w2 out); no
    choice is made against the master alone, and the run over w1 is the local one."""
    local = _fit_local(tmp_path)
    stage, cluster, run_dir = _default_stage(tmp_path)
    cluster.lose("w2", lambda m: isinstance(m, SampleStepChain) and m.step == 2)
    first, records, lines = _rehearse(stage, tmp_path, AloneMeasure(1e-7, 1e-7, 0.0, 3))
    assert first is stage and not [r for r in records if r["type"] == "rehearsal"]
    assert lines[0].startswith("hetconv: the plan's rehearsal stopped: worker w2"), lines
    assert stage.control.active == {"w1"}
    dist = Fit(stage, run_dir, "dist")
    dist.fit()
    assert_same_fit(dist, local)
