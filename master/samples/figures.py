"""One training step's figures under the sample split, as its rounds fill them.

A fresh :class:`StepFigures` starts every step; the stage's ``end_step`` reads the
finished one (the step record of docs/metrics.md, and the measures its decisions take:
master/samples/policy.py) and starts the next.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetconv.config import MASTER_PARTICIPANT
from hetconv.master.samples.plan import Slice
from hetconv.master.timing import timing_entry
from hetconv.model import ConvLayerShape

NO_BATCH = np.empty((0,), dtype=np.float32)
"""The batch before the first step (and what ``forward`` returns for a layer but the last)."""


@dataclass
class StepFigures:
    """Per participant and layer, the timing entries; per participant, its compute, its
    rounds' latency, its waits for peers' pieces and its dense part (step chains), all
    seconds; the step's rounds (their count, their wall time from the first request sent
    to the last reply) and its start (monotonic s; None: no round yet)."""

    timings: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)
    comm_s: float = 0.0  # the rounds' wall time beyond their slowest participant's compute
    compute: dict[str, float] = field(default_factory=dict)
    latency: dict[str, float] = field(default_factory=dict)
    waits: dict[str, float] = field(default_factory=dict)
    dense: dict[str, float] = field(default_factory=dict)
    wall: float = 0.0
    rounds: int = 0
    started: float | None = None
    sent_ahead: bool = False  # the step was sent before the one before it was gathered

    def entry(self, layer: int, participant: str, kernels: int, samples: int,
              peers: bool) -> dict[str, Any]:
        """``participant``'s timing entry of ``layer`` (made empty the first time)."""
        devices = self.timings.setdefault(layer, {})
        if participant not in devices:
            devices[participant] = timing_entry(participant, kernels, samples, peers)
        return devices[participant]

    def add_reply(self, participant: str, compute_s: float, latency_s: float,
                  peer_wait_s: float) -> None:
        """One reply: its compute, and what the barrier waits for: its whole round
        (compute, its share of the wire, its message handling, throttling included)."""
        self.compute[participant] = self.compute.get(participant, 0.0) + compute_s
        self.latency[participant] = self.latency.get(participant, 0.0) + latency_s
        self.waits[participant] = self.waits.get(participant, 0.0) + peer_wait_s

    def add_round(self, wall_s: float, slowest_compute_s: float) -> None:
        self.comm_s += max(0.0, wall_s - slowest_compute_s)
        self.wall += wall_s
        self.rounds += 1

    def record(self) -> dict[str, Any]:
        """The step record's figures (docs/metrics.md)."""
        layers = [{"layer": layer, "participants": list(devices.values())}
                  for layer, devices in sorted(self.timings.items())]
        return {"layers": layers, "comm_s": self.comm_s, "sent_ahead": self.sent_ahead}


@dataclass
class StepState:
    """The step the stage is in: its number, its batch ``x`` (B, C, H, W) float32, the
    slices it is split into (an evaluation's, after one), and its figures so far."""

    step: int = 0
    x: np.ndarray = field(default_factory=lambda: NO_BATCH)
    slices: list[Slice] = field(default_factory=list)
    figures: StepFigures = field(default_factory=StepFigures)

    def members(self) -> list[str]:
        """The participants with samples in this step."""
        return [p.participant for p in self.slices if p.samples > 0]

    def samples(self) -> dict[str, int]:
        """Every participant's samples in this step."""
        return {p.participant: p.samples for p in self.slices}

    def master_has_samples(self) -> bool:
        return any(p.participant == MASTER_PARTICIPANT and p.samples > 0 for p in self.slices)

    def end(self) -> StepFigures:
        """The finished step's figures; the next step's start empty."""
        finished, self.figures = self.figures, StepFigures()
        return finished


def sample_counts(shapes: Sequence[ConvLayerShape], counts: Mapping[str, int]
                  ) -> list[dict[str, Any]]:
    """A ``rebalance``/``replan`` record's ``counts`` under the sample split: per layer,
    every participant of ``counts`` (in its order) with its samples and the whole
    layer's kernels (docs/metrics.md)."""
    return [{"layer": shape.index, "participants": [
        {"participant": name, "kernels": shape.kernels, "samples": samples}
        for name, samples in counts.items()]} for shape in shapes]
