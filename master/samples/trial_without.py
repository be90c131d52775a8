"""Never slower than with one worker fewer (``--fall-back on``, the sample split): when
to try the run without a worker that gets little of the batch, and, after the trial,
whether to leave it out or take it back.

Under the sample split every participant takes part in every batch-norm barrier and in
the weight reduction, and applies every update, whatever its slice. The rebalancer
(``SampleBalance``) gives a slow worker a small slice, but its per-step work (the
barriers' messages, the updates, the reduction's pieces) does not shrink with the
slice, and every peer waits for it at every barrier: on the lab a 0.1-core machine
beside three 0.45-core ones got 8 of 128 samples and made the step 17 % longer than
the three alone (docs/sample-split.md "Never slower than with one worker fewer"). The setup's
model does not see that cost (it charges compute per sample only), so it is measured:
when a worker's slice is under ``SMALL_SHARE`` of an even share, the run goes on
without it from one snapshot to the next (:class:`TryWithout`), and the medians of the
last ``WITHOUT_WINDOW`` steps with it and without it decide (:class:`KeepWithout`: it
stays out for the run, named in the report; :class:`TakeBack`: it is taken back as a
joiner, and not tried again). Under ``WITHOUT_GAIN`` shorter without, it comes back:
a trial costs one snapshot interval at most, once per worker.

Sans-IO: the stage feeds step seconds in and carries out the verdicts
(``master/samples/between.py``); no clock, no sockets (``tests/unit/test_trial_without.py``).
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from hetconv.config import MASTER_PARTICIPANT

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
        self.tried: set[str] = set()  # workers tried once: never again this run
        self.trial: TryWithout | None = None  # the trial under way

    def step(self, seconds: float) -> None:
        """One training step of the current participants (seconds, wall)."""
        self.steps.append(seconds)

    def reset(self) -> None:
        """Other participants (a fault, a join): the steps so far measured another
        plan, and a trial under way is over without a verdict."""
        self.steps.clear()
        self.trial = None

    def at_snapshot(self, samples: Mapping[str, int]) -> Verdict:
        """What to do from this snapshot on (None: go on as now); ``samples``: each
        participant's slice in the current plan (the master's too, when it has one)."""
        if len(self.steps) < WITHOUT_WINDOW:
            return None
        measured = statistics.median(self.steps)
        if self.trial is not None:
            trial, self.trial = self.trial, None
            self.steps.clear()
            if measured <= trial.with_s * (1 - WITHOUT_GAIN):
                return KeepWithout(trial.worker, trial.with_s, measured)
            return TakeBack(trial.worker, trial.with_s, measured)
        candidate = smallest_slice(samples, self.tried)
        if candidate is None:
            return None
        self.tried.add(candidate)
        self.trial = TryWithout(candidate, samples[candidate], sum(samples.values()),
                                measured)
        self.steps.clear()
        return self.trial


def smallest_slice(samples: Mapping[str, int], tried: set[str]) -> str | None:
    """The worker with the smallest slice under ``SMALL_SHARE`` of an even share, not
    tried yet (ties: the later in participant order), when at least one other worker
    would stay (with the master alone left, the master-alone check decides); else None."""
    workers = [name for name in samples if name != MASTER_PARTICIPANT]
    if len(workers) < 2 or not samples:
        return None
    even = sum(samples.values()) / len(samples)
    small = [name for name in workers
             if name not in tried and samples[name] < SMALL_SHARE * even]
    if not small:
        return None
    return min(reversed(small), key=lambda name: samples[name])
