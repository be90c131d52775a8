"""Set-up rehearses the first plan: the step model's terms measured before training.

Set-up's prediction of a plan with workers came from calibration alone: each
participant's compute per sample, timed one layer at a time, plus the link model's
transfers and round trips (``predict_sample_step``). The steps then measured 10-44 %
longer on the lab (issue 50, docs/figures/scale-setup-32-64.md). The step model fitted
on those steps (master/samples/step_model.py) named the missing terms: per round, the
barriers' skew (every batch-norm barrier waits for whichever participant is slow at
that moment: on four 0.45-core machines the sum over phases of the slowest was 7.5 ms
above the slowest participant's sum), the peers' reduction and the message handling on
CPU-quota machines (another ~11 ms there); and each step's slowest participant rather
than the slowest median. Calibration cannot see them: they exist only when the
participants run the step chain together.

So set-up measures them the way training will meet them: it runs ``REHEARSAL_WARMUP``
warm-up steps and then timed steps of the first plan (the step chain, two steps in flight
as in training) at learning rate 0 on random data, until the median step is known within
``REHEARSAL_PRECISION`` (at least ``REHEARSAL_STEPS``, at most ``REHEARSAL_MAX_STEPS``:
:func:`enough_steps`), fits the step model's terms on the timed ones (:func:`fit_step_terms`, the fit the run re-does in place) and hands every
participant its layers back as they were (momentum and batch-norm statistics moved).
The run's in-place model then re-fits the same terms on the run's own steps: one model
from set-up to the report. The prediction is also the figure the master alone is held
to: set-up trains alone where the rehearsed plan is no faster than the master alone
measured (master/alone_first.py).

The socket side is the stage's; the decision is pure (``first_choice`` of
master/alone_first.py, with the step model's band).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hetconv.engine.stage import ConvStage, StageFault
from hetconv.master.alone_first import AloneMeasure
from hetconv.master.rehearsal_steps import REHEARSAL_STEPS, hold_to_alone, rehearse_steps
from hetconv.master.samples.step_model import (
    StepTerms,
    fit_step_terms,
)
from hetconv.metrics import MetricsWriter
from hetconv.model import ModelConfig

if TYPE_CHECKING:
    from hetconv.master.samples.stage import SampleConvStage


@dataclass(frozen=True)
class Rehearsal:
    """The first plan rehearsed: the fitted terms, the slices they predict for, the
    prediction (seconds), the steps timed and the rehearsal's whole cost (seconds, the
    hand-back of the layers included)."""

    terms: StepTerms
    samples: dict[str, int]
    predicted_s: float
    steps: int
    cost_s: float
    steps_s: tuple[float, ...] = ()  # each timed step's wall

    def line(self) -> str:
        t = self.terms
        return (f"hetconv: rehearsed the plan ({self.steps} steps at learning rate 0, "
                f"{self.cost_s:.2f} s): predicted {self.predicted_s * 1e3:.1f} ms a step = "
                f"compute {t.compute_s(self.samples) * 1e3:.1f} + {t.rounds} rounds x "
                f"{t.round_s * 1e3:.1f} + master serial {t.serial_s * 1e3:.1f}")

    def as_record(self) -> dict[str, Any]:
        return {"split_by": "samples", "predicted_step_s": self.predicted_s, "steps": self.steps,
                "cost_s": self.cost_s, "samples": dict(self.samples),
                "rehearsed_steps_s": list(self.steps_s),
                "compute_s": self.terms.compute_s(self.samples), **self.terms.as_record()}


def rehearse(stage: SampleConvStage, model: ModelConfig, params: dict[str, np.ndarray],
             batch: int, state: dict[str, np.ndarray], steps: int = REHEARSAL_STEPS
             ) -> Rehearsal | StageFault | None:
    """Run the first plan's step chain as :func:`rehearse_steps` says (at least
    ``steps`` timed), then hand every participant its layers back as ``state`` holds them (the master's replicas before the
    rehearsal; module doc). A fault on the way is returned (nothing handed back: the
    caller's recovery does it). None where no step had rounds (no worker with samples)."""
    started = time.perf_counter()
    try:
        timed = rehearse_steps(stage, model, params, batch,
                               lambda wall_s: stage.end_rehearsal_step(),
                               lambda sample: sample.step_s, steps)
        stage.drain()
        stage.restore(state)
    except StageFault as fault:
        stage.drain()
        return fault
    if not timed:  # no rounds: nothing with workers to rehearse
        return None
    counts = {p.participant: p.samples for p in stage.members.slices(batch)}
    terms = fit_step_terms(timed)
    return Rehearsal(terms, counts, terms.predict(counts), len(timed),
                     time.perf_counter() - started, tuple(s.step_s for s in timed))


def rehearse_first_plan(stage: SampleConvStage, model: ModelConfig,
                        params: dict[str, np.ndarray], batch: int,
                        alone: AloneMeasure | None, metrics: MetricsWriter,
                        report: Callable[[str], None]) -> ConvStage | None:
    """Rehearse the first plan (:func:`rehearse`) and, where the master alone was measured
    at set-up (``alone``), hold it to that figure. Returns the stage to train with:
    ``stage``, or what its recovery gives where a worker was lost in the rehearsal; None
    where the master should train alone from the start. Said and recorded (a
    ``rehearsal`` record); the run's step model is told the prediction. A stage without
    the step chain (``--data-plane star``, the dense part on the master) or with a
    fault pending is not rehearsed."""
    if stage.chains is None or stage.pending_fault is not None:
        return stage
    state = stage.replicas.state()  # as handed out (the snapshot's audit would add a round)
    outcome = rehearse(stage, model, params, batch, state)
    if isinstance(outcome, StageFault):
        report(f"hetconv: the plan's rehearsal stopped: {outcome}")
        return stage.recover(outcome, state)
    if outcome is None:
        return stage
    report(outcome.line())
    stage.policy.model.setup_predicted_s = outcome.predicted_s
    if alone is not None:
        stage.policy.alone.rehearsed = True  # trials only within the model's band (fall_back.py)
    if hold_to_alone(outcome.predicted_s, outcome.as_record(), alone,
                     "the rehearsed plan predicted", metrics, report):
        return None
    return stage
