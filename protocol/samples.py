"""Message types of the sample split (``--split-by samples``; docs/protocol.md §12).

Under the sample split every participant holds whole conv layers and computes a slice
of the batch; one forward or backward *round* is one request per worker, answered when
its part is done. A round finishes the layer whose whole-batch values the master has
just combined and starts the next one, so each layer costs one round trip each way
(docs/sample-split.md). Same rules as ``protocol.messages``, which lists these types
with all the others.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from .message_base import Message

NO_LAYER = -1
"""``finish_layer``, ``start_layer`` or ``update_layer`` of a round that has none."""


@dataclass(frozen=True, eq=False)
class SampleForwardRequest(Message):
    """master → worker (sample split): one forward round over this worker's samples.

    First, when ``update_layer`` >= 0: the SGD step of that layer at ``learning_rate``
    with the whole batch's ``dweight`` and batch-norm sums ``update_sums`` (2, K) (the
    previous step's last update, carried by the next round instead of a round of its own). Then, when ``finish_layer`` >= 0: finish that layer with the whole batch's batch-norm
    ``mean`` and ``var`` (K,) float32 (absent where the layer needs none: evaluation, no
    batch norm); its output is the next layer's input. A worker without samples in this
    step follows the running statistics instead (``total_count``: the values per channel
    they cover, B·Ho·Wo). Then, when ``start_layer`` >= 0:
    run layers [start_layer, stop_layer) on ``x`` (B_i, C, H, W) when given, else on the
    output just finished; in training every layer but a batch-norm one's last phase is
    run (``stop_layer`` = start_layer + 1), in evaluation the whole range.
    ``total_batch``: the whole batch's samples (B). ``return_output``: the reply carries
    the output of the last layer run or finished. ``update_id`` > 0: the update's
    ``dweight`` is not in the request but reduced among the peers from the pieces of
    reduction ``update_id`` sent by ``contributors`` (participant ids, in the order
    their gradients are added; hetconv/participant/samples/weight_reduce.py); 0: ``dweight`` is given.
    ``update_stop`` > ``update_layer``: the update covers layers [update_layer,
    update_stop), each from reduction ``update_id`` with the batch-norm sums this
    participant kept from the backward chain (``update_sums`` absent); NO_LAYER: the one
    layer ``update_layer``.

    The chain (``sync_id`` > 0, training, ``--data-plane peer``): run every layer of
    [start_layer, stop_layer) in this one request, exchanging each layer's batch-norm
    moments among the peers as exchange ``sync_id`` (hetconv/participant/samples/weight_reduce.py, phase
    ``moments``): ``members`` (participant ids, in the order the moments are combined)
    hold ``member_samples`` samples each, and ``positions`` gives each layer's conv
    output positions Ho·Wo (a member's moments cover its samples times that); a
    participant not among them (no samples this step) runs no layer but combines the
    same moments and follows the running statistics. The reply carries the last layer's
    output. ``slice_statistics``: each member normalises with its own slice's statistics
    and combines every member's moments only after its last layer, for the running
    statistics (``hetconv train --bn-statistics slice``).

    The step chain (``step_chain``; a member gets its ``labels``, int32 (B_i,) class
    ids, with its x): after the last conv layer, the dense part assigned by ``AssignDense`` runs on the slice (its rows
    of the whole batch, hetconv/engine/dense_part.py), its gradient is scattered as layer
    ``stop_layer`` of reduction ``sync_id``, and the backward chain of
    :class:`SampleBackwardRequest` follows in the same request (sums exchanged as
    exchange ``sync_id``, weight gradients scattered as reduction ``sync_id``). The
    reply carries no output but the slice's ``loss_sum`` and ``correct``
    (docs/dense-replica.md).
    """

    TYPE: ClassVar[str] = "sample_forward_request"
    request_id: int
    step: int
    attempt: int
    train: bool
    total_batch: int
    finish_layer: int
    start_layer: int
    stop_layer: int
    return_output: bool
    update_layer: int
    learning_rate: float
    total_count: int
    mean: np.ndarray | None
    var: np.ndarray | None
    x: np.ndarray | None
    dweight: np.ndarray | None
    update_sums: np.ndarray | None
    update_id: int
    contributors: list[Any]
    update_stop: int = NO_LAYER
    sync_id: int = 0
    members: list[Any] = field(default_factory=list)
    member_samples: list[Any] = field(default_factory=list)
    positions: list[Any] = field(default_factory=list)
    slice_statistics: bool = False
    step_chain: bool = False
    labels: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class SampleForwardReply(Message):
    """worker → master: the round is done; the started layer's moments of its conv
    output over this worker's samples (``count`` values per channel, ``total`` and ``m2``
    (K,) float32: the sum and the sum of squares around this slice's mean; absent where
    the layer needs no statistics) and, when asked, ``y`` (B_i, K, H', W').
    ``peer_bytes_sent``/``peer_bytes_received``/``peer_wait_s``: the weight reduction's
    array bytes with the peers and seconds waited for them in this round (not counted
    in ``compute_s``). A step chain's reply: the slice's cross-entropy summed over its
    samples ``loss_sum``, how many it classified right ``correct``, the seconds of
    its dense part ``dense_s`` and, per conv layer, ``[forward_s, backward_s,
    forward_wait_s, backward_wait_s]`` in ``layer_seconds`` (the first two within
    ``compute_s``, waits for peers excluded; the last two within ``peer_wait_s``)."""

    TYPE: ClassVar[str] = "sample_forward_reply"
    request_id: int
    step: int
    attempt: int
    compute_s: float
    count: int
    total: np.ndarray | None
    m2: np.ndarray | None
    y: np.ndarray | None
    peer_bytes_sent: int
    peer_bytes_received: int
    peer_wait_s: float
    loss_sum: float = 0.0
    correct: int = 0
    dense_s: float = 0.0
    layer_seconds: list[Any] = field(default_factory=list)


@dataclass(frozen=True, eq=False)
class SampleBackwardRequest(Message):
    """master → worker (sample split): one backward round over this worker's samples.

    In order: when ``update_layer`` >= 0, the SGD step of that layer at
    ``learning_rate`` with the whole batch's ``dweight`` (K, C, k, k) float32 and
    batch-norm sums ``update_sums`` (2, K) float32 (dgamma, dbeta: a worker without
    samples in this step has none of its own); when
    ``finish_layer`` >= 0, that layer's backward with the whole batch's batch-norm sums
    ``dgamma`` and ``dbeta`` (K,) float32 (its input gradient becomes the next layer's
    dy); when ``start_layer`` >= 0, that layer's backward starts on ``dy``
    (B_i, K, H', W') when given, else on the input gradient just computed.
    ``reduce_id`` > 0: the finished layer's weight gradient is not returned but reduced
    among the peers as reduction ``reduce_id`` (hetconv/participant/samples/weight_reduce.py); 0: it is
    returned. ``update_id``, ``contributors`` and ``update_stop``: as in
    :class:`SampleForwardRequest`.

    The chain (``sync_id`` > 0): from ``start_layer`` down to layer 0 in this one request,
    on ``dy``: each layer's batch-norm sums exchanged among the peers as exchange
    ``sync_id`` (phase ``sums``, added in the order of ``members``) and kept for the
    update, its weight gradient scattered as reduction ``reduce_id``; a participant
    not among the ``members`` only adds the sums. ``slice_statistics``: each member's
    backward uses its own slice's sums, and every member's are added only after layer
    0, for the update (as in :class:`SampleForwardRequest`).
    """

    TYPE: ClassVar[str] = "sample_backward_request"
    request_id: int
    step: int
    attempt: int
    learning_rate: float
    update_layer: int
    finish_layer: int
    start_layer: int
    dweight: np.ndarray | None
    dgamma: np.ndarray | None
    dbeta: np.ndarray | None
    dy: np.ndarray | None
    update_sums: np.ndarray | None
    reduce_id: int
    update_id: int
    contributors: list[Any]
    update_stop: int = NO_LAYER
    sync_id: int = 0
    members: list[Any] = field(default_factory=list)
    slice_statistics: bool = False


@dataclass(frozen=True, eq=False)
class SampleBackwardReply(Message):
    """worker → master: the round is done; the finished layer's weight gradient over
    this worker's samples ``dweight`` (K, C, k, k) float32, and the started layer's
    batch-norm sums ``dgamma``, ``dbeta`` (K,) float32 (each absent where the round had
    no such layer; ``dweight`` also absent when the request's ``reduce_id`` > 0).
    Peer figures as in :class:`SampleForwardReply`."""

    TYPE: ClassVar[str] = "sample_backward_reply"
    request_id: int
    step: int
    attempt: int
    compute_s: float
    dweight: np.ndarray | None
    dgamma: np.ndarray | None
    dbeta: np.ndarray | None
    peer_bytes_sent: int
    peer_bytes_received: int
    peer_wait_s: float


@dataclass(frozen=True, eq=False)
class AssignDense(Message):
    """master → worker (sample split, the dense part replicated: docs/dense-replica.md):
    the network's dense part, for the step chain.

    ``names``: the dense arrays' keys in order (``dense{j}.weight``, ``dense{j}.bias``,
    ..., ``fc.weight``, ``fc.bias``), ``shapes`` each one's shape (weights (O, D),
    biases (O,)); ``values`` and ``velocity`` (N,) float32: every array raveled one
    after the other in that order. ``layers``: the dense layers before the classifier
    as ``[kind, units, rate]`` (``fc`` with its units, ``dropout`` with its rate);
    ``seed``: the run's (dropout masks); ``momentum`` and ``weight_decay`` of its SGD;
    ``layer``: the dense part's index in the reduction plan (the conv layers' count).
    """

    TYPE: ClassVar[str] = "assign_dense"
    request_id: int
    layer: int
    names: list[Any]
    shapes: list[Any]
    layers: list[Any]
    seed: int
    momentum: float
    weight_decay: float
    values: np.ndarray
    velocity: np.ndarray
