"""Link-aware planning: which participants to use and how many kernels each gets.

Pure: calibration profiles and link probes in, a :class:`Plan` out. For every
candidate set of participants the kernels of each layer are split so that every
participant finishes at the same time under its *effective* cost (compute fit plus
what its link adds: the layer input down and the input gradient up as a fixed cost,
its output slice up and output-gradient slice down per kernel), and the step of
that split is predicted with :func:`hetconv.planning.perf_model.predict_star_step` or, for the
peer data plane, :func:`hetconv.planning.perf_model.predict_peer_step`. Candidate
sets grow greedily from the best single participant, adding whichever participant
shortens the predicted step most; the best set seen wins. So a machine whose link
makes the step slower gets no kernels, and when every link is too slow the master
trains alone (or, with ``--no-local``, the best single worker does).
:func:`best_plan` is the same search over a cluster of interchangeable machines
(``hetconv plan``'s what-if estimates, ``hetconv/analysis/whatif.py``): it tries one machine of
each kind.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from hetconv.planning.partition import balanced_counts
from hetconv.planning.perf_model import (
    LayerTraffic,
    Link,
    ParticipantCost,
    predict_peer_step,
    predict_star_step,
)

MIN_PER_KERNEL_S = 1e-9  # a cost line must rise, however little
Counts = tuple[tuple[int, ...], ...]  # counts[layer][profile index]


@dataclass(frozen=True)
class ParticipantProfile:
    """What the planner knows of one participant."""

    participant: str
    costs: tuple[tuple[float, float], ...]  # per layer: (fixed_s, per_kernel_s), fwd + bwd
    link: Link | None  # None: the master's own device (nothing travels)


@dataclass(frozen=True)
class Plan:
    """The chosen participants and kernel counts, with the predictions behind the choice."""

    chosen: tuple[str, ...]  # participant ids in profile order
    counts: tuple[tuple[int, ...], ...]  # counts[layer][profile index]; 0 where not chosen
    predicted_step_s: float  # conv + transfers of one step (no dense part)
    best_single: str  # the fastest participant alone ...
    best_single_step_s: float  # ... and its predicted step
    all_step_s: float  # every participant with the compute-only split (links ignored)


def effective_cost(profile: ParticipantProfile, layer: int,
                   traffic: LayerTraffic) -> tuple[float, float]:
    """(fixed_s, per_kernel_s) of a participant in a layer, its link's share included."""
    fixed, per_kernel = profile.costs[layer]
    link = profile.link
    if link is not None:
        dx = traffic.input_bytes / link.up_bytes_per_s if traffic.need_dx else 0.0
        fixed += traffic.input_bytes / link.down_bytes_per_s + dx + 2 * link.rtt_s
        slice_bytes = traffic.output_bytes / traffic.kernels
        per_kernel += slice_bytes / link.up_bytes_per_s + slice_bytes / link.down_bytes_per_s
    return fixed, max(per_kernel, MIN_PER_KERNEL_S)


def split_counts(profiles: Sequence[ParticipantProfile], chosen: Sequence[int],
                 traffic: Sequence[LayerTraffic]) -> tuple[tuple[int, ...], ...]:
    """Kernels per layer per profile when only the ``chosen`` profiles take part."""
    return _balanced(profiles, chosen, traffic, effective_cost)


def _balanced(profiles: Sequence[ParticipantProfile], chosen: Sequence[int],
              traffic: Sequence[LayerTraffic],
              cost: Callable[[ParticipantProfile, int, LayerTraffic], tuple[float, float]]
              ) -> tuple[tuple[int, ...], ...]:
    """Equal finish times under ``cost`` per layer, over the ``chosen`` profiles."""
    counts = []
    for layer, t in enumerate(traffic):
        chosen_counts = balanced_counts([cost(profiles[i], layer, t) for i in chosen],
                                        t.kernels)
        row = [0] * len(profiles)
        for i, count in zip(chosen, chosen_counts):
            row[i] = count
        counts.append(tuple(row))
    return tuple(counts)


def predict(profiles: Sequence[ParticipantProfile], counts: Sequence[Sequence[int]],
            traffic: Sequence[LayerTraffic], data_plane: str = "star") -> float:
    """Predicted conv + transfer seconds of one step for these counts on ``data_plane``."""
    layers = [[ParticipantCost(p.costs[layer][0], p.costs[layer][1], row[i])
               for i, p in enumerate(profiles)] for layer, row in enumerate(counts)]
    model = predict_peer_step if data_plane == "peer" else predict_star_step
    return model(layers, [p.link for p in profiles], traffic)


def compute_split_counts(profiles: Sequence[ParticipantProfile], chosen: Sequence[int],
                         traffic: Sequence[LayerTraffic]) -> tuple[tuple[int, ...], ...]:
    """Kernels per layer per profile from the compute costs alone (links ignored)."""
    return _balanced(profiles, chosen, traffic, lambda profile, layer, _: profile.costs[layer])


def best_split(profiles: Sequence[ParticipantProfile], chosen: Sequence[int],
               traffic: Sequence[LayerTraffic], data_plane: str = "star") -> tuple[float, Counts]:
    """(predicted step, counts) of the faster of the two splits of the ``chosen``
    profiles: by effective cost (links included, right when the master's link
    serialises transfers) and by compute alone (right when links work in parallel, as
    on the peer plane)."""
    options = [split_counts(profiles, chosen, traffic),
               compute_split_counts(profiles, chosen, traffic)]
    return min((predict(profiles, counts, traffic, data_plane), counts) for counts in options)


def choose_plan(profiles: Sequence[ParticipantProfile], traffic: Sequence[LayerTraffic],
                data_plane: str = "star") -> Plan:
    """The participant set and split with the smallest predicted step (see module doc).

    Every candidate set is split two ways, by effective cost (links included, right
    when the master's link serialises transfers) and by compute alone (right when links
    work in parallel, as on the peer plane); the model's prediction decides.
    """
    if not profiles:
        raise ValueError("no participants to plan for")

    def evaluate(chosen: Sequence[int]) -> tuple[float, Counts]:
        return best_split(profiles, sorted(chosen), traffic, data_plane)

    singles = sorted((evaluate([i])[0], i) for i in range(len(profiles)))
    single_s, single = singles[0]
    chosen = [single]
    best_s, best_counts = evaluate(chosen)
    remaining = [i for i in range(len(profiles)) if i != single]
    while remaining:
        step_s, pick = min((evaluate(chosen + [i])[0], i) for i in remaining)
        chosen.append(pick)
        remaining.remove(pick)
        if step_s < best_s:
            best_s, best_counts = evaluate(chosen)
    compute_only = compute_split_counts(profiles, range(len(profiles)), traffic)
    all_s = predict(profiles, compute_only, traffic, data_plane)
    used = [i for i in range(len(profiles)) if any(row[i] for row in best_counts)]
    return Plan(chosen=tuple(profiles[i].participant for i in used),
                counts=best_counts, predicted_step_s=best_s,
                best_single=profiles[single].participant, best_single_step_s=single_s,
                all_step_s=all_s)


# --- the same search over interchangeable machines (hetconv/analysis/whatif.py) -----------------------
@dataclass
class Evaluator:
    """Predicted step (conv + transfers) and counts of a set of machines, remembered, so
    that clusters sharing a prefix of machines share the work."""

    machines: Sequence[ParticipantProfile]
    traffic: Sequence[LayerTraffic]
    data_plane: str
    seen: dict[tuple[int, ...], tuple[float, Counts]] = field(default_factory=dict)

    def __call__(self, chosen: tuple[int, ...]) -> tuple[float, Counts]:
        """Both of the planner's splits of ``chosen`` (sorted indices); the faster one."""
        if chosen not in self.seen:
            subset = [self.machines[i] for i in chosen]
            self.seen[chosen] = best_split(subset, range(len(subset)), self.traffic,
                                           self.data_plane)
        return self.seen[chosen]


@dataclass(frozen=True)
class ClusterPlan:
    """The planner's choice over a cluster (indices into its machines)."""

    chosen: tuple[int, ...]
    counts: Counts  # counts[layer][j] for machine chosen[j]
    step_s: float  # conv + transfers
    single: int  # the fastest machine alone ...
    single_step_s: float  # ... and its conv + transfers


def _kind(profile: ParticipantProfile) -> Hashable:
    return (profile.costs, profile.link)


def best_plan(machines: Sequence[ParticipantProfile],
              evaluate: Callable[[tuple[int, ...]], tuple[float, Counts]]) -> ClusterPlan:
    """:func:`~hetconv.master.kernels.planner.choose_plan`'s greedy search, trying one machine of
    each kind (the first unused) instead of every machine: start from the best single
    machine, add whichever shortens the step most, keep the best set seen."""
    def candidates(chosen: Sequence[int]) -> list[int]:
        taken, kinds, found = set(chosen), set(), []
        for i, machine in enumerate(machines):
            if i not in taken and _kind(machine) not in kinds:
                kinds.add(_kind(machine))
                found.append(i)
        return found

    single_s, single = min((evaluate((i,))[0], i) for i in candidates(()))
    chosen = [single]
    best: tuple[float, tuple[int, ...]] = (single_s, (single,))
    while remaining := candidates(chosen):
        step_s, pick = min((evaluate(tuple(sorted([*chosen, i])))[0], i) for i in remaining)
        chosen.append(pick)
        if step_s < best[0]:
            best = (step_s, tuple(sorted(chosen)))
    step_s, counts = evaluate(best[1])
    return ClusterPlan(chosen=best[1], counts=counts, step_s=step_s, single=single,
                       single_step_s=single_s)
