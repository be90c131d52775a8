"""The hetconv wire protocol: message types, codec, limits and socket helpers.

Everything that travels between the master and its workers is one of the frozen
dataclasses exported here, encoded by ``encode`` into a msgpack header plus raw
array frames and rebuilt (after full validation) by ``decode``. ``transport``
holds thin pyzmq helpers (ROUTER/DEALER sockets with bounded linger, small
high-water marks, heartbeats and deadlines). This package depends only on the
standard library, numpy, msgpack and pyzmq. The protocol is written down in
docs/protocol.md.
"""
from __future__ import annotations

from protocol.codec import WIRE_DTYPES, decode, encode
from protocol.errors import (
    ERR_BAD_MESSAGE,
    ERR_BAD_REQUEST,
    ERR_INTERNAL,
    ERR_NOT_READY,
    ERR_UNEXPECTED,
    ERR_UNKNOWN_LAYER,
    ERR_VERSION_MISMATCH,
    ERROR_CODES,
    ProtocolError,
    VersionMismatch,
)
from protocol.messages import (
    HANDSHAKE_TYPES,
    MESSAGE_TYPES,
    NO_REQUEST_ID,
    Ack,
    AnyMessage,
    AssignShard,
    BackwardReply,
    BackwardRequest,
    CalibrateReply,
    CalibrateRequest,
    EndRun,
    ErrorReply,
    ForwardReply,
    ForwardRequest,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    Refuse,
    SnapshotReply,
    SnapshotRequest,
    Welcome,
    message_equal,
)
from protocol.transport import (
    CurveClientKeys,
    CurveServerKeys,
    PeerUnreachable,
    SendTimeout,
    TransportError,
    bound_endpoint,
    generate_curve_keypair,
    make_context,
    master_socket,
    recv_message,
    send_message,
    start_curve_authenticator,
    worker_socket,
)
from protocol.version import PROTOCOL_VERSION

__all__ = [
    "ERROR_CODES",
    "ERR_BAD_MESSAGE",
    "ERR_BAD_REQUEST",
    "ERR_INTERNAL",
    "ERR_NOT_READY",
    "ERR_UNEXPECTED",
    "ERR_UNKNOWN_LAYER",
    "ERR_VERSION_MISMATCH",
    "HANDSHAKE_TYPES",
    "MESSAGE_TYPES",
    "NO_REQUEST_ID",
    "PROTOCOL_VERSION",
    "WIRE_DTYPES",
    "Ack",
    "AnyMessage",
    "AssignShard",
    "BackwardReply",
    "BackwardRequest",
    "CalibrateReply",
    "CalibrateRequest",
    "CurveClientKeys",
    "CurveServerKeys",
    "EndRun",
    "ErrorReply",
    "ForwardReply",
    "ForwardRequest",
    "Goodbye",
    "Heartbeat",
    "Hello",
    "Message",
    "PeerUnreachable",
    "ProtocolError",
    "Refuse",
    "SendTimeout",
    "SnapshotReply",
    "SnapshotRequest",
    "TransportError",
    "VersionMismatch",
    "Welcome",
    "bound_endpoint",
    "decode",
    "encode",
    "generate_curve_keypair",
    "make_context",
    "master_socket",
    "message_equal",
    "recv_message",
    "send_message",
    "start_curve_authenticator",
    "worker_socket",
]
