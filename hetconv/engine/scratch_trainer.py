"""A throwaway local trainer: the code ``hetconv train --local`` steps with, its metrics
in a temporary folder. For timing real training steps outside a run: the step benchmark
(hetconv/bench/step.py) and set-up's measure of the master alone (master/alone_first.py)."""
from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from hetconv.engine.shard import LayerSettings
from hetconv.engine.stage import LocalConvStage
from hetconv.engine.training import LoopConfig, Trainer
from hetconv.metrics import MetricsWriter
from hetconv.model import ModelConfig


@contextlib.contextmanager
def scratch_trainer(model: ModelConfig, params: dict[str, np.ndarray],
                    settings: LayerSettings, batch: int, device: str = "cpu"
                    ) -> Iterator[tuple[Trainer, LocalConvStage]]:
    """A :class:`Trainer` over a :class:`LocalConvStage` of ``model`` on ``device``,
    training ``params`` in place; the stage is closed and the folder removed on exit.
    Call ``stage.end_step()`` after each ``trainer.train_step``."""
    with tempfile.TemporaryDirectory(prefix="hetconv-scratch-") as folder:
        stage = LocalConvStage(model, params, settings, device=device)
        try:
            with MetricsWriter(Path(folder) / "metrics.jsonl") as metrics:
                yield Trainer(model, params, stage, LoopConfig(batch=batch, progress=False),
                              metrics, Path(folder), out=lambda line: None), stage
        finally:
            stage.close()
