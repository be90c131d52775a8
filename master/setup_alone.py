"""Set-up's side of the master alone: measuring it, holding the calibrated plan to it,
and handing the run to it (the decisions are master/alone_first.py's, pure).

Where ``--split model`` chooses between workers and the master alone, set-up measures
the master alone (:func:`alone_figure`), holds the first plan's predicted conv part to
it (:func:`compare_alone`) and, where the master alone is no slower, or a rehearsal of
the plan says so (master/samples/rehearsal.py, master/kernels/rehearsal.py), ends the
workers' part of the run and trains alone (:func:`train_alone`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hetconv.config import MasterConfig
from hetconv.engine.shard import LayerSettings
from hetconv.engine.stage import ConvStage, LocalConvStage
from hetconv.master.alone_first import SETUP_BAND, AloneMeasure, first_choice, measure_alone
from hetconv.master.cluster import Cluster
from hetconv.master.plan import Participant
from hetconv.metrics import MetricsWriter
from hetconv.model import ModelConfig


def alone_figure(config: MasterConfig, model: ModelConfig, params: dict[str, np.ndarray],
                 settings: LayerSettings, batch: int, device: str,
                 participants: list[Participant], metrics: MetricsWriter,
                 report: Callable[[str], None]) -> AloneMeasure | None:
    """The master alone measured (master/alone_first.py) where the planner chooses
    (``--split model``) between it and workers; None elsewhere or where it cannot hold a
    step alone."""
    if config.split != "model" or not config.fall_back or not config.use_local_device \
            or not any(p.worker is not None for p in participants):
        return None
    alone = measure_alone(model, params, settings, batch, device)
    if alone is None:
        report(f"hetconv: the master alone cannot hold a step at batch {batch}: "
               "the plan needs workers")
        return None
    report(f"hetconv: the master alone measured at {alone.step_s * 1e3:.1f} ms a step "
           f"(conv {alone.conv_s * 1e3:.1f} ms; {alone.steps} steps at batch {batch})")
    return alone


def compare_alone(predicted_conv_s: float, alone: AloneMeasure, metrics: MetricsWriter,
                  report: Callable[[str], None]) -> bool:
    """Whether the master trains alone from the start: the first plan's predicted conv
    part against the master alone measured (master/alone_first.py); said and recorded."""
    choice = first_choice(predicted_conv_s, alone.conv_s)
    report(f"hetconv: {choice.why}")
    metrics.write("alone_probe", steps=alone.steps, **alone.as_record(),
                  predicted_conv_s=predicted_conv_s, alone_no_slower=choice.alone,
                  within_band=choice.unsure, band=SETUP_BAND)
    return choice.alone


def train_alone(cluster: Cluster, model: ModelConfig, params: dict[str, np.ndarray],
                settings: LayerSettings, device: str, metrics: MetricsWriter,
                report: Callable[[str], None], alone: AloneMeasure, split_by: str,
                why: str, links: list[dict[str, Any]]) -> ConvStage:
    """Set-up's choice is the master alone (its measured conv part beat the plan of the
    split ``split_by`` chosen for ``why``): recorded as a plan of the master alone, with
    the probed ``links`` of the workers not used; the workers go and stay up for the
    next run."""
    report("hetconv: the master trains alone: measured no slower than the plan with workers "
           "(--fall-back off keeps them; the workers stay up for the next run)")
    metrics.write("plan", split_by=split_by, split_by_why=why, chosen=["master"],
                  predicted_step_s=alone.conv_s, best_single="master",
                  best_single_step_s=alone.conv_s, alone=True, **alone.as_record(),
                  not_used=[link["participant"] for link in links], links=links)
    cluster.end_run("the master trains alone: measured no slower than the plan with workers")
    cluster.close()
    return LocalConvStage(model, params, settings, device=device)
