"""Message types of the hetconv wire protocol, one frozen dataclass per type.

Each class has a class-level ``TYPE`` tag (the ``"type"`` of the wire header) and
typed fields. Fields typed ``np.ndarray`` (or ``np.ndarray | None``) travel as raw
array frames; every other field is msgpack-native (int, float, str, bool, list,
dict with str keys) and travels in the header. ``MESSAGE_TYPES`` maps tags to
classes and ``SCHEMAS`` holds the field layout derived from the annotations, which
is what ``protocol.codec`` encodes and validates against. Directions and meaning of
every type are documented in docs/protocol.md. The peer data plane's types are
defined in ``protocol.peer_messages`` and listed here with the others.

Classes carrying arrays use ``eq=False`` (numpy arrays have no boolean ``==``);
compare them with ``message_equal``.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .message_base import Message as Message  # re-exported
from .peer_messages import AssignPeers as AssignPeers  # re-exported
from .peer_messages import DataEndpoint as DataEndpoint  # re-exported
from .peer_messages import PeerBackwardReply as PeerBackwardReply  # re-exported
from .peer_messages import PeerBackwardRequest as PeerBackwardRequest  # re-exported
from .peer_messages import PeerForwardReply as PeerForwardReply  # re-exported
from .peer_messages import PeerForwardRequest as PeerForwardRequest  # re-exported
from .peer_messages import PeerPiece as PeerPiece  # re-exported
from .samples import AssignDense as AssignDense  # re-exported
from .samples import SampleBackwardChain as SampleBackwardChain  # re-exported
from .samples import SampleBackwardReply as SampleBackwardReply  # re-exported
from .samples import SampleBackwardRound as SampleBackwardRound  # re-exported
from .samples import SampleEvaluation as SampleEvaluation  # re-exported
from .samples import SampleForwardChain as SampleForwardChain  # re-exported
from .samples import SampleForwardReply as SampleForwardReply  # re-exported
from .samples import SampleForwardRound as SampleForwardRound  # re-exported
from .samples import SampleStepChain as SampleStepChain  # re-exported
from .samples import SampleUpdateRound as SampleUpdateRound  # re-exported

NO_REQUEST_ID = 0
"""Request id of an ``ErrorReply`` that answers no particular request."""


# --- handshake and liveness ---------------------------------------------------------
@dataclass(frozen=True)
class Hello(Message):
    """worker → master, first message on connect: who I am and what I run on."""

    TYPE: ClassVar[str] = "hello"
    worker_id: str
    device: dict[str, Any]
    protocol_version: int


@dataclass(frozen=True)
class Welcome(Message):
    """master → worker: accepted; the run id and the heartbeat interval to use."""

    TYPE: ClassVar[str] = "welcome"
    worker_id: str
    run_id: str
    heartbeat_interval_s: float
    protocol_version: int


@dataclass(frozen=True)
class Refuse(Message):
    """master → worker: not accepted (a protocol version mismatch); the worker exits."""

    TYPE: ClassVar[str] = "refuse"
    reason: str
    protocol_version: int


@dataclass(frozen=True)
class Heartbeat(Message):
    """either way: I am alive (``sent_at``: the sender's ``time.time()``); a worker's
    also says what its compute thread does (hetconv/participant/progress.py): whom it
    waits for a piece from and how long, or how long it has made no progress."""

    TYPE: ClassVar[str] = "heartbeat"
    sent_at: float
    waiting_for: list[str] = dataclasses.field(default_factory=list)
    waited_s: float = 0.0
    stalled_s: float = 0.0


@dataclass(frozen=True)
class Goodbye(Message):
    """worker → master: I am shutting down cleanly (sent once, best effort).

    There is no failover: the master marks the worker gone, and a run in progress
    fails with an error naming it (at once if the master is waiting for its reply,
    otherwise at the next request or wait that involves it).
    """

    TYPE: ClassVar[str] = "goodbye"
    worker_id: str
    reason: str


# --- calibration ---------------------------------------------------------------------
@dataclass(frozen=True)
class CalibrateRequest(Message):
    """master → worker: time one conv layer's forward+backward at this shape.

    The layer is conv -> batch norm -> ReLU -> 2x2 pool with ``kernels`` kernels,
    on random data of shape (batch, in_channels, height, width); ``pool`` is
    "max", "avg" or "none", ``batch_norm`` false drops the batch norm (as in
    ``AssignShard``).
    """

    TYPE: ClassVar[str] = "calibrate_request"
    request_id: int
    layer: int
    batch: int
    in_channels: int
    height: int
    width: int
    kernels: int
    kernel_size: int
    stride: int
    padding: int
    repeats: int
    pool: str = "max"
    batch_norm: bool = True


@dataclass(frozen=True)
class CalibrateReply(Message):
    """worker → master: median seconds of the layer's forward+backward at that shape
    (at least ``repeats`` timed runs after a warm-up; ``hetconv.participant.calibration.time_block``)."""

    TYPE: ClassVar[str] = "calibrate_reply"
    request_id: int
    layer: int
    seconds: float


@dataclass(frozen=True, eq=False)
class LinkProbeRequest(Message):
    """master → worker: measure the link. ``payload`` (uint8, may be absent) times the
    master → worker direction; the worker answers with ``reply_bytes`` bytes of payload
    (at most ``protocol.limits.MAX_LINK_PROBE_BYTES``), which times the other one."""

    TYPE: ClassVar[str] = "link_probe_request"
    request_id: int
    reply_bytes: int
    payload: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class LinkProbeReply(Message):
    """worker → master: the answer to a ``LinkProbeRequest``: ``reply_bytes`` zero bytes
    (uint8; absent when 0) and the size of the payload it received."""

    TYPE: ClassVar[str] = "link_probe_reply"
    request_id: int
    received_bytes: int
    payload: np.ndarray | None = None


# --- shard placement -------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class AssignShard(Message):
    """master → worker: own kernels [kernel_start, kernel_stop) of ``layer``.

    Shapes (K = kernel_stop - kernel_start, C = input channels, k = kernel size):
    weight and velocity_weight (K, C, k, k); gamma, beta, running_mean,
    running_var, velocity_gamma, velocity_beta (K,). ``pool`` ("max", "avg" or
    "none") follows the ReLU; with ``batch_norm`` false ``beta`` is the conv's bias.
    ``relu``, ``input_from``, ``shortcut_from``: a residual block's routing (docs/residual.md)."""

    TYPE: ClassVar[str] = "assign_shard"
    request_id: int
    layer: int
    kernel_start: int
    kernel_stop: int
    stride: int
    padding: int
    need_dx: bool
    bn_momentum: float
    bn_eps: float
    momentum: float
    weight_decay: float
    weight: np.ndarray
    gamma: np.ndarray
    beta: np.ndarray
    running_mean: np.ndarray
    running_var: np.ndarray
    velocity_weight: np.ndarray
    velocity_gamma: np.ndarray
    velocity_beta: np.ndarray
    pool: str = "max"
    batch_norm: bool = True
    relu: bool = True
    input_from: int = -1
    shortcut_from: int = -1


@dataclass(frozen=True)
class Ack(Message):
    """worker → master: the request (AssignShard, EndRun) was carried out."""

    TYPE: ClassVar[str] = "ack"
    request_id: int


# --- training step ----------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class ForwardRequest(Message):
    """master → worker: the forward of this worker's shard of ``layer`` on x (B, C, H, W).

    ``step`` is the training step (from 0), or -1 for an evaluation forward
    (``train`` false); ``attempt`` is always 0 in this version (no work is re-issued).
    """

    TYPE: ClassVar[str] = "forward_request"
    request_id: int
    step: int
    layer: int
    attempt: int
    train: bool
    x: np.ndarray


@dataclass(frozen=True, eq=False)
class ForwardReply(Message):
    """worker → master: y (B, K, H', W'), this shard's output channels."""

    TYPE: ClassVar[str] = "forward_reply"
    request_id: int
    step: int
    layer: int
    attempt: int
    compute_s: float
    y: np.ndarray


@dataclass(frozen=True, eq=False)
class BackwardRequest(Message):
    """master → worker: dy (B, K, H', W') for this shard; back-propagate and update
    the shard with SGD at ``learning_rate`` (at most once per ``(layer, step)``)."""

    TYPE: ClassVar[str] = "backward_request"
    request_id: int
    step: int
    layer: int
    attempt: int
    learning_rate: float
    dy: np.ndarray


@dataclass(frozen=True, eq=False)
class BackwardReply(Message):
    """worker → master: partial dx (B, C, H, W), or None when need_dx is false."""

    TYPE: ClassVar[str] = "backward_reply"
    request_id: int
    step: int
    layer: int
    attempt: int
    compute_s: float
    dx: np.ndarray | None


# --- snapshots and end of run ----------------------------------------------------------
@dataclass(frozen=True)
class SnapshotRequest(Message):
    """master → worker: send me the current state of your shard of ``layer``."""

    TYPE: ClassVar[str] = "snapshot_request"
    request_id: int
    layer: int


@dataclass(frozen=True, eq=False)
class SnapshotReply(Message):
    """worker → master: the shard's parameters, statistics and optimizer state."""

    TYPE: ClassVar[str] = "snapshot_reply"
    request_id: int
    layer: int
    kernel_start: int
    kernel_stop: int
    weight: np.ndarray
    gamma: np.ndarray
    beta: np.ndarray
    running_mean: np.ndarray
    running_var: np.ndarray
    velocity_weight: np.ndarray
    velocity_gamma: np.ndarray
    velocity_beta: np.ndarray


@dataclass(frozen=True)
class EndRun(Message):
    """master → worker: the run is over (completed or failed); drop all shards, stay up
    for the next run. Answered with ``Ack``."""

    TYPE: ClassVar[str] = "end_run"
    request_id: int
    reason: str


@dataclass(frozen=True)
class ErrorReply(Message):
    """either way: the request (or an undecodable message) failed; see ``code``."""

    TYPE: ClassVar[str] = "error_reply"
    request_id: int
    code: str
    message: str


AnyMessage = (
    Hello | Welcome | Refuse | Heartbeat | Goodbye | DataEndpoint | CalibrateRequest
    | CalibrateReply | LinkProbeRequest | LinkProbeReply | AssignShard | Ack | AssignPeers
    | ForwardRequest | ForwardReply | BackwardRequest | BackwardReply | PeerForwardRequest
    | PeerForwardReply | PeerBackwardRequest | PeerBackwardReply | SnapshotRequest
    | SnapshotReply | EndRun | ErrorReply | PeerPiece | SampleForwardRound | SampleEvaluation
    | SampleForwardChain | SampleStepChain | SampleForwardReply | SampleBackwardRound
    | SampleBackwardChain | SampleUpdateRound | SampleBackwardReply | AssignDense
)
"""Union of all message classes, for exhaustive ``match`` statements."""

HANDSHAKE_TYPES: frozenset[str] = frozenset({Hello.TYPE, Welcome.TYPE, Refuse.TYPE})
"""Types whose schema is frozen across protocol versions, so they decode whatever
version the header says; the receiver compares ``protocol_version`` itself."""


# --- schema derived from the annotations -------------------------------------------------
FieldKind = str  # one of "int", "float", "str", "bool", "dict", "list"


@dataclass(frozen=True)
class MessageSchema:
    """Wire layout of one message class, derived once from its annotations."""

    cls: type[Message]
    header_fields: tuple[tuple[str, FieldKind], ...]
    array_fields: tuple[tuple[str, bool], ...]  # (name, may be None)


def _field_kind(annotation: Any) -> tuple[str, str | bool]:
    """Classify one annotation: ("header", kind) or ("array", optional)."""
    if annotation is np.ndarray:
        return "array", False
    args = typing.get_args(annotation)
    if args and set(args) == {np.ndarray, type(None)}:
        return "array", True
    plain = {int: "int", float: "float", str: "str", bool: "bool", dict: "dict", list: "list"}
    origin = typing.get_origin(annotation) or annotation
    if origin in plain:
        return "header", plain[origin]
    raise TypeError(f"unsupported message field annotation {annotation!r}")


def _schema_of(cls: type[Message]) -> MessageSchema:
    hints = typing.get_type_hints(cls)
    header: list[tuple[str, FieldKind]] = []
    arrays: list[tuple[str, bool]] = []
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        where, detail = _field_kind(hints[field.name])
        if where == "array":
            arrays.append((field.name, bool(detail)))
        else:
            header.append((field.name, str(detail)))
    return MessageSchema(cls, tuple(header), tuple(arrays))


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls for cls in typing.get_args(AnyMessage)
}
"""Type tag → message class."""

SCHEMAS: dict[str, MessageSchema] = {tag: _schema_of(cls) for tag, cls in MESSAGE_TYPES.items()}
"""Type tag → wire layout."""


def message_equal(left: Message, right: Message) -> bool:
    """True when both messages have the same type, fields, and arrays (dtype,
    shape and values; NaNs compare equal)."""
    if type(left) is not type(right):
        return False
    for field in dataclasses.fields(left):  # type: ignore[arg-type]
        a, b = getattr(left, field.name), getattr(right, field.name)
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
                return False
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
            if not np.array_equal(a, b, equal_nan=a.dtype.kind == "f"):
                return False
        elif type(a) is not type(b) or a != b:
            return False
    return True
