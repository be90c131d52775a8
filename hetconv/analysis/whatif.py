"""What if: the performance model's predictions for clusters that were never measured.

From one run's measured participant profiles (the calibration fit per layer,
``fixed_s + per_kernel_s * kernels`` for forward and backward together, and the
link probe's rates), predict the step time of hypothetical clusters of 1 to
:data:`MAX_MACHINES` machines, with another link rate, batch size or network.
Every prediction comes from :mod:`hetconv.master.kernels.planner` (the participants and the
split it would choose, and its step prediction with the model of the run's data
plane) plus the run's measured dense part; nothing here re-derives the model.
Predictions are **model estimates**: the run's measured median step, shown beside
the prediction for the measured configuration, says how far to trust them.

The hypothetical cluster of N machines (:func:`cluster`):

- by default the measured participants repeated in their order (master first when
  it computed): N = the number of participants is the measured configuration; a
  copy of the master's own device is a worker with the median measured link;
- with ``like``, N copies of one measured participant: machine 0 is the master's own
  device (nothing travels), the others are workers with that participant's link
  (the median measured link when it is the master).

Link: the measured links (rate None), or every worker link replaced by
``Link(rate, rate, rtt)`` (bytes per second both ways, the median measured round
trip, :data:`DEFAULT_RTT_S` when the run probed no link).

Approximations, stated once (units: seconds, bytes, bytes per second):

- **Batch**: per-kernel and fixed costs scale linearly with the batch (both are work
  per image; per-call overheads that do not grow with the batch are ignored, so a
  smaller batch is predicted slightly too fast). The dense part scales the same way.
  Traffic is recomputed exactly from the layer shapes.
- **Network** (``arch``, the ``A:B`` form of ``--arch``): layer i's per-kernel cost
  scales with its forward flop per kernel (in channels x kernel area x conv output
  area) over the measured layer i's; its fixed cost with its input elements per image
  over the measured layer's (the per-share work is on the whole input). A layer
  beyond the measured ones is referred to the last measured layer. The dense part
  scales with the dense layer's input features.
- The planner's search is run over interchangeable machines (same costs, same link)
  by symmetry: :func:`best_plan` tries one machine of each kind where
  :func:`~hetconv.master.kernels.planner.choose_plan` tries every machine, which gives the
  same choice with far fewer predictions (about a second for 128 machines of a few
  kinds), and it predicts a set with the machines it uses only (on the peer plane the
  model's round trip and the master's own link then come from those).
- The profiles are the calibration fits; the rebalancer's corrections from measured
  step times (``rebalance`` records) are not applied.

Everything but :func:`read_plan_links` (which reads the run's ``plan`` record) is
pure.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from hetconv.analysis.report.analysis import median, used_steps
from hetconv.analysis.report.records import METRICS_FILE, RunRecords
from hetconv.config import MASTER_PARTICIPANT, WIRE_DTYPES
from hetconv.errors import UserError
from hetconv.master.kernels.planner import (
    Counts,
    Evaluator,
    ParticipantProfile,
    best_plan,
)
from hetconv.master.kernels.split import layer_traffic
from hetconv.metrics import iter_metrics, participant_of
from hetconv.model import (
    ConvLayerShape,
    ModelConfig,
    conv_layer_shapes,
    dense_features,
    model_config,
    parse_network,
)
from hetconv.planning.perf_model import (
    LayerTraffic,
    Link,
    ParticipantCost,
    compute_seconds,
    ideal_speedup,
)

MAX_MACHINES = 128
DEFAULT_MACHINES = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_RTT_S = 2e-4  # a switched LAN's empty round trip, used when the run probed no link
MEASURED_LINK = "measured"


@dataclass(frozen=True)
class MeasuredRun:
    """What one run measured, in the form the model takes."""

    run_dir: str
    profiles: tuple[ParticipantProfile, ...]  # participant order (the master's device first)
    model: ModelConfig  # the measured network: arch, input, kernel size, padding
    batch: int  # images per step
    wire_itemsize: int  # bytes per array element on the wire (4: float32, 2: float16)
    data_plane: str  # "peer" or "star"
    dense_s: float  # median measured dense part per step (0.0 when no step was recorded)
    measured_step_s: float | None  # median measured step (first step skipped); None: no steps
    steps_used: int  # how many steps that median is over
    plan_predicted_step_s: float | None  # the planner's own prediction at the run's start
    slice_statistics: bool = False  # the sample split with ``--bn-statistics slice``
    dense_replicas: bool = False  # the dense part on every participant (docs/dense-replica.md)
    link_itemsizes: tuple[tuple[str, int], ...] = ()  # (worker, bytes) where its link's differ
    steps_in_flight: int = 1  # the sample split's step chains sent ahead (config; 1: older)
    left_out: tuple[str, ...] = ()  # workers the sample split's plan left out (not modelled)

    @property
    def arch(self) -> tuple[int, ...]:
        return self.model.conv_kernels

    @property
    def links_measured(self) -> bool:
        """Whether the link probe measured every worker (runs with ``--split model``)."""
        return all(p.link is not None for p in self.profiles if not _is_master(p))


def _is_master(profile: ParticipantProfile) -> bool:
    return profile.participant == MASTER_PARTICIPANT


@dataclass(frozen=True)
class Scenario:
    """One hypothetical cluster."""

    machines: int  # 1 .. MAX_MACHINES
    rate_bits: float | None  # every worker link's rate (bits per second); None: measured links
    batch: int
    arch: tuple[int, ...]
    like: str | None = None  # N copies of this participant; None: the measured set repeated
    rate_label: str = MEASURED_LINK  # how the rate was written (1gbit)


@dataclass(frozen=True)
class Prediction:
    """The model's estimate for one scenario (seconds, bytes)."""

    scenario: Scenario
    step_s: float  # predicted step: the planner's conv + transfers, plus the dense part
    single_step_s: float  # the fastest machine of the cluster alone, the same way
    ideal_speedup: float  # sum of the machines' compute speeds over the fastest one's
    chosen: int  # machines the planner gives kernels
    master_link_bytes: float  # bytes on the master's link per step (both directions)
    measured_step_s: float | None = None  # only for the measured configuration

    @property
    def speedup(self) -> float:
        """Over the fastest single machine's prediction."""
        return self.single_step_s / self.step_s

    @property
    def share_of_ideal(self) -> float:
        return self.speedup / self.ideal_speedup

    def record(self) -> dict[str, Any]:
        """A JSON-ready row."""
        s = self.scenario
        return {"machines": s.machines, "link": s.rate_label, "rate_bits_per_s": s.rate_bits,
                "batch": s.batch, "arch": ":".join(map(str, s.arch)), "like": s.like,
                "predicted_step_s": self.step_s, "single_machine_step_s": self.single_step_s,
                "speedup": self.speedup, "ideal_speedup": self.ideal_speedup,
                "share_of_ideal": self.share_of_ideal, "chosen": self.chosen,
                "master_link_bytes": self.master_link_bytes,
                "measured_step_s": self.measured_step_s}


# --- from a run directory -----------------------------------------------------------------
def read_plan_links(run_dir: str | Path) -> dict[str, Link]:
    """The probed links of the run's last ``plan`` record, by participant id ({} if none)."""
    links: dict[str, Link] = {}
    for record in iter_metrics(Path(run_dir) / METRICS_FILE):
        if record["type"] != "plan":
            continue
        try:
            links = {participant_of(raw): Link(float(raw["down_bytes_per_s"]),
                                               float(raw["up_bytes_per_s"]), float(raw["rtt_s"]))
                     for raw in record.get("links") or []}
        except (KeyError, TypeError, ValueError):
            links = {}
    return links


def last_plan_value(run_dir: str | Path, key: str, valid: Callable[[Any], bool]) -> Any:
    """The last ``plan`` record's ``key`` among those where ``valid`` holds; None
    without one (a run from before the field)."""
    value = None
    for record in iter_metrics(Path(run_dir) / METRICS_FILE):
        if record["type"] == "plan" and valid(record.get(key)):
            value = record[key]
    return value


def run_wire_dtype(run_dir: str | Path, config: dict[str, object]) -> str:
    """The dtype the run's wire carried: its ``--wire-dtype``, or under ``auto`` the one
    the planner chose (the ``plan`` record's ``wire_dtype``; float32 without one)."""
    flag = str(config.get("wire_dtype") or "float32")
    if flag in WIRE_DTYPES:
        return flag
    return str(last_plan_value(run_dir, "wire_dtype", lambda v: v in WIRE_DTYPES) or "float32")


def run_link_itemsizes(run_dir: str | Path) -> tuple[tuple[str, int], ...]:
    """(worker, bytes per element) of each worker's link as the sample split chose it
    (the ``plan`` record's ``link_wire_dtypes``; empty in runs from before it)."""
    chosen = last_plan_value(run_dir, "link_wire_dtypes", lambda v: isinstance(v, dict)) or {}
    return tuple((str(name), int(np.dtype(str(dtype)).itemsize))
                 for name, dtype in sorted(chosen.items()) if dtype in WIRE_DTYPES)


def run_left_out(run_dir: str | Path) -> tuple[str, ...]:
    """The workers the sample split's ``plan`` record left out (``not_used``), and those
    a later ``replan`` record left out (``left_out``: a trial measured the step shorter
    without them): they did not take part, so the model of the run leaves them out too."""
    left_out = [str(name) for name in
                last_plan_value(run_dir, "not_used", lambda v: isinstance(v, list)) or []]
    for record in iter_metrics(Path(run_dir) / METRICS_FILE):
        names = record.get("left_out") if record["type"] == "replan" else None
        if isinstance(names, list):
            left_out += [str(name) for name in names if str(name) not in left_out]
    return tuple(left_out)


def measured_run(records: RunRecords, links: dict[str, Link]) -> MeasuredRun:
    """The model's inputs from a parsed run directory; a :class:`UserError` when the run
    has no cost fits to start from (a local run, or one from before the fits)."""
    where = records.run_dir
    if last_plan_value(where, "alone", lambda v: v is True):  # calibrated, or not, first
        raise UserError(f"{where}: the master trained alone from set-up (it measured "
                        "no slower than the plan with workers), so no measured profiles "
                        "to predict from; --fall-back off keeps the workers")
    if not records.calibration:
        raise UserError(f"{where}: no calibration records, so no measured profiles to "
                        "predict from (only a distributed run, 'hetconv train --listen', "
                        "calibrates its participants)")
    left_out = run_left_out(where)
    ids = [d.participant for d in records.calibration[0].devices
           if d.participant not in left_out]
    costs: dict[str, list[tuple[float, float]]] = {i: [] for i in ids}
    for layer in records.calibration:
        for entry in layer.devices:
            if entry.participant in left_out:
                continue
            if entry.fixed_s is None or entry.per_kernel_s is None or entry.participant not in costs:
                raise UserError(f"{where}: calibration of layer {layer.layer + 1} has no cost "
                                f"fit for {entry.participant} (a run from an older hetconv?)")
            costs[entry.participant].append((entry.fixed_s, entry.per_kernel_s))
    # a worker the link probe did not measure keeps link None too: see MeasuredRun.links_measured
    profiles = tuple(ParticipantProfile(i, tuple(costs[i]),
                                        None if i == MASTER_PARTICIPANT else links.get(i))
                     for i in ids)
    config = records.config
    try:
        channels, height, width = (int(d) for d in config["input_shape"])
        kernel_size = int(config.get("kernel_size", 5))
        padding = int(config.get("padding", 0))
        text = str(config.get("network") or ":".join(str(int(k)) for k in config["arch"]))
        model = model_config(parse_network(text, kernel_size, padding, where="network"),
                             (channels, height, width), int(config.get("classes", 10)),
                             kernel_size, padding)
        batch = int(config["batch"])
    except (KeyError, TypeError, ValueError) as error:
        raise UserError(f"{where}: config has no usable arch, input_shape or batch "
                        f"({error!r})") from None
    if len(model.conv_kernels) != len(records.calibration):
        raise UserError(f"{where}: {len(records.calibration)} calibrated layers for arch "
                        f"{':'.join(map(str, model.conv_kernels))}")
    steps = used_steps(records.steps)
    return MeasuredRun(run_dir=where, profiles=profiles, model=model, batch=batch,
                       wire_itemsize=np.dtype(run_wire_dtype(where, config)).itemsize,
                       data_plane=str(config.get("data_plane") or "star"),
                       dense_s=median(s.dense_s for s in steps) or 0.0,
                       measured_step_s=median(s.step_s for s in steps), steps_used=len(steps),
                       plan_predicted_step_s=records.plan_predicted_step_s,
                       slice_statistics=config.get("bn_statistics") == "slice",
                       dense_replicas=records.dense_part == "replicas",
                       link_itemsizes=run_link_itemsizes(where),
                       steps_in_flight=2 if config.get("steps_in_flight") == 2 else 1,
                       left_out=left_out)


# --- scaling the measured costs -------------------------------------------------------------
def _flop_per_kernel(shape: ConvLayerShape) -> float:
    return shape.conv_flops(1) / shape.kernels


def _input_elements(shape: ConvLayerShape) -> float:
    return float(np.prod(shape.input_shape(1)))


def scaled_costs(run: MeasuredRun, profile: ParticipantProfile, arch: tuple[int, ...],
                 batch: int) -> tuple[tuple[float, float], ...]:
    """A participant's (fixed_s, per_kernel_s) per layer of ``arch`` at ``batch`` (module doc)."""
    measured = conv_layer_shapes(run.model)
    target = conv_layer_shapes(model_with_arch(run, arch))
    factor = batch / run.batch
    costs = []
    for shape in target:
        ref = min(shape.index, len(measured) - 1)
        fixed, per_kernel = profile.costs[ref]
        fixed_scale = factor * _input_elements(shape) / _input_elements(measured[ref])
        per_kernel_scale = factor * _flop_per_kernel(shape) / _flop_per_kernel(measured[ref])
        costs.append((fixed * fixed_scale, per_kernel * per_kernel_scale))  # exact at 1.0
    return tuple(costs)


def scaled_dense_s(run: MeasuredRun, arch: tuple[int, ...], batch: int) -> float:
    """The measured dense part scaled to ``batch`` and the dense input of ``arch``."""
    return (run.dense_s * batch / run.batch * dense_features(model_with_arch(run, arch))
            / dense_features(run.model))


def model_with_arch(run: MeasuredRun, arch: tuple[int, ...]) -> ModelConfig:
    """The run's network with ``arch`` kernels per conv layer (a layer-token network
    keeps its layers and takes the new kernel counts)."""
    m = run.model
    if not m.convs:
        return ModelConfig(conv_kernels=arch, input_shape=m.input_shape, classes=m.classes,
                           kernel_size=m.kernel_size, padding=m.padding)
    if len(arch) != len(m.convs):
        raise UserError(f"--arch {':'.join(map(str, arch))}: the run's network has "
                        f"{len(m.convs)} conv layers; give one kernel count per layer")
    convs = tuple(replace(c, kernels=k) for c, k in zip(m.convs, arch))
    return ModelConfig(conv_kernels=arch, input_shape=m.input_shape, classes=m.classes,
                       kernel_size=m.kernel_size, padding=m.padding, convs=convs,
                       dense=m.dense)


# --- the hypothetical cluster ---------------------------------------------------------------
def _median_link(run: MeasuredRun) -> Link | None:
    links = [p.link for p in run.profiles if p.link is not None]
    if not links:
        return None
    return Link(statistics.median(link.down_bytes_per_s for link in links),
                statistics.median(link.up_bytes_per_s for link in links),
                statistics.median(link.rtt_s for link in links))


def _worker_link(run: MeasuredRun, scenario: Scenario, own: Link | None) -> Link:
    median_link = _median_link(run)
    if scenario.rate_bits is not None:
        rate = scenario.rate_bits / 8
        return Link(rate, rate, median_link.rtt_s if median_link else DEFAULT_RTT_S)
    link = own or median_link
    if link is None:
        raise UserError(f"{run.run_dir}: no measured link (the link probe runs with "
                        "--split model); give a link rate (--rate)")
    return link


def cluster(run: MeasuredRun, scenario: Scenario) -> list[ParticipantProfile]:
    """The scenario's machines, in order (see the module doc); machine i depends on i only,
    so a smaller cluster is a prefix of a larger one."""
    arch, batch = scenario.arch, scenario.batch
    if scenario.like is not None:
        source = next((p for p in run.profiles if p.participant == scenario.like), None)
        if source is None:
            known = ", ".join(p.participant for p in run.profiles)
            raise UserError(f"--like {scenario.like}: no such participant in {run.run_dir} "
                            f"(it has {known})")
        costs = scaled_costs(run, source, arch, batch)
        machines = [ParticipantProfile(MASTER_PARTICIPANT, costs, None)]
        if scenario.machines > 1:
            link = _worker_link(run, scenario, source.link)
            machines += [ParticipantProfile(f"{source.participant}-{i}", costs, link)
                         for i in range(1, scenario.machines)]
        return machines
    machines = []
    count = len(run.profiles)
    for i in range(scenario.machines):
        source = run.profiles[i % count]
        costs = scaled_costs(run, source, arch, batch)
        name = source.participant if i < count else f"{source.participant}-{i // count}"
        if _is_master(source) and i < count:
            machines.append(ParticipantProfile(name, costs, None))  # the master's own device
        else:
            machines.append(ParticipantProfile(name, costs,
                                               _worker_link(run, scenario, source.link)))
    return machines


# --- bytes on the master's link -------------------------------------------------------------
def master_link_bytes(counts: Counts, remote: Sequence[bool], traffic: Sequence[LayerTraffic],
                      data_plane: str) -> float:
    """Bytes per step between the master's process and the workers, both directions.

    ``counts[layer][j]`` kernels of participant j; ``remote[j]`` False for the master's
    own device. Star: every worker with kernels gets the layer input and the output
    gradient slice and sends back its output slice and (but in layer 0) the input
    gradient. Peer (``hetconv.participant.kernels.exchange``): layer 0's input once to the relay, the last
    layer's output slices and their gradients, and the pieces the master's own share
    exchanges with the workers (all-gather forward, reduce-scatter backward).
    """
    total = 0.0
    last = len(traffic) - 1
    for index, (row, t) in enumerate(zip(counts, traffic)):
        shares = [k / t.kernels for k in row]
        workers = [j for j, k in enumerate(row) if k > 0 and remote[j]]
        if data_plane != "peer":
            for j in workers:  # x down, output slice up; its gradient down, dx up
                total += t.input_bytes + 2 * shares[j] * t.output_bytes
                total += t.input_bytes if t.need_dx else 0.0
            continue
        if index == 0 and workers:
            total += t.input_bytes
        if index == last:
            total += sum(2 * shares[j] * t.output_bytes for j in workers)
            continue
        own_share = sum(shares[j] for j, k in enumerate(row) if k > 0 and not remote[j])
        following = counts[index + 1]
        next_workers = sum(1 for j, k in enumerate(following) if k > 0 and remote[j])
        next_own = any(k > 0 and not remote[j] for j, k in enumerate(following))
        workers_share = sum(shares[j] for j in workers)
        # forward (all-gather): the master's slice to every worker of the next layer, the
        # workers' slices to the master's share there; backward (reduce-scatter) the same
        # amounts the other way: its partial gradient of their channels, theirs of its own
        total += 2 * t.output_bytes * (own_share * next_workers
                                       + (workers_share if next_own else 0.0))
    return total


# --- predictions ----------------------------------------------------------------------------
def predict_scenarios(run: MeasuredRun, scenarios: Sequence[Scenario]) -> list[Prediction]:
    """The model's estimate for every scenario (scenarios differing only in their machine
    count share their predictions)."""
    for scenario in scenarios:
        if not 1 <= scenario.machines <= MAX_MACHINES:
            raise UserError(f"{scenario.machines} machines: give 1 to {MAX_MACHINES}")
    predictions = []
    groups: dict[tuple[Any, ...], tuple[list[ParticipantProfile], Evaluator]] = {}
    for scenario in scenarios:
        key = (scenario.rate_bits, scenario.batch, scenario.arch, scenario.like)
        if key not in groups:
            largest = max(s.machines for s in scenarios
                          if (s.rate_bits, s.batch, s.arch, s.like) == key)
            machines = cluster(run, Scenario(largest, scenario.rate_bits, scenario.batch,
                                             scenario.arch, scenario.like))
            traffic = layer_traffic(conv_layer_shapes(model_with_arch(run, scenario.arch)),
                                    scenario.batch, run.wire_itemsize)
            groups[key] = machines, Evaluator(machines, traffic, run.data_plane)
        machines, evaluate = groups[key]
        used = machines[:scenario.machines]
        plan = best_plan(used, evaluate)
        dense = scaled_dense_s(run, scenario.arch, scenario.batch)
        speeds = [1.0 / compute_seconds([[ParticipantCost(fixed, per_kernel, t.kernels)]
                                         for (fixed, per_kernel), t in
                                         zip(machine.costs, evaluate.traffic)])
                  for machine in used]
        remote = [used[i].link is not None for i in plan.chosen]
        measured = (run.measured_step_s if is_measured(run, scenario) else None)
        predictions.append(Prediction(
            scenario=scenario, step_s=plan.step_s + dense,
            single_step_s=plan.single_step_s + dense, ideal_speedup=ideal_speedup(speeds),
            chosen=sum(1 for j in range(len(plan.chosen)) if any(row[j] for row in plan.counts)),
            master_link_bytes=master_link_bytes(plan.counts, remote, evaluate.traffic,
                                                run.data_plane),
            measured_step_s=measured))
    return predictions


def measured_scenario(run: MeasuredRun) -> Scenario:
    """The configuration the run measured: its participants, links, batch and network."""
    return Scenario(machines=len(run.profiles), rate_bits=None, batch=run.batch, arch=run.arch)


def is_measured(run: MeasuredRun, scenario: Scenario) -> bool:
    return (scenario.machines, scenario.rate_bits, scenario.batch, scenario.arch,
            scenario.like) == (len(run.profiles), None, run.batch, run.arch, None)


def scaling_curve(run: MeasuredRun,
                  machines: Sequence[int] = DEFAULT_MACHINES) -> list[Prediction]:
    """Predicted speedup against machine count for the run's participants repeated, at
    its measured links, batch and network (the report's plot)."""
    return predict_scenarios(run, [Scenario(n, None, run.batch, run.arch) for n in machines])
