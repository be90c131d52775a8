"""Calibrating every participant on every conv layer (the split is master/kernels/split.py).

Each participant (the master's own device unless ``--no-local``, then the workers)
times one block forward + backward at the layer's real shape: the run's batch,
input channels and spatial size, with an equal share of the layer's kernels (the
size a participant will roughly own) and with a quarter of that share, which separates
the fixed cost of a share (unfolding the input, folding dx back) from the cost per
kernel. Participants calibrate concurrently, as they will compute during training.
The split itself is pure (``master/kernels/split.py`` over ``hetconv.planning.partition``).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from hetconv.errors import UserError
from hetconv.master.cluster import Cluster, WorkerHandle
from hetconv.master.plan import Participant
from hetconv.model import ConvLayerShape
from hetconv.participant.calibration import time_block
from hetconv.planning.memory import USABLE, available_bytes, calibration_bytes, gib
from hetconv.planning.partition import fit_affine
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


def calibrate_request(request_id: int, shape: ConvLayerShape, batch: int, kernels: int,
                      repeats: int) -> CalibrateRequest:
    """Time one block forward + backward of layer ``shape`` at ``batch`` x ``kernels``."""
    return CalibrateRequest(
        request_id=request_id, layer=shape.index, batch=batch, in_channels=shape.in_channels,
        height=shape.height, width=shape.width, kernels=kernels,
        kernel_size=shape.kernel_size, stride=shape.stride, padding=shape.padding,
        repeats=repeats, pool=shape.pool, batch_norm=shape.batch_norm)


def kernel_sizes(shape: ConvLayerShape, participants: int, batch: int) -> list[tuple[int, int]]:
    """The kernel split's (batch, kernels) timed per layer: an equal share of the layer's
    kernels among ``participants`` and a quarter of it, on the whole batch."""
    kernels = max(1, math.ceil(shape.kernels / max(participants, 1)))
    return [(batch, kernels), (batch, max(1, kernels // 4))]


def own_fit(shape: ConvLayerShape, batch: int, kernels: int, repeats: int) -> None:
    """UserError (one line) when the master's own device cannot hold the timing of
    ``kernels`` of layer ``shape`` at ``batch`` (as a worker refuses it)."""
    need = calibration_bytes(calibrate_request(0, shape, batch, kernels, repeats))
    available = available_bytes()
    if need > USABLE * available:
        raise UserError(f"the master cannot time layer {shape.index + 1} ({kernels} kernels, "
                        f"batch {batch}): it needs about {gib(need)} and this machine has "
                        f"{gib(available)} available: use a smaller --batch, fewer kernels, "
                        "or --no-local")


def _time_layer(cluster: Cluster, participants: list[Participant], shape: ConvLayerShape,
                sizes: list[tuple[int, int]], repeats: int) -> dict[tuple[int, int, int], float]:
    """Seconds of one block forward + backward of layer ``shape`` per (participant index,
    batch, kernels) for every (batch, kernels) in ``sizes``; the workers and the master's
    own device are timed concurrently, as they will compute during training. The master's
    own device is the one its participant describes (``description["device"]``)."""
    pending: dict[int, WorkerHandle] = {}
    order: dict[int, tuple[int, int, int]] = {}
    for index, participant in enumerate(participants):
        if participant.worker is None:
            continue
        for batch, count in sizes:
            rid = cluster.request_id()
            cluster.send(participant.worker, calibrate_request(rid, shape, batch, count,
                                                               repeats))
            pending[rid] = participant.worker
            order[rid] = (index, batch, count)
    timings: dict[tuple[int, int, int], float] = {}
    local_index = next((i for i, p in enumerate(participants) if p.worker is None), None)
    if local_index is not None:
        local_device = str(participants[local_index].description.get("device", "cpu"))
        for batch, count in sizes:
            own_fit(shape, batch, count, repeats)
            timings[(local_index, batch, count)] = time_block(
                batch, shape.in_channels, shape.height, shape.width, count,
                shape.kernel_size, padding=shape.padding, stride=shape.stride,
                repeats=repeats, device=local_device, pool=shape.pool,
                batch_norm=shape.batch_norm)
    replies = cluster.gather(pending, f"calibration of layer {shape.index + 1}")
    for rid, reply in replies.items():
        assert isinstance(reply.message, CalibrateReply)
        timings[order[rid]] = float(reply.message.seconds)
    return timings


def layer_calibration(shape: ConvLayerShape, participants: int, batch: int,
                      timings: dict[tuple[int, int, int], float]) -> LayerCalibration:
    """A layer's :class:`LayerCalibration` from timings by (participant index, batch,
    kernels) at :func:`kernel_sizes`."""
    (_, kernels), (_, small) = kernel_sizes(shape, participants, batch)
    return LayerCalibration(shape.index, kernels,
                            [timings[(i, batch, kernels)] for i in range(participants)],
                            small, [timings[(i, batch, small)] for i in range(participants)])


def calibrate(cluster: Cluster, participants: list[Participant], shapes: list[ConvLayerShape],
              batch: int, repeats: int = CALIBRATION_REPEATS,
              report: Callable[[str], None] = print) -> list[LayerCalibration]:
    """Time every participant on every layer (concurrently per layer), at an equal share
    of its kernels and a quarter of that, on the whole batch (the kernel split's shape).
    """
    results = []
    for shape in shapes:
        timings = _time_layer(cluster, participants, shape,
                              kernel_sizes(shape, len(participants), batch), repeats)
        calibration = layer_calibration(shape, len(participants), batch, timings)
        results.append(calibration)
        report(f"hetconv: calibrated layer {shape.index + 1} ({shape.kernels} kernels; "
               f"{calibration.calibrated_kernels} / {calibration.small_kernels} per "
               "participant timed): " + ", ".join(
                   f"{p.participant} {s * 1000:.1f} / {t * 1000:.1f} ms"
                   for p, s, t in zip(participants, calibration.seconds,
                                      calibration.small_seconds)))
    return results


def calibrate_samples(cluster: Cluster, participants: list[Participant],
                      shapes: list[ConvLayerShape], batch: int,
                      repeats: int = CALIBRATION_REPEATS,
                      report: Callable[[str], None] = print,
                      slice_samples: int | None = None) -> list[float]:
    """Per participant: seconds per sample of the whole conv chain under the sample
    split, timed in place: every layer whole (all its kernels) on an equal slice of the
    ``batch``, the shape a participant runs there. (The kernel calibration's share of
    the kernels scaled to the whole layer counts its fixed cost once per share and
    over-states the whole layer: 1.5x on 64:256 at 0.45 core.) ``slice_samples``: the
    slice to time (default: the batch over ``participants``; joiners: over the run's)."""
    size = slice_samples or max(1, math.ceil(batch / max(len(participants), 1)))
    totals = [0.0] * len(participants)
    for shape in shapes:
        timings = _time_layer(cluster, participants, shape, [(size, shape.kernels)], repeats)
        for index in range(len(participants)):
            totals[index] += timings[(index, size, shape.kernels)]
    report(f"hetconv: calibrated the sample split (every layer whole, {size} samples): "
           + ", ".join(f"{p.participant} {t * 1000:.1f} ms" for p, t in zip(participants, totals)))
    return [max(t, 1e-9) / size for t in totals]
