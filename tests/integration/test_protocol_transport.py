"""Integration tests of protocol.transport: real ROUTER/DEALER sockets on loopback."""
from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import zmq

from hetconv.bench.protocol_roundtrip import run_roundtrip_bench
from hetconv.protocol import limits
from hetconv.protocol.codec import encode
from hetconv.protocol.errors import ERR_BAD_MESSAGE, ProtocolError, VersionMismatch
from hetconv.protocol.messages import (
    ErrorReply,
    ForwardReply,
    ForwardRequest,
    Heartbeat,
    Hello,
    Welcome,
    message_equal,
)
from hetconv.protocol.transport import (
    CurveClientKeys,
    CurveServerKeys,
    PeerUnreachable,
    SendTimeout,
    bound_endpoint,
    generate_curve_keypair,
    make_context,
    master_socket,
    recv_message,
    send_message,
    start_curve_authenticator,
    worker_socket,
)
from hetconv.protocol.version import PROTOCOL_VERSION

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

LOOPBACK = "tcp://127.0.0.1:*"


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context = make_context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def pair(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    """A master ROUTER and a connected worker DEALER (identity b"w1") that said hello."""
    master = master_socket(ctx, LOOPBACK)
    worker = worker_socket(ctx, bound_endpoint(master), b"w1")
    send_message(worker, Hello("w1", {"kind": "cpu", "cores": 2}, PROTOCOL_VERSION))
    received = recv_message(master, 5.0, with_identity=True)
    assert received is not None and received[0] == b"w1"
    yield master, worker
    worker.close()
    master.close()


def test_round_trip_both_ways(pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    master, worker = pair
    x = np.random.default_rng(0).standard_normal((8, 3, 28, 28)).astype(np.float32)
    sent_bytes = send_message(master, ForwardRequest(11, 1, 0, 0, True, x), identity=b"w1")
    assert sent_bytes > x.nbytes
    request = recv_message(worker, 5.0)
    assert isinstance(request, ForwardRequest) and np.array_equal(request.x, x)
    reply = ForwardReply(request.request_id, request.step, request.layer, request.attempt,
                         0.01, np.ascontiguousarray(request.x[:, :2]))
    send_message(worker, reply)
    received = recv_message(master, 5.0, with_identity=True)
    assert received is not None
    identity, answer = received
    assert identity == b"w1" and message_equal(answer, reply)


def test_large_array_round_trip(pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]) -> None:
    master, worker = pair
    x = np.arange(8 * 2**20 // 4, dtype=np.float32)
    send_message(master, ForwardRequest(1, 1, 0, 0, True, x), identity=b"w1")
    request = recv_message(worker, 10.0)
    assert isinstance(request, ForwardRequest) and np.array_equal(request.x, x)
    assert not request.x.flags.writeable


def test_recv_timeout_returns_none_promptly(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    master, worker = pair
    start = time.monotonic()
    assert recv_message(master, 0.2, with_identity=True) is None
    assert 0.15 <= time.monotonic() - start < 2.0
    start = time.monotonic()
    assert recv_message(worker, 0.0) is None
    assert time.monotonic() - start < 0.5
    for bad in (float("inf"), float("nan"), -1.0, 1e9):
        with pytest.raises(ValueError, match="timeout_s"):
            recv_message(worker, bad)
    with pytest.raises(ValueError, match="ROUTER"):
        recv_message(master, 0.1)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="ROUTER"):
        recv_message(worker, 0.1, with_identity=True)


def test_garbage_gives_protocol_error_with_identity_and_socket_keeps_working(
    ctx: zmq.Context[zmq.Socket[bytes]],
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    master, _ = pair
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.ROUTING_ID, b"rogue")
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(bound_endpoint(master))
    try:
        raw.send_multipart([b"\xc1 not msgpack", b"junk"])
        with pytest.raises(ProtocolError) as info:
            recv_message(master, 5.0, with_identity=True)
        assert info.value.identity == b"rogue" and info.value.code == ERR_BAD_MESSAGE
        raw.send_multipart([b"h"] * (limits.MAX_FRAMES + 1))
        with pytest.raises(ProtocolError, match="frames"):
            recv_message(master, 5.0, with_identity=True)
        bad_version = msgpack.unpackb(encode(Heartbeat(1.0))[0])
        bad_version["v"] = PROTOCOL_VERSION + 1
        raw.send(msgpack.packb(bad_version))
        with pytest.raises(VersionMismatch) as mismatch:
            recv_message(master, 5.0, with_identity=True)
        assert mismatch.value.identity == b"rogue" and mismatch.value.remote_version == PROTOCOL_VERSION + 1
        # the master can answer the offender and go on receiving valid messages
        error = info.value
        send_message(master, ErrorReply(error.request_id or 0, error.code, str(error)),
                     identity=error.identity)
        assert raw.poll(5000) and raw.recv_multipart()
        raw.send_multipart(encode(Heartbeat(2.0)))
        received = recv_message(master, 5.0, with_identity=True)
        assert received == (b"rogue", Heartbeat(2.0))
    finally:
        raw.close()


def test_send_to_unknown_identity_raises(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    master, _ = pair
    with pytest.raises(PeerUnreachable):
        send_message(master, Heartbeat(1.0), identity=b"nobody")


def test_send_times_out_when_peer_does_not_read(
    ctx: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "DEFAULT_SEND_TIMEOUT_MS", 200)
    # A TCP listener that never speaks ZMTP holds the port for the whole test (a port
    # closed and left free could be taken by another process's socket meanwhile).
    silent = socket.create_server(("127.0.0.1", 0))
    endpoint = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
    worker = worker_socket(ctx, endpoint, b"lonely")
    try:
        start = time.monotonic()
        with pytest.raises(SendTimeout, match="timed out"):
            for _ in range(10 * limits.DEFAULT_SNDHWM):
                send_message(worker, Heartbeat(1.0))
        assert time.monotonic() - start < 5.0
    finally:
        worker.close(linger=0)
        silent.close()


def test_socket_options_are_bounded(
    ctx: zmq.Context[zmq.Socket[bytes]], pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]
) -> None:
    for sock in pair:
        assert sock.getsockopt(zmq.LINGER) == limits.DEFAULT_LINGER_MS
        assert sock.getsockopt(zmq.SNDHWM) == limits.DEFAULT_SNDHWM
        assert sock.getsockopt(zmq.RCVHWM) == limits.DEFAULT_RCVHWM
        assert sock.getsockopt(zmq.MAXMSGSIZE) == limits.MAX_MSG_SIZE_BYTES
        assert sock.getsockopt(zmq.SNDTIMEO) == limits.DEFAULT_SEND_TIMEOUT_MS
        assert sock.getsockopt(zmq.HEARTBEAT_IVL) == limits.HEARTBEAT_IVL_MS
    _, worker = pair
    assert worker.getsockopt(zmq.RECONNECT_IVL_MAX) == limits.RECONNECT_IVL_MAX_MS
    with pytest.raises(ValueError, match="identity"):
        worker_socket(ctx, "tcp://127.0.0.1:1", b"\0bad")


def test_curve_admits_only_allowed_keys_and_fails_closed(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    server_public, server_secret = generate_curve_keypair()
    good_public, good_secret = generate_curve_keypair()
    bad_public, bad_secret = generate_curve_keypair()
    server = CurveServerKeys(server_public, server_secret, frozenset({good_public}))

    # no authenticator on this context: ZAP_ENFORCE_DOMAIN refuses everyone
    unguarded = master_socket(ctx, LOOPBACK, curve=server)
    client = worker_socket(ctx, bound_endpoint(unguarded), b"g0",
                           curve=CurveClientKeys(good_public, good_secret, server_public))
    send_message(client, Heartbeat(0.0))
    assert recv_message(unguarded, 0.5, with_identity=True) is None
    client.close(linger=0)
    unguarded.close(linger=0)

    authenticator = start_curve_authenticator(ctx, server.allowed_client_keys)
    try:
        master = master_socket(ctx, LOOPBACK, curve=server)
        good = worker_socket(ctx, bound_endpoint(master), b"good",
                             curve=CurveClientKeys(good_public, good_secret, server_public))
        bad = worker_socket(ctx, bound_endpoint(master), b"bad",
                            curve=CurveClientKeys(bad_public, bad_secret, server_public))
        send_message(bad, Heartbeat(1.0))
        send_message(good, Hello("good", {"kind": "cpu"}, PROTOCOL_VERSION))
        received = recv_message(master, 5.0, with_identity=True)
        assert received is not None and received[0] == b"good"
        send_message(master, Welcome("good", "run-1", 1.0, PROTOCOL_VERSION), identity=b"good")
        assert isinstance(recv_message(good, 5.0), Welcome)
        assert recv_message(master, 0.5, with_identity=True) is None  # bad key never heard
        for sock in (good, bad, master):
            sock.close(linger=0)
    finally:
        authenticator.stop()


def test_roundtrip_bench_smoke() -> None:
    lines: list[str] = []
    rows = run_roundtrip_bench(sizes_mib=(0.25,), repeats=3, out=lines.append)
    assert len(rows) == 1 and rows[0]["size_mib"] == 0.25
    assert rows[0]["codec_median_s"] > 0 and rows[0]["bare_median_s"] > 0
    assert len(lines) == 3 and "%" in lines[-1]
