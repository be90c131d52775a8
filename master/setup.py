"""Setting a distributed run up: membership, calibration, first split, shard assignment.

:func:`open_distributed_stage` is what ``hetconv train --listen`` calls: it waits
for the workers, calibrates every participant on every conv layer, makes the first
split with the run's split rule (``master/kernels/split.py``), prints and records it, sends
every worker its shards (the seeded initial weights) and returns the
:class:`~hetconv.master.kernels.stage.DistributedConvStage` the trainer drives, built
complete: its data plane, its run state machine (``master/run.py``) and its
:class:`RunPlanning` (re-plans, joins, rebalancing).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from hetconv.config import (
    MASTER_PARTICIPANT,
    WIRE_DTYPE_AUTO,
    WIRE_DTYPES,
    WIRE_FLOAT16_GAIN,
    MasterConfig,
)
from hetconv.device_info import describe_device
from hetconv.engine.shard import ConvShard, LayerSettings
from hetconv.engine.stage import ConvStage, LocalConvStage
from hetconv.errors import UserError
from hetconv.keys import server_keys
from hetconv.master.alone_first import SETUP_BAND
from hetconv.master.assign import assign
from hetconv.master.calibration import (
    LayerCalibration,
    calibrate,
    calibrate_samples,
    kernel_sizes,
)
from hetconv.master.cluster import Cluster, ClusterSettings, WorkerHandle
from hetconv.master.joiners import JoinCalibration, Timings
from hetconv.master.kernels.peer_plane import open_peer_plane
from hetconv.master.kernels.phases import Phases
from hetconv.master.kernels.planes import DataPlane, StarPlane
from hetconv.master.kernels.planner import ParticipantProfile, Plan, choose_plan
from hetconv.master.kernels.rebalance import RebalanceDecision, Rebalancer, measured_compute
from hetconv.master.kernels.rehearsal import rehearse_kernel_plan
from hetconv.master.kernels.split import SplitRule, layer_traffic
from hetconv.master.kernels.stage import DistributedConvStage, StageSetup
from hetconv.master.link_probe import probe_links
from hetconv.master.plan import Participant, Shard, format_split, shards_from_counts
from hetconv.master.run import RunControl
from hetconv.master.samples.plan import model_split_by
from hetconv.master.samples.rehearsal import rehearse_first_plan
from hetconv.master.samples.setup import (
    dense_part_for,
    open_sample_stage,
    sample_members_for,
    sample_wire_for,
    samples_refusal_for,
    split_by_for,
)
from hetconv.master.setup_alone import alone_figure, compare_alone, train_alone
from hetconv.metrics import MetricsWriter
from hetconv.model import ConvLayerShape, ModelConfig, conv_layer_shapes, dense_shapes
from hetconv.planning.memory import available_bytes
from hetconv.planning.memory_spread import machine_memory, spread_refusal
from hetconv.planning.perf_model import LayerTraffic


def open_cluster(config: MasterConfig, device: str, threads: int | None,
                 report: Callable[[str], None] = print) -> tuple[Cluster, list[Participant]]:
    """Bind, wait for ``min_workers`` and list the participants (master first)."""
    curve = None
    if config.curve_secret and config.curve_allow:
        curve = server_keys(config.curve_secret, config.curve_allow)
    cluster = Cluster(config.listen, ClusterSettings(), curve)
    try:
        members = cluster.wait_for_workers(config.min_workers, config.wait_s, report)
    except BaseException:
        cluster.close()
        raise
    participants = []
    if config.use_local_device:
        participants.append(Participant(MASTER_PARTICIPANT, None,
                                        describe_device(device, threads=threads)))
    participants += [Participant(w.worker_id, w, w.device) for w in members]
    return cluster, participants


def link_records(profiles: list[ParticipantProfile]) -> list[dict[str, Any]]:
    """The probed links of the ``plan`` record."""
    return [{"participant": profile.participant,
             "down_bytes_per_s": profile.link.down_bytes_per_s,
             "up_bytes_per_s": profile.link.up_bytes_per_s, "rtt_s": profile.link.rtt_s}
            for profile in profiles if profile.link is not None]


def check_spread(config: MasterConfig, model: ModelConfig, shapes: list[ConvLayerShape],
                 batch: int, participants: list[Participant]) -> None:
    """UserError (one line) when the network cannot fit on ``participants`` under any split
    the run may use (hetconv/planning/memory_spread.py), before anything is calibrated:
    the master's memory is what it has available, a worker's the total its Hello says."""
    if config.split_by in ("samples", "kernels"):
        splits = [config.split_by]
    elif samples_refusal_for(model, shapes, config.data_plane) is not None:
        splits = ["kernels"]
    else:
        splits = ["samples", "kernels"]
    memory = machine_memory([(p.participant, p.worker is None, p.description)
                             for p in participants], available_bytes())
    if memory is None:  # a worker that did not say: nothing to conclude
        return
    dense_values = sum(units * (features + 1) for _, features, units in dense_shapes(model))
    refusal = spread_refusal(shapes, batch, dense_values, memory, splits)
    if refusal is not None:
        raise UserError(refusal)


def choose_wire_dtype(profiles: list[ParticipantProfile], shapes: list[ConvLayerShape],
                      batch: int, data_plane: str) -> tuple[str, float, float]:
    """(dtype, predicted step with float32, with float16): float16 when the planner
    predicts a step at least WIRE_FLOAT16_GAIN shorter with it (half the bytes on
    every link), else float32."""
    predicted = {dtype: choose_plan(profiles, layer_traffic(shapes, batch,
                                                            np.dtype(dtype).itemsize),
                                    data_plane).predicted_step_s
                 for dtype in WIRE_DTYPES}
    use16 = predicted["float16"] < predicted["float32"] * (1 - WIRE_FLOAT16_GAIN)
    return ("float16" if use16 else "float32"), predicted["float32"], predicted["float16"]


def planner_inputs(cluster: Cluster, participants: list[Participant],
                   shapes: list[ConvLayerShape], calibration: list[LayerCalibration],
                   batch: int, wire_dtype: str, report: Callable[[str], None] = print
                   ) -> tuple[list[ParticipantProfile], list[LayerTraffic]]:
    """Probe every worker's link; the participants' profiles (calibrated cost and link)
    and every layer's traffic, as the planner takes them."""
    links = probe_links(cluster, participants, report)
    traffic = layer_traffic(shapes, batch, np.dtype(wire_dtype).itemsize)
    profiles = [ParticipantProfile(p.participant,
                                   tuple(cal.cost_models()[i] for cal in calibration), link)
                for i, (p, link) in enumerate(zip(participants, links))]
    return profiles, traffic


def report_plan(choice: Plan, participants: list[Participant],
                profiles: list[ParticipantProfile], metrics: MetricsWriter,
                report: Callable[[str], None] = print, wire_dtype: str = "float32",
                split_why: str = "") -> None:
    """Print and record the planner's choice of participants and its prediction
    (``split_why``: why the run is split by kernels, the ``split by kernels`` line's)."""
    unused = [p.participant for p in participants if p.participant not in choice.chosen]
    report(f"hetconv: plan: {', '.join(choice.chosen)} (predicted conv + transfer "
           f"{choice.predicted_step_s * 1e3:.1f} ms per step; {choice.best_single} alone "
           f"{choice.best_single_step_s * 1e3:.1f} ms, all participants "
           f"{choice.all_step_s * 1e3:.1f} ms)"
           + (f"; not used: {', '.join(unused)}" if unused else ""))
    metrics.write("plan", split_by="kernels", split_by_why=split_why,
                  chosen=list(choice.chosen), predicted_step_s=choice.predicted_step_s,
                  best_single=choice.best_single, best_single_step_s=choice.best_single_step_s,
                  all_step_s=choice.all_step_s, wire_dtype=wire_dtype,
                  links=link_records(profiles))


class RunPlanning:
    """The stage's :class:`~hetconv.master.kernels.stage.Planning`: the split rule over the
    rebalancer's (measured-corrected) profiles for every re-plan, calibrating and
    link-probing the workers that join, rebalancing from measured steps (when on),
    and the line and metrics record of each change. Workers evicted for wrong results
    are never taken back (the run's state machine says who may)."""

    def __init__(self, cluster: Cluster, shapes: list[ConvLayerShape], batch: int,
                 rebalancer: Rebalancer, rule: SplitRule, rebalancing: bool,
                 metrics: MetricsWriter, report: Callable[[str], None] = print):
        self.cluster, self.shapes, self.batch = cluster, shapes, batch
        self.rebalancer, self.rule, self.rebalancing = rebalancer, rule, rebalancing
        self.metrics, self.report = metrics, report
        self.step = 0  # the trainer takes the timings once per step, from step 0
        self._waiting: dict[str, WorkerHandle] = {}  # joinable workers by id
        # joiners are timed beside training, each at the whole layer and a quarter of it
        self.joining = JoinCalibration(cluster, shapes,
                                       lambda shape: kernel_sizes(shape, 1, batch), report)
        self._timed: dict[str, Timings] = {}  # joiners timed, not taken in yet

    def split(self, alive: set[str]) -> list[list[int]]:
        self.rebalancer.restrict(alive)  # re-splits never hand the evicted kernels
        return [list(row) for row in self.rule.split(self.rebalancer.profiles,
                                                     self.rebalancer.traffic, alive).counts]

    def replanned(self, counts: list[list[int]], names: list[str], reason: str) -> None:
        self.rebalancer.adopt(counts)
        self.report(f"hetconv: re-plan ({reason}): " + "; ".join(
            f"layer {layer + 1}: " + ", ".join(f"{p} {c}" for p, c in zip(names, row))
            for layer, row in enumerate(counts)))
        self.metrics.write("replan", reason=reason, counts=[
            {"layer": layer, "participants": [{"participant": p, "kernels": c}
                                         for p, c in zip(names, row)]}
            for layer, row in enumerate(counts)])

    def rebalance(self, timings: dict[str, Any]) -> RebalanceDecision | None:
        if not self.rebalancing:
            return None
        decision = self.rebalancer.observe(self.step, measured_compute(timings))
        self.step += 1
        return decision

    def rebalanced(self, decision: RebalanceDecision, apply_s: float) -> None:
        split = "; ".join(f"layer {layer + 1}: " + ", ".join(
            f"{p} {count}" for p, count in zip(decision.participants, row))
            for layer, row in enumerate(decision.counts))
        self.report(f"hetconv: re-split after step {decision.step}: {decision.reason}; "
                    f"now {split} ({apply_s * 1e3:.0f} ms to apply)")
        self.metrics.write("rebalance", **decision.record(), apply_s=apply_s)

    def _cost_models(self, timings: Timings) -> tuple[tuple[float, float], ...]:
        return _cost_models_of(self.shapes, self.batch, timings)

    def joinable(self, shards: list[list[Shard]], may_rejoin: Callable[[str], bool]
                 ) -> list[str]:
        self.cluster.pump(0.0)  # take in any Hello waiting on the socket
        holding = {id(s.worker) for row in shards for s in row if s.worker is not None}
        self._waiting = {w.worker_id: w for w in self.cluster.known_workers()
                         if not w.gone and id(w) not in holding and may_rejoin(w.worker_id)
                         and (self.rule.data_plane != "peer" or w.data_endpoint)}
        self.joining.settle(self.joining.start(list(self._waiting.values())))  # beside training
        done, failed = self.joining.collect()
        self.joining.drop_failed(failed)
        self._timed.update(done)
        return sorted(name for name in self._waiting if name in self._timed)

    def admit(self, shards: list[list[Shard]], names: list[str]) -> list[list[Shard]]:
        """Calibrate and link-probe ``names``, add their profiles to the rebalancer and
        their columns to ``shards`` (empty, or their old column under their new
        connection); the kernels move at the re-split that follows."""
        joiners = [Participant(name, self._waiting[name], self._waiting[name].device)
                   for name in names]
        self.cluster.admit([p.worker for p in joiners if p.worker is not None])
        models = {p.participant: self._cost_models(self._timed.pop(p.participant))
                  for p in joiners}
        self.report(f"hetconv: worker(s) {', '.join(names)} joined, calibrated beside training")
        links = probe_links(self.cluster, joiners, self.report)
        out = [list(row) for row in shards]
        for joiner, link in zip(joiners, links):
            self.rebalancer.add_participant(ParticipantProfile(
                joiner.participant, models[joiner.participant], link))
            column = next((i for i, s in enumerate(out[0])
                           if s.participant == joiner.participant), None)
            for row in out:
                if column is None:  # new: an empty shard at the end of every layer
                    end = row[-1].stop
                    row.append(Shard(joiner.participant, joiner.worker, end, end))
                else:  # back under its old id: the new connection takes the column
                    old = row[column]
                    row[column] = Shard(old.participant, joiner.worker, old.start, old.stop)
        return out


def _cost_models_of(shapes: list[ConvLayerShape], batch: int,
                    timings: Timings) -> tuple[tuple[float, float], ...]:
    """(fixed seconds, seconds per kernel) per layer of one joiner timed at
    :func:`kernel_sizes` (one participant: the whole layer and a quarter of it)."""
    models = []
    for shape in shapes:
        (_, large), (_, small) = kernel_sizes(shape, 1, batch)
        calibration = LayerCalibration(shape.index, large,
                                       [timings[(shape.index, batch, large)]], small,
                                       [timings[(shape.index, batch, small)]])
        models.append(calibration.cost_models()[0])
    return tuple(models)


def kernel_split_config(config: MasterConfig, model: ModelConfig) -> MasterConfig:
    """The settings the kernel split is planned and run with: a residual network's over
    the star plane (the master joins the shortcuts between layers), without the sample
    split's own settings (``--bn-statistics``, ``--dense-part``: they stay in the sample
    split's config); any other network's as given."""
    if not (model.residual and config.data_plane == "peer"):
        return config
    return replace(config, data_plane="star", bn_statistics="batch", dense_part="auto")


def master_alone(plan: list[list[Shard]]) -> bool:
    """True when no worker holds a kernel in any layer."""
    return all(shard.worker is None or shard.kernels == 0 for row in plan for shard in row)


def open_distributed_stage(config: MasterConfig, model: ModelConfig,
                           params: dict[str, np.ndarray], settings: LayerSettings,
                           metrics: MetricsWriter, batch: int, device: str = "cpu",
                           threads: int | None = None,
                           report: Callable[[str], None] = print) -> ConvStage:
    """Membership, calibration, split and shard assignment; the stage the trainer drives
    (a local stage when the plan gives every kernel to the master's own device)."""
    shapes = conv_layer_shapes(model)
    try:  # a refused --split-by samples: before any worker is contacted
        split_by, why = split_by_for(config, model, shapes, batch)
    except ValueError as error:
        raise UserError(str(error)) from None
    cluster, participants = open_cluster(config, device, threads, report)
    try:
        metrics.write("devices", devices=[{"id": p.participant, **p.description}
                                          for p in participants])
        check_spread(config, model, shapes, batch, participants)
        calibration = calibrate(cluster, participants, shapes, batch, report=report)
        alone = alone_figure(config, model, params, settings, batch, device, participants,
                             metrics, report)
        # under --split model the planner's prediction decides between the two splits,
        # the per-layer byte rule only where there is no model (or the rule agrees)
        by_model = config.split_by == "auto" and config.split == "model" \
            and samples_refusal_for(model, shapes, config.data_plane) is None
        # the sample split chooses its own wire from its own model (sample_wire_for);
        # without a link model (--split equal): float32 unless asked otherwise
        sample_config = replace(config, wire_dtype="float32") \
            if config.wire_dtype == WIRE_DTYPE_AUTO and config.split != "model" else config
        star_for_kernels = model.residual and config.data_plane == "peer"
        asked_slice = config.bn_statistics == "slice"
        config = kernel_split_config(config, model)
        profiles: list[ParticipantProfile] = []
        traffic: list[LayerTraffic] = []
        if config.wire_dtype == WIRE_DTYPE_AUTO and config.split != "model":
            config = replace(config, wire_dtype="float32")  # no link model to choose by
        if participants:  # profiles: for the planner, and re-plans after faults and joins
            wire = "float32" if config.wire_dtype == WIRE_DTYPE_AUTO else config.wire_dtype
            profiles, traffic = planner_inputs(cluster, participants, shapes, calibration, batch,
                                               wire, report)
            if config.wire_dtype == WIRE_DTYPE_AUTO:
                chosen, step32, step16 = choose_wire_dtype(profiles, shapes, batch,
                                                           config.data_plane)
                report(f"hetconv: wire dtype {chosen}"
                       + (" if split by kernels" if split_by == "samples" or by_model else "")
                       + f" (--wire-dtype auto: predicted step {step32 * 1e3:.1f} ms with "
                       f"float32, {step16 * 1e3:.1f} ms with float16; float16 when "
                       f"{WIRE_FLOAT16_GAIN:.0%} shorter)")
                config = replace(config, wire_dtype=chosen)
                traffic = layer_traffic(shapes, batch, np.dtype(chosen).itemsize)
        rule = SplitRule(config.split, config.data_plane,
                         tuple(cal.calibrated_kernels for cal in calibration))
        first = rule.split(profiles, traffic, {p.participant for p in participants})
        by_model = by_model and first.plan is not None
        if (split_by == "samples" or by_model) and participants:
            links = {p.participant: profile.link for p, profile in zip(participants, profiles)}
            per_sample = calibrate_samples(cluster, participants, shapes, batch, report=report)
            chosen_lines: list[str] = []  # the sample split's choices: said if it is taken
            used, used_per_sample, used_links, left_out = sample_members_for(
                sample_config, participants, per_sample, shapes, batch, links, model, params,
                chosen_lines.append)
            compared, predicted, sample_config = dense_part_for(
                sample_config, used, used_per_sample, shapes, batch, used_links, model,
                params, chosen_lines.append)
            sample_config, gained, link_wires = sample_wire_for(
                sample_config, used, used_per_sample, shapes, batch, used_links, model,
                params, chosen_lines.append)
            compared, predicted = compared - gained, predicted - gained
            if by_model and first.plan is not None:
                split_by, why = model_split_by(split_by, why, compared,
                                               first.plan.predicted_step_s, SETUP_BAND)
            if split_by == "samples":
                for line in chosen_lines:
                    report(line)
                report(f"hetconv: split by samples ({why}; predicted conv + transfer "
                       f"{predicted * 1e3:.1f} ms per step)")
                if alone is not None and compare_alone(compared, alone, metrics, report):
                    return train_alone(cluster, model, params, settings, device, metrics,
                                       report, alone, "samples", why, link_records(profiles))
                stage = open_sample_stage(
                    cluster, sample_config, participants, calibration, per_sample, shapes, params,
                    settings, metrics, batch, device, lambda: LocalConvStage(
                        model, params, settings, device=device), report, predicted, links,
                    link_wires, left_out, why, alone_conv_s=None if alone is None else alone.conv_s)
                rehearsed = rehearse_first_plan(stage, model, params, batch, alone, metrics,
                                                report) if config.split == "model" else stage
                if rehearsed is None and alone is not None:
                    stage.release()  # the workers go; the cluster ends with train_alone
                    return train_alone(cluster, model, params, settings, device, metrics,
                                       report, alone, "samples", why, link_records(profiles))
                return rehearsed or stage
        if star_for_kernels:
            report("hetconv: data plane star: split by kernels, a residual network's "
                   "shortcuts are joined on the master, between the layers")
        report(f"hetconv: split by kernels ({why})")
        if asked_slice:
            report("hetconv: --bn-statistics slice does not apply to the kernel split: "
                   "every participant normalises with the whole batch's statistics")
        if first.plan is not None and alone is not None and (compare_alone(  # or no worker:
                first.plan.predicted_step_s, alone, metrics, report)  # the measured figure
                or master_alone(shards_from_counts(participants, first.counts))):
            return train_alone(cluster, model, params, settings, device, metrics, report,
                               alone, "kernels", why, link_records(profiles))
        if first.plan is not None:  # link-aware: which participants, how many kernels
            report_plan(first.plan, participants, profiles, metrics, report, config.wire_dtype,
                        why)
        plan = shards_from_counts(participants, first.counts)
        for shape, cal, shards in zip(shapes, calibration, plan):
            metrics.write("calibration", layer=shape.index, split=config.split,
                          calibrated_kernels=cal.calibrated_kernels, kernels=shape.kernels,
                          small_kernels=cal.small_kernels,
                          participants=[{"participant": p.participant, "seconds": s,
                                    "small_seconds": small, "fixed_s": cost[0],
                                    "per_kernel_s": cost[1], "kernels": shard.kernels,
                                    "kernel_start": shard.start, "kernel_stop": shard.stop,
                                    "share": shard.kernels / shape.kernels}
                                   for p, s, small, cost, shard in zip(
                                       participants, cal.seconds, cal.small_seconds,
                                       cal.cost_models(), shards)])
        for line in format_split(plan, shapes):
            report(line)
        if master_alone(plan):  # no worker would shorten the step: the local path, no overhead
            report("hetconv: the plan uses no worker: training on this machine alone "
                   "(the workers stay up for the next run)")
            cluster.end_run("the master trains alone: no worker would shorten the step")
            cluster.close()
            return LocalConvStage(model, params, settings, device=device)
        local = assign(cluster, plan, params, settings, {}, device, "first")

        def finish() -> None:
            cluster.end_run("training finished")
            cluster.close()

        kernel_stage = build_stage(cluster, config, plan, local, finish, shapes, StageSetup(
            settings, device,
            RunPlanning(cluster, shapes, batch, Rebalancer(
                profiles, traffic, [[s.kernels for s in row] for row in plan],
                config.data_plane), rule, config.rebalancing, metrics, report),
            lambda: LocalConvStage(model, params, settings, device=device)))
        if config.split != "model":
            return kernel_stage
        rehearsed = rehearse_kernel_plan(  # the planner's prediction measured
            kernel_stage, model, params, batch, alone,
            None if first.plan is None else first.plan.predicted_step_s, metrics, report)
        if rehearsed is None and alone is not None:
            kernel_stage.release()  # the workers go; the cluster ends with train_alone
            return train_alone(cluster, model, params, settings, device, metrics, report,
                               alone, "kernels", why, link_records(profiles))
        return rehearsed or kernel_stage
    except BaseException:
        cluster.end_run("master failed during setup")
        cluster.close()
        raise


def build_stage(cluster: Cluster, config: MasterConfig, plan: list[list[Shard]],
                local: dict[int, ConvShard], on_close: Callable[[], None],
                shapes: list[ConvLayerShape], setup: StageSetup) -> DistributedConvStage:
    """The stage with its run state machine and the data plane ``config.data_plane``
    says: star (every activation through the master) or peer (handed out here)."""
    control = RunControl((s.participant for row in plan for s in row if s.worker is not None),
                         stop_on_worker_loss=config.on_worker_loss == "stop")
    peer = config.data_plane == "peer"
    phases = Phases(cluster, plan, local, config.wire_dtype, shapes, control.request_deadline_s,
                    peers=peer)
    try:
        plane: DataPlane = (open_peer_plane(phases, config.peer_timeout_s) if peer
                            else StarPlane(phases))
    except BaseException:
        phases.close()
        raise
    return DistributedConvStage(phases, plane, control, setup, on_close)
