"""The split rule: one function makes the first split and every re-plan.

``--split`` names how a layer's kernels are shared among the participants allowed to
hold them (``alive``); :meth:`SplitRule.split` applies it to the participants'
profiles (calibrated cost lines, corrected by measurements where the rebalancer has
them) at the start of a run, after a fault (over the survivors) and at a join (over
everyone alive), so a run never changes its rule half-way:

- ``model``: the link-aware planner (:func:`hetconv.master.kernels.planner.choose_plan`),
  which may leave participants out;
- ``calibrated``: the paper's equation (1), kernels in proportion to 1/t_i, where t_i
  is participant i's calibrated time of the layer at the *reference share* (the equal
  share the first calibration timed; a participant timed at another share, a joiner,
  is read off its fitted cost line there);
- ``equal``: the same number each.

Pure: profiles in, counts per layer per profile out (0 outside ``alive``).
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from hetconv.config import SPLIT_MODES
from hetconv.master.kernels.planner import ParticipantProfile, Plan, choose_plan
from hetconv.model import ConvLayerShape
from hetconv.planning.partition import equal_counts, kernel_counts
from hetconv.planning.perf_model import LayerTraffic

Counts = tuple[tuple[int, ...], ...]  # counts[layer][profile index]


def layer_traffic(shapes: Sequence[ConvLayerShape], batch: int,
                  itemsize: int) -> list[LayerTraffic]:
    """Every layer's bytes on the wire for ``batch`` images, ``itemsize`` bytes an element."""
    return [LayerTraffic(input_bytes=int(np.prod(s.input_shape(batch))) * itemsize,
                         output_bytes=int(np.prod(s.output_shape(batch))) * itemsize,
                         kernels=s.kernels, need_dx=s.index > 0) for s in shapes]


@dataclass(frozen=True)
class Split:
    """Kernel counts per layer per profile, and the planner's plan behind them (``model``)."""

    counts: Counts
    plan: Plan | None = None


@dataclass(frozen=True)
class SplitRule:
    """How ``--split`` shares the kernels (see the module doc)."""

    mode: str
    data_plane: str = "star"
    reference_kernels: tuple[int, ...] = ()  # per layer: the share t_i was timed at

    def __post_init__(self) -> None:
        if self.mode not in SPLIT_MODES:
            raise ValueError(f"unknown split {self.mode!r}: choose from {', '.join(SPLIT_MODES)}")

    def split(self, profiles: Sequence[ParticipantProfile], traffic: Sequence[LayerTraffic],
              alive: Collection[str]) -> Split:
        """The counts over the profiles named in ``alive`` (the others 0)."""
        chosen = [i for i, p in enumerate(profiles) if p.participant in alive]
        if not chosen:
            raise ValueError("no participant left to split the kernels over")
        if self.mode == "model":
            plan = choose_plan([profiles[i] for i in chosen], traffic, self.data_plane)
            return Split(_spread(plan.counts, chosen, len(profiles)), plan)
        rows = []
        for layer, layer_traffic_ in enumerate(traffic):
            if self.mode == "equal":
                rows.append(equal_counts(len(chosen), layer_traffic_.kernels))
            else:
                seconds = [self.reference_seconds(profiles[i], layer) for i in chosen]
                rows.append(kernel_counts(seconds, layer_traffic_.kernels))
        return Split(_spread(rows, chosen, len(profiles)))

    def reference_seconds(self, profile: ParticipantProfile, layer: int) -> float:
        """t_i of equation (1): the profile's cost of ``layer`` at the reference share."""
        fixed_s, per_kernel_s = profile.costs[layer]
        kernels = self.reference_kernels[layer] if layer < len(self.reference_kernels) else 1
        return fixed_s + per_kernel_s * kernels


def _spread(rows: Sequence[Sequence[int]], chosen: Sequence[int], width: int) -> Counts:
    """Rows over the ``chosen`` profiles widened to every profile (0 elsewhere)."""
    out = []
    for row in rows:
        full = [0] * width
        for index, count in zip(chosen, row):
            full[index] = count
        out.append(tuple(full))
    return tuple(out)
