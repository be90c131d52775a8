"""The sample split's chain: a whole forward or backward pass in one request.

With the weight gradients reduced among the peers (``--data-plane peer``, the
default) the participants need the master for nothing between the layers of a step:
each layer's batch-norm statistics are exchanged among them directly
(:meth:`GradientExchange.share` / :meth:`~GradientExchange.collect`, phases
``moments`` and ``sums``), and every participant combines them itself in the order
of the ``members``, with the same functions as the master's rounds
(``moments_to_statistics``, ``add_in_order``), so every replica gets the same bits as
before. A step is then two requests per worker (one forward chain, one backward
chain) instead of 2L + 2 rounds through the master: each barrier costs one hop
between the peers, not a round trip through the master's loop.

forward chain  (x slice; the previous step's updates of every layer ride along)
    for each layer: the update (its ΣdW gathered) unless done already, conv on the
    slice -> moments, shared; while a peer's moments are out, the updates of the
    layers after it (the dense part's last); every member's moments combined ->
    finish (normalise, ReLU, pool); -> the last layer's output slice
backward chain (dy slice)
    for each layer from the last: batch-norm sums of the slice, shared; the layer
    above's dW_i computed and scattered to its owners (reduction ``sync_id``) while
    the sums travel; every member's sums added -> kept for the update; finish: dx now,
    dW_i at the next layer's barrier (layer 0: at once) -> nothing but the figures

Deferring dW_i fills each batch-norm barrier's wait with work that needs nothing from
the peers (``SampleReplica.finish_backward_split``): the participant shares its sums,
computes the layer above's weight gradient while they travel, and only then waits for
the peers' sums. The values are the one-part backward's (tested against it). The
forward's barriers are filled the same way with the updates of the layers after them:
each is applied, at the latest, before its own layer's forward, so the values do not
change, and a participant whose peers are late spends that time on work of its own
(the dense part's update, 1.05 M values in the VGG-style network, the largest).

A participant without samples in the step (not a member) runs no layer: it combines
the same moments and sums, follows the running statistics and keeps the sums, so its
replica stays equal to the others (the master, which always keeps a replica, too).

Slice statistics (``slice_statistics``, ``hetconv train --bn-statistics slice``: the
semantics of PyTorch DDP's per-rank batch norm): each member normalises its slice
with the slice's own mean and variance, and its backward uses the slice's own sums,
so no layer waits for a peer. The moments and sums still go to every peer, without a
wait: each participant collects them after its last layer, for what must stay equal
on every replica, the running statistics (the whole batch's, as under ``batch``) and
gamma's and beta's gradients (every slice's added in member order).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np

from hetconv.engine.dense_part import Rows
from hetconv.engine.routing import BackwardRoute, ForwardRoute, ForwardTape
from hetconv.engine.shard import ConvShard
from hetconv.participant.ports import PeerLost
from hetconv.participant.samples.dense_replica import as_labels
from hetconv.participant.samples.layers import (
    SampleRequestError,
    SliceLayers,
    compute_seconds,
    tests_delay,
)
from hetconv.participant.samples.outliers import check_scales, moments_scale
from hetconv.participant.samples.replica import add_in_order, moments_to_statistics
from hetconv.participant.samples.weight_reduce import PHASE_MOMENTS, PHASE_SUMS, GradientExchange
from hetconv.participant.wire_cast import to_wire
from hetconv.protocol import (
    ERR_BAD_REQUEST,
    SampleBackwardChain,
    SampleBackwardReply,
    SampleForwardChain,
    SampleForwardReply,
    SampleStepChain,
)


class LayerClock:
    """Each layer's seconds in a chain, less the waits for peers' pieces, and those
    waits apart (the figures of a step chain's reply): :meth:`start` at each layer,
    :meth:`stop` after the last."""

    def __init__(self, exchange: GradientExchange):
        self.exchange = exchange
        self.seconds: dict[int, float] = {}
        self.waits: dict[int, float] = {}
        self._open: tuple[int, float, float] | None = None

    def start(self, layer: int) -> None:
        self.stop()
        self._open = (layer, time.perf_counter(), self.exchange.wait_s)

    def stop(self) -> None:
        if self._open is not None:
            layer, began, waited = self._open
            wait = max(0.0, self.exchange.wait_s - waited)
            spent = time.perf_counter() - began - wait
            self.seconds[layer] = self.seconds.get(layer, 0.0) + max(0.0, spent)
            self.waits[layer] = self.waits.get(layer, 0.0) + wait
            self._open = None


def _members(request: SampleForwardChain | SampleStepChain | SampleBackwardChain) -> list[str]:
    members = [str(m) for m in request.members]
    if not members or len(set(members)) != len(members):
        raise SampleRequestError(ERR_BAD_REQUEST, "a chain needs its members, each once")
    return members


def _whole_batch(exchange: GradientExchange, request: SampleForwardChain | SampleStepChain, layer: int,
                 counts: Mapping[str, int], positions: int, own: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The whole batch's (mean, var) (K,) of ``layer``: every member's moments (this
    participant's ``own``, the others' collected) combined in member order."""
    pieces = exchange.collect(request.sync_id, layer, PHASE_MOMENTS, list(counts))
    if own is not None:
        pieces[exchange.participant] = own
    if len(pieces) > 1:  # a member far out of scale: its training-mode forward is wrong
        found = check_scales({m: moments_scale(pieces[m], counts[m] * positions)
                              for m in pieces}, exchange.participant,
                             f"batch-norm spread of layer {layer + 1}")
        if found is not None:
            raise PeerLost([found[0]], found[1], bad_data=True)
    return moments_to_statistics([(counts[m] * positions, pieces[m][0], pieces[m][1])
                                  for m in counts])


def _updates_while_waiting(held: SliceLayers, shards: Mapping[int, ConvShard],
                           request: SampleForwardChain | SampleStepChain,
                           begun: dict[int, np.ndarray | None] | None, pending: list[int],
                           layer: int, members: list[str]) -> None:
    """Inside ``layer``'s moments barrier (this participant's piece shared): apply the
    updates of the layers after it (the dense part's last) one by one while a peer's
    piece is still out, each only once its reduced gradient is in (a wait for it could
    outlast the barrier's). Each is due before its own layer's forward anyway, so the
    values are the same; the work moves out of the step's path into time spent waiting."""
    exchange = held.peers()
    while any(p > layer for p in pending) and not exchange.arrived(
            request.sync_id, layer, PHASE_MOMENTS, members):
        ready = next((p for p in pending if p > layer and (
            begun is None or exchange.ready_to_gather(request.update_id, p))), None)
        if ready is None:  # no update's pieces are in yet: wait for the barrier's
            return
        pending.remove(ready)
        held.finish_update(shards, request, begun, [ready])


def _forward_route(held: SliceLayers, shards: Mapping[int, ConvShard],
                   request: SampleForwardChain | SampleStepChain, x: np.ndarray) -> ForwardRoute:
    """This member's activations through the chain's layers (a residual network's
    shortcuts joined: hetconv/engine/routing.py)."""
    try:
        return ForwardRoute(held.routing(shards, request.stop_layer), x, request.start_layer)
    except ValueError as error:
        raise SampleRequestError(ERR_BAD_REQUEST, str(error)) from None


def _backward_route(held: SliceLayers, shards: Mapping[int, ConvShard], start_layer: int,
                    dy: np.ndarray) -> BackwardRoute:
    """This member's gradients from ``start_layer`` down (the joins of the forward pass
    kept in ``held.tape``)."""
    routing = held.routing(shards, start_layer + 1)
    tape, held.tape = held.tape, None
    if tape is None:
        if not routing.straight:
            raise SampleRequestError(ERR_BAD_REQUEST, "a residual network's backward chain "
                                     "without its forward chain")
        tape = ForwardTape({})
    try:
        return BackwardRoute(routing, tape, dy, start_layer)
    except ValueError as error:
        raise SampleRequestError(ERR_BAD_REQUEST, str(error)) from None


def forward_chain(held: SliceLayers, request: SampleForwardChain | SampleStepChain,
                  shards: Mapping[int, ConvShard]) -> SampleForwardReply:
    """Every layer of [start_layer, stop_layer) on this participant's slice (see the
    module doc); the reply carries the last layer's output (members only)."""
    started = time.perf_counter()
    exchange = held.peers()
    me = exchange.participant
    members = _members(request)
    counts = dict(zip(members, (int(n) for n in request.member_samples)))
    layers = range(request.start_layer, request.stop_layer)
    if len(counts) != len(members) or len(request.positions) != len(layers):
        raise SampleRequestError(ERR_BAD_REQUEST, "a forward chain trains, with one sample "
                                 "count per member and one position count per layer")
    begun = held.begin_update(shards, request)
    pending = list(held.update_layers(request))
    member = me in counts
    by_slice = request.slice_statistics
    later: dict[int, np.ndarray | None] = {}  # by slice: layer -> own moments, combined last
    x = request.x
    if member:
        if x is None or x.ndim != 4 or x.shape[0] != counts[me]:
            raise SampleRequestError(ERR_BAD_REQUEST, f"a member's chain needs its x of "
                                     f"{counts[me]} samples")
        held.wire_dtype = x.dtype
    clock = LayerClock(exchange)
    route = _forward_route(held, shards, request, x) if member and x is not None else None
    for index, layer in enumerate(layers):
        clock.start(layer)
        if layer in pending:
            pending.remove(layer)
            held.finish_update(shards, request, begun, [layer])
        replica = held.replica(shards, layer)
        positions = int(request.positions[index])
        own = None
        if member:
            assert route is not None
            x = route.input(layer)
            tests_delay(replica.shard)
            try:
                if x.shape[1] != replica.shard.state["weight"].shape[1]:
                    raise ValueError(f"an input of shape {tuple(x.shape)} does not match "
                                     "its weights")
                moments = replica.start_forward(
                    x, counts[me] if by_slice else request.total_batch, True)
            except ValueError as error:
                if layer == request.start_layer:  # the master's input: a bad request
                    raise SampleRequestError(ERR_BAD_REQUEST, f"layer {layer}: {error}") from None
                # this participant's own output does not fit the next layer: its results
                # are wrong, and it says so as bad data of its own (the master evicts it)
                raise PeerLost([me], f"its own output of layer {layer} has the wrong shape "
                               f"{tuple(x.shape)} for layer {layer + 1}: {error}",
                               bad_data=True) from None
            if moments is None:  # no batch norm: nothing to agree on
                x = route.output(layer, replica.finish_forward(None, None))
                continue
            count, total, m2 = moments
            if count != counts[me] * positions:
                raise SampleRequestError(ERR_BAD_REQUEST, f"layer {layer}: moments over {count} "
                                         f"values, expected {counts[me] * positions}")
            own = np.stack([total, m2])
            exchange.share(request.sync_id, request.step, layer, PHASE_MOMENTS, own)
        elif not replica.shard.settings.batch_norm:
            continue
        if by_slice:  # its own statistics now; the whole batch's after the last layer
            later[layer] = own
            if own is None:  # not a member: it follows once every moment is in
                continue
            mean, var = moments_to_statistics([(counts[me] * positions, own[0], own[1])])
        else:
            _updates_while_waiting(held, shards, request, begun, pending, layer, members)
            mean, var = _whole_batch(exchange, request, layer, counts, positions, own)
        if member:
            assert route is not None
            x = replica.finish_forward(mean, var, running=not by_slice)
            hook = getattr(replica.shard, "corrupt_output", None)  # tests' broken worker
            if hook is not None:
                x = hook(x)
            x = route.output(layer, x)
        else:
            replica.follow_statistics(mean, var, request.total_batch * positions)
    clock.stop()
    held.tape = route.tape if route is not None else None
    for layer, own in later.items():  # by slice: the running statistics, the whole batch's
        positions = int(request.positions[layer - request.start_layer])
        mean, var = _whole_batch(exchange, request, layer, counts, positions, own)
        held.replica(shards, layer).follow_statistics(mean, var,
                                                        request.total_batch * positions)
    held.finish_update(shards, request, begun, pending)
    if isinstance(request, SampleStepChain):
        return _dense_and_backward(held, request, shards, x, counts, started, clock)
    y = to_wire(x, held.wire_dtype) if member and request.return_output and x is not None \
        else None
    figures = held.peer_figures()
    return SampleForwardReply(request_id=request.request_id, step=request.step,
                              attempt=request.attempt, compute_s=compute_seconds(started, figures),
                              count=0, total=None, m2=None, y=y, **figures)


def _dense_and_backward(held: SliceLayers, request: SampleStepChain,
                        shards: Mapping[int, ConvShard], features: np.ndarray | None,
                        counts: Mapping[str, int], started: float,
                        forward: LayerClock) -> SampleForwardReply:
    """The rest of a step chain after the conv layers' forward: a member runs the dense
    part on its rows of the batch and scatters its gradient (layer ``stop_layer`` of
    reduction ``sync_id``), then every participant runs the backward chain."""
    dense = held.dense
    if dense is None or dense.layer != request.stop_layer:
        raise SampleRequestError(ERR_BAD_REQUEST, "a step chain needs the dense part "
                                 "(AssignDense) at the layer after the conv layers")
    exchange = held.peers()
    me = exchange.participant
    members = list(counts)
    dy = None
    loss_sum, correct, dense_s = 0.0, 0, 0.0
    if me in counts:
        assert features is not None
        labels = as_labels(request.labels, counts[me], dense.classes())
        if labels is None:
            raise SampleRequestError(ERR_BAD_REQUEST, f"a member's step chain needs its "
                                     f"{counts[me]} labels, class ids below {dense.classes()}")
        start = sum(counts[m] for m in members[:members.index(me)])
        dense_started = time.perf_counter()
        try:
            done, vector = dense.train_slice(
                features.reshape(features.shape[0], -1).astype(np.float32, copy=False),
                labels, request.step, Rows(start, start + counts[me], request.total_batch))
        except ValueError as error:  # the features do not fit the dense part
            raise SampleRequestError(ERR_BAD_REQUEST, f"the dense part: {error}") from None
        exchange.scatter(request.sync_id, request.step, dense.layer, vector)
        dense_s = time.perf_counter() - dense_started
        loss_sum, correct = done.loss_sum, done.correct
        dy = done.dflat.reshape(features.shape)
    backward = _backward_layers(held, shards, request.step, request.stop_layer - 1,
                                request.sync_id, request.sync_id, members,
                                request.slice_statistics, dy)
    figures = held.peer_figures()
    layer_seconds = [[forward.seconds.get(layer, 0.0), backward.seconds.get(layer, 0.0),
                      forward.waits.get(layer, 0.0), backward.waits.get(layer, 0.0)]
                     for layer in range(request.start_layer, request.stop_layer)]
    return SampleForwardReply(request_id=request.request_id, step=request.step,
                              attempt=request.attempt, compute_s=compute_seconds(started, figures),
                              count=0, total=None, m2=None, y=None, loss_sum=loss_sum,
                              correct=correct, dense_s=dense_s, layer_seconds=layer_seconds,
                              **figures)


def _added_sums(exchange: GradientExchange, sync_id: int, layer: int,
                members: list[str], own: np.ndarray | None) -> np.ndarray:
    """The whole batch's batch-norm sums (2, K) of ``layer``: every member's (dgamma_i,
    dbeta_i) (this participant's ``own``, the others' collected) added in member order."""
    pieces = exchange.collect(sync_id, layer, PHASE_SUMS, members)
    if own is not None:
        pieces[exchange.participant] = own
    return np.stack([add_in_order([pieces[m][0] for m in members]),
                     add_in_order([pieces[m][1] for m in members])])


def backward_chain(held: SliceLayers, request: SampleBackwardChain,
                   shards: Mapping[int, ConvShard]) -> SampleBackwardReply:
    """From ``start_layer`` down to layer 0 on this participant's dy slice (see the
    module doc): the sums kept for the update, the weight gradients scattered."""
    started = time.perf_counter()
    members = _members(request)
    if request.sync_id <= 0 or request.start_layer < 0:
        raise SampleRequestError(ERR_BAD_REQUEST, "a backward chain needs its sync_id "
                                 "and its first layer")
    if held.peers().participant in members and request.dy is None:
        raise SampleRequestError(ERR_BAD_REQUEST, "a member's backward chain needs its dy")
    _backward_layers(held, shards, request.step, request.start_layer, request.sync_id,
                     request.sync_id, members, request.slice_statistics, request.dy)
    figures = held.peer_figures()
    return SampleBackwardReply(request_id=request.request_id, step=request.step,
                               attempt=request.attempt, compute_s=compute_seconds(started, figures),
                               dweight=None, dgamma=None, dbeta=None, **figures)


def _scatter_pending(exchange: GradientExchange, clock: LayerClock,
                     pending: tuple[int, Callable[[], np.ndarray]], reduce_id: int, step: int,
                     current: int) -> None:
    """Compute the weight gradient of layer ``pending[0]`` (counted in that layer's
    seconds) and scatter it, then go on with layer ``current``."""
    layer, weight_gradient = pending
    clock.start(layer)
    try:
        dweight = weight_gradient()
    except RuntimeError as error:
        raise SampleRequestError(ERR_BAD_REQUEST, str(error)) from None
    exchange.scatter(reduce_id, step, layer, dweight)
    exchange.release()  # this participant's barrier piece is out already: no need to wait
    clock.start(current)


def _backward_layers(held: SliceLayers, shards: Mapping[int, ConvShard], step: int,
                     start_layer: int, sync_id: int, reduce_id: int, members: list[str],
                     by_slice: bool, dy: np.ndarray | None) -> LayerClock:
    """The backward chain from ``start_layer`` down to layer 0: each layer's sums
    exchanged as ``sync_id`` (and kept for the update), its weight gradient scattered as
    reduction ``reduce_id``; ``dy`` None for a participant that is not a member.
    Returns each layer's seconds."""
    exchange = held.peers()
    member = exchange.participant in members
    later: dict[int, np.ndarray | None] = {}  # by slice: layer -> own sums, added last
    clock = LayerClock(exchange)
    pending: tuple[int, Callable[[], np.ndarray]] | None = None  # (layer, its dW_i later)
    route = _backward_route(held, shards, start_layer, dy) \
        if member and dy is not None else None
    for layer in range(start_layer, -1, -1):
        clock.start(layer)
        replica = held.replica(shards, layer)
        own = None
        if member:
            assert route is not None
            dy = route.gradient(layer)
            tests_delay(replica.shard)
            try:
                own = np.stack(replica.start_backward(dy))
            except (RuntimeError, ValueError) as error:
                raise SampleRequestError(ERR_BAD_REQUEST, str(error)) from None
            exchange.share(sync_id, step, layer, PHASE_SUMS, own)
        if pending is not None:  # the layer above's dW_i while this barrier's pieces travel
            _scatter_pending(exchange, clock, pending, reduce_id, step, layer)
            pending = None
        if by_slice:  # this slice's own sums now; every slice's added after the last layer
            later[layer] = own
            if own is None:
                continue
            dgamma, dbeta = own[0], own[1]
        else:
            held.kept_sums[layer] = _added_sums(exchange, sync_id, layer, members, own)
            dgamma, dbeta = held.kept_sums[layer]
        if member:
            assert route is not None
            try:
                if route.need_dx(layer) and not by_slice:  # dW_i waits for the next barrier
                    dx, later_dweight = replica.finish_backward_split(dgamma, dbeta)
                    route.input_gradient(layer, dx)
                    pending = (layer, later_dweight)
                    continue
                dx_or_none, dweight = replica.finish_backward(dgamma, dbeta,
                                                              need_dx=route.need_dx(layer))
                route.input_gradient(layer, dx_or_none)
            except RuntimeError as error:
                raise SampleRequestError(ERR_BAD_REQUEST, str(error)) from None
            exchange.scatter(reduce_id, step, layer, dweight)
    if pending is not None:  # (never: layer 0 computes its dW_i at once)
        _scatter_pending(exchange, clock, pending, reduce_id, step, 0)
    clock.stop()
    for layer, own in later.items():  # by slice: gamma's and beta's gradients, every slice's
        held.kept_sums[layer] = _added_sums(exchange, sync_id, layer, members, own)
    return clock
