"""How much memory a training step needs, estimated before the run starts.

A conv layer keeps, from its forward pass to its backward pass (float32, B samples, the
layer's K kernels of C x k x k over an H x W input, a Ho x Wo output, a Hp x Wp pooled one):
its padded input (B C (H+2p)(W+2p)), its conv output and what batch norm, the ReLU and the
pool keep of it (about 3 B K Ho Wo: the rows, the normalised values or masks, the pooled
winners), and its output (B K Hp Wp). Its backward pass adds the gradients in flight (B C H
W for dx, B K Hp Wp for dy), and it holds its weight, velocity and weight gradient
(3 K C k k) throughout. Every layer's forward arrays are alive at the peak (the start of
the backward pass), so the need is their sum plus the dense part's arrays (3 x its
values) and the batch's images. A Winograd layer keeps its transformed input instead of the padded
one (a*a/(m*m) times its output positions).

Measured against tracemalloc's peak over the first two steps (tests/unit/test_memory.py):
0.54x-1.19x on the networks there (the conv kernels' per-thread scratch and chunk buffers,
a few tens of MB, are not modelled). So the check is one-sided: a network is refused
(``check_fits``, one line, before anything starts) only where even this estimate exceeds
the memory available, instead of swelling until the machine swaps or the kernel kills
the run; one that is refused would not have fit.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hetconv.errors import UserError
from hetconv.model import ConvLayerShape

FLOAT_BYTES = 4
USABLE = 0.9
"""The share of the available memory a run may plan to use."""


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes a training step holds at its peak, and the layer that holds the most."""

    total: int
    largest_layer: int  # index of the conv layer with the most bytes
    largest: int


def _kept_input(shape: ConvLayerShape, batch: int, kernels: int) -> int:
    """Values of the input the conv keeps for its backward pass: the padded input, or
    where it runs as Winograd the transformed input V (a*a, C, tiles), a*a/(m*m) times the
    output's positions (hetconv.ops.conv picks the algorithm the same way)."""
    from hetconv.ops import conv, conv_winograd
    from hetconv.ops.conv_chunks import SHIFTED_TAPS
    from hetconv.ops.conv_geometry import choose_layout, make_geometry

    channels = shape.in_channels
    padded = batch * channels * (shape.height + 2 * shape.padding) * (
        shape.width + 2 * shape.padding)
    if not kernels:
        return padded
    geometry = make_geometry((batch, channels, shape.height, shape.width),
                             (kernels, channels, shape.kernel_size, shape.kernel_size),
                             shape.stride, shape.padding)
    smallest = conv.WINOGRAD_MIN_CHANNELS.get(shape.kernel_size, channels + 1)
    if conv_winograd.supported(geometry) and min(channels, kernels) >= smallest \
            and choose_layout(geometry) != SHIFTED_TAPS:
        size, _, tiles = conv_winograd.transformed_input_shape(geometry)
        return batch * size * channels * tiles
    return padded


def layer_bytes(shape: ConvLayerShape, batch: int, kernels: int | None = None) -> int:
    """Bytes conv layer ``shape`` holds for ``batch`` samples and ``kernels`` of its
    kernels (all by default): see the module doc."""
    k = shape.kernels if kernels is None else kernels
    channels = shape.in_channels
    padded = _kept_input(shape, batch, k)
    conv = batch * k * shape.conv_height * shape.conv_width
    out = batch * k * shape.pooled_height * shape.pooled_width
    weights = k * channels * shape.kernel_size ** 2
    gradients = batch * channels * shape.height * shape.width + out
    return FLOAT_BYTES * (padded + 3 * conv + out + gradients + 3 * weights)


def workspace_bytes(shape: ConvLayerShape, batch: int, kernels: int | None = None) -> int:
    """Bytes conv layer ``shape``'s backward pass allocates while it runs, beyond what
    the layer keeps: where it runs as Winograd, the gradient of its transformed input
    (dV, as large as V; the padded input's gradient is counted by :func:`layer_bytes`),
    one layer at a time (measured: a 1024-to-342-kernel 3x3
    layer at batch 128 peaks at 4.0 GB, 1.85 GB kept + 1.64 GB dV)."""
    k = shape.kernels if kernels is None else kernels
    kept = _kept_input(shape, batch, k)
    padded = batch * shape.in_channels * (shape.height + 2 * shape.padding) * (
        shape.width + 2 * shape.padding)
    # the padded input's gradient is the ``gradients`` term of layer_bytes already
    return FLOAT_BYTES * kept if kept != padded else 0


def step_need(shapes: Sequence[ConvLayerShape], batch: int, dense_values: int = 0
              ) -> MemoryNeed:
    """The whole step's need on one participant holding every layer for ``batch``
    samples (the local run, the sample split's slice) with a dense part of
    ``dense_values`` values: every layer's kept arrays, the largest one layer's
    backward workspace (layers run one at a time), the dense part and the images."""
    per_layer = [layer_bytes(shape, batch) for shape in shapes]
    largest = max(range(len(per_layer)), key=per_layer.__getitem__)
    first = shapes[0]
    images = FLOAT_BYTES * batch * first.in_channels * first.height * first.width
    workspace = max(workspace_bytes(shape, batch) for shape in shapes)
    total = sum(per_layer) + workspace + 3 * FLOAT_BYTES * dense_values + images
    return MemoryNeed(total, largest, per_layer[largest])


def calibration_bytes(request: Any) -> int:
    """Bytes a worker needs to time one layer as a ``CalibrateRequest`` asks (its
    forward and backward at the request's batch and kernels)."""
    from hetconv.ops.conv_layer import conv_output_size

    conv_h = conv_output_size(request.height, request.kernel_size, request.stride,
                              request.padding)
    conv_w = conv_output_size(request.width, request.kernel_size, request.stride,
                              request.padding)
    pooled = (conv_h // 2, conv_w // 2) if request.pool != "none" else (conv_h, conv_w)
    shape = ConvLayerShape(request.layer, request.in_channels, request.height, request.width,
                           request.kernels, request.kernel_size, request.padding, conv_h,
                           conv_w, pooled[0], pooled[1], request.stride, request.pool)
    return layer_bytes(shape, request.batch) + workspace_bytes(shape, request.batch)


def gib(count: int | float) -> str:
    return f"{count / 2**30:.1f} GiB"


def check_fits(need: MemoryNeed, available: int, batch: int, where: str = "this machine"
               ) -> None:
    """UserError (one line) when ``need`` exceeds USABLE of ``available`` bytes."""
    if need.total <= USABLE * available:
        return
    raise UserError(
        f"the network needs at least about {gib(need.total)} for a training step at batch {batch} "
        f"(conv layer {need.largest_layer + 1} alone {gib(need.largest)}); {where} has "
        f"{gib(available)} available: use a smaller --batch, fewer kernels, or more workers "
        "under --split-by kernels")


def available_bytes() -> int:
    """The memory this machine has available now (psutil)."""
    import psutil

    return int(psutil.virtual_memory().available)
