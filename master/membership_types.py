"""The membership state machine's vocabulary: what it knows of a worker and of a request,
the events it takes in and the actions it gives out (``master/membership.py``), and
which reply answers which request. Plain data, no logic beyond matching a reply to its
request.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetconv.participant.progress import ComputeReport
from hetconv.protocol import (
    Ack,
    AssignDense,
    AssignPeers,
    AssignShard,
    BackwardReply,
    BackwardRequest,
    CalibrateReply,
    CalibrateRequest,
    EndRun,
    ErrorReply,
    ForwardReply,
    ForwardRequest,
    LinkProbeReply,
    LinkProbeRequest,
    Message,
    PeerBackwardReply,
    PeerBackwardRequest,
    PeerForwardReply,
    PeerForwardRequest,
    SampleBackwardReply,
    SampleForwardReply,
    SnapshotReply,
    SnapshotRequest,
    limits,
)
from hetconv.protocol.samples import SAMPLE_BACKWARD_REQUESTS, SAMPLE_FORWARD_REQUESTS
from hetconv.session_events import BadMessage as BadMessage  # re-exported: shared vocabulary
from hetconv.session_events import Log as Log  # re-exported
from hetconv.session_events import Tick as Tick  # re-exported

REPLY_TYPES: tuple[type[Message], ...] = (ForwardReply, BackwardReply, CalibrateReply,
                                          SnapshotReply, Ack, ErrorReply, PeerForwardReply,
                                          PeerBackwardReply, LinkProbeReply,
                                          SampleForwardReply, SampleBackwardReply)
"""The message types a worker sends to answer a request."""

ECHOED_FIELDS = ("step", "layer", "attempt")
"""Request fields a reply carries back unchanged, where both types have them."""
LINK_RETRY_S = 10.0
"""How long a worker behind a dead link (its connection retransmitting, not a stopped
peer: master/liveness.py) may stay silent before it is lost; SIGSTOP and kill are
still found after ``liveness_timeout_s`` (5 s). Below ZeroMQ's own heartbeat limits
(``limits.HEARTBEAT_TIMEOUT_MS``, ``HEARTBEAT_TTL_MS``: 12 s), so that this check, not
libzmq closing the connection, decides."""
SILENT_SUSPECT_BEATS = 4
"""An awaited worker silent for this many heartbeat intervals (2 s at 0.5 s) holds back
the request deadline of the others it awaits with (their late answers may wait on its
pieces): the liveness limit names it instead, and a deadline waits at most that much
longer (a CI run blamed a live worker whose weight reduction waited on a stopped one)."""
LINK_CHECK_AFTER_S = 1.0
"""A member silent this long (two heartbeat intervals) has its link checked on every
tick until it is heard again: once it is seen behind a dead link, every request then
outstanding waits ``LINK_RETRY_S`` longer than its deadline (its answer may depend on
that member's pieces, which come when the link heals)."""


@dataclass
class WorkerHandle:
    """What the master knows of one connected worker."""

    identity: bytes
    worker_id: str
    device: dict[str, Any]
    last_seen: float  # monotonic seconds of the last decoded message from it
    gone: bool = False
    connection_lost: bool = False  # gone because the socket lost its connection
    data_endpoint: str = ""  # its peer data endpoint (DataEndpoint), "" until announced
    data_public_key: str = ""  # its CURVE public key for the data plane (z85), or ""
    curve_key: str = ""  # the CURVE key (ZAP User-Id) it said Hello with; "" without CURVE
    peer_address: str = ""  # the IP its connection comes from (ZMQ Peer-Address), "" unknown
    link_down: bool = False  # seen behind a dead link since last heard (master/liveness.py)
    forgeries: int = 0  # messages under its identity with another key, refused
    misbehaved: bool = False  # evicted for failing its peers: kept through a Hello again
    # what its compute thread was doing at its last heartbeat (hetconv/participant/progress.py)
    compute: ComputeReport = field(default_factory=ComputeReport)
    compute_at: float = 0.0  # monotonic seconds that heartbeat came

    @property
    def name(self) -> str:
        return f"{self.worker_id} ({self.device.get('device', '?')})"


@dataclass(frozen=True)
class ClusterSettings:
    """Deadlines of the master's side (defaults from ``protocol.limits``)."""

    heartbeat_interval_s: float = limits.DEFAULT_HEARTBEAT_INTERVAL_S
    liveness_timeout_s: float = (limits.DEFAULT_HEARTBEAT_INTERVAL_S
                                 * limits.DEFAULT_HEARTBEAT_LIVENESS)
    request_timeout_s: float = limits.DEFAULT_REQUEST_TIMEOUT_S
    # a worker silent behind a stalled link (master/liveness.py) is lost only after this
    link_retry_s: float = LINK_RETRY_S
    # a worker silent this long has its link checked (the TCP tables are read)
    link_check_after_s: float = LINK_CHECK_AFTER_S
    forgery_log_interval_s: float = 60.0  # at most one warning per routing id this often


@dataclass
class KeyBinding:
    """The CURVE key a routing id is bound to, and what was refused under it."""

    key: str  # the ZAP User-Id (z85 public key) that first said Hello; "" without CURVE
    refused: int = 0  # messages under this routing id from another key, dropped
    unlogged: int = 0  # of those, not yet counted in a warning
    logged_at: float = -math.inf  # monotonic seconds of the last warning


@dataclass
class Reply:
    """A worker's answer to one request, as received."""

    worker: WorkerHandle
    message: Message
    received_at: float  # monotonic seconds
    payload_bytes: int


def payload_bytes(message: Message) -> int:
    """Bytes of array payload a message carries (what crosses the network, roughly)."""
    return sum(value.nbytes for value in vars(message).values() if isinstance(value, np.ndarray))


def expected_reply(request: Message) -> type[Message] | None:
    """The reply type that answers ``request`` (besides ErrorReply); None: not a request."""
    match request:
        case ForwardRequest():
            return ForwardReply
        case BackwardRequest():
            return BackwardReply
        case CalibrateRequest():
            return CalibrateReply
        case SnapshotRequest():
            return SnapshotReply
        case LinkProbeRequest():
            return LinkProbeReply
        case PeerForwardRequest():
            return PeerForwardReply
        case PeerBackwardRequest():
            return PeerBackwardReply
        case _ if isinstance(request, SAMPLE_FORWARD_REQUESTS):
            return SampleForwardReply
        case _ if isinstance(request, SAMPLE_BACKWARD_REQUESTS):
            return SampleBackwardReply
        case AssignShard() | AssignPeers() | AssignDense() | EndRun():
            return Ack
    return None


def reply_mismatch(request: Message, reply: Message) -> str | None:
    """How ``reply`` echoes the request's step, layer or attempt wrongly; None if it
    echoes every one of :data:`ECHOED_FIELDS` that both messages have."""
    for key in ECHOED_FIELDS:
        if hasattr(request, key) and hasattr(reply, key):
            wanted, got = getattr(request, key), getattr(reply, key)
            if got != wanted:
                return f"{key} {got}, expected {wanted}"
    return None


# --- events in ---------------------------------------------------------------------
@dataclass(frozen=True)
class MessageReceived:
    """``message`` decoded at ``now`` (monotonic seconds) from ROUTER peer ``identity``;
    ``user_id``: the ZAP User-Id of its connection (with CURVE its public key, z85)."""

    identity: bytes
    message: Message
    now: float
    user_id: str = ""
    peer_address: str = ""  # the IP of its connection, "" where the transport did not say


@dataclass(frozen=True)
class RequestSent:
    """``request`` went to ``worker`` at ``now``; its reply is expected from that worker."""

    worker: WorkerHandle
    request: Message
    now: float


@dataclass(frozen=True)
class RequestsAwaited:
    """The master now waits for the replies to ``pending`` (request id → worker), for
    ``what`` (named in failures). Ids not seen in :class:`RequestSent` are registered
    here, without a type check."""

    pending: Mapping[int, WorkerHandle]
    what: str
    now: float
    timeout_s: float | None = None  # a deadline for these requests, counted from their send
    background: bool = False  # answered beside training: failures kept, not raised


@dataclass(frozen=True)
class SendFailed:
    """The transport could not send to ``worker`` (``detail`` says why)."""

    worker: WorkerHandle
    detail: str


Event = MessageReceived | BadMessage | Tick | RequestSent | RequestsAwaited | SendFailed


# --- actions out -------------------------------------------------------------------
@dataclass(frozen=True)
class Send:
    """Send ``message`` to ROUTER peer ``identity``; a failed send is not an error."""

    identity: bytes
    message: Message


@dataclass(frozen=True)
class Fail:
    """Stop waiting: ``worker`` died, went silent, left or answered wrongly."""

    worker: WorkerHandle
    reason: str  # one line that names the worker
    culprit: str | None = None  # the participant at fault, when not ``worker`` itself
    evict: bool = False  # its results were wrong: evict it even though it is alive


@dataclass(frozen=True)
class Completed:
    """Request ``request_id`` got its reply (kept until :meth:`Membership.replies_for`)."""

    request_id: int
    reply: Reply


Action = Send | Log | Fail | Completed


@dataclass
class Request:
    """One outstanding request and, once it came, its reply."""

    worker: WorkerHandle
    sent_at: float
    message: Message | None  # None: registered by RequestsAwaited only
    what: str = "a request"
    reply: Reply | None = None
    timeout_s: float | None = None  # its own deadline (None: the settings' backstop)
    link_down_seen: bool = False  # a member's link was down while it waited: +link_retry_s
    # a request answered beside training (a joiner's calibration): its failure is kept
    # here for whoever collects it, never a Fail that would stop the step being gathered
    background: bool = False
    failure: str = ""


