"""The sample split's decisions as one sans-IO policy (master/samples/policy.py): step
figures and snapshots in, commands and verdicts out; no clock, no sockets, no stage."""
from __future__ import annotations

import pytest

from hetconv.config import MASTER_PARTICIPANT as MASTER
from hetconv.master.samples.balance import REBALANCE_WINDOW, SampleBalance
from hetconv.master.samples.fall_back import ALONE_WINDOW, TryAlone
from hetconv.master.samples.figures import StepFigures
from hetconv.master.samples.policy import ModelChecked, Reslice, SamplePolicy
from hetconv.master.samples.step_model import MODEL_SKIP, MODEL_WINDOW
from hetconv.master.samples.trial_without import (
    WITHOUT_WINDOW,
    KeepWithout,
    TakeBack,
    TryWithout,
)

SAMPLES = {MASTER: 32, "w1": 32}


def figures(compute: dict[str, float], wall: float, started: float | None = 0.0,
            dense: dict[str, float] | None = None) -> StepFigures:
    """One step's figures: every participant's compute (s) is also its rounds' latency."""
    return StepFigures(compute=dict(compute), latency=dict(compute),
                       waits={n: 0.0 for n in compute}, dense=dict(dense or {}), wall=wall,
                       rounds=2, started=started)


def policy(**options: object) -> SamplePolicy:
    return SamplePolicy(SampleBalance({MASTER: 1.0, "w1": 1.0}), **options)  # type: ignore[arg-type]


def steps(policy: SamplePolicy, count: int, compute: dict[str, float], wall: float,
          samples: dict[str, int] = SAMPLES, start: float = 0.0, period: float = 1.0,
          dense: dict[str, float] | None = None) -> list[object]:
    """``count`` steps ending ``period`` apart from ``start``; every command they gave."""
    commands: list[object] = []
    for index in range(count):
        now = start + (index + 1) * period
        commands += policy.step_ended(figures(compute, wall, started=now - wall, dense=dense),
                                      samples, now)
    return commands


def test_a_balanced_run_asks_for_nothing() -> None:
    p = policy()
    commands = steps(p, REBALANCE_WINDOW * 2, {MASTER: 0.010, "w1": 0.010}, 0.012)
    assert not [c for c in commands if isinstance(c, Reslice)]
    assert p.at_snapshot(SAMPLES) is None


def test_a_slower_worker_is_resliced_once_its_window_is_measured() -> None:
    p = policy()
    before = steps(p, REBALANCE_WINDOW - 1, {MASTER: 0.010, "w1": 0.030}, 0.031)
    assert before == []
    assert Reslice() in steps(p, 1, {MASTER: 0.010, "w1": 0.030}, 0.031)
    slices = {s.participant: s.samples for s in p.balance.slices([MASTER, "w1"], 64)}
    assert slices[MASTER] > slices["w1"]


def test_rebalancing_off_never_reslices() -> None:
    p = policy(rebalancing=False)
    commands = steps(p, REBALANCE_WINDOW * 2, {MASTER: 0.010, "w1": 0.030}, 0.031)
    assert not [c for c in commands if isinstance(c, Reslice)]


def test_the_step_model_checks_itself_once_fitted_and_checked() -> None:
    p = policy(setup_predicted_s=0.012)
    checks = [c for c in steps(p, MODEL_SKIP + 2 * MODEL_WINDOW,
                               {MASTER: 0.010, "w1": 0.010}, 0.012)
              if isinstance(c, ModelChecked)]
    assert len(checks) == 1
    assert checks[0].check.measured_s == pytest.approx(0.012)
    assert checks[0].check.setup_predicted_s == pytest.approx(0.012)
    # a step that never began (no round recorded) feeds no model
    q = policy()
    for _ in range(MODEL_SKIP + 2 * MODEL_WINDOW):
        assert q.step_ended(figures({MASTER: 0.01}, 0.012, started=None), SAMPLES, 1.0) == []


def test_a_run_slower_than_the_master_alone_is_tried_alone_at_a_snapshot() -> None:
    """The master's own compute per sample times the batch is its estimate alone; a run
    whose conv part (its step chain's dense part taken out) measures slower than that
    is tried alone at the next snapshot, and with --fall-back off never."""
    slow = {MASTER: 0.004, "w1": 0.004}  # the master alone: 0.004 / 32 x 64 = 8 ms
    p = policy()
    steps(p, ALONE_WINDOW, slow, wall=0.030 + 0.005, dense={MASTER: 0.001, "w1": 0.005})
    verdict = p.at_snapshot(SAMPLES)
    assert isinstance(verdict, TryAlone)
    assert verdict.measured_s == pytest.approx(0.030)  # the wall less the slowest dense part
    assert verdict.alone_s == pytest.approx(0.006)  # (4 - 1 ms dense) / 32 x 64
    off = policy(fall_back=False)
    steps(off, ALONE_WINDOW, slow, wall=0.035)
    assert off.at_snapshot(SAMPLES) is None


def test_a_worker_with_a_tiny_slice_is_tried_without_then_kept_out_or_taken_back() -> None:
    """Periods come from the steps' ends (the first after a snapshot gives none); a
    worker under a quarter of an even share is tried without; shorter without keeps it
    out, not shorter takes it back."""
    samples = {"w1": 30, "w2": 30, "w3": 1}  # the master computes nothing
    for without_s, verdict_type in ((0.010, KeepWithout), (0.019, TakeBack)):
        p = SamplePolicy(SampleBalance({"w1": 1.0, "w2": 1.0, "w3": 1.0}))
        steps(p, WITHOUT_WINDOW + 1, {"w1": 0.01, "w2": 0.01, "w3": 0.01}, 0.02,
              samples, period=0.020)
        trial = p.at_snapshot(samples)
        assert isinstance(trial, TryWithout) and trial.worker == "w3"
        assert p.on_trial() == "w3"
        without = {"w1": 31, "w2": 30}
        steps(p, WITHOUT_WINDOW + 1, {"w1": 0.01, "w2": 0.01}, without_s, without,
              start=100.0, period=without_s)
        verdict = p.at_snapshot(without)
        assert isinstance(verdict, verdict_type) and verdict.worker == "w3", verdict
        assert p.on_trial() is None


def test_a_fault_or_a_join_ends_a_trial_and_forgets_the_window() -> None:
    samples = {"w1": 30, "w2": 30, "w3": 1}
    p = SamplePolicy(SampleBalance({"w1": 1.0, "w2": 1.0, "w3": 1.0}))
    steps(p, WITHOUT_WINDOW + 1, {"w1": 0.01}, 0.02, samples, period=0.02)
    assert isinstance(p.at_snapshot(samples), TryWithout)
    p.fault()
    assert p.on_trial() is None
    assert p.at_snapshot(samples) is None  # the steps so far measured other participants
    steps(p, WITHOUT_WINDOW - 1, {"w1": 0.01}, 0.02, samples, period=0.02)
    p.joined()
    steps(p, 2, {"w1": 0.01}, 0.02, samples, start=50.0, period=0.02)
    assert p.at_snapshot(samples) is None  # too few steps since the join
