"""The master alone, measured at set-up: the figure every plan with workers must beat.

Set-up used to *estimate* the master alone from its calibration: the kernel split's
cost line, fitted on an equal share of every layer and a quarter of it, extrapolated
to the whole layer (4x past what was timed), or the sample split's seconds per sample
on a slice times the batch. On the lab's four unequal machines at 10 Mbit (32:64) that
said 206.5 ms a step; the master really alone took 130 ms (issue 50). A plan with
workers was then chosen against the wrong figure, and a trial some 20 steps later had
to undo it. So where the master computes and has workers, set-up now *measures* it:
``ALONE_PROBE_STEPS`` real training steps of the whole network at the run's batch on a
copy of the weights (:func:`measure_alone`, the code a run alone trains with), after
calibration, while the workers wait as they would.

The first plan is then decided by :func:`first_choice` against that figure
(``--fall-back on``, the default): the master alone where it measured no slower than the
plan's predicted conv part; the plan with workers where the prediction, even
``SETUP_BAND`` more pessimistic (the set-up model's stated error: 24-44 % optimistic on
the lab's machines, issue 50), is faster; in between the plan with workers, marked
unsure, and the run's fall-back check holds its measured steps to this measured figure
(:class:`~hetconv.master.samples.fall_back.AloneCheck`, with the estimate's trigger: the
figure erred -18 % to +29 % against the master really alone on the lab).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from hetconv.engine.shard import LayerSettings
from hetconv.model import ModelConfig, conv_layer_shapes, dense_shapes
from hetconv.planning.memory import USABLE, available_bytes, step_need

ALONE_PROBE_STEPS = 3
"""Steps timed (after one warm-up step): their median is the figure."""
SETUP_BAND = 0.30
"""The set-up model's stated error for a plan with workers: it predicted 24-30 % short
of the measured step on the lab (issue 50), so a plan is sure to beat the master alone
only when its prediction this much longer still does."""


@dataclass(frozen=True)
class AloneMeasure:
    """The master alone at the run's batch, medians of ``steps`` steps (seconds): the
    whole step, its conv part (forward, backward and update of every conv layer) and
    its dense part."""

    step_s: float
    conv_s: float
    dense_s: float
    steps: int

    def as_record(self) -> dict[str, float]:
        return {"alone_measured_step_s": self.step_s, "alone_measured_conv_s": self.conv_s,
                "alone_measured_dense_s": self.dense_s}


def measure_alone(model: ModelConfig, params: dict[str, np.ndarray], settings: LayerSettings,
                  batch: int, device: str, steps: int = ALONE_PROBE_STEPS) -> AloneMeasure | None:
    """Time ``steps`` training steps of ``model`` alone on ``device`` at ``batch`` (random
    images and labels, a copy of ``params``: the run's weights do not move); None where
    the step would not fit in this machine's memory (then the master cannot train alone)."""
    from hetconv.engine.scratch_trainer import scratch_trainer

    dense_values = sum(units * (features + 1) for _, features, units in dense_shapes(model))
    if step_need(conv_layer_shapes(model), batch, dense_values).total > USABLE * available_bytes():
        return None
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *model.input_shape), dtype=np.float32)
    labels = rng.integers(0, model.classes, batch)
    copy = {name: array.copy() for name, array in params.items()}
    figures: list[dict[str, float]] = []
    with scratch_trainer(model, copy, settings, batch, device) as (trainer, stage):
        for step in range(steps + 1):
            figures.append(trainer.train_step(x, labels, step, 0.0))
            stage.end_step()
    timed = figures[1:]
    return AloneMeasure(statistics.median(float(f["step_s"]) for f in timed),
                        statistics.median(float(f["conv_s"]) for f in timed),
                        statistics.median(float(f["dense_s"]) for f in timed), len(timed))


@dataclass(frozen=True)
class FirstChoice:
    """Set-up's choice between its plan with workers and the master alone."""

    alone: bool  # train alone from the start
    unsure: bool  # the plan with workers, but within the model's band of alone
    why: str


def first_choice(predicted_conv_s: float, alone_conv_s: float, band: float = SETUP_BAND,
                 plan: str = "the plan with workers predicted from calibration"
                 ) -> FirstChoice:
    """Alone, or the plan with workers, from the plan's predicted seconds (the conv part
    with its transfers from calibration; or a whole step, ``plan`` naming whose) and
    the master alone's measured ones, ``band`` the prediction's stated error (module
    doc): alone where it is no slower; the plan, marked unsure, within the band."""
    figures = (f"{plan} at {predicted_conv_s * 1e3:.1f} ms a step, "
               f"the master alone measured at {alone_conv_s * 1e3:.1f} ms")
    if alone_conv_s <= predicted_conv_s:
        return FirstChoice(True, False, figures + ": the master alone is no slower")
    if alone_conv_s <= predicted_conv_s * (1 + band):
        return FirstChoice(False, True, figures + f": within the model's {band:.0%} error, "
                           "the run's measured steps decide")
    return FirstChoice(False, False, figures + f": faster even {band:.0%} slower than "
                       "predicted")
