"""Set-up's rehearsal of a first plan, shared by both splits: real training steps at
learning rate 0 on random data, timed until their median is known.

The sample split fits its step model's terms on the steps (master/samples/rehearsal.py);
the kernel split takes their median (master/kernels/rehearsal.py). Both then hand every
participant its layers back as they were, and hold the figure to the master alone
measured at set-up (master/alone_first.py). The length rule (:func:`enough_steps`) is
pure; :func:`rehearse_steps` drives a stage through a scratch trainer.
"""
from __future__ import annotations

import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from hetconv.engine.stage import ConvStage
from hetconv.master.alone_first import AloneMeasure, first_choice
from hetconv.metrics import MetricsWriter
from hetconv.model import ModelConfig

Timed = TypeVar("Timed")

REHEARSAL_BAND = 0.10
"""The band a rehearsed plan's figure is held to the master alone with (``first_choice``
of master/alone_first.py): the step model's own (``MODEL_TOLERANCE`` of
master/samples/step_model.py, the same 10 %): within it the plan is kept, unsure."""

REHEARSAL_WARMUP = 2
"""Steps run first and not timed (first-touch memory, the peers' first pieces)."""
REHEARSAL_STEPS = 6
"""Steps timed at least before the precision is judged (the step then in flight is timed
too: at least 7 in all); the terms are the timed steps' medians."""
REHEARSAL_MAX_STEPS = 20
"""Steps timed at most, however much the steps swing."""
REHEARSAL_PRECISION = 0.03
"""The rehearsal times steps until the standard error of their median is at most this
fraction of it. The demo's steps (two workers on the master's two cores) swing by
+-20 % from one step to the next (42-72 ms): six steps knew the median to about 6 %,
and set-up's prediction missed the median of the first fitted steps (9 steps, itself
known to about 5 %) by more than 10 % in two runs of six
(docs/figures/ab/issue50-demo-setup.log); a quiet machine stops at six."""
MEDIAN_ERROR_FACTOR = 1.2533 * 1.4826
"""The standard error of a median of n normal draws is sqrt(pi / 2) sigma / sqrt(n);
sigma estimated robustly as 1.4826 times the median absolute deviation."""


def median_error(steps_s: Sequence[float]) -> float:
    """The standard error of the median of ``steps_s`` (seconds) as a fraction of the
    median (inf for fewer than two steps or a zero median)."""
    if len(steps_s) < 2:
        return math.inf
    middle = statistics.median(steps_s)
    if middle <= 0:
        return math.inf
    spread = statistics.median(abs(s - middle) for s in steps_s)
    return MEDIAN_ERROR_FACTOR * spread / math.sqrt(len(steps_s)) / middle


def enough_steps(steps_s: Sequence[float], least: int = REHEARSAL_STEPS) -> bool:
    """Whether the rehearsal has timed enough steps (``steps_s``, seconds): at least
    ``least`` and its median known within ``REHEARSAL_PRECISION``, or
    ``REHEARSAL_MAX_STEPS`` in any case."""
    if len(steps_s) >= REHEARSAL_MAX_STEPS:
        return True
    return len(steps_s) >= least and median_error(steps_s) <= REHEARSAL_PRECISION


def rehearse_steps(stage: ConvStage, model: ModelConfig, params: dict[str, np.ndarray],
                   batch: int, end_step: Callable[[float], Timed | None],
                   seconds: Callable[[Timed], float], least: int = REHEARSAL_STEPS
                   ) -> list[Timed]:
    """Drive ``stage`` through ``REHEARSAL_WARMUP`` steps and then until
    :func:`enough_steps` (at least ``least`` timed) at learning rate 0 on random images
    x (batch, C, H, W) and labels, two in flight where the stage runs so (the step after
    the one that made it enough runs too: it was already in flight). ``end_step`` is
    called after each step with its wall seconds and gives what is timed of it (None:
    nothing, e.g. a step without rounds); ``seconds`` reads a timed step's seconds.
    The timed steps after the warm-up; a StageFault on the way propagates."""
    from hetconv.engine.training import LoopConfig, Trainer

    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *model.input_shape), dtype=np.float32)
    labels = rng.integers(0, model.classes, batch)
    copy = {name: array.copy() for name, array in params.items()}
    timed: list[Timed] = []
    with tempfile.TemporaryDirectory(prefix="hetconv-rehearsal-") as folder, \
            MetricsWriter(Path(folder) / "metrics.jsonl") as metrics:
        trainer = Trainer(model, copy, stage, LoopConfig(batch=batch, progress=False),
                          metrics, Path(folder), out=lambda line: None)
        step, last = 0, False
        while not last:
            # decided before the step, which may start the next one early
            last = enough_steps([seconds(t) for t in timed], least) or \
                step + 1 >= REHEARSAL_WARMUP + REHEARSAL_MAX_STEPS or \
                (not timed and step + 1 >= REHEARSAL_WARMUP + least)  # nothing timed
            ahead = (x, labels, step + 1, 0.0) if trainer.runs_ahead() and not last else None
            started = time.perf_counter()
            trainer.train_step(x, labels, step, 0.0, ahead=ahead)
            sample = end_step(time.perf_counter() - started)
            if step >= REHEARSAL_WARMUP and sample is not None:
                timed.append(sample)
            step += 1
    return timed


def hold_to_alone(figure_s: float, record: dict[str, Any], alone: AloneMeasure | None,
                  label: str, metrics: MetricsWriter, report: Callable[[str], None]) -> bool:
    """Hold a rehearsed plan's figure (seconds a step) to the master alone measured at
    set-up (``first_choice`` with ``REHEARSAL_BAND``, said with ``label``) and write the
    ``rehearsal`` record (``record`` and the choice). True where the master alone is no
    slower: it trains alone from the first step. Without ``alone``: the record, False."""
    if alone is None:
        metrics.write("rehearsal", **record)
        return False
    choice = first_choice(figure_s, alone.step_s, REHEARSAL_BAND, label)
    report(f"hetconv: {choice.why}")
    metrics.write("rehearsal", **record, alone_measured_step_s=alone.step_s,
                  alone_no_slower=choice.alone, within_band=choice.unsure,
                  band=REHEARSAL_BAND)
    return choice.alone
