"""Never slower than the master alone (``--fall-back on``): when to try the master
alone, and, after the trial, whether to stay alone or go back to the workers.

Under the sample split the master computes a slice of every step, so it can estimate,
on its own machine and under the same load, what the whole batch would cost it alone
(its measured compute per sample times the batch). The estimate is a measure of
slices, not of the whole batch, and it errs both ways on the lab's CPU quotas: 24-27 %
short of the master really alone (54.6 against 71.5 ms; 88.6 against 118-124 in the
baselines of the same invocation; 2 x 0.45 core, 32:64), and up to 34 % over it (the
step model's per-sample figure times the batch, same runs: 81-162 ms against 118-124;
0.6/0.4/0.2/0.2: 95.7 against 85). So it only *triggers* a trial, and the trigger
leaves room for that error: a trial starts as soon as the run is not clearly faster
than the estimate (``TRIAL_TRIGGER``); once a trial has measured the master alone, the
estimate is corrected by it and the trigger is tight (``CORRECTED_TRIGGER``). With one
trigger of 1.05 a run 7 % slower than the master alone went on so for all its steps
where the estimate came out high (0.6/0.4/0.2/0.2, 32:64: 93.7 ms a step against 87.8
alone). The trial: from the next snapshot the master really trains alone (the workers
wait, heartbeated) for ``ALONE_WINDOW`` steps, or ``EARLY_STEPS`` where its steps are
already clearly on one side of the run's (``CLEAR_MARGIN``); the trainer takes a
snapshot there (:meth:`AloneCheck.verdict_ready`), not at the next one due, and the
medians of two measured step times decide (:class:`AloneCheck`). Going back to the workers costs one hand-out of the
layers; a wrong trial costs ``EARLY_STEPS`` to ``ALONE_WINDOW`` steps at the slower
speed, once: the trial
also corrects the estimate (measured over estimated alone), so the same conditions do
not trigger it again.

Sans-IO: the stage feeds measured seconds in and acts on the verdicts
(``master/samples/trial_alone.py``); no clock, no sockets (``tests/unit/test_fall_back.py``).
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from hetconv.master.samples.step_model import MODEL_TOLERANCE

ALONE_WINDOW = 9
"""Steps whose median is compared: the last ones with the workers, the trial's alone."""
STAY_ALONE_REASON = "slower than the master alone"
"""How the ``replan`` record that leaves the master alone for the rest of the run
begins (read back by ``hetconv bench scale`` and ``hetconv report``)."""
TRIAL_TRIGGER = 0.75
"""Before any trial: a trial starts when the conv part with the workers measures more
than this fraction of the estimate of the master alone (the estimate errs by up to
a third either way: module doc). Runs that scale well stay well under it (four 0.45-core
machines, 32:64: 55-62 ms against estimates of 111-178)."""
EARLY_STEPS = 4
"""A trial measured this many steps alone may end before ``ALONE_WINDOW`` when its
steps but the first (which pays the restore's first touches) are all clearly on one
side of the run with the workers (``CLEAR_MARGIN``)."""
CLEAR_MARGIN = 1.25
"""Clearly on one side: each of those steps more than this factor slower than the median
step with the workers, or this factor faster. The trials seen on the lab's quota
machines measured the master alone 1.3-1.5 times slower than the workers or within a
few percent of them; the close ones run the whole window."""
REHEARSED_TRIGGER = 1 / (1 + MODEL_TOLERANCE)
"""Where set-up rehearsed the plan and held it to the master alone measured
(master/samples/rehearsal.py): a trial starts only when the run's steps come within
the step model's band (``MODEL_TOLERANCE``) of the master alone, where that band
covers both choices (issue 50: trials only when the model is unsure)."""
CORRECTED_TRIGGER = 1.05
"""After a trial corrected the estimate by what it measured: a trial starts again only
when the workers measure this much slower than the corrected estimate."""


@dataclass(frozen=True)
class TryAlone:
    """Train the master alone from this snapshot to the next: the plan measured
    ``measured_s`` per step, the master alone is estimated at ``alone_s``."""

    measured_s: float
    alone_s: float


@dataclass(frozen=True)
class StayAlone:
    """The trial is over: alone (``alone_s``, measured, the median of ``trial_steps``)
    beat the workers (``measured_s``): drop them and train on alone."""

    measured_s: float
    alone_s: float
    trial_steps: int = ALONE_WINDOW


@dataclass(frozen=True)
class GoBack:
    """The trial is over: the workers (``measured_s``) beat the master alone
    (``alone_s``, measured, the median of ``trial_steps``): hand them the snapshot and
    train on with them."""

    measured_s: float
    alone_s: float
    trial_steps: int = ALONE_WINDOW


Verdict = TryAlone | StayAlone | GoBack | None


class AloneCheck:
    """Decides, at each snapshot, between the workers and the master alone.

    Feed :meth:`distributed_step` with every step the workers take part in, and
    :meth:`trial_step` with every step of a trial; call :meth:`at_snapshot` after
    every snapshot and act on its verdict."""

    def __init__(self, measured_alone_s: float | None = None, rehearsed: bool = False
                 ) -> None:
        """``measured_alone_s``: the master alone's conv part measured at set-up
        (master/alone_first.py): the figure the workers are held to instead of the
        in-run estimate, until a trial measures it again. Three steps at set-up erred
        -18 % to +29 % against the master really alone on the lab (its batch pipeline
        and the quota's phase are not those of training), about as much as the
        estimate, so the trigger stays ``TRIAL_TRIGGER``; what it removes is the
        estimate's swing from step to step (issue 50: every two-machine run was tried).
        ``rehearsed``: set-up also rehearsed the plan against that figure, so the
        trigger is ``REHEARSED_TRIGGER`` (the step model's band)."""
        self.measured_alone_s = measured_alone_s
        self.rehearsed = rehearsed
        self.walls: deque[float] = deque(maxlen=ALONE_WINDOW)  # s, conv part, with workers
        self.estimates: deque[float] = deque(maxlen=ALONE_WINDOW)  # s, alone, estimated
        self.trial: deque[float] = deque(maxlen=ALONE_WINDOW)  # s, alone, measured
        self.in_trial = False
        self.correction = 1.0  # measured over estimated alone, from the last trial
        self.corrected = False  # a trial measured the master alone: the tight trigger
        self._estimate_then = 0.0  # the median estimate that started the trial

    def distributed_step(self, wall_s: float, alone_estimate_s: float) -> None:
        """A step with the workers: its conv part (first round sent to last reply) and
        the estimate of the master alone (its compute per sample times the batch)."""
        self.walls.append(wall_s)
        self.estimates.append(alone_estimate_s)

    def trial_step(self, alone_s: float) -> None:
        """A step of the trial: the master's conv part alone, measured."""
        self.trial.append(alone_s)

    def verdict_ready(self) -> bool:
        """Whether a trial has measured enough to decide: ``ALONE_WINDOW`` steps alone,
        or ``EARLY_STEPS`` clearly on one side (the trainer then takes a snapshot after
        this step, where :meth:`at_snapshot` gives the verdict)."""
        return self.in_trial and (len(self.trial) >= ALONE_WINDOW
                                  or self._clear_side() is not None)

    def _clear_side(self) -> str | None:
        """The master alone's side against the median step with the workers, "slower" or
        "faster", where each of the last ``EARLY_STEPS`` - 1 of at least ``EARLY_STEPS``
        trial steps is so by ``CLEAR_MARGIN``; None while unclear."""
        if len(self.trial) < EARLY_STEPS or not self.walls:
            return None
        recent = list(self.trial)[-(EARLY_STEPS - 1):]
        measured = statistics.median(self.walls)
        if min(recent) > CLEAR_MARGIN * measured:
            return "slower"
        if max(recent) * CLEAR_MARGIN < measured:
            return "faster"
        return None

    def at_snapshot(self) -> Verdict:
        """What to do from this snapshot on (None: go on as now)."""
        if self.in_trial:
            return self._end_trial()
        if len(self.walls) < ALONE_WINDOW or len(self.estimates) < ALONE_WINDOW:
            return None
        measured = statistics.median(self.walls)
        estimate = statistics.median(self.estimates)
        alone = estimate * self.correction
        trigger = CORRECTED_TRIGGER if self.corrected else TRIAL_TRIGGER
        if self.measured_alone_s and not self.corrected:  # measured, not estimated
            alone = self.measured_alone_s  # erring as much: the same trigger,
            if self.rehearsed:  # unless the plan was rehearsed against it: the model's band
                trigger = REHEARSED_TRIGGER
        if alone <= 0 or measured <= trigger * alone:
            return None
        self.in_trial, self._estimate_then = True, estimate
        self.trial.clear()
        return TryAlone(measured, alone)

    def _end_trial(self) -> Verdict:
        if not self.verdict_ready():
            return None  # too few steps alone yet: the trial goes on to the next snapshot
        measured = statistics.median(self.walls)
        alone = statistics.median(self.trial)
        self.in_trial = False
        if alone <= measured:
            return StayAlone(measured, alone, len(self.trial))
        if self._estimate_then > 0:
            self.correction = alone / self._estimate_then
            self.corrected = True
        self.walls.clear()
        self.estimates.clear()
        return GoBack(measured, alone, len(self.trial))
