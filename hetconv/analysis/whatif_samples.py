"""What if, for a run split by samples: the step of clusters that were never measured,
from one of two models of the sample split, with the same scenarios, table and
measured-configuration check as the kernel split's what-if
(:mod:`hetconv.analysis.whatif`) and its cluster rule: the measured participants
repeated in order, or ``like`` N copies of one.

**The fitted model** (where the run has one: its last ``model`` record split by
samples with usable terms, :func:`read_step_model`): the run's step model fitted in
place (:mod:`hetconv.master.samples.step_model`), ``compute + rounds·round + serial``,
within ±10 % of the run's own steps where the calibration model below was 20-40 %
short. For a scenario (units: seconds, bytes):

- ``b_i``: the fitted compute per sample of the measured participant that machine
  copies, and likewise each fitted step's ``b_i(t)``, scaled by the conv chain's
  forward flop per sample over the measured one's; the compute term is
  :meth:`StepTerms.compute_s` (median over the fitted steps of each step's slowest
  participant). A participant the fit has no figure for (it had no samples in the
  fitted steps) takes its calibrated seconds per sample (the ``plan`` record's) and is
  named in the table's note (:meth:`FittedModel.calibrated`).
- Slices follow speed from those ``b_i`` (equation 1 applied to samples).
- Per round: ``round' = round + (wire(scenario) − wire(measured)) / rounds``, at
  least 0, where ``wire`` is :func:`predict_sample_step` less its compute part
  (``max_i b_i·n_i``, the same figures given to it). The fitted ``round`` already
  holds the measured configuration's wire, the barriers' skew and the message
  handling; only the *change* in transfer time the link model predicts is added:
  skew and message handling per round are assumed to stay as measured, and so is
  the number of rounds a step (another layer count changes the round trips' time
  through the wire difference only).
- ``serial``: scaled like the dense part (``scaled_dense_s / dense_s``; unscaled
  where the run measured no dense part).
- No dense part is added: with the step chain (the dense part replicated, the
  default) a participant's measured compute is its request's wall time less its waits
  for peers' pieces, the dense part included (``compute_seconds`` in
  participant/samples/layers.py; ``SamplePolicy.step_ended`` takes the dense part back
  out of it for the master-alone check), so ``b_i`` already holds it; with the dense
  part on the master it runs between the rounds, in ``serial``.
- The fastest machine of the cluster alone (the speedup's reference): ``min_i
  b_i·batch + serial``, no rounds; a cluster of one machine (the master alone) is
  predicted so too.

For the measured configuration (batch, network and links as measured) the
prediction is ``terms.predict`` at the run's own slices, the median over its steps
(:func:`measured_step`; wire difference 0, scales 1); at the slices by speed for a
run without step records. The terms are pooled over every window the run fitted
(:func:`pool_fits`).

**The calibration model** (no usable ``model`` record, or no measured links to move
the fitted round cost to others): :func:`predict_sample_step` from the calibrated
seconds per sample of the whole conv chain (the ``plan`` record's
``seconds_per_sample``, :func:`read_sample_plan`) and the probed links, plus the
measured dense part. Approximations:

- **Batch**: a participant's seconds per sample do not change with its slice (the
  per-call cost is spread over the calibrated slice; a much smaller slice is
  predicted too fast). The fitted model assumes the same.
- **Network** (``arch``): seconds per sample scale with the conv forward flop per
  sample of the whole chain over the measured one's; the dense part as in the kernel
  what-if.
- The master's dense part is the measured median, scaled the same way. Replicated on
  the participants (``dense_part`` "replicas", docs/dense-replica.md): the measured
  median is the slowest member's, on its slice; it scales with the largest slice, and
  the dense part's values join the weight reduction (``predict_sample_step``).
- Slices follow speed, also for a run that was split ``--split equal``.

Pure, but for :func:`read_sample_plan` and :func:`read_step_model`, which read the
run's metrics.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hetconv.analysis.report.records import METRICS_FILE
from hetconv.analysis.whatif import (
    MAX_MACHINES,
    MeasuredRun,
    Prediction,
    Scenario,
    cluster,
    is_measured,
    measured_scenario,
    model_with_arch,
    scaled_dense_s,
)
from hetconv.errors import UserError
from hetconv.master.kernels.planner import ParticipantProfile
from hetconv.master.samples.plan import (
    Slice,
    conv_weights,
    predict_sample_step,
    sample_bytes,
    sample_slices,
)
from hetconv.master.samples.step_model import (
    StepSample,
    StepTerms,
    terms_from_record,
)
from hetconv.metrics import iter_metrics
from hetconv.model import ConvLayerShape, ModelConfig, conv_layer_shapes, dense_shapes

CALIBRATION_MODEL = ("the sample split's calibration model (predict_sample_step from the "
                     "plan record's seconds per sample, plus the measured dense part)")


def read_sample_plan(run_dir: str | Path) -> dict[str, float] | None:
    """Seconds per sample per participant from the run's last ``plan`` record when the
    run was split by samples; None when it was split by kernels."""
    seconds: dict[str, float] | None = None
    for record in iter_metrics(Path(run_dir) / METRICS_FILE):
        if record["type"] != "plan":
            continue
        if record.get("split_by") != "samples":
            seconds = None
            continue
        try:
            seconds = {str(k): float(v) for k, v in dict(record["seconds_per_sample"]).items()}
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{run_dir}: the sample split's plan record has no usable "
                            "seconds_per_sample (a run from an older hetconv?)") from None
    return seconds


@dataclass(frozen=True)
class FittedModel:
    """The run's step model fitted in place: the terms of its last ``model`` record
    (split by samples) and how many steps they were fitted on."""

    terms: StepTerms
    fitted_steps: int
    source: str = "model"  # the last fit's record: "model" (in place) or "rehearsal" (set-up)
    windows: int = 1  # the fits pooled (pool_fits)
    run_slices: tuple[Mapping[str, int], ...] = ()  # each step's slices with workers (run_slices)

    def calibrated(self, run: MeasuredRun) -> tuple[str, ...]:
        """The run's participants the fit has no figure for: predicted from their
        calibrated seconds per sample (module doc)."""
        return tuple(p.participant for p in run.profiles
                     if p.participant not in self.terms.per_sample_s)

    def describe(self) -> str:
        """Which model, in a few words (the table's note, the JSON's ``estimate``)."""
        where = ("fitted in place" if self.source == "model"
                 else "fitted at set-up on the plan's rehearsal")
        windows = f" in {self.windows} windows" if self.windows > 1 else ""
        return (f"the run's step model {where}: compute + rounds x round + serial, "
                f"from {self.fitted_steps} steps{windows}")


def usable_terms(terms: StepTerms | None) -> StepTerms | None:
    """``terms`` where every figure is finite and in range (a compute per sample above
    0, the round and serial costs 0 or more, a round at least); None otherwise."""
    if terms is None or not terms.per_sample_s or terms.rounds < 1:
        return None
    per_sample = list(terms.per_sample_s.values())
    in_steps = [value for step in terms.steps_s for value in step.values()]
    if not (all(math.isfinite(v) and v > 0 for v in per_sample)
            and all(math.isfinite(v) and v >= 0 for v in in_steps)
            and all(math.isfinite(v) and v >= 0 for v in (terms.round_s, terms.serial_s))):
        return None
    return terms


def step_model_from_record(record: Mapping[str, Any]) -> FittedModel | None:
    """The fitted model of one ``model`` record; None where its terms are missing,
    garbled or out of range (a record of an older hetconv, a hand-edited one)."""
    try:
        terms = usable_terms(terms_from_record(record))
    except OverflowError:  # int(inf): a rounds of 1e400
        return None
    if terms is None:
        return None
    fitted = record.get("fitted_steps", record.get("steps"))
    steps = fitted if isinstance(fitted, int) and not isinstance(fitted, bool) and fitted > 0 \
        else len(terms.steps_s)
    return FittedModel(terms, steps, "rehearsal" if record.get("type") == "rehearsal"
                       else "model")


def read_step_model(run_dir: str | Path) -> FittedModel | None:
    """The run's step model over every window it was fitted on: set-up's ``rehearsal``
    record (master/samples/rehearsal.py) and each ``model`` record split by samples
    whose participants are the last fit's (:func:`pool_fits`); None without a usable
    last fit (an unusable one is not replaced by an earlier one: it was fitted before a
    re-fit or a re-plan)."""
    fits: list[dict[str, Any]] = []
    for record in iter_metrics(Path(run_dir) / METRICS_FILE):
        if (record["type"] == "rehearsal" and record.get("split_by", "samples") == "samples") \
                or (record["type"] == "model" and record.get("split_by") == "samples"):
            fits.append(record)
    if not fits:
        return None
    last = step_model_from_record(fits[-1])
    if last is None:
        return None
    same = [fit for fit in (step_model_from_record(r) for r in fits[:-1])
            if fit is not None and set(fit.terms.per_sample_s) == set(last.terms.per_sample_s)
            and fit.terms.rounds == last.terms.rounds]
    pooled = pool_fits([*same, last])
    # not re-fitted on every step of the run: the fits above are the model's own, each
    # checked on the steps after it; a fit on all 63 steps of the lab's runs was no
    # closer to their median (docs/usage.md "hetconv plan")
    steps = run_step_samples(run_dir, pooled.terms)
    return replace(pooled, run_slices=tuple(dict(step.samples) for step in steps))


def run_step_samples(run_dir: str | Path, terms: StepTerms) -> list[StepSample]:
    """The run's steps as the step model takes them (:class:`StepSample`), from its
    ``step`` records: every step but the first where more than one participant had
    samples, all of them in ``terms`` (a step of the master alone, or of other
    participants, is left out). A participant's compute is its layers' forward and
    backward seconds (the step chain's compute spread over its layers), the rounds'
    wall the slowest compute plus ``comm_s`` (their wall beyond it), ``terms.rounds``
    rounds a step."""
    out: list[StepSample] = []
    seen = 0
    for record in iter_metrics(Path(run_dir) / METRICS_FILE):
        if record["type"] != "step":
            continue
        seen += 1
        try:
            samples: dict[str, int] = {}
            compute: dict[str, float] = {}
            for layer in record["layers"]:
                for entry in layer["participants"]:
                    name = str(entry["participant"])
                    if int(entry.get("samples", 0)) > 0:
                        samples[name] = int(entry["samples"])
                        compute[name] = compute.get(name, 0.0) + float(
                            entry["forward_s"]) + float(entry["backward_s"])
            step_s, comm_s = float(record["step_s"]), float(record["comm_s"])
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            continue
        if seen > 1 and len(samples) > 1 and set(samples) <= set(terms.per_sample_s) \
                and all(math.isfinite(v) and v >= 0 for v in (step_s, comm_s, *compute.values())):
            out.append(StepSample(step_s, max(compute.values()) + comm_s, terms.rounds,
                                  compute, samples))
    return out


def measured_step(terms: StepTerms, slices: Sequence[Mapping[str, int]]) -> float:
    """The model's step for the measured configuration at the run's own slices: the
    median over its steps of ``terms.predict`` at each step's slices (the rebalancer's,
    cut a window late for speeds that swing: :func:`pool_fits`)."""
    return statistics.median(terms.predict(samples) for samples in slices)


def pool_fits(fits: Sequence[FittedModel]) -> FittedModel:
    """One model from the windows of the same participants (not empty; the last is the
    run's last fit): each participant's compute per sample and the per-round and serial
    costs the medians of the windows', and the compute term over every window's steps.
    On CPU-quota machines a participant's speed swings for about 10 steps at a time
    (docs/sample-split.md) and the rebalancer follows it a window late: the slices the
    run measured its steps on were cut for another window's speeds. One window's speeds
    slice the batch as if it knew them (two 0.45-core machines: the last window alone
    predicted the run's 106.5 ms step at 65.6)."""
    if len(fits) == 1:
        return fits[0]
    last = fits[-1].terms
    names = list(last.per_sample_s)
    terms = StepTerms(
        {name: statistics.median(f.terms.per_sample_s[name] for f in fits) for name in names},
        statistics.median(f.terms.round_s for f in fits),
        statistics.median(f.terms.serial_s for f in fits), last.rounds,
        tuple(step for f in fits for step in f.terms.steps_s))
    return FittedModel(terms, sum(f.fitted_steps for f in fits), fits[-1].source, len(fits))


def _chain_flops(shapes: Sequence[ConvLayerShape]) -> float:
    """Conv forward flop per sample of the whole chain."""
    return float(sum(shape.conv_flops(1) for shape in shapes))


def _master_link_bytes(slices: Sequence[tuple[str, int]], remote: dict[str, bool],
                       shapes: Sequence[ConvLayerShape], itemsize: int, data_plane: str,
                       weights: int, replicated: bool = False) -> float:
    """Bytes per step on the master's link, both directions: every worker's x and dy
    slices down and y slice up; with the star plane its weight gradient up and the sum
    down too (the peer plane reduces them worker to worker, but the master takes part:
    2·(P-1)/P of them each way). ``replicated`` (the dense part on every participant):
    only the x slices, and ``weights`` counts the dense part's values too."""
    x_bytes, y_bytes = sample_bytes(shapes, itemsize)
    if replicated:
        y_bytes = 0
    workers = [(name, n) for name, n in slices if remote.get(name)]
    total = sum(n * (x_bytes + 2 * y_bytes) for _, n in workers)
    if not workers:
        return 0.0
    if data_plane == "peer":
        participants = len(workers) + 1
        return total + 2 * 2 * (participants - 1) / participants * 4 * weights
    return total + sum(2 * 4 * weights for _, n in workers if n > 0)


@dataclass(frozen=True)
class SampleCluster:
    """One scenario's machines with their seconds per sample and slices by speed."""

    scenario: Scenario
    shapes: list[ConvLayerShape]
    machines: list[ParticipantProfile]
    sources: list[str]
    per_sample: dict[str, float]  # by machine
    slices: list[Slice]
    replicated: bool  # the dense part on every participant, its values reduced by the peers
    values: int  # the dense part's values, where replicated (0 otherwise)

    @property
    def samples(self) -> dict[str, int]:
        return {s.participant: s.samples for s in self.slices}


def _cluster(run: MeasuredRun, scenario: Scenario, figures: Mapping[str, float]
             ) -> tuple[SampleCluster, float]:
    """The scenario's machines, each with its source's figure scaled to the scenario's
    network, and that scale."""
    if not 1 <= scenario.machines <= MAX_MACHINES:
        raise UserError(f"{scenario.machines} machines: give 1 to {MAX_MACHINES}")
    model = model_with_arch(run, scenario.arch)
    shapes = conv_layer_shapes(model)
    scale = _chain_flops(shapes) / _chain_flops(conv_layer_shapes(run.model))  # 1.0: x / x
    machines = cluster(run, scenario)
    sources = _sources(run, scenario)
    names = [m.participant for m in machines]
    seconds = [figures[source] * scale for source in sources]
    replicated = run.dense_replicas and run.data_plane == "peer"
    return SampleCluster(scenario, shapes, machines, sources, dict(zip(names, seconds)),
                         sample_slices(names, seconds, scenario.batch), replicated,
                         dense_values(model) if replicated else 0), scale


def _conv_step(run: MeasuredRun, c: SampleCluster) -> float:
    """``predict_sample_step`` for the cluster at its slices."""
    return predict_sample_step(c.slices, c.per_sample, {m.participant: m.link for m in c.machines},
                               c.shapes, conv_weights(c.shapes), run.wire_itemsize,
                               "peer" if run.data_plane == "peer" else "master",
                               slice_statistics=run.slice_statistics, dense_values=c.values,
                               link_itemsizes=_link_itemsizes(run, c.machines, c.sources),
                               ahead=run.steps_in_flight > 1)


def _wire(run: MeasuredRun, c: SampleCluster) -> float:
    """``predict_sample_step`` less its compute part: the transfers and round trips."""
    compute = max((c.per_sample[s.participant] * s.samples for s in c.slices), default=0.0)
    return _conv_step(run, c) - compute


def _prediction(run: MeasuredRun, c: SampleCluster, step_s: float, single_s: float) -> Prediction:
    speeds = [1.0 / t for t in c.per_sample.values()]
    return Prediction(
        scenario=c.scenario, step_s=step_s, single_step_s=single_s,
        ideal_speedup=sum(speeds) / max(speeds),
        chosen=sum(1 for s in c.slices if s.samples > 0),
        master_link_bytes=_master_link_bytes(
            [(s.participant, s.samples) for s in c.slices],
            {m.participant: m.link is not None for m in c.machines}, c.shapes,
            run.wire_itemsize, run.data_plane, conv_weights(c.shapes) + c.values,
            c.replicated),
        measured_step_s=run.measured_step_s if is_measured(run, c.scenario) else None)


def predict_sample_scenarios(run: MeasuredRun, seconds_per_sample: dict[str, float],
                             scenarios: Sequence[Scenario],
                             fitted: FittedModel | None = None) -> list[Prediction]:
    """The estimate for every scenario (module doc): from the ``fitted`` model where
    given, else from the calibration model."""
    if fitted is not None:
        out = []
        for scenario in scenarios:
            c, terms = fitted_terms(run, seconds_per_sample, fitted, scenario)
            alone = _alone(c, terms)  # also a cluster of one machine's step: no rounds
            step = terms.predict(c.samples) if len(c.machines) > 1 else alone
            if fitted.run_slices and is_measured(run, scenario):
                step = measured_step(terms, fitted.run_slices)  # the run's own slices
            out.append(_prediction(run, c, step, alone))
        return out
    missing = [p.participant for p in run.profiles if p.participant not in seconds_per_sample]
    if missing:
        raise UserError(f"{run.run_dir}: the sample split's plan record has no seconds per "
                        f"sample for {', '.join(missing)}")
    measured = sample_slices([p.participant for p in run.profiles],
                             [seconds_per_sample[p.participant] for p in run.profiles], run.batch)
    measured_largest = max((s.samples for s in measured), default=run.batch) or run.batch
    out = []
    for scenario in scenarios:
        c, _ = _cluster(run, scenario, seconds_per_sample)
        conv = _conv_step(run, c)
        dense = alone_dense = scaled_dense_s(run, scenario.arch, scenario.batch)
        if c.replicated:  # measured on the largest slice; runs on the scenario's largest
            per_sample_dense = dense / scenario.batch * run.batch / measured_largest
            alone_dense = per_sample_dense * scenario.batch
            dense = per_sample_dense * max(s.samples for s in c.slices)
        single = min(c.per_sample.values()) * scenario.batch
        out.append(_prediction(run, c, conv + dense, single + alone_dense))
    return out


def _alone(c: SampleCluster, terms: StepTerms) -> float:
    """The fastest machine of the cluster alone: the whole batch, no rounds."""
    return min(terms.per_sample_s[name] for name in c.per_sample) * c.scenario.batch \
        + terms.serial_s


def fitted_terms(run: MeasuredRun, seconds_per_sample: Mapping[str, float],
                 fitted: FittedModel, scenario: Scenario) -> tuple[SampleCluster, StepTerms]:
    """The scenario's cluster and its terms from the fitted model (module doc): its
    step is ``terms.predict(cluster.samples)`` (for more than one machine). Needs the
    run's measured links (the measured configuration's wire)."""
    if not run.links_measured:
        raise UserError(f"{run.run_dir}: the fitted step model needs the run's measured "
                        "links (its round cost holds their wire)")
    terms = fitted.terms
    figures = {p.participant: terms.per_sample_s.get(p.participant,
                                                     seconds_per_sample.get(p.participant))
               for p in run.profiles}
    missing = [name for name, figure in figures.items() if figure is None]
    if missing:
        raise UserError(f"{run.run_dir}: neither the step model nor the plan record has "
                        f"seconds per sample for {', '.join(missing)}")
    known = {name: figure for name, figure in figures.items() if figure is not None}
    c, scale = _cluster(run, scenario, known)
    base = c if is_measured(run, scenario) else _cluster(run, measured_scenario(run), known)[0]
    wire = 0.0 if base is c else _wire(run, c) - _wire(run, base)
    serial = 1.0
    if run.dense_s > 0 and (scenario.batch, scenario.arch) != (run.batch, run.arch):
        serial = scaled_dense_s(run, scenario.arch, scenario.batch) / run.dense_s
    steps = tuple({name: step[source] * scale
                   for name, source in zip(c.per_sample, c.sources) if source in step}
                  for step in terms.steps_s)
    return c, StepTerms(c.per_sample, max(0.0, terms.round_s + wire / terms.rounds),
                        terms.serial_s * serial, terms.rounds, steps)


def dense_values(model: ModelConfig) -> int:
    """Values in the dense part's arrays (N: every weight and bias)."""
    return sum(out * (features + 1) for _, features, out in dense_shapes(model))


def _link_itemsizes(run: MeasuredRun, machines: list[ParticipantProfile],
                    sources: list[str]) -> dict[str, int]:
    """Each machine's wire bytes per element: its source's link's, as the run chose."""
    chosen = dict(run.link_itemsizes)
    return {machine.participant: chosen[source]
            for machine, source in zip(machines, sources) if source in chosen}


def _sources(run: MeasuredRun, scenario: Scenario) -> list[str]:
    """The measured participant each machine of :func:`cluster` copies, in order."""
    if scenario.like is not None:
        return [scenario.like] * scenario.machines
    count = len(run.profiles)
    return [run.profiles[i % count].participant for i in range(scenario.machines)]
