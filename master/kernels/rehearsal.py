"""Set-up rehearses a kernel plan: its step measured before training.

The kernel planner predicts a plan's step from calibration and the link model
(master/kernels/planner.py): each layer timed alone, one participant at a time. What
the steps then add (each layer's barrier waits for its slowest shard, the master's
gather and scatter between layers, message handling on CPU-quota machines) it cannot
see; the sample split's calibrated predictions missed the lab's steps by 10-44 % for
that reason (issue 50, master/samples/rehearsal.py). So where ``--split model`` chose
the kernel split and its plan uses workers, set-up runs the plan for real
(:func:`hetconv.master.rehearsal_steps.rehearse_steps`: real steps at learning rate 0
on random data, timed until their median is known within 3 %), hands every
participant its shards back as they were handed out, and takes the median step as its
figure for the plan. Said, recorded (a ``rehearsal`` record with ``split_by``
"kernels") and, where the master alone was measured at set-up, held to it with the
same rule and band as the sample split's rehearsal (``first_choice``): the master
alone no slower, it trains alone from the first step.

The kernel split has no step model of terms (its rebalancer refits a cost line per
layer and participant from the steps instead), so the figure is the measured median
itself, not a fit.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hetconv.engine.stage import ConvStage, StageFault
from hetconv.master.alone_first import AloneMeasure
from hetconv.master.kernels.stage import DistributedConvStage
from hetconv.master.rehearsal_steps import hold_to_alone, rehearse_steps
from hetconv.metrics import MetricsWriter
from hetconv.model import ModelConfig


@dataclass(frozen=True)
class KernelRehearsal:
    """A kernel plan rehearsed: each timed step's wall (seconds), the rehearsal's whole
    cost (seconds, the hand-back included) and the planner's prediction (seconds; None
    where the split had no planner, ``--split equal`` or ``calibrated``)."""

    steps_s: tuple[float, ...]
    cost_s: float
    planner_s: float | None

    @property
    def measured_s(self) -> float:
        """Set-up's figure for the plan: the median timed step (seconds)."""
        return statistics.median(self.steps_s)

    def line(self) -> str:
        planner = "" if self.planner_s is None else \
            f" (the planner predicted {self.planner_s * 1e3:.1f} from calibration)"
        return (f"hetconv: rehearsed the kernel plan ({len(self.steps_s)} steps at learning "
                f"rate 0, {self.cost_s:.2f} s): {self.measured_s * 1e3:.1f} ms a step"
                f"{planner}")

    def as_record(self) -> dict[str, Any]:
        return {"split_by": "kernels", "predicted_step_s": self.measured_s,
                "steps": len(self.steps_s), "cost_s": self.cost_s,
                "rehearsed_steps_s": list(self.steps_s),
                "planner_predicted_step_s": self.planner_s}


def rehearse_kernel_plan(stage: DistributedConvStage, model: ModelConfig,
                         params: dict[str, np.ndarray], batch: int,
                         alone: AloneMeasure | None, planner_s: float | None,
                         metrics: MetricsWriter, report: Callable[[str], None]
                         ) -> ConvStage | None:
    """Rehearse ``stage``'s plan (module doc) and hand every shard back as ``params``
    (the state the plan was handed out with) holds it. Returns the stage to train with:
    ``stage``, or what its recovery gives where a worker was lost in the rehearsal;
    None where the master alone (``alone``, measured at set-up) is no slower."""
    started = time.perf_counter()

    def step_ended(wall_s: float) -> float:
        stage.end_rehearsal_step()
        return wall_s

    try:
        walls = rehearse_steps(stage, model, params, batch, step_ended, float)
        stage.restore(params)
    except StageFault as fault:
        report(f"hetconv: the plan's rehearsal stopped: {fault}")
        return stage.recover(fault, params)
    if not walls:
        return stage
    outcome = KernelRehearsal(tuple(walls), time.perf_counter() - started, planner_s)
    report(outcome.line())
    if hold_to_alone(outcome.measured_s, outcome.as_record(), alone,
                     "the rehearsed kernel plan measured", metrics, report):
        return None
    return stage
