"""Rebalancing from measured step times: when to re-split the kernels, and how.

The planner splits the kernels from a startup calibration, but what a participant
really takes per step in training can differ (other load, caches, the master's
helper thread sharing its cores with the socket loop). A :class:`Rebalancer` is fed
every training step's measured compute seconds per layer and participant (forward +
backward, as the participants time themselves) and the kernels each held. After
``warmup_steps`` ignored steps it keeps the last ``window_steps`` of them; once the
window is full it corrects each participant's calibrated cost of every layer where
it holds kernels by the median of measured / predicted (fixed and per-kernel parts
alike; where it holds none it keeps its last profile). Every full window also leaves
one measured point (kernels, median seconds) per participant and layer; once a
participant has been measured at two or more kernel counts of a layer, its cost
line there is fitted to those points (:func:`fit_cost_line`) instead of scaled from
the calibration, so successive re-splits converge on the measured costs rather
than swinging between two calibration-scaled guesses; a window far off the fitted
line (DRIFT_FRACTION) drops the older points, so a machine that slows down or
recovers is followed. A worker never measured in a layer (the calibration gave it no
kernels) borrows the median measured / calibrated scale of the workers that were, so
a calibration that overstated every worker does not keep one out for good. It then asks the planner for a plan
on the same data plane and links, and proposes a re-split only when the corrected
prediction of the current split is more than ``threshold`` slower than the new
plan's, and at most once per ``min_interval_steps``. Pure: numbers in, a
:class:`RebalanceDecision` or None out. A decision is taken as applied: the
rebalancer then expects the new counts, and starts a new warm-up and window.
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hetconv.master.kernels.planner import ParticipantProfile, choose_plan, predict
from hetconv.metrics import participant_entries, participant_of
from hetconv.planning.perf_model import LayerTraffic

DRIFT_FRACTION = 0.25
"""A window this far off the participant's fitted cost line means the machine changed
(other load, throttling): its older measured points are dropped."""
Counts = tuple[tuple[int, ...], ...]  # counts[layer][profile index]
LayerMeasure = Mapping[str, tuple[int, float]]  # participant -> (kernels, compute seconds)


@dataclass(frozen=True)
class RebalanceSettings:
    """When the measured step times may change the split."""

    warmup_steps: int = 3  # steps ignored at the start and after every re-split
    window_steps: int = 5  # steps whose medians correct the profiles
    threshold: float = 0.10  # re-split only if the step is predicted this much faster
    min_interval_steps: int = 20  # at most one re-split per this many steps

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.window_steps < 1 or self.min_interval_steps < 1:
            raise ValueError("warmup_steps >= 0, window_steps >= 1, min_interval_steps >= 1")
        if not 0 <= self.threshold < 1:
            raise ValueError("threshold must be in [0, 1)")


@dataclass(frozen=True)
class RebalanceDecision:
    """A proposed re-split, decided after ``step``."""

    step: int
    counts: Counts  # new kernels per layer per participant (profile order)
    old_predicted_step_s: float  # the current split under the corrected profiles
    new_predicted_step_s: float  # the new split under the same profiles
    reason: str
    participants: tuple[str, ...]  # profile order
    scales: tuple[tuple[float, ...], ...]  # scales[layer][profile]: measured / calibrated

    def record(self) -> dict[str, Any]:
        """The ``rebalance`` metrics record's fields (docs/metrics.md)."""
        return {"step": self.step, "reason": self.reason,
                "old_predicted_step_s": self.old_predicted_step_s,
                "new_predicted_step_s": self.new_predicted_step_s,
                "counts": [{"layer": layer, "participants": [
                    {"participant": p, "kernels": count, "scale": scale}
                    for p, count, scale in zip(self.participants, row, self.scales[layer])]}
                    for layer, row in enumerate(self.counts)]}


def measured_compute(timings: Mapping[str, Any]) -> list[dict[str, tuple[int, float]]]:
    """Per layer, participant -> (kernels, forward_s + backward_s) from a stage's
    ``end_step()`` result."""
    layers: dict[int, dict[str, tuple[int, float]]] = {}
    for layer in timings.get("layers", []):
        layers[int(layer["layer"])] = {
            participant_of(d): (int(d["kernels"]), float(d["forward_s"]) + float(d["backward_s"]))
            for d in participant_entries(layer)}
    return [layers.get(index, {}) for index in range(max(layers, default=-1) + 1)]


class Rebalancer:
    """Decides re-splits from measured step times (see the module doc)."""

    def __init__(self, calibrated: Sequence[ParticipantProfile], traffic: Sequence[LayerTraffic],
                 counts: Sequence[Sequence[int]], data_plane: str = "star",
                 settings: RebalanceSettings | None = None):
        if len(counts) != len(traffic):
            raise ValueError("counts and traffic must have one row per layer")
        self.calibrated = tuple(calibrated)
        self.profiles = tuple(calibrated)  # the current belief: calibrated, then corrected
        self.traffic = tuple(traffic)
        self.counts: Counts = tuple(tuple(row) for row in counts)
        self.data_plane = data_plane
        self.settings = settings or RebalanceSettings()
        self._window: deque[list[list[float | None]]] = deque(maxlen=self.settings.window_steps)
        self._ignore = self.settings.warmup_steps
        self._last_change: int | None = None
        # (layer, profile index) -> kernels -> median measured seconds of a full window
        self._points: dict[tuple[int, int], dict[int, float]] = {}
        # who may be given kernels: every profile until a fault evicts one (``restrict``)
        self.active: frozenset[str] = frozenset(p.participant for p in calibrated)

    def observe(self, step: int, layers: Sequence[LayerMeasure]) -> RebalanceDecision | None:
        """Take one step's measurements; a decision (already adopted) or None."""
        ratios = self._ratios(layers)
        if ratios is None:  # kernels differ from the current split: not this split's step
            return None
        if self._ignore > 0:
            self._ignore -= 1
            return None
        self._window.append(ratios)
        if len(self._window) < self.settings.window_steps:
            return None
        if self._last_change is not None and \
                step - self._last_change < self.settings.min_interval_steps:
            return None
        scales = self._scales()
        self._remember_points()
        self.profiles = tuple(self._corrected(index, scales) for index in range(len(scales[0])))
        old_s = predict(self.profiles, self.counts, self.traffic, self.data_plane)
        counts, new_s = self._plan_over(self.active)
        improved = new_s < old_s * (1 - self.settings.threshold)
        if counts == self.counts or not improved:
            return None
        factors = ", ".join(
            f"{p.participant} x{statistics.median(values):.2f}"
            for i, p in enumerate(self.profiles)
            if (values := [s for row in scales if (s := row[i]) is not None]))
        reason = (f"measured / calibrated compute: {factors}; predicted step "
                  f"{old_s * 1e3:.1f} -> {new_s * 1e3:.1f} ms")
        decision = RebalanceDecision(
            step=step, counts=counts, old_predicted_step_s=old_s,
            new_predicted_step_s=new_s, reason=reason,
            participants=tuple(p.participant for p in self.profiles),
            scales=tuple(tuple(1.0 if s is None else s for s in row) for row in scales))
        self.counts = counts
        self._window.clear()
        self._ignore = self.settings.warmup_steps
        self._last_change = step
        return decision

    def adopt(self, counts: Sequence[Sequence[int]]) -> None:
        """The split changed for another reason (a recovery, a join): expect ``counts``
        from now on and start a new warm-up and window."""
        self.counts = tuple(tuple(row) for row in counts)
        self._window.clear()
        self._ignore = self.settings.warmup_steps

    def restrict(self, alive: set[str] | frozenset[str]) -> None:
        """Only the participants in ``alive`` may hold kernels from now on: the others
        were evicted (a fault) and come back only through a join, which calls
        :meth:`add_participant`. Re-splits never hand an evicted participant kernels."""
        names = {p.participant for p in self.profiles}
        unknown = set(alive) - names
        if unknown:
            raise ValueError(f"no profile for participant(s) {sorted(unknown)}")
        self.active = frozenset(alive)

    def add_participant(self, profile: ParticipantProfile) -> None:
        """A participant that joined (or rejoined under its old id): its calibrated
        profile replaces the old one, or it is added at the end with 0 kernels."""
        names = [p.participant for p in self.calibrated]
        if profile.participant in names:
            index = names.index(profile.participant)
            self.active = self.active | {profile.participant}
            self.calibrated = tuple(profile if i == index else p
                                    for i, p in enumerate(self.calibrated))
            self.profiles = tuple(profile if i == index else p
                                  for i, p in enumerate(self.profiles))
            self._points = {k: v for k, v in self._points.items() if k[1] != index}
            return
        self.active = self.active | {profile.participant}
        self.calibrated += (profile,)
        self.profiles += (profile,)
        self.counts = tuple(row + (0,) for row in self.counts)
        self._window.clear()

    def _plan_over(self, alive: set[str] | frozenset[str]) -> tuple[Counts, float]:
        """(counts over every profile, 0 outside ``alive``; the plan's predicted step)."""
        chosen = [i for i, p in enumerate(self.profiles) if p.participant in alive]
        if not chosen:
            raise ValueError("no participant left to plan for")
        plan = choose_plan([self.profiles[i] for i in chosen], self.traffic, self.data_plane)
        counts = tuple(tuple(row[chosen.index(i)] if i in chosen else 0
                             for i in range(len(self.profiles))) for row in plan.counts)
        return counts, plan.predicted_step_s

    # --- the arithmetic ---------------------------------------------------------------
    def _ratios(self, layers: Sequence[LayerMeasure]) -> list[list[float | None]] | None:
        """Per layer per profile: measured / calibrated prediction (None: no kernels)."""
        if len(layers) != len(self.counts):
            return None
        out: list[list[float | None]] = []
        for layer, (row, measured) in enumerate(zip(self.counts, layers)):
            ratios: list[float | None] = []
            for profile, count in zip(self.calibrated, row):
                kernels, seconds = measured.get(profile.participant, (0, 0.0))
                if kernels != count:
                    return None
                fixed, per_kernel = profile.costs[layer]
                predicted = fixed + per_kernel * count
                ratios.append(seconds / predicted if count > 0 and predicted > 0 else None)
            out.append(ratios)
        return out

    def _scales(self) -> list[list[float | None]]:
        """Per layer per profile: the median ratio over the window (None: no kernels)."""
        layers, width = len(self.counts), len(self.calibrated)
        scales: list[list[float | None]] = []
        for layer in range(layers):
            row: list[float | None] = []
            for index in range(width):
                values = [r for step in self._window
                          if (r := step[layer][index]) is not None]
                row.append(statistics.median(values) if values else None)
            scales.append(row)
        return scales

    def _peers_scale(self, layer: int, index: int,
                     scales: Sequence[Sequence[float | None]]) -> float | None:
        """The median measured / calibrated scale of the other *workers* (participants
        with a link) in ``layer``: calibrated under the same conditions, they share its
        bias (the master's own device is timed differently)."""
        if self.calibrated[index].link is None:
            return None
        values = [s for i, s in enumerate(scales[layer])
                  if s is not None and i != index and self.calibrated[i].link is not None]
        return statistics.median(values) if values else None

    def _remember_points(self) -> None:
        """One (kernels, median seconds) point per participant and layer of this window."""
        for layer, row in enumerate(self.counts):
            for index, (profile, count) in enumerate(zip(self.calibrated, row)):
                values = [step[layer][index] for step in self._window]
                ratios = [v for v in values if v is not None]
                if count <= 0 or not ratios:
                    continue
                fixed, per_kernel = profile.costs[layer]
                seconds = statistics.median(ratios) * (fixed + per_kernel * count)
                points = self._points.setdefault((layer, index), {})
                line = fit_cost_line(points)
                if line is not None and abs(seconds / (line[0] + line[1] * count) - 1) > \
                        DRIFT_FRACTION:  # the machine changed: older points no longer hold
                    points.clear()
                points[count] = seconds

    def _corrected(self, index: int, scales: Sequence[Sequence[float | None]]
                   ) -> ParticipantProfile:
        calibrated, current = self.calibrated[index], self.profiles[index]
        costs = []
        for layer, row in enumerate(scales):
            scale = row[index]
            fitted = fit_cost_line(self._points.get((layer, index), {}))
            if fitted is not None:  # measured at two or more kernel counts
                costs.append(fitted)
            elif scale is None and (layer, index) not in self._points \
                    and (borrowed := self._peers_scale(layer, index, scales)) is not None:
                # never measured here: its calibration is as far off as its peers' were
                fixed_s, per_kernel_s = calibrated.costs[layer]
                costs.append((fixed_s * borrowed, per_kernel_s * borrowed))
            elif scale is None:  # no kernels here: keep what we believed
                costs.append(current.costs[layer])
            else:
                fixed_s, per_kernel_s = calibrated.costs[layer]
                costs.append((fixed_s * scale, per_kernel_s * scale))
        return replace(current, costs=tuple(costs))


def fit_cost_line(points: Mapping[int, float]) -> tuple[float, float] | None:
    """(fixed_s, per_kernel_s) of the least-squares line through measured (kernels,
    seconds) points, or None with fewer than two kernel counts or a line that does not
    rise. The fixed part is kept within [0, the smallest measured time]."""
    if len(points) < 2:
        return None
    ks = [float(k) for k in points]
    ts = [points[k] for k in points]
    mean_k, mean_t = statistics.fmean(ks), statistics.fmean(ts)
    spread = sum((k - mean_k) ** 2 for k in ks)
    if spread <= 0:
        return None
    slope = sum((k - mean_k) * (t - mean_t) for k, t in zip(ks, ts)) / spread
    if slope <= 0:
        return None
    fixed = min(max(0.0, mean_t - slope * mean_k), min(ts))
    # the slope again, through the (possibly clipped) fixed part: least squares
    per_kernel = sum(k * (t - fixed) for k, t in zip(ks, ts)) / sum(k * k for k in ks)
    return (fixed, per_kernel) if per_kernel > 0 else None
