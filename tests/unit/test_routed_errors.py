"""A message the master cannot decode, or that is over its limit, still says whose
connection it came on (``ProtocolError.user_id``, the ZAP User-Id, as ``Routed.user_id``):
so a forgery under a worker's routing id from another allowed CURVE key cannot pass for
that worker's bad reply (the worker's request fails only as its lost connection). One process, sockets on loopback, no clocks waited on."""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hetconv.master.membership import (
    BadMessage,
    ClusterSettings,
    Fail,
    Membership,
    MessageReceived,
    RequestsAwaited,
    RequestSent,
)
from hetconv.protocol import (
    PROTOCOL_VERSION,
    ForwardReply,
    ForwardRequest,
    Hello,
    ProtocolError,
    encode,
)
from hetconv.protocol.admission import MAX_STRANGER_MESSAGE_BYTES
from hetconv.protocol.transport import (
    CurveClientKeys,
    CurveServerKeys,
    bound_endpoint,
    generate_curve_keypair,
    make_context,
    master_socket,
    recv_routed,
    start_curve_authenticator,
    worker_socket,
)

pytestmark = [pytest.mark.timeout(30)]
SETTINGS = ClusterSettings(heartbeat_interval_s=0.5, liveness_timeout_s=5.0,
                           request_timeout_s=60.0, forgery_log_interval_s=10.0)


class Keys:
    def __init__(self) -> None:
        self.server = generate_curve_keypair()
        self.owner = generate_curve_keypair()  # the worker the routing id is bound to
        self.forger = generate_curve_keypair()  # another allowed key

    def client(self, pair: tuple[bytes, bytes]) -> CurveClientKeys:
        return CurveClientKeys(pair[0], pair[1], self.server[0])


@pytest.fixture
def curve_master() -> Iterator[tuple[Any, Keys]]:
    keys = Keys()
    context = make_context()
    authenticator = start_curve_authenticator(context, frozenset({keys.owner[0],
                                                                  keys.forger[0]}))
    sock = master_socket(context, "tcp://127.0.0.1:*", curve=CurveServerKeys(
        keys.server[0], keys.server[1], frozenset({keys.owner[0], keys.forger[0]})))
    try:
        yield sock, keys
    finally:
        sock.close(linger=0)
        authenticator.stop()
        context.term()


def read_error(sock: Any, admitted: set[bytes]) -> ProtocolError:
    """The ProtocolError of the next message to arrive (within 10 s)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        sock.poll(200)
        try:
            received = recv_routed(sock, admitted=admitted)
        except ProtocolError as error:
            return error
        assert received is None, f"decoded: {received!r}"
    raise AssertionError("no message arrived")


def send_from(keys: Keys, pair: tuple[bytes, bytes], endpoint: str,
              frames: list[bytes]) -> Any:
    context = make_context()
    sock = worker_socket(context, endpoint, b"id-b", curve=keys.client(pair))
    sock.send_multipart(frames)
    return context, sock


def test_an_undecodable_forgery_says_whose_it_is_and_blames_no_worker(
        curve_master: tuple[Any, Keys]) -> None:
    sock, keys = curve_master
    membership = Membership("run1", SETTINGS)
    owner = keys.owner[0].decode()
    membership.handle(MessageReceived(b"id-b", Hello(worker_id="b", device={"device": "cpu"},
                                                     protocol_version=PROTOCOL_VERSION),
                                      0.0, owner))
    worker = membership.workers[b"id-b"]
    request = ForwardRequest(request_id=membership.next_request_id(), step=0, layer=0,
                             attempt=0, train=True, x=np.zeros((1, 1, 2, 2), np.float32))
    membership.handle(RequestSent(worker, request, 0.0))
    membership.handle(RequestsAwaited({request.request_id: worker}, "forward of layer 1", 0.0))
    # the worker's own connection is gone; another allowed key takes its free routing id
    # and sends a reply to the pending request that cannot be decoded (its array is missing)
    header = encode(ForwardReply(request_id=request.request_id, step=0, layer=0, attempt=0,
                                 compute_s=0.0, y=np.zeros((1, 1, 1, 1), np.float32)))[0]
    context, forger = send_from(keys, keys.forger, bound_endpoint(sock), [bytes(header)])
    try:
        error = read_error(sock, {b"id-b"})
    finally:
        forger.close(linger=0)
        context.term()
    assert error.identity == b"id-b" and error.request_id == request.request_id
    assert getattr(error, "user_id", None) == keys.forger[0].decode()
    actions = membership.handle(BadMessage(error, getattr(error, "user_id", None), 1.0))
    assert not any(isinstance(action, Fail) for action in actions), actions
    assert worker.forgeries == 1  # and the worker's own connection counts as lost
    assert worker.gone and worker.connection_lost
    # the same bytes from the bound key are that worker's own bad reply: it fails
    assert any(isinstance(action, Fail)
               for action in membership.handle(BadMessage(error, owner, 2.0)))


def test_a_strangers_message_over_its_limit_says_whose_it_is(
        curve_master: tuple[Any, Keys]) -> None:
    sock, keys = curve_master
    context, stranger = send_from(keys, keys.forger, bound_endpoint(sock),
                                  [b"\x93", bytes(MAX_STRANGER_MESSAGE_BYTES)])
    try:
        error = read_error(sock, set())
    finally:
        stranger.close(linger=0)
        context.term()
    assert "has not said Hello" in error.message and error.identity == b"id-b"
    assert getattr(error, "user_id", None) == keys.forger[0].decode()


def test_without_curve_the_user_id_is_empty() -> None:
    context = make_context()
    sock = master_socket(context, "tcp://127.0.0.1:*")
    peer = worker_socket(context, bound_endpoint(sock), b"id-b")
    try:
        peer.send_multipart([b"\x93garbage"])
        error = read_error(sock, {b"id-b"})
    finally:
        peer.close(linger=0)
        sock.close(linger=0)
        context.term()
    assert error.identity == b"id-b" and getattr(error, "user_id", None) == ""
