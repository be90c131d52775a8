"""The sample split's decisions from measured steps, as one sans-IO policy.

After every training step (:meth:`SamplePolicy.step_ended`) and at every snapshot
(:meth:`SamplePolicy.at_snapshot`) the stage hands in what it measured and carries out
what comes back; the policy itself reads no clock and touches no socket. It holds the
four decisions of a run split by samples:

- the re-slicing from measured compute (``SampleBalance``, ``--rebalance``): a
  :class:`Reslice` when the balance moved;
- the step model calibrated in place (``InPlaceModel``): a :class:`ModelChecked` once
  its check of the fitted terms is complete;
- never slower than the master alone (``AloneCheck``, ``--fall-back``): a ``TryAlone``
  at a snapshot; the trial itself is ``TrialAloneStage``'s, which ends it with
  ``StayAlone`` or ``GoBack``;
- never slower than with one worker fewer (``WithoutCheck``): ``TryWithout``, then
  ``KeepWithout`` or ``TakeBack``.

The participants changing for another reason (a fault, a join, a re-split, the
workers back from a trial) are events too: each tells the decisions whose window
measured the old participants to start over.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hetconv.config import MASTER_PARTICIPANT
from hetconv.master.samples.balance import SampleBalance
from hetconv.master.samples.fall_back import AloneCheck, TryAlone
from hetconv.master.samples.figures import StepFigures
from hetconv.master.samples.step_model import InPlaceModel, ModelCheck, StepSample
from hetconv.master.samples.trial_without import KeepWithout, TakeBack, TryWithout, WithoutCheck


@dataclass(frozen=True)
class Reslice:
    """Slice the batch again: the balance moved (from measured compute per sample)."""


@dataclass(frozen=True)
class ModelChecked:
    """The in-place model's check is complete: say it and record it."""

    check: ModelCheck


StepCommand = Reslice | ModelChecked
SnapshotVerdict = TryAlone | TryWithout | KeepWithout | TakeBack | None


def step_sample(figures: StepFigures, samples: Mapping[str, int], now: float
                ) -> StepSample | None:
    """A step ended at ``now`` (monotonic s) as the step model takes it (its wall from the
    first request, its rounds, each participant's compute and samples); None for a step
    without rounds (the master alone)."""
    if figures.started is None or not figures.rounds:
        return None
    return StepSample(now - figures.started, figures.wall, figures.rounds,
                      dict(figures.compute), {n: c for n, c in samples.items() if c > 0})


class SamplePolicy:
    """Events in (steps, snapshots, participant changes), commands out (module doc)."""

    def __init__(self, balance: SampleBalance, setup_predicted_s: float | None = None,
                 rebalancing: bool = True, fall_back: bool = True,
                 alone_measured_s: float | None = None):
        self.balance = balance
        self.rebalancing = rebalancing
        self.fall_back = fall_back
        self.alone = AloneCheck(alone_measured_s)  # never slower than the master alone
        self.without = WithoutCheck()  # ... nor than with one worker fewer
        self.model = InPlaceModel(setup_predicted_s)  # calibrated in place
        self._last_step_end: float | None = None  # monotonic s

    # --- after every training step ---------------------------------------------------
    def step_ended(self, figures: StepFigures, samples: Mapping[str, int],
                   now: float) -> list[StepCommand]:
        """A training step ended at ``now`` (monotonic s) with these ``figures``, on
        slices of ``samples`` per participant."""
        own = samples.get(MASTER_PARTICIPANT, 0)
        if own > 0 and MASTER_PARTICIPANT in figures.compute:
            # the conv part on both sides (the trial of the master alone times its conv
            # calls only): a step chain's dense part taken out of its wall and compute
            dense = figures.dense
            self.alone.distributed_step(
                max(0.0, figures.wall - max(dense.values(), default=0.0)),
                max(0.0, figures.compute[MASTER_PARTICIPANT]
                    - dense.get(MASTER_PARTICIPANT, 0.0)) / own * sum(samples.values()))
        if self._last_step_end is not None:  # the step's period, from the last step's end
            self.without.step(now - self._last_step_end)
        self._last_step_end = now
        commands: list[StepCommand] = []
        sample = step_sample(figures, samples, now)
        if sample is not None:
            self.without.observe(sample)
            check = self.model.observe(sample)
            if check is not None:
                commands.append(ModelChecked(check))
        if self.rebalancing and self.balance.observe(
                figures.compute, figures.latency, dict(samples), figures.waits):
            commands.append(Reslice())
        return commands

    # --- at a snapshot -----------------------------------------------------------------
    def at_snapshot(self, next_samples: Mapping[str, int]) -> SnapshotVerdict:
        """What to do from this snapshot on (None: go on as now); ``next_samples``: each
        participant's slice of the next step. The master alone is tried first: where
        the run is slower than it, its trial decides in one interval; then a worker too
        slow for its slice, where the run beats the master."""
        self._last_step_end = None  # the next step's period would hold the snapshot's
        if not self.fall_back:
            return None
        verdict = self.alone.at_snapshot()
        if isinstance(verdict, TryAlone):
            return verdict
        return self.without.at_snapshot(next_samples)

    def on_trial(self) -> str | None:
        """The worker the run is tried without now, if any."""
        trial = self.without.trial
        return trial.worker if trial is not None else None

    # --- the participants changed ------------------------------------------------------
    def fault(self) -> None:
        """A fault: a trial without a worker under way is over."""
        self.without.reset()

    def joined(self) -> None:
        """Workers joined: measure the participants afresh."""
        self.without.reset()

    def resplit(self) -> None:
        """Other participants: the step model fits and checks again."""
        self.model.reset()

    def back_from_alone(self) -> None:
        """The workers are back after a trial of the master alone (its steps were the
        master's alone)."""
        self.without.reset()
        self._last_step_end = None
