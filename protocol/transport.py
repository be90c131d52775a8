"""ZeroMQ socket helpers for the hetconv protocol: sockets, send, receive. No logic.

The master binds one ROUTER; each worker connects one DEALER whose routing id is
its identity. Both get bounded LINGER, a small send high-water mark, a send timeout,
ZMTP heartbeats and a per-frame size limit (all from ``protocol.limits``), so that
shutdown never hangs, a frozen peer cannot make us queue sends without bound, and a
dead TCP connection is noticed. The receive high-water mark is off on purpose (see
``limits.DEFAULT_RCVHWM``: a bounded one lets any peer abort libzmq); readers bound
their own work instead (``recv_frames``, ``recv_routed`` and
``hetconv.protocol.admission``). ``recv_message`` always takes a deadline.

CURVE: pass ``CurveServerKeys`` to ``master_socket`` and ``CurveClientKeys`` to
``worker_socket``. The listening socket then sets ``ZAP_DOMAIN`` and
``ZAP_ENFORCE_DOMAIN``, so without a running authenticator on the *same* context
every connection is refused (fails closed). Start one with
``start_curve_authenticator`` *before* ``master_socket`` binds, and stop it after
the socket is closed.
"""
from __future__ import annotations

import errno
import math
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, overload

import zmq

if TYPE_CHECKING:  # imported when a CURVE run starts one: it pulls in asyncio (~80 ms a start)
    from zmq.auth.thread import ThreadAuthenticator

from . import admission, limits
from .codec import decode, encode
from .errors import ERR_BAD_MESSAGE, ProtocolError
from .messages import Message


class TransportError(Exception):
    """A message could not be handed to ZeroMQ."""


class SendTimeout(TransportError):
    """The send queue stayed full for ``DEFAULT_SEND_TIMEOUT_MS`` (peer frozen)."""


class PeerUnreachable(TransportError):
    """ROUTER: no connected peer has this identity (it left or never came)."""


@dataclass(frozen=True)
class CurveServerKeys:
    """The master's CURVE key pair (z85 bytes) and the allowed worker public keys."""

    public_key: bytes
    secret_key: bytes
    allowed_client_keys: frozenset[bytes]


@dataclass(frozen=True)
class CurveClientKeys:
    """A worker's CURVE key pair and the master's public key (all z85 bytes)."""

    public_key: bytes
    secret_key: bytes
    server_public_key: bytes


def generate_curve_keypair() -> tuple[bytes, bytes]:
    """A new CURVE key pair ``(public_key, secret_key)``, z85-encoded."""
    public_key, secret_key = zmq.curve_keypair()
    return public_key, secret_key


class _AllowList:
    """ZAP credentials provider: allow exactly the listed z85 public keys."""

    def __init__(self, allowed_client_keys: frozenset[bytes]) -> None:
        self.allowed_client_keys = allowed_client_keys

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == limits.ZAP_DOMAIN and key in self.allowed_client_keys


def start_curve_authenticator(
    ctx: zmq.Context[zmq.Socket[bytes]], allowed_client_keys: frozenset[bytes]
) -> ThreadAuthenticator:
    """Start a ZAP handler on ``ctx`` that admits only ``allowed_client_keys``.

    Call before ``master_socket(..., curve=...)``; call ``.stop()`` on the result
    after closing the socket and before terminating the context.
    """
    from zmq.auth.thread import ThreadAuthenticator

    authenticator = ThreadAuthenticator(ctx)
    authenticator.start()
    authenticator.configure_curve_callback(
        domain=limits.ZAP_DOMAIN, credentials_provider=_AllowList(allowed_client_keys)
    )
    return authenticator


def make_context(io_threads: int = 1) -> zmq.Context[zmq.Socket[bytes]]:
    """A fresh ZeroMQ context (not the global instance) for one master or worker."""
    return zmq.Context(io_threads=io_threads)


def _apply_common_options(sock: zmq.Socket[bytes]) -> None:
    sock.setsockopt(zmq.LINGER, limits.DEFAULT_LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, limits.DEFAULT_SNDHWM)
    sock.setsockopt(zmq.RCVHWM, limits.DEFAULT_RCVHWM)
    sock.setsockopt(zmq.SNDTIMEO, limits.DEFAULT_SEND_TIMEOUT_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.MAX_MSG_SIZE_BYTES)
    sock.setsockopt(zmq.HEARTBEAT_IVL, limits.HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, limits.HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, limits.HEARTBEAT_TTL_MS)
    sock.setsockopt(zmq.HANDSHAKE_IVL, limits.HANDSHAKE_IVL_MS)


def master_socket(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, *, curve: CurveServerKeys | None = None
) -> zmq.Socket[bytes]:
    """A ROUTER bound to ``endpoint`` (``tcp://host:*`` picks a free port; read it
    back with ``bound_endpoint``). ROUTER_MANDATORY makes a send to an unknown
    worker fail loudly; ROUTER_HANDOVER lets a restarted worker reuse its identity.
    """
    sock = ctx.socket(zmq.ROUTER)
    try:
        _apply_common_options(sock)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if curve is not None:
            sock.setsockopt(zmq.ZAP_DOMAIN, limits.ZAP_DOMAIN.encode())
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
        sock.bind(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def worker_socket(
    ctx: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    identity: bytes,
    *,
    curve: CurveClientKeys | None = None,
) -> zmq.Socket[bytes]:
    """A DEALER with routing id ``identity`` connected to the master's ``endpoint``;
    ZeroMQ reconnects by itself with back-off RECONNECT_IVL → RECONNECT_IVL_MAX."""
    if not 1 <= len(identity) <= 255 or identity[:1] == b"\0":
        raise ValueError("identity must be 1-255 bytes and must not start with a zero byte")
    sock = ctx.socket(zmq.DEALER)
    try:
        _apply_common_options(sock)
        sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.setsockopt(zmq.RECONNECT_IVL, limits.RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, limits.RECONNECT_IVL_MAX_MS)
        if curve is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
        sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def bound_endpoint(sock: zmq.Socket[bytes]) -> str:
    """The endpoint a socket actually bound (resolves a ``*`` port)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def send_message(sock: zmq.Socket[bytes], msg: Message, identity: bytes | None = None,
                 *, block: bool = True) -> int:
    """Encode and send ``msg`` (to ``identity`` on a ROUTER); return the bytes sent.

    Array frames go without copying: do not mutate the message's arrays afterwards.
    ``block`` False: never wait, not even for SNDTIMEO (for answers to strangers and
    other messages that may be lost: a peer that does not read cannot hold the caller).
    Raises ``ProtocolError`` (nothing sent) for an invalid message, ``SendTimeout``
    when the peer's queue stays full (at once when not ``block``), ``PeerUnreachable``
    for an unknown identity.
    """
    return send_frames(sock, encode(msg), msg.TYPE, identity, block=block)


def send_frames(sock: zmq.Socket[bytes], frames: list[bytes | memoryview], what: str,
                identity: bytes | None = None, *, block: bool = True) -> int:
    """Send encoded ``frames`` (of a ``what`` message) as :func:`send_message` does."""
    parts: list[bytes | memoryview] = frames if identity is None else [identity, *frames]
    try:
        flags = 0 if block else zmq.NOBLOCK  # one frame: one call, no multipart loop
        _ = (sock.send(parts[0], flags, copy=False) if len(parts) == 1 else
             sock.send_multipart(parts, flags, copy=False))
    except zmq.Again:
        waited = f"after {limits.DEFAULT_SEND_TIMEOUT_MS} ms" if block else "at once"
        raise SendTimeout(f"send of {what} timed out {waited}; the peer is not reading"
                          ) from None
    except zmq.ZMQError as exc:
        if exc.errno == errno.EHOSTUNREACH:
            raise PeerUnreachable(f"no connected peer with identity {identity!r}") from None
        raise
    return sum(len(frame) if isinstance(frame, bytes) else frame.nbytes for frame in frames)


@overload
def recv_message(
    sock: zmq.Socket[bytes], timeout_s: float, with_identity: Literal[False] = False, *,
    max_total_bytes: int = limits.MAX_TOTAL_BYTES
) -> Message | None: ...


@overload
def recv_message(
    sock: zmq.Socket[bytes], timeout_s: float, with_identity: Literal[True], *,
    max_total_bytes: int = limits.MAX_TOTAL_BYTES
) -> tuple[bytes, Message] | None: ...


def recv_message(
    sock: zmq.Socket[bytes], timeout_s: float, with_identity: bool = False, *,
    max_total_bytes: int = limits.MAX_TOTAL_BYTES
) -> Message | tuple[bytes, Message] | None:
    """Wait at most ``timeout_s`` for one message and decode it (zero copy).

    Returns the message, ``(identity, message)`` when ``with_identity`` (ROUTER),
    or None on timeout. The deadline is set as the socket's RCVTIMEO, which stays
    set after the call. A message that fails to decode, or whose frames hold more than
    ``max_total_bytes`` (counted while reading, see ``recv_frames``), is consumed and
    raises ``ProtocolError`` with ``.identity`` set (ROUTER), so the caller can answer
    with an ``ErrorReply``; the socket stays usable.
    """
    if not (math.isfinite(timeout_s) and 0 <= timeout_s <= limits.MAX_RECV_TIMEOUT_S):
        raise ValueError(
            f"timeout_s must be a number in [0, {limits.MAX_RECV_TIMEOUT_S}], got {timeout_s!r}"
        )
    if with_identity != (sock.type == zmq.ROUTER):
        raise ValueError("with_identity=True is for ROUTER sockets, and ROUTER needs it")
    # RCVTIMEO bounds the wait inside libzmq: one C call, cheaper than a Poller.
    sock.setsockopt(zmq.RCVTIMEO, math.ceil(timeout_s * 1000))
    frames = recv_frames(sock, routed=with_identity, max_total_bytes=max_total_bytes)
    if frames is None:
        return None
    if not with_identity:
        return decode(frames)
    identity = _identity(frames[0])
    try:
        return identity, decode(frames[1:])
    except ProtocolError as error:
        error.identity = identity
        raise


def _identity(frame: zmq.Frame | bytes) -> bytes:
    return frame if isinstance(frame, bytes) else frame.bytes


def recv_frames(sock: zmq.Socket[bytes], *, routed: bool = False, flags: int = 0,
                accept: Callable[[bytes], bool] | None = None,
                admitted: Container[bytes] | None = None,
                max_total_bytes: int = limits.MAX_TOTAL_BYTES
                ) -> list[zmq.Frame | bytes] | None:
    """The frames of the next message (zero copy), or None if none came (``zmq.Again``).

    ``routed``: the first frame is a ROUTER identity, returned as bytes; when
    ``accept(identity)`` says no, the rest is read and released and only the identity
    is returned. Frames past what ``decode`` accepts (``MAX_FRAMES``) are read and
    released one by one instead of being kept, and one frame too many is kept, so that
    ``decode`` refuses the message: a message of a million frames costs no more memory
    here than one of ``MAX_FRAMES + 1``.

    Bytes are bounded the same way, while reading: ``max_total_bytes`` is the most the
    message's frames (a routing identity not counted) may hold, and on a ROUTER a
    sender whose identity is not in ``admitted`` (a stranger: it has not said Hello)
    gets ``admission.MAX_STRANGER_MESSAGE_BYTES`` instead (``admitted`` None: every
    sender is admitted). Once the frames read pass the limit, those kept are released,
    the rest are read and released, and ``ProtocolError`` (``identity`` set, and on a
    ROUTER ``user_id``: :func:`recv_routed`) is raised: it never holds more than that. libzmq itself hands out no frame of a
    message before its last frame has arrived, so the whole message was in memory, once
    and briefly, before this runs (``limits.MAX_MSG_SIZE_BYTES`` bounds each frame
    before it is buffered; only CURVE keeps a stranger from sending one at all).
    """
    keep = limits.MAX_FRAMES + 1 + int(routed)
    try:  # a small identity is cheaper copied than wrapped in a zmq.Frame
        first: zmq.Frame | bytes = sock.recv(flags, copy=routed)
    except zmq.Again:
        return None
    frames: list[zmq.Frame | bytes] = [first]
    identity: bytes | None = None
    crossed_on: str | None = None  # the User-Id of the connection of an over-limit message
    limit = max_total_bytes
    total = 0
    if routed:
        identity = _identity(first)
        if accept is not None and not accept(identity):
            keep = limit = 1  # dropped unread: nothing but the identity is kept
        elif admitted is not None and identity not in admitted:
            limit = min(limit, admission.MAX_STRANGER_MESSAGE_BYTES)
    else:
        total = len(first)
        if total > limit:
            frames.clear()
    more = first.more if isinstance(first, zmq.Frame) else sock.getsockopt(zmq.RCVMORE)
    while more:  # the rest of a message is there already; a Frame says whether more come
        frame = sock.recv(copy=False)
        more = frame.more
        total += len(frame)
        if total > limit:
            if routed and crossed_on is None:
                crossed_on = user_id(frame)
            del frames[int(routed):]  # release what was kept; keep reading to the end
        elif len(frames) < keep:
            frames.append(frame)
    if total > limit and keep > 1:
        whose = " for a sender that has not said Hello" if limit < max_total_bytes else ""
        raise _from_connection(ProtocolError(
            ERR_BAD_MESSAGE, f"message of {total} bytes exceeds the limit of {limit} bytes"
            f"{whose}; dropped while reading", identity=identity), crossed_on)
    return frames


def user_id(frame: zmq.Frame) -> str:
    """The ZAP ``User-Id`` of the connection a frame came on (with CURVE, the sender's
    z85 public key; our authenticator sets it), or "" without authentication."""
    try:
        return str(frame.get("User-Id"))
    except (zmq.ZMQError, UnicodeDecodeError):
        return ""


def peer_address(frame: zmq.Frame) -> str:
    """The remote IP address of the TCP connection a frame came on (ZeroMQ's
    ``Peer-Address`` message property, as libzmq writes it), or "" where there is none
    (``ipc://``, ``inproc://``)."""
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, UnicodeDecodeError):
        return ""


def _from_connection(error: ProtocolError, connection_user_id: str | None) -> ProtocolError:
    """``error`` with ``user_id`` set: the ZAP User-Id of the connection its message came
    on ("" without CURVE), None where no frame said (ProtocolError itself has no such
    field; the master reads it with ``getattr``)."""
    error.user_id = connection_user_id  # type: ignore[attr-defined]
    return error


@dataclass(frozen=True)
class Routed:
    """One message read from a ROUTER: the sender's identity, its ZAP ``User-Id``
    ("" without CURVE), the message, and the remote IP address of the connection it came
    on (``peer_address``, ZeroMQ's ``Peer-Address``; "" where the transport has none):
    the master matches it against the TCP connections that retransmit
    (``hetconv.master.liveness``)."""

    identity: bytes
    user_id: str
    message: Message
    peer_address: str = ""


def recv_routed(sock: zmq.Socket[bytes], accept: Callable[[bytes], bool] | None = None,
                admitted: Container[bytes] | None = None) -> Routed | bytes | None:
    """Read one waiting message from a ROUTER without waiting.

    Returns None when nothing is waiting, the sender's identity (bytes) when
    ``accept(identity)`` said no (the message was dropped undecoded), else a
    :class:`Routed` (with its connection's ``User-Id`` and ``Peer-Address``).
    ``admitted``: the identities of peers that said Hello; any other sender's message
    may hold at most ``admission.MAX_STRANGER_MESSAGE_BYTES`` (None: every sender gets
    ``MAX_TOTAL_BYTES``), see ``recv_frames``. A message that fails
    to decode or is over its limit raises ``ProtocolError`` with ``.identity`` and
    ``.user_id`` set (the connection's ZAP User-Id, as :attr:`Routed.user_id`; None
    where it could not be read), so that the master can tell a forgery under a worker's
    routing id from that worker's own bad message; the socket stays usable.
    """
    if sock.type != zmq.ROUTER:
        raise ValueError("recv_routed is for ROUTER sockets")
    frames = recv_frames(sock, routed=True, flags=zmq.NOBLOCK, accept=accept,
                         admitted=admitted)
    if frames is None:
        return None
    identity = _identity(frames[0])
    if len(frames) == 1 and accept is not None:
        return identity  # not accepted (an identity alone is no message anyway)
    last = frames[-1]
    try:
        message = decode(frames[1:])
    except ProtocolError as error:
        error.identity = identity
        _from_connection(error, user_id(last) if isinstance(last, zmq.Frame) else None)
        raise
    if not isinstance(last, zmq.Frame):  # a message has a header frame: not reached
        return Routed(identity, "", message)
    return Routed(identity, user_id(last), message, peer_address(last))
