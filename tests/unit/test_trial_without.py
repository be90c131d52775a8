"""The trial without a worker (master/samples/trial_without.py): when a worker with a small
slice is tried without, and how a trial ends. Sans-IO: seconds in, verdicts out."""
from __future__ import annotations

import pytest

from hetconv.master.samples.step_model import StepSample, StepTerms
from hetconv.master.samples.trial_without import (
    FIT_LEAST,
    SMALL_SHARE,
    WITHOUT_GAIN,
    WITHOUT_WINDOW,
    KeepWithout,
    TakeBack,
    TryWithout,
    WithoutCheck,
    fit_recent,
    smallest_slice,
    unsure_without,
    without_ratio,
)


def fill(check: WithoutCheck, seconds: float, count: int = WITHOUT_WINDOW) -> None:
    for _ in range(count):
        check.step(seconds)


SLOW_W3 = {"master": 42, "w1": 42, "w2": 42, "w3": 2}  # w3: 2 of an even 32


def test_the_smallest_slice_under_half_an_even_share_is_the_candidate() -> None:
    assert smallest_slice(SLOW_W3, set()) == "w3"
    assert smallest_slice(SLOW_W3, {"w3"}) is None  # tried once: never again
    assert smallest_slice({"master": 32, "w1": 32, "w2": 32, "w3": 32}, set()) is None
    # the 0.2-core workers of 0.6/0.4/0.2/0.2 (13-15 of 128): no trial
    assert smallest_slice({"master": 58, "w1": 45, "w2": 13, "w3": 12}, set()) is None
    # just under the threshold, and an empty slice, both count; the smaller first
    even = 128 / 4
    small = int(SMALL_SHARE * even) - 1
    assert smallest_slice({"master": 64 - small, "w1": 64, "w2": small, "w3": 0},
                          set()) == "w3"
    # the master is never a candidate; with one worker left it is the alone check's
    assert smallest_slice({"master": 2, "w1": 60, "w2": 66}, set()) is None
    assert smallest_slice({"master": 120, "w1": 8}, set()) is None
    assert smallest_slice({"w1": 120, "w2": 8}, set()) == "w2"  # --no-local


def test_no_verdict_before_a_full_window_of_steps() -> None:
    check = WithoutCheck()
    fill(check, 0.08, WITHOUT_WINDOW - 1)
    assert check.at_snapshot(SLOW_W3) is None and check.trial is None


def test_a_trial_that_measures_shorter_keeps_the_worker_out() -> None:
    check = WithoutCheck()
    fill(check, 0.085)
    verdict = check.at_snapshot(SLOW_W3)
    assert verdict == TryWithout("w3", 2, 128, pytest.approx(0.085))
    assert check.trial == verdict and "w3" in check.tried
    # the next snapshot comes before a full window without it: the trial goes on
    fill(check, 0.070, WITHOUT_WINDOW - 1)
    assert check.at_snapshot({"master": 43, "w1": 43, "w2": 42}) is None
    check.step(0.070)
    verdict = check.at_snapshot({"master": 43, "w1": 43, "w2": 42})
    assert verdict == KeepWithout("w3", pytest.approx(0.085), pytest.approx(0.070))
    assert check.trial is None
    fill(check, 0.070)
    assert check.at_snapshot({"master": 43, "w1": 43, "w2": 42}) is None


@pytest.mark.parametrize("without_s", [0.085, 0.09, 0.085 * (1 - WITHOUT_GAIN / 2)],
                         ids=["same", "slower", "within-the-margin"])
def test_a_trial_not_clearly_shorter_takes_the_worker_back_for_good(without_s: float) -> None:
    check = WithoutCheck()
    fill(check, 0.085)
    assert isinstance(check.at_snapshot(SLOW_W3), TryWithout)
    fill(check, without_s)
    verdict = check.at_snapshot({"master": 43, "w1": 43, "w2": 42})
    assert verdict == TakeBack("w3", pytest.approx(0.085), pytest.approx(without_s))
    fill(check, 0.085)
    assert check.at_snapshot(SLOW_W3) is None  # w3 was tried: not again


def test_a_fault_or_a_join_ends_a_trial_without_a_verdict() -> None:
    check = WithoutCheck()
    fill(check, 0.085)
    assert isinstance(check.at_snapshot(SLOW_W3), TryWithout)
    fill(check, 0.07, 3)
    check.reset()
    assert check.trial is None and not check.steps
    fill(check, 0.07)
    assert check.at_snapshot({"master": 43, "w1": 43, "w2": 42}) is None


def test_the_decision_imports_no_sockets_threads_or_clock() -> None:
    import ast
    from pathlib import Path

    import hetconv.master.samples.trial_without as module
    tree = ast.parse(Path(module.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {str(node.module).split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert not imported & {"zmq", "socket", "threading", "time", "asyncio"}, imported


# --- once the step model is fitted: a trial only within its band (issue 50) ------------
def terms_of(per_sample_ms: dict[str, float], round_ms: float) -> StepTerms:
    return StepTerms({n: v / 1e3 for n, v in per_sample_ms.items()}, round_ms / 1e3, 0.0, 1)


def feed(check: WithoutCheck, terms: StepTerms, samples: dict[str, int],
         count: int = WITHOUT_WINDOW) -> None:
    """``count`` steps whose figures the model fits back to ``terms`` (one round, no
    serial part), each also a step of the terms' predicted seconds."""
    working = {n: c for n, c in samples.items() if c > 0}
    compute = {n: terms.per_sample_s[n] * c for n, c in working.items()}
    rounds_s = max(compute.values()) + terms.round_s
    for _ in range(count):
        check.step(rounds_s)
        check.observe(StepSample(rounds_s, rounds_s, 1, compute, working))


# three 1 ms/sample participants and one ten times slower, sliced by speed (42/41/41/4)
THREE_AND_A_SLOW_ONE = terms_of({"master": 1.0, "w1": 1.0, "w2": 1.0, "w3": 10.0}, 10.0)
SLICED = {"master": 42, "w1": 41, "w2": 41, "w3": 4}


def test_the_model_predicts_the_step_without_a_worker_from_the_rest_resliced() -> None:
    # with: max(42, 41, 41, 4 x 10) + 10 = 52 ms; without w3 the rest take 43/43/42: 53 ms
    assert without_ratio(THREE_AND_A_SLOW_ONE, SLICED, "w3") == pytest.approx(53 / 52)
    # without w1 the others take 61/61/6 (speeds 1, 1, 0.1): max(61, 61, 60) + 10 = 71 ms
    assert without_ratio(THREE_AND_A_SLOW_ONE, SLICED, "w1") == pytest.approx(71 / 52)
    assert unsure_without(THREE_AND_A_SLOW_ONE, SLICED, set()) == ("w3", pytest.approx(53 / 52))
    # the slice rule stays first: w1 and w2 (41 of an even 32) are no candidates
    assert unsure_without(THREE_AND_A_SLOW_ONE, SLICED, {"w3"}) is None


def test_where_the_model_is_sure_the_rest_would_be_slower_no_trial_starts() -> None:
    # 0.6/0.4/0.2/0.2 cores (1.67/2.5/5/5 ms a sample) sliced 55/37/18/18, rounds 30 ms:
    # with max(91.7, 92.5, 90, 90) + 30 = 122.5; without a 0.2 the rest take 64/43/21:
    # max(106.7, 107.5, 105) + 30 = 137.5 ms, 12 % longer: beyond the model's 10 %
    terms = terms_of({"master": 1 / 0.6, "w1": 2.5, "w2": 5.0, "w3": 5.0}, 30.0)
    samples = {"master": 55, "w1": 37, "w2": 18, "w3": 18}
    assert without_ratio(terms, samples, "w3") == pytest.approx(137.5 / 122.5)
    assert unsure_without(terms, samples, set()) is None
    check = WithoutCheck()
    feed(check, terms, samples)
    assert check.at_snapshot(samples) is None and check.trial is None
    # the slice rule alone would not try them either (13-15 of 128 measured on the lab)
    assert smallest_slice(samples, set()) is None
    # where it would: two workers (--no-local), w2 with 14 of 128 (under a quarter of an
    # even 64) at w1's speed: without it w1 takes all 128, 12 % longer (no trial)
    equal = terms_of({"w1": 1.0, "w2": 1.0}, 0.0)
    assert smallest_slice({"w1": 114, "w2": 14}, set()) == "w2"
    assert without_ratio(equal, {"w1": 114, "w2": 14}, "w2") == pytest.approx(128 / 114)
    assert unsure_without(equal, {"w1": 114, "w2": 14}, set()) is None
    # with 4 of 128 it is within the band (128 / 124): the trial measures it
    assert unsure_without(equal, {"w1": 124, "w2": 4}, set()) == ("w2", pytest.approx(128 / 124))


def test_within_the_band_the_trial_says_the_models_figure() -> None:
    check = WithoutCheck()
    feed(check, THREE_AND_A_SLOW_ONE, SLICED)
    fitted = fit_recent(list(check.figures))
    assert fitted is not None and fitted.round_s == pytest.approx(0.010)
    assert dict(fitted.per_sample_s) == pytest.approx(THREE_AND_A_SLOW_ONE.per_sample_s)
    verdict = check.at_snapshot(SLICED)
    assert isinstance(verdict, TryWithout) and verdict.worker == "w3"
    assert verdict.with_s == pytest.approx(0.052)
    assert verdict.model_ratio == pytest.approx(53 / 52)
    assert verdict.why().startswith("the step model predicts the step +1.9% without it")
    assert not check.figures  # the trial's steps are another plan's
    # too few recent figures to fit (a step chain without rounds: the master's own):
    # the slice rule (w3's 4 of an even 32)
    check = WithoutCheck()
    feed(check, THREE_AND_A_SLOW_ONE, SLICED, FIT_LEAST - 1)
    fill(check, 0.052)
    assert fit_recent(list(check.figures)) is None
    verdict = check.at_snapshot(SLICED)
    assert isinstance(verdict, TryWithout) and verdict.model_ratio is None
    assert "its slice is 4 of 128 samples" in verdict.why()
    # the master is never a candidate, and one worker left is the alone check's
    assert unsure_without(THREE_AND_A_SLOW_ONE, {"master": 120, "w3": 8}, set()) is None
