"""The sample split's step model calibrated in place (master/samples/step_model.py): the fit's
three terms, its prediction for other slices, and when the check is made."""
from __future__ import annotations

import statistics

import pytest

from hetconv.master.samples.step_model import (
    MODEL_CHECKS,
    MODEL_SKIP,
    MODEL_TOLERANCE,
    MODEL_WINDOW,
    InPlaceModel,
    ModelCheck,
    StepSample,
    fit_step_terms,
)


def _step(samples: dict[str, int], per_sample: dict[str, float], round_s: float,
          serial_s: float, rounds: int = 6, jitter: float = 0.0) -> StepSample:
    """A step made from known terms (the slowest compute + rounds·round_s + serial)."""
    compute = {n: per_sample[n] * c * (1 + jitter) for n, c in samples.items()}
    rounds_s = max(compute.values()) + rounds * round_s
    return StepSample(rounds_s + serial_s, rounds_s, rounds, compute, samples)


def test_the_fit_recovers_the_terms_a_step_was_made_of() -> None:
    per_sample = {"master": 0.002, "a": 0.001}
    window = [_step({"master": 40, "a": 88}, per_sample, 0.003, 0.015, jitter=j)
              for j in (0.0, 0.01, -0.01, 0.02, 0.0)]
    terms = fit_step_terms(window)
    assert terms.per_sample_s["master"] == pytest.approx(0.002)
    assert terms.per_sample_s["a"] == pytest.approx(0.001)
    assert terms.round_s == pytest.approx(0.003)
    assert terms.serial_s == pytest.approx(0.015)
    assert terms.rounds == 6
    # another slicing: only the compute term moves
    assert terms.predict({"master": 64, "a": 64}) == pytest.approx(0.128 + 6 * 0.003 + 0.015)


def test_the_compute_term_is_each_steps_slowest_participant_not_the_slowest_median() -> None:
    """Two equal machines whose speeds swing against each other (the lab's quota
    periods): each step waits for whichever is slow then. Their medians are equal, so
    the slowest median would predict 64 ms of compute; the steps took 76.8."""
    swing = [0.0008, 0.0010, 0.0012] * 3  # the master's s/sample; m1 the mirror image
    window = [_step({"master": 64, "m1": 64}, {"master": m, "m1": 0.0020 - m}, 0.004, 0.002,
                    rounds=1) for m in swing]
    terms = fit_step_terms(window)
    assert terms.per_sample_s == {"master": pytest.approx(0.0010), "m1": pytest.approx(0.0010)}
    assert terms.compute_s({"master": 64, "m1": 64}) == pytest.approx(0.0012 * 64)
    assert terms.round_s == pytest.approx(0.004)
    assert terms.predict({"master": 64, "m1": 64}) == pytest.approx(
        statistics.median(s.step_s for s in window))
    # other slices: each step's slowest at those slices
    assert terms.compute_s({"master": 96, "m1": 32}) == pytest.approx(0.0010 * 96)


def test_the_fit_refuses_no_steps() -> None:
    with pytest.raises(ValueError, match="no steps"):
        fit_step_terms([])


def test_the_check_predicts_the_slices_after_a_re_slice_not_the_fitted_ones() -> None:
    per_sample = {"master": 0.002, "a": 0.001}
    model = InPlaceModel(setup_predicted_s=0.1)
    first, second = {"master": 64, "a": 64}, {"master": 43, "a": 85}
    checks = []
    for _ in range(MODEL_SKIP + MODEL_WINDOW):
        checks.append(model.observe(_step(first, per_sample, 0.004, 0.01)))
    # the rebalancer moved samples: the check is of the new slices, measured on them
    for _ in range(MODEL_WINDOW):
        checks.append(model.observe(_step(second, per_sample, 0.004, 0.01)))
    done = [c for c in checks if c is not None]
    assert len(done) == 1
    check = done[0]
    assert check.samples == second
    assert check.predicted_s == pytest.approx(0.086 + 6 * 0.004 + 0.01)
    assert check.error == pytest.approx(0.0, abs=1e-9)
    assert check.setup_predicted_s == 0.1
    assert "predicted" in check.line() and "measured" in check.line()
    record = check.as_record()
    assert record["fitted_steps"] == MODEL_WINDOW and record["checked_steps"] == MODEL_WINDOW
    # once checked it says nothing more
    assert model.observe(_step(second, per_sample, 0.004, 0.01)) is None


def test_a_slower_step_than_the_fit_shows_as_an_optimistic_model() -> None:
    per_sample = {"master": 0.002, "a": 0.001}
    model = InPlaceModel()
    slices = {"master": 64, "a": 64}
    for _ in range(MODEL_SKIP + MODEL_WINDOW):
        model.observe(_step(slices, per_sample, 0.004, 0.01))
    check = None
    for _ in range(MODEL_WINDOW):
        check = model.observe(_step(slices, per_sample, 0.008, 0.01)) or check
    assert check is not None and check.error < -0.1
    assert check.refit and "fitting again on these 9" in check.line()


def _checks(model: InPlaceModel, steps: list[StepSample]) -> list[ModelCheck]:
    return [c for c in (model.observe(step) for step in steps) if c is not None]


def test_a_fit_on_warm_up_steps_is_fitted_again_and_the_next_check_stands() -> None:
    """The demo's case: the first steps are slower than the rest (first-touch memory,
    the batch pipeline filling up); the first check is off, the fit on the steps it
    checked is not, and the model says nothing more."""
    slices = {"a": 70, "b": 58}
    warm = _step(slices, {"a": 0.0015, "b": 0.0015}, 0.009, 0.001)
    settled = _step(slices, {"a": 0.0011, "b": 0.0012}, 0.009, 0.001)
    checks = _checks(model := InPlaceModel(), [warm] * (MODEL_SKIP + MODEL_WINDOW)
                     + [settled] * (3 * MODEL_WINDOW))
    assert [(c.attempt, c.refit) for c in checks] == [(1, True), (2, False)]
    first, second = checks
    assert first.error > MODEL_TOLERANCE and first.measured_s == pytest.approx(settled.step_s)
    assert second.error == pytest.approx(0.0, abs=1e-9)
    assert "fitted again on 9 steps" in second.line() and "fitting again" not in second.line()
    assert second.as_record()["attempt"] == 2 and second.as_record()["refit"] is False
    assert model.done


def test_a_model_that_never_settles_stops_after_the_last_check() -> None:
    slices = {"a": 64, "b": 64}
    fast = _step(slices, {"a": 0.001, "b": 0.001}, 0.004, 0.001)
    slow = _step(slices, {"a": 0.002, "b": 0.002}, 0.004, 0.001)
    steps = [fast] * MODEL_SKIP + [s for k in range(6) for s in [[fast, slow][k % 2]]
                                   * MODEL_WINDOW]
    checks = _checks(InPlaceModel(), steps)
    assert [c.attempt for c in checks] == list(range(1, MODEL_CHECKS + 1))
    assert [c.refit for c in checks] == [True] * (MODEL_CHECKS - 1) + [False]
    assert all(abs(c.error) > MODEL_TOLERANCE for c in checks)  # reported as it is


def test_other_participants_start_the_fit_again() -> None:
    per_sample = {"master": 0.002, "a": 0.001, "b": 0.001}
    model = InPlaceModel()
    for _ in range(MODEL_SKIP + 3):
        model.observe(_step({"master": 40, "a": 44, "b": 44}, per_sample, 0.004, 0.01))
    # "b" was evicted: what was fitted so far is dropped
    results = [model.observe(_step({"master": 60, "a": 68}, per_sample, 0.004, 0.01))
               for _ in range(2 * MODEL_WINDOW)]
    assert all(r is None for r in results)
    results = [model.observe(_step({"master": 60, "a": 68}, per_sample, 0.004, 0.01))
               for _ in range(2)]
    check = [r for r in results if r is not None]
    assert len(check) == 1 and check[0].samples == {"master": 60, "a": 68}


def test_a_model_record_gives_back_the_terms_it_was_written_with() -> None:
    from hetconv.master.samples.step_model import terms_from_record
    swing = [0.0008, 0.0010, 0.0012]
    terms = fit_step_terms([_step({"master": 64, "m1": 64}, {"master": m, "m1": 0.002 - m},
                                  0.004, 0.002, rounds=1) for m in swing])
    again = terms_from_record(terms.as_record())
    assert again is not None
    for slices in ({"master": 64, "m1": 64}, {"master": 90, "m1": 38}):
        assert again.predict(slices) == pytest.approx(terms.predict(slices))
    assert terms_from_record({"per_sample_s": "x", "round_s": 1}) is None
    assert terms_from_record({}) is None
