"""What a worker refuses before it computes: pure checks of the master's requests.

A request that decodes can still be nonsense: a stride of 0, a negative padding or
batch-norm epsilon, kernels [5, 2), weights of the wrong shape, an input holding NaN
or Inf, or a calibration whose arrays could never travel in a training step (a 4 GiB
input). Each check here returns one line saying what is wrong (the message of the
``bad_request`` error reply) or None when the request may be served. No sockets, no
state, no clock: :func:`refusal` judges one message on its own and is called by the
session (worker/session.py) before a request reaches the compute thread;
:func:`conv_size_refusal` bounds a conv's arrays by what one frame may carry and is
also called by the service (worker/service.py) with a shard's own stride and padding.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from hetconv.config import WIRE_DTYPES
from hetconv.ops.conv_layer import POOLS
from hetconv.participant.samples.dense_replica import dense_refusal
from hetconv.protocol import (
    AssignDense,
    AssignPeers,
    AssignShard,
    BackwardRequest,
    CalibrateRequest,
    ForwardRequest,
    Message,
    PeerBackwardRequest,
    PeerForwardRequest,
    SampleBackwardChain,
    SampleBackwardRound,
    SampleEvaluation,
    SampleForwardChain,
    SampleForwardRound,
    SampleStepChain,
    SampleUpdateRound,
    limits,
)

MAX_CALIBRATION_REPEATS = 20
"""Most timed runs a ``CalibrateRequest`` may ask for."""
ACTIVATION_DTYPES = tuple(np.dtype(name) for name in WIRE_DTYPES)
"""Dtypes of x and dy on the wire (``hetconv.config.WIRE_DTYPES``)."""
STATE_DTYPE = np.dtype(np.float32)
"""Dtype of every array of an ``AssignShard`` (the master sends float32)."""
FINITE_CHUNK = 1 << 18
"""Values :func:`all_finite` checks at a time."""
VECTOR_NAMES = ("gamma", "beta", "running_mean", "running_var", "velocity_gamma",
                "velocity_beta")
"""The (K,) arrays of an ``AssignShard``."""


def refusal(message: Message) -> str | None:
    """Why the worker refuses ``message`` (one line, naming its type), or None."""
    match message:
        case AssignShard():
            reason = assign_shard_refusal(message)
        case CalibrateRequest():
            reason = calibrate_refusal(message)
        case ForwardRequest():
            reason = (_ids_refusal(message.layer, message.step, message.attempt, min_step=-1)
                      or activation_refusal("x", message.x))
        case BackwardRequest():
            reason = (_ids_refusal(message.layer, message.step, message.attempt, min_step=0)
                      or _rate_refusal(message.learning_rate)
                      or activation_refusal("dy", message.dy))
        case PeerForwardRequest():
            reason = (_ids_refusal(message.layer, message.step, message.attempt, min_step=-1)
                      or _at_least("pass_id", message.pass_id, 0)
                      or (None if message.x is None else activation_refusal("x", message.x)))
        case PeerBackwardRequest():
            reason = (_ids_refusal(message.layer, message.step, message.attempt, min_step=0)
                      or _at_least("pass_id", message.pass_id, 0)
                      or _rate_refusal(message.learning_rate)
                      or (None if message.dy is None else activation_refusal("dy", message.dy)))
        case SampleForwardRound():
            reason = (_ids_refusal(0, message.step, message.attempt, min_step=0)
                      or _at_least("total_batch", message.total_batch, 1)
                      or _update_refusal(message)
                      or (None if message.x is None else activation_refusal("x", message.x)))
        case SampleEvaluation():
            reason = (_ids_refusal(0, message.step, message.attempt, min_step=-1)
                      or _at_least("total_batch", message.total_batch, 1)
                      or _at_least("stop_layer", message.stop_layer, 1)
                      or activation_refusal("x", message.x))
        case SampleForwardChain() | SampleStepChain():
            reason = (_ids_refusal(0, message.step, message.attempt, min_step=0)
                      or _at_least("total_batch", message.total_batch, 1)
                      or _update_refusal(message)
                      or _chain_refusal(message.sync_id, message.members,
                                        message.member_samples, message.positions,
                                        message.stop_layer)
                      or _labels_refusal(message)
                      or (None if message.x is None else activation_refusal("x", message.x)))
        case SampleBackwardRound() | SampleUpdateRound():
            reason = (_ids_refusal(0, message.step, message.attempt, min_step=0)
                      or _rate_refusal(message.learning_rate)
                      or (_at_least("reduce_id", message.reduce_id, 0)
                          if isinstance(message, SampleBackwardRound) else None)
                      or _update_refusal(message)
                      or (None if not isinstance(message, SampleBackwardRound)
                          or message.dy is None else activation_refusal("dy", message.dy)))
        case SampleBackwardChain():
            reason = (_ids_refusal(0, message.step, message.attempt, min_step=0)
                      or _rate_refusal(message.learning_rate)
                      or _chain_refusal(message.sync_id, message.members)
                      or (None if message.dy is None else activation_refusal("dy", message.dy)))
        case AssignPeers():
            reason = assign_peers_refusal(message)
        case AssignDense():
            reason = dense_refusal(message)
        case _:
            reason = None
    return None if reason is None else f"{message.TYPE}: {reason}"


# --- one request type each ----------------------------------------------------------------
def assign_shard_refusal(request: AssignShard) -> str | None:
    """Kernels [kernel_start, kernel_stop) (an empty range drops the layer), settings in
    range, and arrays of the documented shapes (weight and velocity_weight (K, C, k, k),
    the rest (K,)), float32 and finite, with no negative running variance."""
    start, stop = request.kernel_start, request.kernel_stop
    if not 0 <= start <= stop:
        return f"kernels [{start}, {stop}): need 0 <= kernel_start <= kernel_stop"
    reason = (_at_least("layer", request.layer, 0) or _at_least("stride", request.stride, 1)
              or _at_least("padding", request.padding, 0) or _pool_refusal(request.pool)
              or _number_refusal("bn_eps", request.bn_eps, 0.0, math.inf, low_open=True)
              or _number_refusal("bn_momentum", request.bn_momentum, 0.0, 1.0)
              or _number_refusal("momentum", request.momentum, 0.0, 1.0)
              or _number_refusal("weight_decay", request.weight_decay, 0.0, math.inf))
    if reason is not None:
        return reason
    kernels = stop - start
    weight = request.weight
    if weight.ndim != 4 or weight.shape[0] != kernels or min(weight.shape[1:], default=0) < 1 \
            or weight.shape[2] != weight.shape[3]:
        return (f"weight of shape {tuple(weight.shape)}: need (K, C, k, k) with K = "
                f"{kernels} kernels and C, k at least 1")
    shapes = {"weight": weight.shape, "velocity_weight": weight.shape}
    shapes.update({name: (kernels,) for name in VECTOR_NAMES})
    for name, shape in shapes.items():
        array = getattr(request, name)
        if array.shape != shape or array.dtype != STATE_DTYPE:
            return (f"{name} is {array.dtype} of shape {tuple(array.shape)}, expected "
                    f"{STATE_DTYPE} of shape {tuple(shape)}")
        if not all_finite(array):
            return f"{name} holds NaN or Inf"
    if kernels and float(np.min(request.running_var)) < 0:
        return "running_var holds a negative variance"
    return None


def calibrate_refusal(request: CalibrateRequest) -> str | None:
    """Positive sizes, a repeat count of 1 to ``MAX_CALIBRATION_REPEATS``, a known pool,
    and arrays no bigger than a training step of that layer could carry."""
    for name in ("batch", "in_channels", "height", "width", "kernels", "kernel_size",
                 "stride", "repeats"):
        reason = _at_least(name, getattr(request, name), 1)
        if reason is not None:
            return reason
    reason = (_at_least("layer", request.layer, 0) or _at_least("padding", request.padding, 0)
              or _pool_refusal(request.pool))
    if reason is not None:
        return reason
    if request.repeats > MAX_CALIBRATION_REPEATS:
        return f"repeats must be 1..{MAX_CALIBRATION_REPEATS}, got {request.repeats}"
    return conv_size_refusal(request.batch, request.in_channels, request.height,
                             request.width, request.kernels, request.kernel_size,
                             request.stride, request.padding, request.pool)


def assign_peers_refusal(request: AssignPeers) -> str | None:
    """A known wire dtype and a peer timeout that is a real deadline."""
    if request.wire_dtype not in WIRE_DTYPES:
        return f"wire dtype {request.wire_dtype!r}, expected one of {WIRE_DTYPES}"
    return _number_refusal("timeout_s", request.timeout_s, 0.0, limits.MAX_RECV_TIMEOUT_S,
                           low_open=True)


# --- shared checks ------------------------------------------------------------------------
def activation_refusal(name: str, array: np.ndarray) -> str | None:
    """An activation or gradient (B, C, H, W) in a wire dtype, every value finite."""
    if array.ndim != 4:
        return f"{name} must be (B, C, H, W), got shape {tuple(array.shape)}"
    if array.dtype not in ACTIVATION_DTYPES:
        return f"{name} must be float32 or float16, got {array.dtype}"
    if not all_finite(array):
        return f"{name} holds NaN or Inf"
    return None


def conv_size_refusal(batch: int, channels: int, height: int, width: int, kernels: int,
                      kernel_size: int, stride: int, padding: int, pool: str = "none",
                      itemsize: int = 4) -> str | None:
    """Why a conv layer of these sizes is more than a training step may hold, or None.

    Input (B, C, H, W), its zero-padded copy (B, C, H+2p, W+2p) and output (B, K, H', W')
    of ``itemsize`` bytes a value (4: float32), and weights (K, C, k, k) of float32, must
    each fit in one frame (``limits.MAX_FRAME_BYTES``); the output must be at least 1x1
    (2x2 before a pooling).
    """
    out_h = (height + 2 * padding - kernel_size) // stride + 1
    out_w = (width + 2 * padding - kernel_size) // stride + 1
    if out_h < 1 or out_w < 1:
        return (f"a {kernel_size}x{kernel_size} kernel with padding {padding} does not fit "
                f"a {height}x{width} input")
    if pool != "none" and (out_h < 2 or out_w < 2):
        return f"2x2 pooling of a {out_h}x{out_w} output"
    sizes = {"input": (batch * channels * height * width, itemsize),
             "padded input": (batch * channels * (height + 2 * padding) * (width + 2 * padding),
                              itemsize),
             "output": (batch * kernels * out_h * out_w, itemsize),
             "weights": (kernels * channels * kernel_size * kernel_size, 4)}
    for what, (elements, size) in sizes.items():
        if elements * size > limits.MAX_FRAME_BYTES:
            return (f"the {what} would hold {elements * size} bytes, over the "
                    f"{limits.MAX_FRAME_BYTES}-byte limit of one array")
    return None


def all_finite(array: np.ndarray) -> bool:
    """Whether every value is finite, checked in chunks of ``FINITE_CHUNK`` values so
    that the temporary stays small (and in cache) whatever the array's size."""
    flat = array.reshape(-1)  # a view: arrays from the wire are contiguous
    for start in range(0, flat.size, FINITE_CHUNK):
        if not np.isfinite(flat[start:start + FINITE_CHUNK]).all():
            return False
    return True


def _ids_refusal(layer: int, step: int, attempt: int, min_step: int) -> str | None:
    return (_at_least("layer", layer, 0) or _at_least("step", step, min_step)
            or _at_least("attempt", attempt, 0))


def _rate_refusal(learning_rate: float) -> str | None:
    return _number_refusal("learning_rate", learning_rate, 0.0, math.inf)


def _pool_refusal(pool: str) -> str | None:
    return None if pool in POOLS else f"pool must be one of {POOLS}, got {pool!r}"


def _update_refusal(message: SampleForwardRound | SampleForwardChain | SampleStepChain
                    | SampleBackwardRound | SampleUpdateRound) -> str | None:
    """The update a request carries: ids >= 0, the contributors distinct participant
    ids (the codec bounds the list's length), and an update of several layers reduced
    among the peers."""
    update_id, contributors = message.update_id, message.contributors
    reason = _at_least("update_id", update_id, 0)
    if reason is not None:
        return reason
    if not all(isinstance(c, str) and c for c in contributors) \
            or len(set(contributors)) != len(contributors):
        return "contributors must be distinct participant ids"
    if update_id > 0 and not contributors:
        return "a reduction among the peers needs its contributors"
    if message.update_stop > message.update_layer + 1 and (
            message.update_layer < 0 or update_id <= 0):
        return "an update of several layers is reduced among the peers (update_id > 0)"
    return None


def _labels_refusal(message: SampleForwardChain | SampleStepChain) -> str | None:
    """Labels come only in a step chain, with the x of a member's slice."""
    labels = message.labels
    if labels is None:
        return None
    if message.x is None:
        return "labels come only with a member's x in a step chain"
    if labels.dtype.kind not in "iu" or labels.shape != (message.x.shape[0],):
        return f"labels must be integer class ids, one per sample of x ({message.x.shape[0]})"
    return None


def _chain_refusal(sync_id: int, members: list[Any], samples: list[Any] | None = None,
                   positions: list[Any] | None = None, layers: int = 0) -> str | None:
    """The sample split's chain (hetconv/participant/samples/chain.py): ``sync_id`` >= 1,
    distinct member ids and, forward, one sample count (>= 1) per member and one
    position count (>= 1) per layer run."""
    reason = _at_least("sync_id", sync_id, 1)
    if reason is not None:
        return reason
    if not members or not all(isinstance(m, str) and m for m in members) \
            or len(set(members)) != len(members):
        return "a chain needs its members, distinct participant ids"
    if samples is not None and (len(samples) != len(members) or not all(
            type(n) is int and n >= 1 for n in samples)):
        return "member_samples must give each member's samples (>= 1)"
    if positions is not None and (len(positions) != layers or not all(
            type(n) is int and n >= 1 for n in positions)):
        return f"positions must give each of the {layers} layers' output positions (>= 1)"
    return None


def _at_least(name: str, value: int, low: int) -> str | None:
    return None if value >= low else f"{name} must be at least {low}, got {value}"


def _number_refusal(name: str, value: float, low: float, high: float,
                    low_open: bool = False) -> str | None:
    """``value`` finite and in [low, high] ((low, high] when ``low_open``)."""
    above = value > low if low_open else value >= low
    if math.isfinite(value) and above and value <= high:
        return None
    bracket = "(" if low_open else "["
    return f"{name} must be a finite number in {bracket}{low:g}, {high:g}], got {value!r}"
