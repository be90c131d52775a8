"""The layers a participant of the sample split holds whole, kept between its requests.

Under ``--split-by samples`` the worker holds whole conv layers (``AssignShard`` of
kernels [0, K)) and the master drives each step (protocol/samples.py,
docs/sample-split.md). :class:`SliceLayers` keeps what lies between requests: a
:class:`~hetconv.participant.samples.replica.SampleReplica` per layer (rebuilt when the layer's
shard is replaced), the output of the layer finished last (the next layer's input),
the input gradient computed last (the next layer's dy), the pending update and the
peers' weight reduction. Requests are checked here against the layers held (shapes of
the statistics, sums and gradients); a request that does not fit raises
:class:`SampleRequestError` (answered ``bad_request`` or ``unknown_layer``).
:mod:`~hetconv.participant.samples.rounds` and :mod:`~hetconv.participant.samples.chain`
compute over it; :mod:`~hetconv.participant.samples.runner` picks which.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from hetconv.engine.routing import ForwardTape, Routing
from hetconv.engine.shard import ConvShard
from hetconv.participant.samples.dense_replica import DenseReplica
from hetconv.participant.samples.replica import SampleReplica
from hetconv.participant.samples.weight_reduce import GradientExchange
from hetconv.protocol import (
    ERR_BAD_REQUEST,
    ERR_UNKNOWN_LAYER,
    SampleBackwardRound,
    SampleForwardChain,
    SampleForwardRound,
    SampleStepChain,
    SampleUpdateRound,
)

CarriesUpdate = (SampleForwardRound | SampleForwardChain | SampleStepChain | SampleBackwardRound
                 | SampleUpdateRound)
"""The requests that carry the pending update (its six fields)."""


def compute_seconds(started: float, figures: dict[str, Any]) -> float:
    """Seconds since ``started`` less the waits for peers' pieces: what the slice cost
    this participant (the re-slicing and the estimate of the master alone read it)."""
    return max(0.0, time.perf_counter() - started - float(figures["peer_wait_s"]))


class SampleRequestError(Exception):
    """A sample-split request that does not fit the layers held (``code``, one line)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def checked_vector(array: np.ndarray | None, name: str, kernels: int, layer: int) -> np.ndarray:
    if array is None or array.shape != (kernels,) or array.dtype != np.float32:
        got = "nothing" if array is None else f"{array.dtype} {tuple(array.shape)}"
        raise SampleRequestError(ERR_BAD_REQUEST, f"layer {layer}: {name} must be float32 "
                                 f"({kernels},), got {got}")
    if not np.isfinite(array).all():
        raise SampleRequestError(ERR_BAD_REQUEST, f"layer {layer}: {name} holds NaN or Inf")
    return array


def tests_delay(shard: ConvShard) -> None:
    """The tests' slow worker (tests/support/faulty_worker.py ``FaultyShard``); nothing
    otherwise."""
    delay = getattr(shard, "training_delay", None)
    if delay is not None:
        delay()


class SliceLayers:
    """What a participant keeps between sample-split requests (see the module doc)."""

    def __init__(self) -> None:
        self._replicas: dict[int, tuple[ConvShard, SampleReplica]] = {}
        self.activation: np.ndarray | None = None  # the last finished layer's output
        self.gradient: np.ndarray | None = None  # the last finished layer's dx
        self.wire_dtype = np.dtype(np.float32)  # of the activations, as x came
        # the weight reduction among the peers (set by AssignPeers; None: via the master)
        self.exchange: GradientExchange | None = None
        # the chain's whole-batch batch-norm sums (2, K) per layer, kept for its update
        self.kept_sums: dict[int, np.ndarray] = {}
        # the dense part replicated (AssignDense; the master's: its trainer's arrays)
        self.dense: DenseReplica | None = None
        # the last training forward's residual joins, for its backward (engine/routing.py)
        self.tape: ForwardTape | None = None

    def reset(self) -> None:
        """Forget everything (the run ended, or the layers were re-assigned)."""
        self._replicas.clear()
        self.kept_sums.clear()
        self.activation = self.gradient = None
        self.dense = None
        self.tape = None

    @staticmethod
    def routing(shards: Mapping[int, ConvShard], count: int) -> Routing:
        """How layers [0, count) are chained (each one's ``input_from`` and
        ``shortcut_from``, as AssignShard gave them)."""
        if any(i not in shards for i in range(count)):
            raise SampleRequestError(ERR_UNKNOWN_LAYER, "the sample split needs every conv "
                                     f"layer 0..{count - 1} assigned")
        try:
            return Routing.from_routes([(shards[i].settings.input_from,
                                         shards[i].settings.shortcut_from)
                                        for i in range(count)])
        except ValueError as error:
            raise SampleRequestError(ERR_BAD_REQUEST, str(error)) from None

    def update_shape(self, shards: Mapping[int, ConvShard], layer: int) -> tuple[int, ...]:
        """The shape of ``layer``'s weight gradient: a conv layer's (K, C, k, k), or the
        dense part's (N,) (its index in the plan: the conv layers' count)."""
        if self.dense is not None and layer == self.dense.layer:
            return (self.dense.part.size(),)
        return tuple(self.replica(shards, layer).shard.state["weight"].shape)

    def peers(self) -> GradientExchange:
        if self.exchange is None:
            raise SampleRequestError(ERR_BAD_REQUEST, "a weight reduction among the peers, "
                                     "but no AssignPeers for this run yet")
        return self.exchange

    @staticmethod
    def update_layers(request: CarriesUpdate) -> range:
        """The layers the request's update covers: [update_layer, update_stop), or the
        one layer ``update_layer`` (none when it is NO_LAYER)."""
        if request.update_layer < 0:
            return range(0)
        stop = request.update_stop if request.update_stop > request.update_layer \
            else request.update_layer + 1
        return range(request.update_layer, stop)

    def begin_update(self, shards: Mapping[int, ConvShard], request: CarriesUpdate
                      ) -> dict[int, np.ndarray | None] | None:
        """First half of a peer-reduced update: reduce this participant's range of each
        layer and share it (None when the request carries its ``dweight`` or no update)."""
        if request.update_layer < 0 or request.update_id <= 0:
            return None
        contributors = [str(c) for c in request.contributors]
        if not contributors or len(set(contributors)) != len(contributors):
            raise SampleRequestError(ERR_BAD_REQUEST, "contributors must name each "
                                     "participant with samples once")
        return {layer: self.peers().reduce(
            request.update_id, request.step, layer, contributors,
            self.update_shape(shards, layer))
            for layer in self.update_layers(request)}

    def finish_update(self, shards: Mapping[int, ConvShard], request: CarriesUpdate,
                       begun: dict[int, np.ndarray | None] | None,
                       layers: Sequence[int] | None = None) -> None:
        """The update of ``layers`` (default: every layer of the request's), each dW
        gathered from the peers when reduced among them; the batch-norm sums are the
        request's ``update_sums``, or those this participant kept from the chain."""
        for layer in self.update_layers(request) if layers is None else layers:
            dweight = request.dweight
            if begun is not None:
                dweight = self.peers().gather(request.update_id, layer, begun.get(layer),
                                               self.update_shape(shards, layer))
            if self.dense is not None and layer == self.dense.layer:
                if dweight is None:
                    raise SampleRequestError(ERR_BAD_REQUEST, "the dense part's update is "
                                             "reduced among the peers")
                self.dense.apply(dweight, request.learning_rate)
                continue
            sums = request.update_sums
            if sums is None:
                sums = self.kept_sums.pop(layer, None)
            self._update(shards, layer, dweight, request.learning_rate, sums)

    def peer_figures(self) -> dict[str, Any]:
        if self.exchange is None:
            return {"peer_bytes_sent": 0, "peer_bytes_received": 0, "peer_wait_s": 0.0}
        self.exchange.flush()  # the request's end: no bulk piece stays queued
        sent, received, waited = self.exchange.take_stats()
        return {"peer_bytes_sent": sent, "peer_bytes_received": received,
                "peer_wait_s": waited}

    def replica(self, shards: Mapping[int, ConvShard], layer: int) -> SampleReplica:
        """The replica of ``layer`` over its current shard (a whole layer)."""
        shard = shards.get(layer)
        if shard is None or shard.kernel_start != 0:
            raise SampleRequestError(ERR_UNKNOWN_LAYER, f"no whole layer {layer} assigned for "
                                     "the sample split")
        held = self._replicas.get(layer)
        if held is None or held[0] is not shard:
            held = (shard, SampleReplica(shard))
            self._replicas[layer] = held
        return held[1]

    def _update(self, shards: Mapping[int, ConvShard], layer: int, dweight: np.ndarray | None,
                learning_rate: float, sums: np.ndarray | None) -> None:
        """The SGD step of ``layer`` with the whole batch's weight gradient and batch-norm
        sums (2, K)."""
        replica = self.replica(shards, layer)
        kernels = replica.shard.kernels
        if sums is None or sums.shape != (2, kernels) or sums.dtype != np.float32 \
                or not np.isfinite(sums).all():
            raise SampleRequestError(ERR_BAD_REQUEST, f"layer {layer}: update_sums must be "
                                     f"finite float32 (2, {kernels})")
        shape = tuple(replica.shard.state["weight"].shape)
        if dweight is None or tuple(dweight.shape) != shape or dweight.dtype != np.float32:
            raise SampleRequestError(ERR_BAD_REQUEST, f"layer {layer}: dweight must be "
                                     f"float32 {shape}")
        if not np.isfinite(dweight).all():
            raise SampleRequestError(ERR_BAD_REQUEST, f"layer {layer}: dweight holds NaN or Inf")
        if not np.isfinite(learning_rate) or learning_rate < 0:
            raise SampleRequestError(ERR_BAD_REQUEST, f"learning_rate {learning_rate}")
        try:
            replica.apply_update(dweight, learning_rate, sums=(sums[0], sums[1]))
        except RuntimeError as error:
            raise SampleRequestError(ERR_BAD_REQUEST, str(error)) from None
