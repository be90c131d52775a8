"""Opening a distributed run: membership, calibration, split, shard assignment.

:func:`open_distributed_stage` is what ``hetconv train --listen`` calls: it waits
for the workers, calibrates every device on every conv layer, prints and records
the kernel split, sends every worker its shards (the seeded initial weights) and
returns the :class:`DistributedConvStage` the trainer drives.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from hetconv.config import MASTER_PARTICIPANT, WIRE_DTYPE_AUTO, MasterConfig
from hetconv.device_info import describe_device
from hetconv.keys import server_keys
from hetconv.master.calibration import LayerCalibration, calibrate
from hetconv.master.cluster import Cluster, ClusterSettings
from hetconv.master.link_probe import probe_links
from hetconv.master.offload import DistributedConvStage, assign_shard
from hetconv.master.peer_stage import build_stage
from hetconv.master.plan import (
    Participant,
    Shard,
    format_split,
    reshard,
    shards_from_counts,
    split_layers,
)
from hetconv.master.planner import ParticipantProfile, choose_plan
from hetconv.master.rebalance import Rebalancer, measured_compute
from hetconv.metrics import MetricsWriter
from hetconv.model import ConvLayerShape, ModelConfig, conv_layer_shapes
from hetconv.names import PARAMETER_NAMES, layer_key
from hetconv.partition import balanced_counts, equal_counts
from hetconv.perf_model import LayerTraffic
from hetconv.shard import ConvShard, LayerSettings
from hetconv.stage import ConvStage, LocalConvStage


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


def assign_shards(cluster: Cluster, plan: list[list[Shard]], params: dict[str, np.ndarray],
                  settings: LayerSettings, device: str) -> dict[int, ConvShard]:
    """Send each worker its shards; build the master's own shards."""
    local: dict[int, ConvShard] = {}
    pending = {}
    for layer, shards in enumerate(plan):
        for shard in shards:
            state = {name: params[layer_key(layer, name)][shard.start:shard.stop]
                     for name in PARAMETER_NAMES}
            if shard.worker is None:
                local[layer] = ConvShard(layer, shard.start, shard.stop, settings, state,
                                         device=device)
                continue
            if shard.kernels == 0:
                continue
            rid = cluster.request_id()
            cluster.send(shard.worker, assign_shard(rid, layer, shard.start, shard.stop,
                                                    settings, state))
            pending[rid] = shard.worker
    cluster.gather(pending, "shard assignment")
    return local


def layer_traffic(shapes: list[ConvLayerShape], batch: int,
                  wire_dtype: str) -> list[LayerTraffic]:
    """Every layer's bytes on the wire for a batch, in ``wire_dtype``."""
    itemsize = np.dtype(wire_dtype).itemsize
    return [LayerTraffic(input_bytes=int(np.prod(s.input_shape(batch))) * itemsize,
                         output_bytes=int(np.prod(s.output_shape(batch))) * itemsize,
                         kernels=s.kernels, need_dx=s.index > 0) for s in shapes]


def choose_wire_dtype(profiles: list[ParticipantProfile], shapes: list[ConvLayerShape],
                      batch: int, data_plane: str) -> tuple[str, float, float]:
    """(dtype, predicted step with float32, with float16): float16 when the planner
    predicts a step at least WIRE_FLOAT16_GAIN shorter with it (half the bytes on
    every link), else float32."""
    predicted = {dtype: choose_plan(profiles, layer_traffic(shapes, batch, dtype),
                                    data_plane).predicted_step_s
                 for dtype in ("float32", "float16")}
    use16 = predicted["float16"] < predicted["float32"] * (1 - WIRE_FLOAT16_GAIN)
    return ("float16" if use16 else "float32"), predicted["float32"], predicted["float16"]


WIRE_FLOAT16_GAIN = 0.03
"""--wire-dtype auto takes float16 only for a predicted step this much shorter."""


def planner_inputs(cluster: Cluster, participants: list[Participant],
                   shapes: list[ConvLayerShape], calibration: list[LayerCalibration],
                   batch: int, wire_dtype: str, report: Callable[[str], None] = print
                   ) -> tuple[list[ParticipantProfile], list[LayerTraffic]]:
    """Probe every worker's link; the participants' profiles (calibrated cost and link)
    and every layer's traffic, as the planner takes them."""
    links = probe_links(cluster, participants, report)
    traffic = layer_traffic(shapes, batch, wire_dtype)
    profiles = [ParticipantProfile(p.participant,
                                   tuple(cal.cost_models()[i] for cal in calibration), link)
                for i, (p, link) in enumerate(zip(participants, links))]
    return profiles, traffic


def plan_with_links(participants: list[Participant], profiles: list[ParticipantProfile],
                    traffic: list[LayerTraffic], data_plane: str, metrics: MetricsWriter,
                    report: Callable[[str], None] = print,
                    wire_dtype: str = "float32") -> list[list[Shard]]:
    """Let the planner choose participants and kernels, print and record the plan and
    its prediction."""
    choice = choose_plan(profiles, traffic, data_plane)
    unused = [p.participant for p in participants if p.participant not in choice.chosen]
    report(f"hetconv: plan: {', '.join(choice.chosen)} (predicted conv + transfer "
           f"{choice.predicted_step_s * 1e3:.1f} ms per step; {choice.best_single} alone "
           f"{choice.best_single_step_s * 1e3:.1f} ms, all participants "
           f"{choice.all_step_s * 1e3:.1f} ms)"
           + (f"; not used: {', '.join(unused)}" if unused else ""))
    metrics.write("plan", chosen=list(choice.chosen), predicted_step_s=choice.predicted_step_s,
                  best_single=choice.best_single, best_single_step_s=choice.best_single_step_s,
                  all_step_s=choice.all_step_s, wire_dtype=wire_dtype,
                  links=[{"device": p.participant, "down_bytes_per_s": profile.link.down_bytes_per_s,
                          "up_bytes_per_s": profile.link.up_bytes_per_s,
                          "rtt_s": profile.link.rtt_s}
                         for p, profile in zip(participants, profiles) if profile.link is not None])
    return shards_from_counts(participants, choice.counts)


class StepRebalancing:
    """The stage's ``after_step``: feeds each step's measured compute to a
    :class:`Rebalancer`, applies its re-splits (:meth:`DistributedConvStage.resplit`),
    prints one line and writes a ``rebalance`` record for each."""

    def __init__(self, stage: DistributedConvStage, rebalancer: Rebalancer,
                 settings: LayerSettings, metrics: MetricsWriter,
                 report: Callable[[str], None] = print):
        self.stage, self.rebalancer, self.settings = stage, rebalancer, settings
        self.metrics, self.report = metrics, report
        self.step = 0  # the trainer takes the timings once per step, from step 0

    def __call__(self, timings: dict[str, Any]) -> None:
        decision = self.rebalancer.observe(self.step, measured_compute(timings))
        self.step += 1
        if decision is None:
            return
        started = time.perf_counter()
        self.stage.resplit(decision.counts, self.settings)
        apply_s = time.perf_counter() - started
        split = "; ".join(f"layer {layer + 1}: " + ", ".join(
            f"{p} {count}" for p, count in zip(decision.participants, row))
            for layer, row in enumerate(decision.counts))
        self.report(f"hetconv: re-split after step {decision.step}: {decision.reason}; "
                    f"now {split} ({apply_s * 1e3:.0f} ms to apply)")
        self.metrics.write("rebalance", **decision.record(), apply_s=apply_s)

def split_for(mode: str, rebalancer: Rebalancer, alive: set[str]) -> list[list[int]]:
    """Kernel counts per layer per participant (the rebalancer's order) over the
    participants in ``alive`` (the others 0), as ``--split`` says: ``model`` the
    link-aware planner, ``equal`` the same share each, ``calibrated`` equal finish times
    under the (measured-corrected) cost lines."""
    if mode == "model":
        return [list(row) for row in rebalancer.plan_for(alive)]
    profiles = rebalancer.profiles
    chosen = [i for i, p in enumerate(profiles) if p.participant in alive]
    if not chosen:
        raise ValueError("no participant left to split the kernels over")
    out = []
    for layer, traffic in enumerate(rebalancer.traffic):
        counts = (equal_counts(len(chosen), traffic.kernels) if mode == "equal" else
                  balanced_counts([profiles[i].costs[layer] for i in chosen], traffic.kernels))
        row = [0] * len(profiles)
        for i, count in zip(chosen, counts):
            row[i] = count
        out.append(row)
    return out


class JoinHandler:
    """At a re-plan point: calibrate and link-probe every worker that said Hello
    since the last one (new, restarted or back after an eviction), add it as a
    participant and re-plan over everyone alive. Workers evicted for wrong results
    are not taken back in this run."""

    def __init__(self, cluster: Cluster, shapes: list[ConvLayerShape], batch: int,
                 wire_dtype: str, rebalancer: Rebalancer, data_plane: str,
                 report: Callable[[str], None] = print, split: str = "model"):
        self.cluster, self.shapes, self.batch = cluster, shapes, batch
        self.split = split
        self.wire_dtype, self.rebalancer, self.data_plane = wire_dtype, rebalancer, data_plane
        self.report = report

    def joiners(self, stage: DistributedConvStage) -> list[Participant]:
        self.cluster.pump(0.0)  # take in any Hello waiting on the socket
        holding = {id(s.worker) for row in stage.shards for s in row if s.worker is not None}
        return [Participant(w.worker_id, w, w.device) for w in self.cluster.known_workers()
                if not w.gone and id(w) not in holding
                and stage.may_rejoin(w.worker_id)
                and (self.data_plane != "peer" or w.data_endpoint)]

    def __call__(self, stage: DistributedConvStage) -> list[list[Shard]] | None:
        """The new shards (counts re-planned, joiners included) or None: nobody new."""
        joiners = self.joiners(stage)
        if not joiners:
            return None
        names = ", ".join(p.participant for p in joiners)
        self.report(f"hetconv: worker(s) {names} joined: calibrating")
        self.cluster.admit([p.worker for p in joiners if p.worker is not None])
        calibration = calibrate(self.cluster, joiners, self.shapes, self.batch,
                                report=self.report)
        links = probe_links(self.cluster, joiners, self.report)
        shards = [list(row) for row in stage.shards]
        for index, (joiner, link) in enumerate(zip(joiners, links)):
            self.rebalancer.add_participant(ParticipantProfile(
                joiner.participant, tuple(cal.cost_models()[index] for cal in calibration),
                link))
            column = next((i for i, s in enumerate(shards[0])
                           if s.participant == joiner.participant), None)
            for row in shards:
                if column is None:  # new: an empty shard at the end of every layer
                    end = row[-1].stop
                    row.append(Shard(joiner.participant, joiner.worker, end, end))
                else:  # back under its old id: the new connection takes the column
                    old = row[column]
                    row[column] = Shard(old.participant, joiner.worker, old.start, old.stop)
        alive = {s.participant for s in shards[0] if s.worker is None or not s.worker.gone}
        self.rebalancer.restrict(alive)  # the joined in, the gone (still) out
        return reshard(shards, split_for(self.split, self.rebalancer, alive))


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
    cluster, participants = open_cluster(config, device, threads, report)
    try:
        metrics.write("devices", devices=[{"id": p.participant, **p.description}
                                          for p in participants])
        calibration = calibrate(cluster, participants, shapes, batch, report=report)
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
                report(f"hetconv: wire dtype {chosen} (--wire-dtype auto: predicted step "
                       f"{step32 * 1e3:.1f} ms with float32, {step16 * 1e3:.1f} ms with "
                       "float16)")
                config = replace(config, wire_dtype=chosen)
                traffic = layer_traffic(shapes, batch, chosen)
        if config.split == "model":  # link-aware: which participants, how many kernels
            plan = plan_with_links(participants, profiles, traffic, config.data_plane, metrics,
                                   report, config.wire_dtype)
        else:
            plan = split_layers(participants, shapes, calibration, config.split)
        for shape, cal, shards in zip(shapes, calibration, plan):
            metrics.write("calibration", layer=shape.index, split=config.split,
                          calibrated_kernels=cal.calibrated_kernels, kernels=shape.kernels,
                          small_kernels=cal.small_kernels,
                          devices=[{"device": p.participant, "seconds": s,
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
        local = assign_shards(cluster, plan, params, settings, device)
    except BaseException:
        cluster.end_run("master failed during setup")
        cluster.close()
        raise

    def finish() -> None:
        cluster.end_run("training finished")
        cluster.close()

    stage = build_stage(cluster, config, plan, local, finish, shapes)  # star or peer plane
    stage.settings, stage.device = settings, device
    stage.stop_on_worker_loss = config.on_worker_loss == "stop"
    stage.local_stage_factory = lambda: LocalConvStage(model, params, settings, device=device)
    rebalancer: Rebalancer | None = None
    if profiles:  # re-plans (recovery) use the planner over the participants left
        rebalancer = Rebalancer(profiles, traffic, [[s.kernels for s in row] for row in plan],
                                config.data_plane)
        planner, mode = rebalancer, config.split

        def replan(alive: set[str]) -> list[list[int]]:  # after a fault: only the survivors
            planner.restrict(alive)
            return split_for(mode, planner, alive)
        stage.replan = replan

    def replanned(counts: list[list[int]], reason: str) -> None:
        if rebalancer is not None:
            rebalancer.adopt(counts)
        names = [s.participant for s in stage.shards[0]]
        report(f"hetconv: re-plan ({reason}): " + "; ".join(
            f"layer {layer + 1}: " + ", ".join(f"{p} {c}" for p, c in zip(names, row))
            for layer, row in enumerate(counts)))
        metrics.write("replan", reason=reason, counts=[
            {"layer": layer, "devices": [{"device": p, "kernels": c}
                                         for p, c in zip(names, row)]}
            for layer, row in enumerate(counts)])
    stage.on_replan = replanned
    if rebalancer is not None:
        stage.join = JoinHandler(cluster, shapes, batch, config.wire_dtype, rebalancer,
                                 config.data_plane, report, config.split)
    if config.rebalancing and rebalancer is not None:
        stage.after_step = StepRebalancing(stage, rebalancer, settings, metrics, report)
    return stage
