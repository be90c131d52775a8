"""Never slower than the master alone: the trial's decisions (master/samples/fall_back.py) and
the trial stage (master/samples/trial_alone.py), without sockets or a clock."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hetconv.master.samples.fall_back import (
    ALONE_WINDOW,
    CLEAR_MARGIN,
    CORRECTED_TRIGGER,
    EARLY_STEPS,
    TRIAL_TRIGGER,
    AloneCheck,
    GoBack,
    StayAlone,
    TryAlone,
)
from hetconv.master.samples.trial_alone import TrialAloneStage


def _with_workers(check: AloneCheck, wall: float, estimate: float,
                  steps: int = ALONE_WINDOW) -> None:
    for _ in range(steps):
        check.distributed_step(wall, estimate)


def test_no_trial_before_a_full_window_or_while_the_workers_are_faster() -> None:
    check = AloneCheck()
    _with_workers(check, 0.020, 0.010, ALONE_WINDOW - 1)
    assert check.at_snapshot() is None  # too few steps to judge
    check = AloneCheck()
    _with_workers(check, 0.010, 0.016)
    assert check.at_snapshot() is None  # clearly faster than the estimate alone
    _with_workers(check, 0.010, 0.010 / TRIAL_TRIGGER * 1.001)
    assert check.at_snapshot() is None  # within the trigger


def test_a_run_only_somewhat_faster_than_the_estimate_is_tried_alone() -> None:
    """The estimate errs by up to a third either way (the module doc): a run 10 %
    faster than it may still be slower than the master really alone (0.6/0.4/0.2/0.2
    on the lab: 93.7 ms a step with the workers, estimated 95.7 alone, 87.8 measured
    alone), so it is tried."""
    check = AloneCheck()
    _with_workers(check, 0.0937, 0.0957)
    assert check.at_snapshot() == TryAlone(pytest.approx(0.0937), pytest.approx(0.0957))
    for _ in range(ALONE_WINDOW):
        check.trial_step(0.0878)
    assert check.at_snapshot() == StayAlone(pytest.approx(0.0937), pytest.approx(0.0878))


def test_medians_ignore_one_outlier() -> None:
    check = AloneCheck()
    _with_workers(check, 0.010, 0.016, ALONE_WINDOW - 1)
    check.distributed_step(0.5, 0.016)
    assert check.at_snapshot() is None


def test_a_trial_that_confirms_the_estimate_stays_alone() -> None:
    """Alone a little faster (17 against 18 ms: not clearly): the whole window decides."""
    check = AloneCheck()
    _with_workers(check, 0.018, 0.012)
    assert check.at_snapshot() == TryAlone(pytest.approx(0.018), pytest.approx(0.012))
    assert check.in_trial
    for _ in range(ALONE_WINDOW - 1):
        check.trial_step(0.017)
        assert not check.verdict_ready()
    assert check.at_snapshot() is None  # too few steps alone: the trial goes on
    check.trial_step(0.017)
    assert check.verdict_ready()
    assert check.at_snapshot() == StayAlone(pytest.approx(0.018), pytest.approx(0.017))


@pytest.mark.parametrize("alone_s, verdict", [(0.080, GoBack), (0.036, StayAlone)])
def test_a_trial_clearly_on_one_side_decides_after_a_few_steps(
        alone_s: float, verdict: type) -> None:
    """The master alone 1.6 times slower than the workers (or faster by as much): the
    trial decides after EARLY_STEPS steps, judged on all but the first (which pays the
    restore's first touches: here it is 3 times slower)."""
    check = AloneCheck()
    _with_workers(check, 0.050, 0.060)
    assert isinstance(check.at_snapshot(), TryAlone)
    check.trial_step(3 * alone_s)
    for _ in range(EARLY_STEPS - 2):
        check.trial_step(alone_s)
        assert not check.verdict_ready()
    check.trial_step(alone_s)
    assert check.verdict_ready()
    decided = check.at_snapshot()
    assert isinstance(decided, verdict) and not check.in_trial
    assert decided.measured_s == pytest.approx(0.050)
    assert decided.trial_steps == EARLY_STEPS


@pytest.mark.parametrize("recent", [
    (0.060, 0.060, 0.062),  # 1.2x the workers' 50 ms: within the margin
    (0.080, 0.080, 0.060),  # one step of the three within it
    (0.036, 0.036, 0.041),  # faster, one step within the margin
])
def test_a_trial_not_clearly_on_one_side_runs_the_whole_window(
        recent: tuple[float, float, float]) -> None:
    check = AloneCheck()
    _with_workers(check, 0.050, 0.060)
    assert isinstance(check.at_snapshot(), TryAlone)
    check.trial_step(0.070)
    for seconds in recent:
        check.trial_step(seconds)
    assert not check.verdict_ready() and check.at_snapshot() is None and check.in_trial
    assert 0.050 * CLEAR_MARGIN > 0.060  # what the first case stands for


def test_a_trial_that_refutes_the_estimate_goes_back_and_corrects_it() -> None:
    """The estimate 24 % short (as on the lab's CPU quotas): the trial measures the
    master alone slower than the workers, the run goes back, and the same steps do not
    start another trial (the estimate is corrected by what the trial measured)."""
    check = AloneCheck()
    _with_workers(check, 0.060, 0.0546)  # 1.10x the estimate: a trial
    assert isinstance(check.at_snapshot(), TryAlone)
    for _ in range(ALONE_WINDOW):
        check.trial_step(0.0715)
    verdict = check.at_snapshot()
    assert verdict == GoBack(pytest.approx(0.060), pytest.approx(0.0715))
    assert not check.in_trial and check.correction == pytest.approx(0.0715 / 0.0546)
    assert check.at_snapshot() is None  # the window starts over with the workers
    _with_workers(check, 0.060, 0.0546)
    assert check.at_snapshot() is None  # corrected: 60 ms against 71.5 alone
    # measured now: the tight trigger, not the band for the estimate's error
    _with_workers(check, 0.0715 * CORRECTED_TRIGGER * 0.999, 0.0546)
    assert check.at_snapshot() is None
    _with_workers(check, 0.090, 0.0546)  # the workers got slower since
    assert check.at_snapshot() == TryAlone(pytest.approx(0.090), pytest.approx(0.0715))


class _Local:
    """A local stage that takes ``seconds`` (of the fake clock) per call."""

    def __init__(self, clock: list[float], seconds: float) -> None:
        self.clock, self.seconds, self.closed, self.restored = clock, seconds, False, 0

    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        self.clock[0] += self.seconds
        return x

    def backward(self, layer: int, dy: np.ndarray, need_dx: bool, learning_rate: float,
                 step: int) -> np.ndarray | None:
        self.clock[0] += self.seconds
        return dy

    def end_step(self) -> dict[str, Any]:
        return {"layers": [], "comm_s": 0.0}

    def snapshot(self) -> dict[str, np.ndarray]:
        return {}

    def restore(self, state: dict[str, np.ndarray]) -> None:
        self.restored += 1

    def recover(self, fault: Any, state: dict[str, np.ndarray]) -> Any:
        raise fault

    def replan_point(self, state: dict[str, np.ndarray]) -> Any:
        return self

    def close(self) -> None:
        self.closed = True


class _Waiting:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.back = object()

    def keep_alive(self) -> None:
        self.events.append("alive")

    def stay_alone(self, verdict: StayAlone) -> None:
        self.events.append(f"stay {verdict.alone_s:.3f}")

    def go_back(self, verdict: GoBack, state: dict[str, np.ndarray]) -> Any:
        self.events.append(f"back {verdict.alone_s:.3f}")
        return self.back

    def close(self) -> None:
        self.events.append("close")


def _trial(seconds_per_call: float, with_workers_s: float) -> tuple[TrialAloneStage, Any, Any]:
    clock = [0.0]
    check = AloneCheck()
    _with_workers(check, with_workers_s, 0.001)
    assert isinstance(check.at_snapshot(), TryAlone)
    local, waiting = _Local(clock, seconds_per_call), _Waiting()
    stage = TrialAloneStage(local, waiting, check, clock=lambda: clock[0])
    x = np.zeros((2, 1, 4, 4), dtype=np.float32)
    for step in range(ALONE_WINDOW):
        for layer in range(2):
            stage.forward(layer, x, True, step)
        stage.forward(0, x, False, step)  # an evaluation: not the step's conv part
        for layer in (1, 0):
            stage.backward(layer, x, layer > 0, 0.1, step)
        stage.end_step()
    return stage, local, waiting


def test_the_trial_stage_times_each_steps_conv_part_and_stays_alone() -> None:
    stage, local, waiting = _trial(0.001, with_workers_s=0.010)  # 4 ms alone against 10
    assert waiting.events == ["alive"] * ALONE_WINDOW  # heartbeats every step
    assert stage.check.trial == pytest.approx([0.004] * ALONE_WINDOW)
    assert stage.replan_point({}) is local
    assert waiting.events[-2:] == ["stay 0.004", "close"] and not local.closed


def test_the_trial_stage_goes_back_to_the_waiting_workers() -> None:
    stage, local, waiting = _trial(0.004, with_workers_s=0.010)  # 16 ms alone against 10
    assert stage.replan_point({}) is waiting.back
    assert waiting.events[-1] == "back 0.016" and local.closed


def test_the_trial_stage_asks_for_a_snapshot_once_it_can_decide() -> None:
    """Alone 16 ms against 10 with the workers: clear after EARLY_STEPS steps, so the
    trial asks the trainer for its snapshot then, not at the next one due."""
    clock = [0.0]
    check = AloneCheck()
    _with_workers(check, 0.010, 0.001)
    assert isinstance(check.at_snapshot(), TryAlone)
    waiting = _Waiting()
    stage = TrialAloneStage(_Local(clock, 0.004), waiting, check, clock=lambda: clock[0])
    x = np.zeros((2, 1, 4, 4), dtype=np.float32)
    asked = []
    for step in range(EARLY_STEPS):
        for layer in range(2):
            stage.forward(layer, x, True, step)
        for layer in (1, 0):
            stage.backward(layer, x, layer > 0, 0.1, step)
        stage.end_step()
        asked.append(stage.wants_replan_point())
    assert asked == [False] * (EARLY_STEPS - 1) + [True]
    assert stage.replan_point({}) is waiting.back and waiting.events[-1] == "back 0.016"


def test_a_master_alone_measured_at_set_up_replaces_the_estimate() -> None:
    """Issue 50: set-up measured the master alone (master/alone_first.py). Runs are held
    to that figure, not to the in-run estimate: two 0.45-core machines at 109 ms a step
    (170 ms alone at set-up) are no longer tried because an estimate swung low; a run over
    TRIAL_TRIGGER of the figure (the 0.6/0.4/0.2/0.2 machines: 105.8 ms, 131.9 measured
    alone, 103 really) is; a trial that goes back corrects the estimate as before."""
    check = AloneCheck(measured_alone_s=0.170)
    _with_workers(check, 0.109, 0.120)  # the estimate alone would start a trial
    assert check.at_snapshot() is None
    check = AloneCheck(measured_alone_s=0.1319)
    _with_workers(check, 0.1058, 0.500)
    assert check.at_snapshot() == TryAlone(pytest.approx(0.1058), pytest.approx(0.1319))
    for _ in range(ALONE_WINDOW):
        check.trial_step(0.150)  # slower alone than the workers
    assert isinstance(check.at_snapshot(), GoBack)
    assert check.corrected and check.correction == pytest.approx(0.150 / 0.500)


def test_after_set_ups_rehearsal_a_trial_starts_only_within_the_models_band() -> None:
    """Issue 50: set-up rehearsed the plan against the master alone measured. The run
    at 0.80 of that figure (tried before: over TRIAL_TRIGGER) is not tried; one whose
    steps come within the step model's 10 % band of it (0.92) is."""
    from hetconv.master.samples.fall_back import REHEARSED_TRIGGER

    assert REHEARSED_TRIGGER == pytest.approx(1 / 1.10)
    plain = AloneCheck(measured_alone_s=0.100)
    _with_workers(plain, 0.080, 0.500)
    assert isinstance(plain.at_snapshot(), TryAlone)  # 0.80 > TRIAL_TRIGGER
    check = AloneCheck(measured_alone_s=0.100, rehearsed=True)
    _with_workers(check, 0.080, 0.500)
    assert check.at_snapshot() is None
    _with_workers(check, 0.092, 0.500)
    assert check.at_snapshot() == TryAlone(pytest.approx(0.092), pytest.approx(0.100))
