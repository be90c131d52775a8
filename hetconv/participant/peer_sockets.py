"""The peer data plane's sockets: one bound PULL per participant, one PUSH per peer.

A participant binds a PULL socket (its data endpoint, announced to the master) and,
once the master has handed out the peers (``AssignPeers``), connects one PUSH to
each peer's endpoint. Pieces are :class:`~hetconv.protocol.PeerPiece` messages,
encoded by the protocol codec (every array description checked on receipt). With
CURVE the PULL is a CURVE server with ZAP domain enforcement (fails closed) whose
authenticator admits exactly the keys the master handed out; each PUSH is a CURVE
client that knows its peer's public key. These sockets are used by one thread
only: the worker's compute thread, or the master's helper thread. Outside a run
(before ``AssignPeers``, after ``EndRun``) nothing is expected on the data endpoint:
the worker's compute thread calls :meth:`PeerSockets.drain` while idle, so that what
strangers send there is released instead of piling up in libzmq's queue. Warnings
about bad messages are rate-limited (``admission.WarningBudget``).

Before it connects, :meth:`PeerSockets.open` checks that every peer's data port
answers a plain TCP connection (:func:`check_reachable`, at most
``DATA_PORT_PROBE_TIMEOUT_S``): a port a firewall drops is one clear line naming both
sides and the port (:func:`unreachable_line`) and a :class:`PeerLost` naming the
unreachable peer, instead of pieces queued toward a port that never answers.
"""
from __future__ import annotations

import errno
import logging
import math
import os
import selectors
import socket
import time
from typing import Any, cast
from urllib.parse import urlsplit

import zmq

from hetconv.config import MASTER_PARTICIPANT
from hetconv.errors import UserError
from hetconv.participant.piece_sources import endpoint_addresses, local_addresses, source_refusal
from hetconv.participant.ports import PeerLost
from hetconv.protocol import (
    PeerPiece,
    ProtocolError,
    admission,
    limits,
    peer_wire,
    transport,
)

log = logging.getLogger("hetconv.dataplane")


class AllowList:
    """ZAP credentials provider whose allowed keys change when the master says so."""

    def __init__(self) -> None:
        self.keys: frozenset[bytes] = frozenset()

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == limits.ZAP_DOMAIN and key in self.keys


def route_address(endpoint: str) -> str:
    """This machine's IP address on the route to ``endpoint``'s host (no packet is
    sent: a UDP socket is connected and asked for its own address)."""
    parts = urlsplit(endpoint)
    host = parts.hostname
    if parts.scheme != "tcp" or not host or host in ("*", "0.0.0.0"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, parts.port or 9))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


REBIND_S = 2.0
"""How long an idle data endpoint closed after a flood tries to listen on its port again."""
IDLE_DRAIN_BATCH = 4096
"""Messages one idle drain releases at most (the compute thread then looks for a request
and drains again at once while the flood lasts)."""
IDLE_FLOOD_MESSAGES = 64
"""Messages found at once on an idle data endpoint that make it a flood: every
connection to it is closed (a peer sends nothing there outside a run)."""
DATA_PORT_PROBE_TIMEOUT_S = 3.0
"""How long a participant waits for a peer's data port to accept a TCP connection when
the peers are handed out (never longer than the peer timeout): no answer within it is
reported as a port a firewall blocks."""
UNREACHABLE_MARK = "'s data port "
"""What every line of :func:`unreachable_line` holds (the master finds a worker's
report in its error reply by it)."""


def who(participant: str) -> str:
    """``the master`` or ``worker NAME``."""
    return "the master" if participant == MASTER_PARTICIPANT else f"worker {participant}"


def unreachable_line(me: str, peer: str, endpoint: str, reason: str) -> str:
    """The one line saying that ``me`` cannot reach ``peer``'s data port, e.g.
    ``worker b cannot reach worker a's data port tcp://10.0.0.1:5601 (no answer in
    3.0 s: a firewall blocking TCP port 5601?)``."""
    port = urlsplit(endpoint).port if endpoint.startswith("tcp://") else None
    hint = f"a firewall blocking TCP port {port}?" if port else "check its --advertise"
    return f"{who(me)} cannot reach {who(peer)}{UNREACHABLE_MARK}{endpoint} ({reason}: {hint})"


def is_unreachable_line(text: str) -> bool:
    return " cannot reach " in text and UNREACHABLE_MARK in text


def _start_probe(endpoint: str) -> socket.socket | str:
    """A non-blocking socket connecting to ``endpoint``, or why none could start."""
    parts = urlsplit(endpoint)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if parts.scheme != "tcp" or not host or port is None:
        return "not a tcp://HOST:PORT endpoint"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as error:
        return f"cannot resolve {host}: {error}"
    probe = socket.socket(family, kind, proto)
    probe.setblocking(False)
    code = probe.connect_ex(address)
    if code in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY):
        return probe
    probe.close()
    return os.strerror(code).lower()


def probe_endpoints(endpoints: dict[str, str], timeout_s: float) -> dict[str, str]:
    """Open a TCP connection to every endpoint at once and close it as soon as it is
    accepted (no ZMTP handshake, so a CURVE endpoint's authenticator never sees it);
    the peers whose endpoint accepted none within ``timeout_s``, each with why
    (``no answer in 3.0 s``, ``connection refused``, ...)."""
    failed: dict[str, str] = {}
    selector = selectors.DefaultSelector()
    try:
        for peer, endpoint in endpoints.items():
            started = _start_probe(endpoint)
            if isinstance(started, str):
                failed[peer] = started
            else:
                selector.register(started, selectors.EVENT_WRITE, peer)
        deadline = time.monotonic() + timeout_s
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in selector.select(left):
                probe = cast("socket.socket", key.fileobj)
                code = probe.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    failed[key.data] = os.strerror(code).lower()
                selector.unregister(probe)
                probe.close()
        for key in list(selector.get_map().values()):
            failed[key.data] = f"no answer in {timeout_s:.1f} s"
    finally:
        for key in list(selector.get_map().values()):
            selector.unregister(key.fileobj)
            cast("socket.socket", key.fileobj).close()
        selector.close()
    return failed


def check_reachable(me: str, peers: dict[str, str], timeout_s: float) -> None:
    """Probe every peer's data endpoint but ``me``'s (:func:`probe_endpoints`); when
    some cannot be reached, log one line for each (ERROR) and raise :class:`PeerLost`
    naming the one at fault: the first peer that cannot be reached, or ``me`` when none
    of two or more can (then its own network is the likelier cause)."""
    others = {peer: endpoint for peer, endpoint in peers.items() if peer != me}
    failed = probe_endpoints(others, timeout_s)
    if not failed:
        return
    lines = [unreachable_line(me, peer, others[peer], failed[peer])
             for peer in others if peer in failed]
    for line in lines:
        log.error("%s", line)
    first = next(peer for peer in others if peer in failed)
    if len(failed) == len(others) > 1:
        raise PeerLost([me], f"{lines[0]}; {who(me)} reaches none of its {len(others)} "
                             "peers' data ports: a firewall blocking its outgoing TCP?")
    raise PeerLost([first], lines[0])


def _options(sock: zmq.Socket[Any], send_timeout_ms: int) -> None:
    sock.setsockopt(zmq.LINGER, limits.DEFAULT_LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, limits.DEFAULT_SNDHWM)
    sock.setsockopt(zmq.RCVHWM, limits.DEFAULT_RCVHWM)
    sock.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.MAX_MSG_SIZE_BYTES)
    sock.setsockopt(zmq.HEARTBEAT_IVL, limits.HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, limits.HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, limits.HEARTBEAT_TTL_MS)
    sock.setsockopt(zmq.HANDSHAKE_IVL, limits.HANDSHAKE_IVL_MS)


class PeerSockets:
    """One participant's data endpoint and its connections to the peers (a PiecePort).

    ``curve``: this participant's (public, secret) z85 key pair, or None for plain ZMTP.
    ``authenticate``: start a ZAP handler on ``ctx`` whose allow-list :meth:`open`
    sets; pass False where one already runs on ``ctx`` (the master's, which admits
    its ``--curve-allow`` keys).
    """

    def __init__(self, ctx: zmq.Context[Any], bind: str,
                 curve: tuple[bytes, bytes] | None = None, authenticate: bool = True):
        self.ctx = ctx
        self.curve = curve
        self.allow = AllowList()
        self._authenticator: Any = None
        self.pushes: dict[str, zmq.Socket[Any]] = {}
        self.routes: dict[str, tuple[str, str]] = {}  # peer -> (endpoint, CURVE key)
        # without CURVE: peer -> the IP addresses its pieces may come from (piece_sources)
        self.sources: dict[str, frozenset[str]] = {}
        self.local: frozenset[str] = frozenset()
        self.send_timeout_ms = limits.DEFAULT_SEND_TIMEOUT_MS
        self.warnings = admission.WarningBudget()
        if curve is not None and authenticate:
            self._authenticator = transport.start_curve_authenticator(ctx, frozenset())
            self._authenticator.configure_curve_callback(domain=limits.ZAP_DOMAIN,
                                                         credentials_provider=self.allow)
        self.pull = ctx.socket(zmq.PULL)
        self._wait_ms = -1  # the pull socket's RCVTIMEO as last set by receive()
        try:
            _options(self.pull, self.send_timeout_ms)
            if curve is not None:
                self.pull.setsockopt(zmq.ZAP_DOMAIN, limits.ZAP_DOMAIN.encode())
                self.pull.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
                self.pull.setsockopt(zmq.CURVE_SERVER, 1)
                self.pull.setsockopt(zmq.CURVE_PUBLICKEY, curve[0])
                self.pull.setsockopt(zmq.CURVE_SECRETKEY, curve[1])
            self.pull.bind(bind)
        except zmq.ZMQError as error:
            self.close()
            raise UserError(f"cannot bind the data endpoint {bind}: {error.strerror}; "
                            "choose another --data-port") from None
        self.port = int(transport.bound_endpoint(self.pull).rsplit(":", 1)[1])

    @property
    def public_key(self) -> str:
        return self.curve[0].decode() if self.curve is not None else ""

    def endpoint(self, address: str) -> str:
        """The endpoint peers connect to, at ``address``."""
        return f"tcp://{address}:{self.port}"

    # --- set up by AssignPeers -------------------------------------------------------------
    def open(self, me: str, peers: dict[str, str], peer_keys: dict[str, str],
             timeout_s: float, probe: bool = True) -> PeerSockets:
        """Connect to ``peers`` (participant → endpoint) and admit exactly their
        ``peer_keys``; replaces earlier connections. Returns itself (the port).
        ``probe``: first check that every peer's data port answers
        (:func:`check_reachable`; :class:`PeerLost` if not, everything reset)."""
        self.reset()
        if probe:
            check_reachable(me, peers, min(DATA_PORT_PROBE_TIMEOUT_S, timeout_s))
        self.send_timeout_ms = max(1, int(timeout_s * 1000))
        if self.curve is not None:
            self.allow.keys = frozenset(key.encode() for peer, key in peer_keys.items()
                                        if peer != me and key)
        for peer in peers:
            if peer != me and self.curve is not None and not peer_keys.get(peer, ""):
                raise ValueError(f"no CURVE key for peer {peer}")
        self.routes = {peer: (endpoint, peer_keys.get(peer, ""))
                       for peer, endpoint in peers.items() if peer != me}
        if self.curve is None:  # CURVE admits exactly the keys: no address rule needed
            self.sources = {peer: endpoint_addresses(endpoint)
                            for peer, (endpoint, _) in self.routes.items()}
            self.local = local_addresses()
        return self

    def _connect(self, peer: str) -> zmq.Socket[Any] | None:
        """The PUSH to ``peer``, connected on first use: by the first piece every
        participant has its AssignPeers, so no handshake meets an empty allow-list
        (a CURVE handshake refused by ZAP would lose the pieces queued behind it)."""
        push = self.pushes.get(peer)
        if push is not None or peer not in self.routes:
            return push
        endpoint, key = self.routes[peer]
        push = cast("zmq.Socket[Any]", self.ctx.socket(zmq.PUSH))
        try:
            _options(push, self.send_timeout_ms)
            if self.curve is not None:
                push.setsockopt(zmq.CURVE_SERVERKEY, key.encode())
                push.setsockopt(zmq.CURVE_PUBLICKEY, self.curve[0])
                push.setsockopt(zmq.CURVE_SECRETKEY, self.curve[1])
            push.connect(endpoint)
        except BaseException:
            push.close(linger=0)
            raise
        self.pushes[peer] = push
        return push

    def reset(self) -> None:
        """Forget the peers: close the connections, admit nobody."""
        for push in self.pushes.values():
            push.close(linger=0)
        self.pushes = {}
        self.routes = {}
        self.sources = {}
        self.allow.keys = frozenset()

    def close(self) -> None:
        self.reset()
        self.pull.close(linger=0)
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None

    # --- the PiecePort ---------------------------------------------------------------------
    def send(self, participant: str, piece: PeerPiece) -> int:
        push = self._connect(participant)
        if push is None:
            raise PeerLost([participant], f"no connection to peer {participant}")
        try:
            transport.send_frames(push, peer_wire.pack_piece(piece), PeerPiece.TYPE)
        except (transport.TransportError, zmq.ZMQError) as error:
            raise PeerLost([participant], f"cannot send to peer {participant}: {error}") from None
        return int(piece.data.nbytes)

    def receive(self, timeout_s: float) -> PeerPiece | None:
        # RCVTIMEO bounds the wait (no Poller first), set only when it changes: 18 us
        # of CPU a call with cold caches (docs/figures/ab/peer-wire-cold.py); a timeout
        # of 0 is a poll (NOBLOCK), which leaves it as it is
        flags = zmq.NOBLOCK if timeout_s <= 0 else 0
        wait_ms = math.ceil(min(max(0.0, timeout_s), limits.MAX_RECV_TIMEOUT_S) * 1000)
        if not flags and wait_ms != self._wait_ms:
            self.pull.setsockopt(zmq.RCVTIMEO, wait_ms)
            self._wait_ms = wait_ms
        try:
            frames = transport.recv_frames(self.pull, flags=flags)
            message = None if frames is None else peer_wire.decode_frames(frames)
        except ProtocolError as error:
            self._warn(f"dropped an undecodable data-plane message: {error}")
            return None
        if not isinstance(message, PeerPiece):
            if message is not None:
                self._warn(f"dropped a {message.TYPE} on the data endpoint")
            return None
        if self.sources and frames and isinstance(frames[0], zmq.Frame):
            refusal = source_refusal(message.sender, transport.peer_address(frames[0]),
                                     self.sources, self.local)
            if refusal is not None:
                self._warn(refusal)
                return None
        return message

    # --- outside a run ---------------------------------------------------------------------
    def drain(self, max_messages: int = IDLE_DRAIN_BATCH) -> int:
        """Read and release, undecoded, up to ``max_messages`` messages waiting on the
        data endpoint (outside a run nothing should be there); how many there were.
        Each frame is taken without a copy and dropped at once: a flood is released
        as fast as libzmq hands it over (about 3 us a frame)."""
        dropped = 0
        pull = self.pull
        while dropped < max_messages:
            try:
                pull.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            while pull.getsockopt(zmq.RCVMORE):
                pull.recv(copy=False)
            dropped += 1
        if dropped >= IDLE_FLOOD_MESSAGES:  # a flood: nothing is expected here outside a run
            self._rebind()
            self._warn(f"dropped {dropped} message(s) that came to the data endpoint "
                       "outside a run, and closed every connection to it (a flood)")
        elif dropped:
            self._warn(f"dropped {dropped} message(s) that came to the data endpoint "
                       "outside a run")
        else:
            self._summarize(time.monotonic())
        return dropped

    def _rebind(self) -> None:
        """Close every connection to the data endpoint, with what libzmq queued for it,
        and listen again on the same port (outside a run: no peer is connected). libzmq
        closes the listener in its I/O thread: the port may still be taken for a moment,
        so the bind is tried again for up to ``REBIND_S``."""
        endpoint = transport.bound_endpoint(self.pull)
        try:
            self.pull.unbind(endpoint)
        except zmq.ZMQError as error:
            log.warning("could not close the data endpoint %s: %s", endpoint, error)
            return
        deadline = time.monotonic() + REBIND_S
        while True:
            try:
                self.pull.bind(endpoint)
                return
            except zmq.ZMQError as error:
                if time.monotonic() >= deadline:
                    log.error("could not listen again on the data endpoint %s: %s",
                              endpoint, error)
                    return
                time.sleep(0.01)

    def _warn(self, text: str) -> None:
        now = time.monotonic()
        self._summarize(now)
        if self.warnings.admit(now):
            log.warning("%s", text)

    def _summarize(self, now: float) -> None:
        suppressed = self.warnings.take_suppressed(now)
        if suppressed:
            log.warning("%d more data-plane warning(s) not logged in the last %.0f s",
                        suppressed, self.warnings.window_s)
