"""Exceptions and error codes of the hetconv wire protocol.

``ProtocolError`` is the single exception class that decoding raises for any input,
however malformed; ``VersionMismatch`` is its subclass for a peer speaking another
protocol version. Both carry a machine-readable ``code`` (one of the ``ERR_*``
constants, also used in ``ErrorReply.code``; the table of codes, with who sends
each, is in docs/protocol.md section 4.2) and a one-line human message. The
transport attaches the ROUTER peer identity, and the codec attaches the request id
and message type when it got far enough to read them, so that the receiver can
answer with an ``ErrorReply`` to the right peer and request.
"""
from __future__ import annotations

ERR_BAD_MESSAGE = "bad_message"
"""The bytes are not a well-formed message (framing, header, types, limits)."""
ERR_BAD_REQUEST = "bad_request"
"""A well-formed message the worker will not act on: content out of range or of the
wrong shape or dtype, a step already applied, a type it does not serve, or a request
before its session began."""
ERR_UNKNOWN_LAYER = "unknown_layer"
"""A request names a layer for which the receiver holds no shard."""
ERR_UNEXPECTED = "unexpected_message"
"""A well-formed message of a type the receiver does not accept (the master, given
anything but a reply, Heartbeat, Hello or Goodbye by a known worker)."""
ERR_VERSION_MISMATCH = "version_mismatch"
"""The peer speaks another protocol version."""
ERR_NOT_READY = "not_ready"
"""The receiver is not ready for the request yet. Reserved: no code path sends it in
this version (a worker without a session answers ``ERR_BAD_REQUEST``, the master
``ERR_UNKNOWN_WORKER``)."""
ERR_PEER_LOST = "peer_lost"
"""Peer data plane: a participant waited longer than its deadline for a piece from a
peer, or could not send one to it. The message starts with ``peer=NAME:`` (see
:func:`peer_named`)."""
ERR_BAD_PEER_DATA = "bad_peer_data"
"""Peer data plane: a peer sent a piece holding NaN or Inf. The message starts with
``peer=NAME:``; the master evicts that peer."""
ERR_INTERNAL = "internal"
"""The worker failed while handling a valid request (a bug or resource failure)."""
ERR_UNKNOWN_WORKER = "unknown_worker"
"""The master does not know the sending worker (no Hello yet, or declared gone):
the worker must say Hello again."""

ERROR_CODES: frozenset[str] = frozenset(
    {
        ERR_BAD_MESSAGE,
        ERR_BAD_REQUEST,
        ERR_UNKNOWN_LAYER,
        ERR_UNEXPECTED,
        ERR_VERSION_MISMATCH,
        ERR_NOT_READY,
        ERR_INTERNAL,
        ERR_UNKNOWN_WORKER,
        ERR_PEER_LOST,
        ERR_BAD_PEER_DATA,
    }
)
"""Codes defined by this protocol version. ``ErrorReply.code`` is not restricted to
this set on decode, so that a newer peer's code still reaches the log."""


PEER_PREFIX = "peer="


def peer_error_message(peer: str, text: str) -> str:
    """An ``ErrorReply.message`` about ``peer`` in the ``peer=NAME: text`` form."""
    return f"{PEER_PREFIX}{peer}: {text}"


def peer_named(message: str) -> str | None:
    """The peer a ``peer=NAME: ...`` error message is about, or None."""
    if not message.startswith(PEER_PREFIX):
        return None
    name, sep, _ = message[len(PEER_PREFIX):].partition(":")
    return name if sep and name and " " not in name else None


class ProtocolError(Exception):
    """A message could not be encoded or decoded.

    Attributes:
        code: one of the ``ERR_*`` constants.
        message: one line saying what was wrong.
        request_id: the request id read from the header, if it could be read.
        message_type: the type tag read from the header, if it could be read.
        identity: the ROUTER peer identity, set by ``transport.recv_message``.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        request_id: int | None = None,
        message_type: str | None = None,
        identity: bytes | None = None,
    ) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message.replace("\n", " ")
        self.request_id = request_id
        self.message_type = message_type
        self.identity = identity

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!r}, {self.message!r})"


class VersionMismatch(ProtocolError):
    """The peer's message carries a protocol version other than ours.

    Attributes:
        local_version: our ``PROTOCOL_VERSION``.
        remote_version: the version found in the peer's header.
    """

    def __init__(
        self,
        local_version: int,
        remote_version: int,
        *,
        request_id: int | None = None,
        message_type: str | None = None,
        identity: bytes | None = None,
    ) -> None:
        super().__init__(
            ERR_VERSION_MISMATCH,
            f"peer speaks protocol version {remote_version}, we speak {local_version}"
            f" (message type {message_type!r}); upgrade the older side",
            request_id=request_id,
            message_type=message_type,
            identity=identity,
        )
        self.local_version = local_version
        self.remote_version = remote_version
