"""The sample split's rounds, a participant's side: one request each, through the master.

Under the star data plane the master drives each step as rounds (docs/sample-split.md):
a forward round finishes one layer with the whole batch's statistics and starts the
next on this participant's slice; a backward round does the same with the batch-norm
sums. An evaluation runs every layer on a slice; an update round only applies the
pending update. Each computes over the participant's
:class:`~hetconv.participant.samples.layers.SliceLayers`.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from hetconv.engine.routing import ForwardRoute
from hetconv.engine.shard import ConvShard
from hetconv.participant.samples.layers import (
    SampleRequestError,
    SliceLayers,
    checked_vector,
    compute_seconds,
    tests_delay,
)
from hetconv.participant.wire_cast import to_wire
from hetconv.protocol import (
    ERR_BAD_REQUEST,
    SampleBackwardReply,
    SampleBackwardRound,
    SampleEvaluation,
    SampleForwardReply,
    SampleForwardRound,
    SampleUpdateRound,
)


def forward_round(held: SliceLayers, request: SampleForwardRound,
                  shards: Mapping[int, ConvShard]) -> SampleForwardReply:
    """One forward round of a training step: finish one layer with the whole batch's
    statistics, start the next on this slice, the update riding along."""
    started = time.perf_counter()
    begun = held.begin_update(shards, request)
    uses_update = request.update_layer in (request.finish_layer, request.start_layer)
    if uses_update:
        held.finish_update(shards, request, begun)
    finished: np.ndarray | None = None
    if request.finish_layer >= 0:
        replica = held.replica(shards, request.finish_layer)
        kernels = replica.shard.kernels
        mean = var = None
        if request.mean is not None or request.var is not None:
            mean = checked_vector(request.mean, "mean", kernels, request.finish_layer)
            var = checked_vector(request.var, "var", kernels, request.finish_layer)
        if not replica.started and request.start_layer < 0 and mean is not None \
                and var is not None:
            # no samples of this step here: only the running statistics move
            if request.total_count < 1:
                raise SampleRequestError(ERR_BAD_REQUEST, "total_count must be >= 1")
            replica.follow_statistics(mean, var, request.total_count)
        else:
            try:
                finished = replica.finish_forward(mean, var)
            except RuntimeError as error:  # no forward started: a round out of order
                raise SampleRequestError(ERR_BAD_REQUEST, str(error)) from None
            hook = getattr(replica.shard, "corrupt_output", None)  # tests' broken worker (FaultyShard)
            if hook is not None:
                finished = hook(finished)
            held.activation = finished
    count, total, m2 = 0, None, None
    if request.start_layer >= 0:
        x = request.x if request.x is not None else held.activation
        if x is None:
            raise SampleRequestError(ERR_BAD_REQUEST, f"layer {request.start_layer}: no "
                                     "input (no x and no layer finished before)")
        if request.x is not None:
            held.wire_dtype = request.x.dtype
        if request.total_batch < x.shape[0]:
            raise SampleRequestError(ERR_BAD_REQUEST, f"total_batch {request.total_batch} "
                                     f"is smaller than this slice's {x.shape[0]} samples")
        layer = request.start_layer
        replica = held.replica(shards, layer)
        _check_input(x, replica, layer)
        tests_delay(replica.shard)
        try:
            moments = replica.start_forward(x, request.total_batch, True)
        except ValueError:
            if request.x is not None:
                raise  # the master's input: a bad request
            # this participant's own previous output does not fit the layer: its
            # results are wrong; say so with moments over no values (the master
            # evicts a participant whose moments miss its slice's values)
            kernels = replica.shard.kernels
            moments = (0, np.zeros(kernels, np.float32), np.zeros(kernels, np.float32))
        if moments is not None:
            count, total, m2 = moments
    if not uses_update:  # the gather's wait overlapped this round's compute
        held.finish_update(shards, request, begun)
    y = None
    if request.return_output:
        if finished is None:
            raise SampleRequestError(ERR_BAD_REQUEST, "return_output without a finished "
                                     "layer")
        y = to_wire(finished, held.wire_dtype)
    figures = held.peer_figures()
    return SampleForwardReply(request_id=request.request_id, step=request.step,
                              attempt=request.attempt,
                              compute_s=compute_seconds(started, figures), count=int(count),
                              total=total, m2=m2, y=y, **figures)


def evaluation_round(held: SliceLayers, request: SampleEvaluation,
                     shards: Mapping[int, ConvShard]) -> SampleForwardReply:
    """Layers [0, stop_layer) in evaluation mode on this slice; the last one's output."""
    started = time.perf_counter()
    x = request.x
    held.wire_dtype = x.dtype
    if request.total_batch < x.shape[0]:
        raise SampleRequestError(ERR_BAD_REQUEST, f"total_batch {request.total_batch} "
                                 f"is smaller than this slice's {x.shape[0]} samples")
    stop = max(request.stop_layer, 1)
    route = ForwardRoute(held.routing(shards, stop), x)  # a residual network's shortcuts
    for layer in range(0, stop):
        replica = held.replica(shards, layer)
        x = route.input(layer)
        _check_input(x, replica, layer)
        x = route.output(layer, replica.forward_eval(x))
    held.activation = x
    figures = held.peer_figures()
    return SampleForwardReply(request_id=request.request_id, step=request.step,
                              attempt=request.attempt,
                              compute_s=compute_seconds(started, figures), count=0,
                              total=None, m2=None, y=to_wire(x, held.wire_dtype), **figures)


def _check_input(x: np.ndarray, replica: Any, layer: int) -> None:
    weight = replica.shard.state["weight"]
    if x.ndim != 4 or x.shape[1] != weight.shape[1]:
        raise SampleRequestError(ERR_BAD_REQUEST, f"layer {layer}: input of shape "
                                 f"{tuple(x.shape)} does not match its weights")


def backward_round(held: SliceLayers, request: SampleBackwardRound,
                   shards: Mapping[int, ConvShard]) -> SampleBackwardReply:
    """One backward round: the update riding along, finish one layer with the whole
    batch's sums, start the next layer's sums on this slice."""
    started = time.perf_counter()
    begun = held.begin_update(shards, request)
    uses_update = request.update_layer in (request.finish_layer, request.start_layer)
    if uses_update:
        held.finish_update(shards, request, begun)
    dweight_out = None
    if request.finish_layer >= 0:
        replica = held.replica(shards, request.finish_layer)
        kernels = replica.shard.kernels
        dgamma = checked_vector(request.dgamma, "dgamma", kernels, request.finish_layer)
        dbeta = checked_vector(request.dbeta, "dbeta", kernels, request.finish_layer)
        try:
            held.gradient, dweight_out = replica.finish_backward(
                dgamma, dbeta, need_dx=request.finish_layer > 0)
        except RuntimeError as error:
            raise SampleRequestError(ERR_BAD_REQUEST, str(error)) from None
        if request.reduce_id > 0 and dweight_out is not None:
            held.peers().scatter(request.reduce_id, request.step, request.finish_layer,
                                  dweight_out)
            dweight_out = None
    sums: tuple[np.ndarray | None, np.ndarray | None] = (None, None)
    if request.start_layer >= 0:
        replica = held.replica(shards, request.start_layer)
        dy = request.dy if request.dy is not None else held.gradient
        if dy is None:
            raise SampleRequestError(ERR_BAD_REQUEST, f"layer {request.start_layer}: no dy")
        tests_delay(replica.shard)
        try:
            sums = replica.start_backward(dy)
        except (RuntimeError, ValueError) as error:
            raise SampleRequestError(ERR_BAD_REQUEST, str(error)) from None
    if not uses_update:  # the gather's wait overlapped this round's compute
        held.finish_update(shards, request, begun)
    figures = held.peer_figures()
    return SampleBackwardReply(request_id=request.request_id, step=request.step,
                               attempt=request.attempt,
                               compute_s=compute_seconds(started, figures),
                               dweight=dweight_out, dgamma=sums[0], dbeta=sums[1],
                               **figures)


def update_round(held: SliceLayers, request: SampleUpdateRound,
                 shards: Mapping[int, ConvShard]) -> SampleBackwardReply:
    """The pending update, nothing else."""
    started = time.perf_counter()
    held.finish_update(shards, request, held.begin_update(shards, request))
    figures = held.peer_figures()
    return SampleBackwardReply(request_id=request.request_id, step=request.step,
                               attempt=request.attempt,
                               compute_s=compute_seconds(started, figures),
                               dweight=None, dgamma=None, dbeta=None, **figures)
