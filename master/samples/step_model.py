"""The sample split's step model, calibrated in place from the run's first steps.

The setup's prediction (``predict_sample_step``) knows the calibrated compute, the
links and one round trip per round; it cannot know what a round costs beyond that on
the machines at hand: message handling, CPU-quota throttling and the skew between the
participants at every barrier (2L a step), nor the master's serial part (the dense
layers and its turnaround between rounds). On four 0.45-core machines it was 10-35 %
low (docs/sample-split.md). So after the first steps the master fits three terms to
what it measured (:func:`fit_step_terms`), over a window of ``MODEL_WINDOW`` steps:

- ``b_i``: each participant's compute per sample (median of the window), and the
  window's steps' own compute per sample per participant: the compute term of a
  prediction is the median over those steps of each step's slowest participant,
  ``median_t max_i b_i(t)·n_i``, not the slowest median ``max_i b_i·n_i``. On the lab's
  quota-throttled machines the participants' speeds swing against each other from step
  to step (two equal 0.45-core machines: one at 0.5-0.8 ms a sample while the other
  takes 1.3-1.5), and every step waits for whichever is slow then; the slowest median
  left that out and predicted 10-31 % short on two machines (docs/sample-split.md);
- ``round_s``: per round, the rounds' wall time beyond the slowest participant's
  compute, (Σ_r wall_r − max_i Σ_r c_i,r) / rounds (median): the wire, message
  handling and the barriers' skew (2L + 2 rounds under ``--data-plane star``; 2 chains
  by default, each holding L barriers among the peers);
- ``serial_s``: the step beyond its rounds (median): the master's dense layers and
  its work between rounds, while every worker waits.

The prediction for any slicing of the batch is then
``median_t max_i b_i(t)·n_i + rounds·round_s + serial_s`` (:meth:`StepTerms.predict`). The model is
checked, not assumed: :class:`InPlaceModel` predicts the step for the slices in use
after the window (a re-slice by the rebalancer included: a new split, not the fitted
one) and compares with the median of the next ``MODEL_WINDOW`` steps measured on
them. The check is written as a ``model`` record and a console line.

A check off by more than ``MODEL_TOLERANCE`` fits again, on the steps it was checked
on, and checks that fit on the next window, at most ``MODEL_CHECKS`` checks in all:
the first steps of a run are often slower than the rest (first-touch memory, the
batch pipeline filling up beside the workers), and a fit on them says nothing about
the run. Every check is
reported; the last one is the model's figure.

Sans-IO: seconds in, a check out (``tests/unit/test_step_model.py``).
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

MODEL_WINDOW = 9
"""Steps fitted, then steps measured to check the prediction."""
MODEL_SKIP = 1
"""First steps left out of the fit (start-up: first-touch memory, caches)."""
MODEL_TOLERANCE = 0.10
"""A check off by more than this (either way) fits again on the steps it checked."""
MODEL_CHECKS = 3
"""Checks at most; the last one stands whatever its error."""


@dataclass(frozen=True)
class StepSample:
    """One training step as the master saw it (seconds): the whole step (first
    request of its first round to the end of its backward), the wall time of its
    rounds, their number, and per participant its compute and its samples."""

    step_s: float
    rounds_s: float
    rounds: int
    compute_s: Mapping[str, float]
    samples: Mapping[str, int]


@dataclass(frozen=True)
class StepTerms:
    """The fitted model (see the module doc): ``per_sample_s`` b_i per participant
    (medians), ``round_s`` per round, ``serial_s`` per step, ``rounds`` per step, and
    ``steps_s`` each fitted step's compute per sample per participant (b_i(t))."""

    per_sample_s: Mapping[str, float]
    round_s: float
    serial_s: float
    rounds: int
    steps_s: tuple[Mapping[str, float], ...] = ()

    def compute_s(self, samples: Mapping[str, int]) -> float:
        """The compute of a step with ``samples`` per participant: the median over the
        fitted steps of each step's slowest participant at these slices (a participant
        without a figure in a step at its median), or, without the steps, the slowest
        median."""
        working = {name: count for name, count in samples.items()
                   if count > 0 and name in self.per_sample_s}
        if not working:
            return 0.0
        if not self.steps_s:
            return max(self.per_sample_s[name] * count for name, count in working.items())
        return statistics.median(
            max(step.get(name, self.per_sample_s[name]) * count
                for name, count in working.items()) for step in self.steps_s)

    def predict(self, samples: Mapping[str, int]) -> float:
        """Seconds of one step with ``samples`` per participant."""
        return self.compute_s(samples) + self.rounds * self.round_s + self.serial_s

    def as_record(self) -> dict[str, object]:
        return {"round_s": self.round_s, "serial_s": self.serial_s, "rounds": self.rounds,
                "per_sample_s": dict(self.per_sample_s),
                "steps_per_sample_s": [dict(step) for step in self.steps_s]}


def terms_from_record(record: Mapping[str, Any]) -> StepTerms | None:
    """The terms a ``model`` record was written with (:meth:`StepTerms.as_record`), to
    predict other slices than the checked ones; None where the record lacks them or
    holds something else (a record of an older version, without the fitted steps,
    predicts from the medians alone)."""
    try:
        per_sample = {str(n): float(v) for n, v in record["per_sample_s"].items()}
        steps = tuple({str(n): float(v) for n, v in step.items()}
                      for step in record.get("steps_per_sample_s") or [])
        return StepTerms(per_sample, float(record["round_s"]), float(record["serial_s"]),
                         int(record["rounds"]), steps)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def fit_step_terms(window: Sequence[StepSample]) -> StepTerms:
    """The terms of the module doc, medians over ``window`` (not empty; every step with
    the same number of rounds)."""
    if not window:
        raise ValueError("no steps to fit the step model to")
    rounds = window[-1].rounds
    per_sample: dict[str, list[float]] = {}
    steps: list[dict[str, float]] = []
    beyond, serial = [], []
    for step in window:
        steps.append({})
        for name, seconds in step.compute_s.items():
            count = step.samples.get(name, 0)
            if count > 0:
                per_sample.setdefault(name, []).append(seconds / count)
                steps[-1][name] = seconds / count
        slowest = max((step.compute_s.get(name, 0.0) for name, count in step.samples.items()
                       if count > 0), default=0.0)
        beyond.append(max(0.0, step.rounds_s - slowest) / max(step.rounds, 1))
        serial.append(max(0.0, step.step_s - step.rounds_s))
    return StepTerms({name: statistics.median(values) for name, values in per_sample.items()},
                     statistics.median(beyond), statistics.median(serial), rounds,
                     tuple(steps))


@dataclass(frozen=True)
class ModelCheck:
    """The fitted model's prediction for the slices of the checked steps against the
    median of those steps, and the setup's prediction of the conv part and its
    transfers (``predict_sample_step``; None when it made none), for reference."""

    terms: StepTerms
    samples: Mapping[str, int]
    predicted_s: float
    measured_s: float
    setup_predicted_s: float | None
    fitted_steps: int
    checked_steps: int
    attempt: int = 1  # 1 for the first check, then one more for each fit again
    refit: bool = False  # off by more than MODEL_TOLERANCE: fitted again on these steps

    @property
    def error(self) -> float:
        """(predicted − measured) / measured: negative when the model is optimistic."""
        return (self.predicted_s - self.measured_s) / self.measured_s

    def line(self) -> str:
        t = self.terms
        compute = t.compute_s(self.samples)
        again = " again" if self.attempt > 1 else ""
        text = (f"hetconv: step model fitted{again} on {self.fitted_steps} steps: predicted "
                f"{self.predicted_s * 1e3:.1f} ms = compute {compute * 1e3:.1f} + "
                f"{t.rounds} rounds x {t.round_s * 1e3:.1f} + master serial "
                f"{t.serial_s * 1e3:.1f}; measured {self.measured_s * 1e3:.1f} ms over the "
                f"next {self.checked_steps} ({self.error:+.1%})")
        if self.refit:
            text += (f": off by more than {MODEL_TOLERANCE:.0%}, the steps' speed changed "
                     f"since the fit; fitting again on these {self.checked_steps}")
        return text

    def as_record(self) -> dict[str, object]:
        return {"predicted_step_s": self.predicted_s, "measured_step_s": self.measured_s,
                "error": self.error, "setup_predicted_step_s": self.setup_predicted_s,
                "compute_s": self.terms.compute_s(self.samples), "samples": dict(self.samples),
                "fitted_steps": self.fitted_steps, "checked_steps": self.checked_steps,
                "attempt": self.attempt, "refit": self.refit, **self.terms.as_record()}


class InPlaceModel:
    """Fit on steps [MODEL_SKIP, MODEL_SKIP + MODEL_WINDOW), then check on the next
    ``MODEL_WINDOW`` steps whose slices are the same (a step on other slices, or with
    other participants, starts the check again). A check off by more than
    ``MODEL_TOLERANCE`` fits again on its own steps and checks on the next window, up
    to ``MODEL_CHECKS`` checks. Once done, it says nothing more; :meth:`reset` (a
    re-plan: other participants) starts over."""

    def __init__(self, setup_predicted_s: float | None = None):
        self.setup_predicted_s = setup_predicted_s
        self.reset()

    def reset(self) -> None:
        self._seen = 0
        self._fit: list[StepSample] = []
        self._terms: StepTerms | None = None
        self._checked: list[StepSample] = []
        self._attempt = 1
        self.done = False

    def observe(self, step: StepSample) -> ModelCheck | None:
        """Take one step; the check once it is complete (once), else None."""
        if self.done:
            return None
        self._seen += 1
        if self._seen <= MODEL_SKIP:
            return None
        if self._terms is None:
            if self._fit and set(step.samples) != set(self._fit[0].samples):
                self.reset()  # other participants: start over
                return None
            self._fit.append(step)
            if len(self._fit) == MODEL_WINDOW:
                self._terms = fit_step_terms(self._fit)
            return None
        if self._checked and dict(step.samples) != dict(self._checked[0].samples):
            self._checked = []  # re-sliced: check the prediction for the new slices
        if set(step.samples) - set(self._terms.per_sample_s):
            self.reset()
            return None
        self._checked.append(step)
        if len(self._checked) < MODEL_WINDOW:
            return None
        samples = dict(self._checked[0].samples)
        check = ModelCheck(self._terms, samples, self._terms.predict(samples),
                           statistics.median(s.step_s for s in self._checked),
                           self.setup_predicted_s, len(self._fit), len(self._checked),
                           attempt=self._attempt)
        if abs(check.error) > MODEL_TOLERANCE and self._attempt < MODEL_CHECKS:
            self._fit, self._checked = self._checked, []
            self._terms = fit_step_terms(self._fit)
            self._attempt += 1
            return replace(check, refit=True)
        self.done = True
        return check
