"""The master alone on trial: a conv stage that runs the master alone from one snapshot
until the trial can decide (it asks the trainer for a snapshot then:
:class:`hetconv.engine.stage.EarlyReplanStage`) while the sample stage's workers wait, then
stays alone or goes back to them as :class:`hetconv.master.samples.fall_back.AloneCheck`
decides (``--fall-back on``)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from hetconv.engine.stage import ConvStage, StageFault
from hetconv.master.samples.fall_back import AloneCheck, GoBack, StayAlone


class WaitingStage(Protocol):
    """What the trial needs of the stage whose workers wait (the sample stage)."""

    def keep_alive(self) -> None:
        """Heartbeat the waiting workers and take in what they sent (between steps)."""
        ...

    def stay_alone(self, verdict: StayAlone) -> None:
        """Say and record that the master alone won; release the workers."""
        ...

    def go_back(self, verdict: GoBack, state: dict[str, np.ndarray]) -> ConvStage:
        """Say and record that the workers won; hand them ``state``; the stage to go
        on with."""
        ...

    def close(self) -> None: ...


class TrialAloneStage:
    """A :class:`hetconv.engine.stage.ConvStage`: ``local`` (the master alone, restored from
    the snapshot the trial started at) runs every layer; each step's conv part
    (seconds, the sum of its forward and backward calls, as the sample stage's rounds
    are summed) goes to ``check``; at each snapshot ``check`` says whether the trial
    goes on, the master stays alone, or the ``waiting`` workers come back."""

    def __init__(self, local: ConvStage, waiting: WaitingStage, check: AloneCheck,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.local = local
        self.waiting = waiting
        self.check = check
        self.clock = clock
        self._conv_s = 0.0  # this step's conv part so far

    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        started = self.clock()
        try:
            return self.local.forward(layer, x, train, step)
        finally:
            if train:
                self._conv_s += self.clock() - started

    def backward(self, layer: int, dy: np.ndarray, need_dx: bool, learning_rate: float,
                 step: int) -> np.ndarray | None:
        started = self.clock()
        try:
            return self.local.backward(layer, dy, need_dx, learning_rate, step)
        finally:
            self._conv_s += self.clock() - started

    def end_step(self) -> dict[str, Any]:
        self.check.trial_step(self._conv_s)
        self._conv_s = 0.0
        self.waiting.keep_alive()
        return self.local.end_step()

    def wants_replan_point(self) -> bool:
        """The trial measured enough to decide: a snapshot now, not at the next one due."""
        return self.check.verdict_ready()

    def snapshot(self) -> dict[str, np.ndarray]:
        return self.local.snapshot()

    def restore(self, state: dict[str, np.ndarray]) -> None:
        self._conv_s = 0.0
        self.local.restore(state)

    def recover(self, fault: StageFault, state: dict[str, np.ndarray]) -> ConvStage:
        return self.local.recover(fault, state)

    def replan_point(self, state: dict[str, np.ndarray]) -> ConvStage:
        verdict = self.check.at_snapshot()
        if isinstance(verdict, StayAlone):
            self.waiting.stay_alone(verdict)
            self.waiting.close()
            return self.local
        if isinstance(verdict, GoBack):
            self.local.close()
            return self.waiting.go_back(verdict, state)
        return self

    def close(self) -> None:
        self.local.close()
        self.waiting.close()
