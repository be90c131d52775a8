"""Calibrating every participant on every conv layer (the split is master/split.py).

Each participant (the master's own device unless ``--no-local``, then the workers)
times one block forward + backward at the layer's real shape: the run's batch,
input channels and spatial size, with an equal share of the layer's kernels (the
size a participant will roughly own) and with a quarter of that share, which separates
the fixed cost of a share (unfolding the input, folding dx back) from the cost per
kernel. Participants calibrate concurrently, as they will compute during training.
The split itself is pure (``master/split.py`` over ``hetconv.partition``).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from hetconv.calibration import time_block
from hetconv.master.cluster import Cluster, WorkerHandle
from hetconv.master.plan import Participant
from hetconv.model import ConvLayerShape
from hetconv.partition import fit_affine
from hetconv.protocol import CalibrateReply, CalibrateRequest

CALIBRATION_REPEATS = 2


@dataclass(frozen=True)
class LayerCalibration:
    """Block forward+backward seconds per participant at two kernel counts."""

    layer: int
    calibrated_kernels: int  # an equal share of the layer
    seconds: list[float]  # per participant, at calibrated_kernels
    small_kernels: int  # a quarter of that, for the fixed-cost fit
    small_seconds: list[float]

    def cost_models(self) -> list[tuple[float, float]]:
        """(fixed seconds, seconds per kernel) per participant."""
        return [fit_affine(self.small_kernels, small, self.calibrated_kernels, large)
                for small, large in zip(self.small_seconds, self.seconds)]


def calibrate(cluster: Cluster, participants: list[Participant], shapes: list[ConvLayerShape],
              batch: int, repeats: int = CALIBRATION_REPEATS,
              report: Callable[[str], None] = print) -> list[LayerCalibration]:
    """Time every participant on every layer (concurrently per layer).

    The master's own device is the one its participant describes (``description
    ["device"]``, ``cpu`` or ``gpu:N``), timed as a real step: transfers included.
    """
    results = []
    for shape in shapes:
        kernels = max(1, math.ceil(shape.kernels / len(participants)))
        small = max(1, kernels // 4)
        pending: dict[int, WorkerHandle] = {}
        order: dict[int, tuple[int, int]] = {}
        for index, participant in enumerate(participants):
            if participant.worker is None:
                continue
            for count in (kernels, small):
                rid = cluster.request_id()
                cluster.send(participant.worker, CalibrateRequest(
                    request_id=rid, layer=shape.index, batch=batch,
                    in_channels=shape.in_channels, height=shape.height, width=shape.width,
                    kernels=count, kernel_size=shape.kernel_size, stride=shape.stride,
                    padding=shape.padding, repeats=repeats, pool=shape.pool,
                    batch_norm=shape.batch_norm))
                pending[rid] = participant.worker
                order[rid] = (index, count)
        timings: dict[tuple[int, int], float] = {}
        local_index = next((i for i, p in enumerate(participants) if p.worker is None), None)
        if local_index is not None:
            # Timed while the workers calibrate too: that is how training will run.
            local_device = str(participants[local_index].description.get("device", "cpu"))
            for count in (kernels, small):
                timings[(local_index, count)] = time_block(
                    batch, shape.in_channels, shape.height, shape.width, count,
                    shape.kernel_size, padding=shape.padding, stride=shape.stride,
                    repeats=repeats, device=local_device, pool=shape.pool,
                    batch_norm=shape.batch_norm)
        replies = cluster.gather(pending, f"calibration of layer {shape.index + 1}")
        for rid, reply in replies.items():
            assert isinstance(reply.message, CalibrateReply)
            timings[order[rid]] = float(reply.message.seconds)
        seconds = [timings[(i, kernels)] for i in range(len(participants))]
        small_seconds = [timings[(i, small)] for i in range(len(participants))]
        results.append(LayerCalibration(shape.index, kernels, seconds, small, small_seconds))
        report(f"hetconv: calibrated layer {shape.index + 1} ({shape.kernels} kernels; "
               f"{kernels} / {small} per participant timed): " + ", ".join(
                   f"{p.participant} {s * 1000:.1f} / {t * 1000:.1f} ms"
                   for p, s, t in zip(participants, seconds, small_seconds)))
    return results
