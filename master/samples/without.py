"""The sample stage's side of the trial without a worker (``master/samples/trial_without.py``
decides): set the worker aside through the run's state machine, then leave it out for
the run or take it back as a joiner, each said on the console and recorded."""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from hetconv.engine.stage import ConvStage
from hetconv.master.run import Command, RunControl, SetAside
from hetconv.master.samples.between import SampleSetup, sample_counts
from hetconv.master.samples.plan import Slice
from hetconv.master.samples.trial_without import (
    WITHOUT_GAIN,
    WITHOUT_WINDOW,
    KeepWithout,
    TakeBack,
    TryWithout,
    Verdict,
    WithoutCheck,
)

log = logging.getLogger("hetconv.master")


class WithoutTrials:
    """Mixed into the sample stage (attributes set in its ``__init__``)."""

    control: RunControl
    setup: SampleSetup
    _slice_batch: Callable[[int], list[Slice]]  # the balance's slices of a batch
    without_check: WithoutCheck
    set_aside: set[str]  # workers left out for the rest of the run by a trial

    # the run state machine's commands carried out (master/samples/between.py)
    _carry_out: Callable[[list[Command], dict[str, np.ndarray]], ConvStage]

    def kept_out(self) -> set[str]:
        """Workers not to take in as joiners now: left out by the plan for their links,
        by a trial, or out on trial."""
        trial = self.without_check.trial
        return set(self.setup.left_out) | self.set_aside \
            | ({trial.worker} if trial is not None else set())

    def without_verdict(self, state: dict[str, np.ndarray]) -> ConvStage | None:
        """At a snapshot: act on the trial check's verdict; the stage to go on with when
        the participants changed (a trial started), else None."""
        # the slices the next step takes (``self.slices`` may hold an evaluation's)
        slices = self._slice_batch(self.setup.batch)
        verdict: Verdict = self.without_check.at_snapshot(
            {piece.participant: piece.samples for piece in slices})
        if isinstance(verdict, TryWithout):
            reason = (f"trying without {verdict.worker}: its slice is {verdict.samples} of "
                      f"{verdict.batch} samples, yet every peer waits for it at every "
                      f"barrier; the step measured {verdict.with_s * 1e3:.1f} ms with it "
                      f"(median of {WITHOUT_WINDOW} steps)")
            self.setup.report(f"hetconv: {reason}; until the next snapshot it waits")
            return self._carry_out(self.control.handle(SetAside(verdict.worker, reason)),
                                   state)
        if isinstance(verdict, KeepWithout):
            self.set_aside.add(verdict.worker)
            reason = (f"not used from now on: {verdict.worker} (the step measured "
                      f"{verdict.without_s * 1e3:.1f} ms without it, "
                      f"{verdict.with_s * 1e3:.1f} ms with it, medians of {WITHOUT_WINDOW} "
                      "steps; it stays connected until the run ends)")
            self.setup.report(f"hetconv: {reason}")
            log.warning("%s", reason)
            self.setup.metrics.write(
                "replan", reason=reason, split_by="samples", left_out=[verdict.worker],
                measured_step_s=verdict.without_s, with_step_s=verdict.with_s,
                counts=sample_counts(self.setup.shapes,
                                     {piece.participant: piece.samples for piece in slices}))
        if isinstance(verdict, TakeBack):
            self.setup.report(
                f"hetconv: taking {verdict.worker} back: without it the step measured "
                f"{verdict.without_s * 1e3:.1f} ms, with it {verdict.with_s * 1e3:.1f} ms "
                f"(not {WITHOUT_GAIN:.0%} shorter); it joins again")
        return None
