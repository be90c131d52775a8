"""Calibrating every device for every conv layer, then splitting the kernels.

Each participant (the master's own device unless ``--no-local``, then the workers)
times one block forward + backward at the layer's real shape: the run's batch,
input channels and spatial size, with an equal share of the layer's kernels (the
size a device will roughly own). Devices calibrate concurrently, as they will
compute during training. The split itself is pure (``hetconv.partition``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from hetconv.calibration import time_block
from hetconv.model import ConvLayerShape
from hetconv.partition import equal_counts, kernel_counts, kernel_ranges
from master.cluster import Cluster, WorkerHandle
from master.offload import MASTER, Part
from protocol import CalibrateRequest

CALIBRATION_REPEATS = 2


@dataclass(frozen=True)
class Participant:
    device: str  # "master" or the worker id
    worker: WorkerHandle | None
    description: dict[str, Any]


@dataclass(frozen=True)
class LayerCalibration:
    layer: int
    calibrated_kernels: int
    seconds: list[float]  # per participant, same order


def calibrate(cluster: Cluster, participants: list[Participant], shapes: list[ConvLayerShape],
              batch: int, local_device_xp: Any, repeats: int = CALIBRATION_REPEATS,
              report: Callable[[str], None] = print) -> list[LayerCalibration]:
    """Time every participant on every layer (concurrently per layer)."""
    results = []
    for shape in shapes:
        kernels = max(1, math.ceil(shape.kernels / len(participants)))
        pending: dict[int, WorkerHandle] = {}
        order: dict[int, int] = {}
        for index, participant in enumerate(participants):
            if participant.worker is None:
                continue
            rid = cluster.request_id()
            cluster.send(participant.worker, CalibrateRequest(
                request_id=rid, layer=shape.index, batch=batch, in_channels=shape.in_channels,
                height=shape.height, width=shape.width, kernels=kernels,
                kernel_size=shape.kernel_size, stride=1, padding=shape.padding,
                repeats=repeats))
            pending[rid] = participant.worker
            order[rid] = index
        seconds = [0.0] * len(participants)
        local_index = next((i for i, p in enumerate(participants) if p.worker is None), None)
        if local_index is not None:
            # Timed while the workers calibrate too: that is how training will run.
            seconds[local_index] = time_block(batch, shape.in_channels, shape.height,
                                              shape.width, kernels, shape.kernel_size,
                                              padding=shape.padding, repeats=repeats,
                                              xp=local_device_xp)
        replies = cluster.gather(pending, f"calibration of layer {shape.index + 1}")
        for rid, reply in replies.items():
            seconds[order[rid]] = float(reply.message.seconds)
        results.append(LayerCalibration(shape.index, kernels, seconds))
        report(f"hetconv: calibrated layer {shape.index + 1} ({shape.kernels} kernels, "
               f"{kernels} per device timed): " + ", ".join(
                   f"{p.device} {s * 1000:.1f} ms" for p, s in zip(participants, seconds)))
    return results


def split_layers(participants: list[Participant], shapes: list[ConvLayerShape],
                 calibration: list[LayerCalibration], mode: str) -> list[list[Part]]:
    """Kernel ranges per layer per participant ('calibrated' or 'equal' split)."""
    plan = []
    for shape, cal in zip(shapes, calibration):
        counts = (kernel_counts(cal.seconds, shape.kernels) if mode == "calibrated"
                  else equal_counts(len(participants), shape.kernels))
        plan.append([Part(p.device, p.worker, start, stop)
                     for p, (start, stop) in zip(participants, kernel_ranges(counts))])
    return plan


def format_split(plan: list[list[Part]], shapes: list[ConvLayerShape]) -> list[str]:
    """Human-readable lines: the kernels each device got per layer."""
    lines = []
    for shape, parts in zip(shapes, plan):
        cells = ", ".join(f"{p.device} {p.kernels} ({100 * p.kernels / shape.kernels:.0f}%)"
                          for p in parts)
        lines.append(f"hetconv: layer {shape.index + 1} split of {shape.kernels} kernels: {cells}")
    return lines


__all__ = ["MASTER", "Participant", "LayerCalibration", "calibrate", "split_layers",
           "format_split"]
