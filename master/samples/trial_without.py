"""Never slower than with one worker fewer (``--fall-back on``, the sample split): when
to try the run without a worker that gets little of the batch, and, after the trial,
whether to leave it out or take it back.

Under the sample split every participant takes part in every batch-norm barrier and in
the weight reduction, and applies every update, whatever its slice. The rebalancer
(``SampleBalance``) gives a slow worker a small slice, but its per-step work (the
barriers' messages, the updates, the reduction's pieces) does not shrink with the
slice, and every peer waits for it at every barrier: on the lab a 0.1-core machine
beside three 0.45-core ones got 8 of 128 samples and made the step 17 % longer than
the three alone (docs/sample-split.md "Never slower than with one worker fewer"). The step model
(master/samples/step_model.py) does not see that cost either: it charges compute per
sample, and the same rounds with one participant fewer. So it is measured: a worker
whose slice is under ``SMALL_SHARE`` of an even share is a candidate, and where the
step model fitted on the last steps at the snapshot (:func:`fit_recent`) covers the
participants, it is tried only where the model predicts the step without it (the
batch re-sliced over the rest by their fitted speed) within its own error band
(``MODEL_TOLERANCE``) of the step with it (:func:`without_ratio`): the choice the
model cannot make, which the trial measures (issue 50: trials only where the model is
unsure). Outside the band the model is sure the rest would be slower, and no trial
runs. The slice rule stays first: on a small network the model's compute per sample
holds each step's fixed costs, and with two workers of 30 and 34 samples of 64 it put
the step without one at -2 %, a trial the slice rule never starts. The run goes on
without it from one snapshot to the next (:class:`TryWithout`), and the medians of the
last ``WITHOUT_WINDOW`` steps with it and without it decide (:class:`KeepWithout`: it
stays out for the run, named in the report; :class:`TakeBack`: it is taken back as a
joiner, and not tried again). Under ``WITHOUT_GAIN`` shorter without, it comes back:
a trial costs one snapshot interval at most, once per worker.

Sans-IO: the stage feeds step seconds in and carries out the verdicts
(``master/samples/between.py``); no clock, no sockets (``tests/unit/test_trial_without.py``).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hetconv.config import MASTER_PARTICIPANT
from hetconv.master.samples.plan import sample_slices
from hetconv.master.samples.step_model import (
    MODEL_TOLERANCE,
    StepSample,
    StepTerms,
    fit_step_terms,
)

WITHOUT_WINDOW = 9
"""Steps whose median is compared: the last ones with the worker, the trial's without."""
SMALL_SHARE = 0.25
"""A worker is tried without when its slice is under this fraction of an even share
(batch / participants). Measured on the lab (32:64, batch 128): a 0.1-core worker
beside three of 0.45 core got 1-2 samples and the step was 1.5-1.9x longer with it
than without; the 0.2-core workers of 0.6/0.4/0.2/0.2 got 13-15 (40-47 % of an even
share) and with 0.5 here were tried: two trials of three measured within 5 % and took
them back, each trial and rejoin costing a snapshot interval and a calibration
(docs/figures/ab/unequal-trial-half-share-32-64.md, at e4aa284)."""
WITHOUT_GAIN = 0.05
"""The run without the worker must measure at least this much shorter to keep it out
(the lab's 9-step medians move by a few percent between windows)."""


@dataclass(frozen=True)
class TryWithout:
    """Run without ``worker`` from this snapshot to the next: its slice was
    ``samples`` of ``batch``; the step measured ``with_s`` (median) with it."""

    worker: str
    samples: int
    batch: int
    with_s: float
    model_ratio: float | None = None  # the step model's without / with, where it chose

    def why(self) -> str:
        """Why it is tried, for the console and the ``replan`` record."""
        if self.model_ratio is None:
            return (f"its slice is {self.samples} of {self.batch} samples, yet every peer "
                    "waits for it at every barrier")
        return (f"the step model predicts the step {self.model_ratio - 1:+.1%} without it "
                f"(its slice is {self.samples} of {self.batch}), within the model's "
                f"{MODEL_TOLERANCE:.0%} error, and it does not see the cost of a "
                "participant at every barrier")


@dataclass(frozen=True)
class KeepWithout:
    """The trial is over: without ``worker`` the step measured ``without_s``, with it
    ``with_s`` (medians): leave it out for the rest of the run."""

    worker: str
    with_s: float
    without_s: float


@dataclass(frozen=True)
class TakeBack:
    """The trial is over: without ``worker`` the step was not ``WITHOUT_GAIN`` shorter
    (``without_s`` against ``with_s``): take it back; it is not tried again."""

    worker: str
    with_s: float
    without_s: float


Verdict = TryWithout | KeepWithout | TakeBack | None


class WithoutCheck:
    """Decides, at each snapshot, whether to try the run without its smallest-slice
    worker, and how a trial ends.

    Feed :meth:`step` with every training step's seconds; call :meth:`at_snapshot`
    after every snapshot and act on its verdict; :meth:`reset` when the participants
    change for another reason (a fault, a join), which also ends a trial."""

    def __init__(self) -> None:
        self.steps: deque[float] = deque(maxlen=WITHOUT_WINDOW)  # s, the current plan's
        self.figures: deque[StepSample] = deque(maxlen=WITHOUT_WINDOW)  # the model's input
        self.tried: set[str] = set()  # workers tried once: never again this run
        self.trial: TryWithout | None = None  # the trial under way

    def step(self, seconds: float) -> None:
        """One training step of the current participants (seconds, wall)."""
        self.steps.append(seconds)

    def observe(self, sample: StepSample) -> None:
        """A training step's figures as the step model takes them: the last
        ``WITHOUT_WINDOW`` are fitted at a snapshot (:func:`fit_recent`)."""
        self.figures.append(sample)

    def reset(self) -> None:
        """Other participants (a fault, a join): the steps so far measured another
        plan, and a trial under way is over without a verdict."""
        self._clear()
        self.trial = None

    def _clear(self) -> None:
        self.steps.clear()
        self.figures.clear()

    def at_snapshot(self, samples: Mapping[str, int]) -> Verdict:
        """What to do from this snapshot on (None: go on as now); ``samples``: each
        participant's slice in the current plan (the master's too, when it has one)."""
        if len(self.steps) < WITHOUT_WINDOW:
            return None
        measured = statistics.median(self.steps)
        if self.trial is not None:
            trial, self.trial = self.trial, None
            self._clear()
            if measured <= trial.with_s * (1 - WITHOUT_GAIN):
                return KeepWithout(trial.worker, trial.with_s, measured)
            return TakeBack(trial.worker, trial.with_s, measured)
        ratio: float | None = None
        terms = fit_recent(list(self.figures))
        if covers(terms, samples):
            assert terms is not None
            chosen = unsure_without(terms, samples, self.tried)
            if chosen is None:
                return None
            candidate, ratio = chosen
        else:
            found = smallest_slice(samples, self.tried)
            if found is None:
                return None
            candidate = found
        self.tried.add(candidate)
        self.trial = TryWithout(candidate, samples[candidate], sum(samples.values()),
                                measured, ratio)
        self._clear()
        return self.trial


def small_slices(samples: Mapping[str, int], tried: set[str]) -> list[str]:
    """The workers (not tried yet) whose slice is under ``SMALL_SHARE`` of an even share,
    in participant order, when at least one other worker would stay (with the master
    alone left, the master-alone check decides); else none."""
    workers = [name for name in samples if name != MASTER_PARTICIPANT]
    if len(workers) < 2 or not samples:
        return []
    even = sum(samples.values()) / len(samples)
    return [name for name in workers
            if name not in tried and samples[name] < SMALL_SHARE * even]


def smallest_slice(samples: Mapping[str, int], tried: set[str]) -> str | None:
    """The worker of :func:`small_slices` with the smallest slice (ties: the later in
    participant order); None where there is none."""
    small = small_slices(samples, tried)
    if not small:
        return None
    return min(reversed(small), key=lambda name: samples[name])


FIT_LEAST = 5
"""Steps the model is fitted on at least at a snapshot (of the last ``WITHOUT_WINDOW``)."""


def fit_recent(figures: Sequence[StepSample]) -> StepTerms | None:
    """The step model fitted on the recent steps (``fit_step_terms``) that had the last
    one's participants and rounds, where there are ``FIT_LEAST``; else None. Recent,
    not the run's first fit: a machine that got busy since is seen as it is now."""
    if not figures:
        return None
    last = figures[-1]
    same = [f for f in figures if f.rounds == last.rounds
            and set(f.compute_s) == set(last.compute_s)]
    return fit_step_terms(same) if len(same) >= FIT_LEAST else None


def covers(terms: StepTerms | None, samples: Mapping[str, int]) -> bool:
    """Whether ``terms`` hold a figure for every participant with a slice."""
    return terms is not None and all(
        name in terms.per_sample_s for name, count in samples.items() if count > 0)


def without_ratio(terms: StepTerms, samples: Mapping[str, int], worker: str) -> float:
    """The step model's step without ``worker`` over its step with ``samples``: the
    batch re-sliced over the others with a figure, by their fitted seconds per sample
    (:func:`sample_slices`); the rounds and the serial part as they are. inf where no
    one would be left."""
    rest = [name for name in samples if name != worker and name in terms.per_sample_s]
    with_s = terms.predict(samples)
    if not rest or with_s <= 0:
        return math.inf
    batch = sum(samples.values())
    slices = sample_slices(rest, [terms.per_sample_s[name] for name in rest], batch)
    return terms.predict({s.participant: s.samples for s in slices}) / with_s


def unsure_without(terms: StepTerms, samples: Mapping[str, int], tried: set[str]
                   ) -> tuple[str, float] | None:
    """Of the :func:`small_slices` workers, the one whose removal the model predicts
    costs least, with its :func:`without_ratio`, where that is within the model's band
    (at most 1 + ``MODEL_TOLERANCE``); None where there is no small slice or the model
    is sure the step would be longer without each of them."""
    ratios = {name: without_ratio(terms, samples, name)
              for name in small_slices(samples, tried)}
    within = {name: r for name, r in ratios.items() if r <= 1 + MODEL_TOLERANCE}
    if not within:
        return None
    best = min(reversed(list(within)), key=lambda name: within[name])
    return best, within[best]
