"""Message types of the peer data plane (``--data-plane peer``; docs/protocol.md §11).

The announcement of a worker's data endpoint, the master's ``AssignPeers``, the
per-layer requests and replies of a step without a star, and ``PeerPiece``, the one
message participants send each other. Same rules as ``protocol.messages``, which
lists these types with all the others.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .message_base import Message


@dataclass(frozen=True)
class DataEndpoint(Message):
    """worker → master, after every Welcome: where this worker's data plane listens.

    ``endpoint`` is ``tcp://ADDRESS:PORT`` that the other participants connect to;
    ``public_key`` is the worker's CURVE public key (z85) or ``""`` without CURVE.
    """

    TYPE: ClassVar[str] = "data_endpoint"
    worker_id: str
    endpoint: str
    public_key: str


@dataclass(frozen=True)
class AssignPeers(Message):
    """master → worker: the peer data plane of this run (``--data-plane peer``).

    ``participant`` is the receiver's own participant id; ``peers`` maps every other
    participant id to its data endpoint and ``peer_keys`` to its CURVE public key (z85;
    ``""`` without CURVE): exactly these keys may connect to the receiver's data
    endpoint. ``plan`` holds, per conv layer, ``[participant, kernel_start,
    kernel_stop]`` for every participant in kernel order (empty ranges included).
    ``timeout_s``: the longest wait for a peer's piece; ``wire_dtype`` of the pieces.
    """

    TYPE: ClassVar[str] = "assign_peers"
    request_id: int
    participant: str
    wire_dtype: str
    timeout_s: float
    peers: dict[str, Any]
    peer_keys: dict[str, Any]
    plan: list[Any]


@dataclass(frozen=True, eq=False)
class PeerForwardRequest(Message):
    """master → worker (peer data plane): the forward of this worker's shard of ``layer``.

    ``x`` (B, C, H, W) comes only for layer 0; a later layer's input is gathered from
    the participants' output pieces of the previous layer. ``pass_id`` numbers the
    master's forward passes (training and evaluation) from 1 and keys the pieces.
    """

    TYPE: ClassVar[str] = "peer_forward_request"
    request_id: int
    pass_id: int
    step: int
    layer: int
    attempt: int
    train: bool
    x: np.ndarray | None


@dataclass(frozen=True, eq=False)
class PeerForwardReply(Message):
    """worker → master: done; ``y`` (B, K, H', W') only for the last layer. Seconds
    computing and waiting for pieces, and data-plane bytes to and from other workers."""

    TYPE: ClassVar[str] = "peer_forward_reply"
    request_id: int
    step: int
    layer: int
    attempt: int
    compute_s: float
    peer_wait_s: float
    peer_bytes_sent: int
    peer_bytes_received: int
    y: np.ndarray | None


@dataclass(frozen=True, eq=False)
class PeerBackwardRequest(Message):
    """master → worker (peer data plane): back-propagate this worker's shard of ``layer``
    and update it at ``learning_rate``; ``dy`` (B, K, H', W') comes only for the last
    layer, an earlier layer's is reduced from the participants' partial input gradients."""

    TYPE: ClassVar[str] = "peer_backward_request"
    request_id: int
    pass_id: int
    step: int
    layer: int
    attempt: int
    learning_rate: float
    dy: np.ndarray | None


@dataclass(frozen=True)
class PeerBackwardReply(Message):
    """worker → master: done (the partial input gradient went to the peers)."""

    TYPE: ClassVar[str] = "peer_backward_reply"
    request_id: int
    step: int
    layer: int
    attempt: int
    compute_s: float
    peer_wait_s: float
    peer_bytes_sent: int
    peer_bytes_received: int


@dataclass(frozen=True, eq=False)
class PeerPiece(Message):
    """either way (participant → participant, on data endpoints): one piece of an exchange.

    ``phase`` ``input``: layer 0's input x, channels [0, C), passed on by the relay worker.
    ``forward``: the sender's output channels [kernel_start, kernel_stop) of
    ``layer`` (all-gather of the next layer's input). ``backward``: the sender's partial
    gradient of ``layer``'s output channels [kernel_start, kernel_stop), the receiver's
    kernels of ``layer`` (reduce-scatter). Keyed by (pass_id, layer, phase, sender).
    ``data`` holds samples [batch_start, batch_stop) of a batch of ``batch_size``: an
    exchange travels in a few pieces of consecutive samples, so the receiver computes
    on the first while the rest is on the wire.
    """

    TYPE: ClassVar[str] = "peer_piece"
    pass_id: int
    step: int
    layer: int
    phase: str
    attempt: int
    sender: str
    kernel_start: int
    kernel_stop: int
    batch_start: int
    batch_stop: int
    batch_size: int
    data: np.ndarray
