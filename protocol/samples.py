"""Message types of the sample split (``--split-by samples``; docs/protocol.md §12).

Under the sample split every participant holds whole conv layers and computes a slice
of the batch (docs/sample-split.md). The master asks for work in one of six modes,
one request type each, every one answered when the worker's part is done:

- :class:`SampleForwardRound` and :class:`SampleBackwardRound`: a round through the
  master (``--data-plane star``): finish the layer whose whole-batch values the master
  has just combined, start the next one;
- :class:`SampleForwardChain` and :class:`SampleBackwardChain`: every layer in one
  request, the batch-norm values exchanged among the peers (``--data-plane peer``);
- :class:`SampleStepChain`: a whole training step in one request (the dense part
  replicated: docs/dense-replica.md);
- :class:`SampleUpdateRound`: only the pending update (before a snapshot or an
  evaluation, or for a worker without samples in a backward round);
- :class:`SampleEvaluation`: every layer in evaluation mode on a slice.

Every request that carries the pending update has the same six update fields
(``update_layer``, ``dweight``, ``update_sums``, ``update_id``, ``contributors``,
``update_stop``, described once at :class:`SampleUpdateRound`). Same rules as
``protocol.messages``, which lists these types with all the others.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from .message_base import Message

NO_LAYER = -1
"""``finish_layer``, ``start_layer``, ``update_layer`` or ``update_stop`` of a request
that has none."""


@dataclass(frozen=True, eq=False)
class SampleUpdateRound(Message):
    """master → worker (sample split): apply the pending update, nothing else.

    The SGD step of layer ``update_layer`` at ``learning_rate`` with the whole batch's
    ``dweight`` (K, C, k, k) float32 and batch-norm sums ``update_sums`` (2, K) float32
    (dgamma, dbeta). ``update_id`` > 0: ``dweight`` is not in the request but reduced
    among the peers from the pieces of reduction ``update_id`` sent by ``contributors``
    (participant ids, in the order their gradients are added;
    hetconv/participant/samples/weight_reduce.py); 0: ``dweight`` is given.
    ``update_stop`` > ``update_layer``: the update covers layers [update_layer,
    update_stop), each from reduction ``update_id`` with the batch-norm sums this
    participant kept from the backward chain (``update_sums`` absent); NO_LAYER: the one
    layer ``update_layer``. The same six fields carry the update in every request that
    has them. Answered with :class:`SampleBackwardReply` (no arrays)."""

    TYPE: ClassVar[str] = "sample_update_round"
    request_id: int
    step: int
    attempt: int
    learning_rate: float
    update_layer: int
    dweight: np.ndarray | None
    update_sums: np.ndarray | None
    update_id: int
    contributors: list[Any]
    update_stop: int = NO_LAYER


@dataclass(frozen=True, eq=False)
class SampleForwardRound(Message):
    """master → worker (sample split, ``--data-plane star``): one forward round of a
    training step over this worker's samples.

    First the update it carries, when ``update_layer`` >= 0 (:class:`SampleUpdateRound`).
    Then, when ``finish_layer`` >= 0: finish that layer with the whole batch's batch-norm
    ``mean`` and ``var`` (K,) float32 (absent where the layer has no batch norm); its
    output is the next layer's input. A worker without samples in this step follows the
    running statistics instead (``total_count``: the values per channel they cover,
    B·Ho·Wo). Then, when ``start_layer`` >= 0: run layer ``start_layer`` up to its
    batch-norm statistics on ``x`` (B_i, C, H, W) when given, else on the output just
    finished. ``total_batch``: the whole batch's samples (B). ``return_output``: the
    reply carries the output of the layer finished."""

    TYPE: ClassVar[str] = "sample_forward_round"
    request_id: int
    step: int
    attempt: int
    total_batch: int
    finish_layer: int
    start_layer: int
    return_output: bool
    learning_rate: float
    total_count: int
    mean: np.ndarray | None
    var: np.ndarray | None
    x: np.ndarray | None
    update_layer: int
    dweight: np.ndarray | None
    update_sums: np.ndarray | None
    update_id: int
    contributors: list[Any]
    update_stop: int = NO_LAYER


@dataclass(frozen=True, eq=False)
class SampleEvaluation(Message):
    """master → worker (sample split): layers [0, ``stop_layer``) in evaluation mode
    (running statistics) on ``x`` (B_i, C, H, W), a slice of a batch of ``total_batch``
    samples; the reply carries the last layer's output ``y``."""

    TYPE: ClassVar[str] = "sample_evaluation"
    request_id: int
    step: int
    attempt: int
    total_batch: int
    stop_layer: int
    x: np.ndarray


@dataclass(frozen=True, eq=False)
class SampleForwardChain(Message):
    """master → worker (sample split, ``--data-plane peer``): a training step's forward
    pass, every layer of [0, ``stop_layer``) in this one request.

    First the update it carries (:class:`SampleUpdateRound`'s fields). Each layer's
    batch-norm moments are exchanged among the peers as exchange ``sync_id``
    (hetconv/participant/samples/weight_reduce.py, phase ``moments``): ``members``
    (participant ids, in the order the moments are combined) hold ``member_samples``
    samples each, and ``positions`` gives each layer's conv output positions Ho·Wo (a
    member's moments cover its samples times that); a participant not among them (no
    samples this step, no ``x``) runs no layer but combines the same moments and follows
    the running statistics. The reply carries the last layer's output of a member's
    slice. ``slice_statistics``: each member normalises with its own slice's statistics
    and combines every member's moments only after its last layer, for the running
    statistics (``hetconv train --bn-statistics slice``)."""

    TYPE: ClassVar[str] = "sample_forward_chain"
    request_id: int
    step: int
    attempt: int
    total_batch: int
    stop_layer: int
    learning_rate: float
    x: np.ndarray | None
    update_layer: int
    dweight: np.ndarray | None
    update_sums: np.ndarray | None
    update_id: int
    contributors: list[Any]
    update_stop: int
    sync_id: int
    members: list[Any]
    member_samples: list[Any]
    positions: list[Any]
    slice_statistics: bool

    start_layer: ClassVar[int] = 0  # a chain starts at the first layer
    return_output: ClassVar[bool] = True
    labels: ClassVar[None] = None


@dataclass(frozen=True, eq=False)
class SampleStepChain(Message):
    """master → worker (sample split, the dense part replicated: docs/dense-replica.md):
    a whole training step in one request.

    The forward chain of :class:`SampleForwardChain` (same fields), then the dense part
    assigned by ``AssignDense`` on the slice (a member gets its ``labels``, int32 (B_i,)
    class ids, with its x; its rows of the whole batch, hetconv/engine/dense_part.py),
    its gradient scattered as layer ``stop_layer`` of reduction ``sync_id``, then the
    backward chain of :class:`SampleBackwardChain` (sums exchanged as exchange
    ``sync_id``, weight gradients scattered as reduction ``sync_id``). The reply carries
    no output but the slice's ``loss_sum`` and ``correct``."""

    TYPE: ClassVar[str] = "sample_step_chain"
    request_id: int
    step: int
    attempt: int
    total_batch: int
    stop_layer: int
    learning_rate: float
    x: np.ndarray | None
    labels: np.ndarray | None
    update_layer: int
    dweight: np.ndarray | None
    update_sums: np.ndarray | None
    update_id: int
    contributors: list[Any]
    update_stop: int
    sync_id: int
    members: list[Any]
    member_samples: list[Any]
    positions: list[Any]
    slice_statistics: bool

    start_layer: ClassVar[int] = 0  # a chain starts at the first layer
    return_output: ClassVar[bool] = False


@dataclass(frozen=True, eq=False)
class SampleForwardReply(Message):
    """worker → master: the answer to a forward round, a forward or step chain or an
    evaluation. A round: the started layer's moments of its conv
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
class SampleBackwardRound(Message):
    """master → worker (sample split, ``--data-plane star``): one backward round over
    this worker's samples.

    In order: the update it carries (:class:`SampleUpdateRound`'s fields); when
    ``finish_layer`` >= 0, that layer's backward with the whole batch's batch-norm sums
    ``dgamma`` and ``dbeta`` (K,) float32 (its input gradient becomes the next layer's
    dy); when ``start_layer`` >= 0, that layer's backward starts on ``dy``
    (B_i, K, H', W') when given, else on the input gradient just computed.
    ``reduce_id`` > 0: the finished layer's weight gradient is not returned but reduced
    among the peers as reduction ``reduce_id`` (hetconv/participant/samples/weight_reduce.py);
    0: it is returned."""

    TYPE: ClassVar[str] = "sample_backward_round"
    request_id: int
    step: int
    attempt: int
    learning_rate: float
    finish_layer: int
    start_layer: int
    dgamma: np.ndarray | None
    dbeta: np.ndarray | None
    dy: np.ndarray | None
    reduce_id: int
    update_layer: int
    dweight: np.ndarray | None
    update_sums: np.ndarray | None
    update_id: int
    contributors: list[Any]
    update_stop: int = NO_LAYER


@dataclass(frozen=True, eq=False)
class SampleBackwardChain(Message):
    """master → worker (sample split, ``--data-plane peer``): a training step's backward
    pass, from ``start_layer`` down to layer 0 in this one request, on ``dy``
    (B_i, K, H', W'; absent for a participant without samples): each layer's batch-norm
    sums exchanged among the peers as exchange ``sync_id`` (phase ``sums``, added in the
    order of ``members``) and kept for the update, its weight gradient scattered as
    reduction ``sync_id``; a participant not among the ``members`` only adds the sums.
    ``slice_statistics``: each member's backward uses its own slice's sums, and every
    member's are added only after layer 0, for the update."""

    TYPE: ClassVar[str] = "sample_backward_chain"
    request_id: int
    step: int
    attempt: int
    learning_rate: float
    start_layer: int
    dy: np.ndarray | None
    sync_id: int
    members: list[Any]
    slice_statistics: bool


@dataclass(frozen=True, eq=False)
class SampleBackwardReply(Message):
    """worker → master: the answer to a backward round or chain or an update round. A
    backward round: the finished layer's weight gradient over
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


SAMPLE_FORWARD_REQUESTS = (SampleForwardRound, SampleEvaluation, SampleForwardChain,
                           SampleStepChain)
"""The requests answered with a :class:`SampleForwardReply`."""
SAMPLE_BACKWARD_REQUESTS = (SampleBackwardRound, SampleBackwardChain, SampleUpdateRound)
"""The requests answered with a :class:`SampleBackwardReply`."""
SAMPLE_REQUESTS = SAMPLE_FORWARD_REQUESTS + SAMPLE_BACKWARD_REQUESTS
SampleRequest = (SampleForwardRound | SampleEvaluation | SampleForwardChain | SampleStepChain
                 | SampleBackwardRound | SampleBackwardChain | SampleUpdateRound)
"""Every request of the sample split, one type per mode."""
