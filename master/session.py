"""Opening a distributed run: membership, calibration, split, shard assignment.

:func:`open_distributed_stage` is what ``hetconv train --listen`` calls: it waits
for the workers, calibrates every device on every conv layer, prints and records
the kernel split, sends every worker its shards (the seeded initial weights) and
returns the :class:`DistributedConvStage` the trainer drives.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np

from hetconv.backend import array_module_for
from hetconv.device_info import describe_device
from hetconv.errors import UserError
from hetconv.keys import server_keys
from hetconv.metrics import MetricsWriter
from hetconv.model import ModelConfig, conv_layer_shapes
from hetconv.shard import BlockSettings, ConvShard
from master.calibration import MASTER, Participant, calibrate, format_split, split_layers
from master.cluster import Cluster, ClusterSettings
from master.offload import DistributedConvStage, Part
from protocol import AssignShard


def open_cluster(args: argparse.Namespace, report: Callable[[str], None] = print) -> tuple[
        Cluster, list[Participant]]:
    """Bind, wait for ``--min-workers`` and list the participants (master first)."""
    if args.min_workers < 0:
        raise UserError("--min-workers must be >= 0")
    if args.no_local and args.min_workers < 1:
        raise UserError("--no-local needs at least one worker (--min-workers 1 or more)")
    curve = None
    if getattr(args, "curve_secret", None) or getattr(args, "curve_allow", None):
        if not (args.curve_secret and args.curve_allow):
            raise UserError("CURVE needs both --curve-secret (the master's NAME.key_secret) "
                            "and --curve-allow (a directory of worker NAME.key files)")
        curve = server_keys(args.curve_secret, args.curve_allow)
    cluster = Cluster(args.listen, ClusterSettings(), curve)
    try:
        members = cluster.wait_for_workers(args.min_workers, args.wait, report)
    except BaseException:
        cluster.close()
        raise
    participants = []
    if not args.no_local:
        participants.append(Participant(MASTER, None,
                                        describe_device(args.device, threads=args.threads)))
    participants += [Participant(w.worker_id, w, w.device) for w in members]
    return cluster, participants


def assign_shards(cluster: Cluster, plan: list[list[Part]], params: dict[str, np.ndarray],
                  settings: BlockSettings, xp: Any) -> dict[int, ConvShard]:
    """Send each worker its kernel slices; build the master's own shards."""
    local: dict[int, ConvShard] = {}
    pending = {}
    for layer, parts in enumerate(plan):
        prefix = f"conv{layer}."
        for part in parts:
            state = {name: params[prefix + name][part.start:part.stop]
                     for name in ("weight", "gamma", "beta", "running_mean", "running_var")}
            if part.worker is None:
                local[layer] = ConvShard(layer, part.start, part.stop, settings, state, xp)
                continue
            if part.kernels == 0:
                continue
            rid = cluster.request_id()
            cluster.send(part.worker, AssignShard(
                request_id=rid, layer=layer, kernel_start=part.start, kernel_stop=part.stop,
                stride=settings.stride, padding=settings.padding, need_dx=layer > 0,
                bn_momentum=settings.bn_momentum, bn_eps=settings.bn_eps,
                momentum=settings.momentum, weight_decay=settings.weight_decay,
                velocity_weight=np.zeros_like(state["weight"]),
                velocity_gamma=np.zeros_like(state["gamma"]),
                velocity_beta=np.zeros_like(state["beta"]),
                **{k: np.ascontiguousarray(v) for k, v in state.items()}))
            pending[rid] = part.worker
    cluster.gather(pending, "shard assignment")
    return local


def open_distributed_stage(args: argparse.Namespace, model: ModelConfig,
                           params: dict[str, np.ndarray], settings: BlockSettings,
                           metrics: MetricsWriter,
                           report: Callable[[str], None] = print) -> DistributedConvStage:
    shapes = conv_layer_shapes(model)
    cluster, participants = open_cluster(args, report)
    try:
        metrics.write("devices", devices=[{"id": p.device, **p.description}
                                          for p in participants])
        xp = array_module_for(args.device)
        calibration = calibrate(cluster, participants, shapes, args.batch, xp, report=report)
        plan = split_layers(participants, shapes, calibration, args.split)
        for shape, cal, parts in zip(shapes, calibration, plan):
            metrics.write("calibration", layer=shape.index, split=args.split,
                          calibrated_kernels=cal.calibrated_kernels, kernels=shape.kernels,
                          small_kernels=cal.small_kernels,
                          devices=[{"device": p.device, "seconds": s, "small_seconds": small,
                                    "fixed_s": model[0], "per_kernel_s": model[1],
                                    "kernels": part.kernels, "kernel_start": part.start,
                                    "kernel_stop": part.stop,
                                    "share": part.kernels / shape.kernels}
                                   for p, s, small, model, part in zip(
                                       participants, cal.seconds, cal.small_seconds,
                                       cal.cost_models(), parts)])
        for line in format_split(plan, shapes):
            report(line)
        local = assign_shards(cluster, plan, params, settings, xp)
    except BaseException:
        cluster.end_run("master failed during setup")
        cluster.close()
        raise

    def finish() -> None:
        cluster.end_run("training finished")
        cluster.close()

    return DistributedConvStage(cluster, plan, local, finish,
                                wire_dtype=getattr(args, "wire_dtype", "float32"))
