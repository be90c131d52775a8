"""Big messages from strangers, and nonsensical requests, against real processes.

Issue 20 items 3 and 4. What the reader can bound, and what it cannot: libzmq hands
out no frame of a multipart message before its last frame has arrived, so a message
of several large frames is in the receiving process's memory once, whole, before any
reader runs (each frame is bounded by ``MAXMSGSIZE``; only CURVE keeps a stranger from
sending one at all). What our side guarantees, and these tests check: such a message
is released as it is read and never kept or decoded, a stranger's message over
``MAX_STRANGER_MESSAGE_BYTES`` is refused however small next to ``MAX_TOTAL_BYTES``,
nothing a stranger sends to a worker's data endpoint between runs stays in memory,
each costs one log line, and the process goes on serving. And a real worker answers
``bad_request`` to a nonsensical ``AssignShard``, ``ForwardRequest`` or
``CalibrateRequest`` and keeps serving.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import numpy as np
import psutil
import pytest
import zmq

from hetconv.lab import free_port
from hetconv.protocol import (
    ERR_BAD_REQUEST,
    PROTOCOL_VERSION,
    Ack,
    AssignShard,
    CalibrateRequest,
    DataEndpoint,
    ErrorReply,
    ForwardReply,
    ForwardRequest,
    Heartbeat,
    Hello,
    LinkProbeReply,
    Message,
    Welcome,
    encode,
)
from hetconv.protocol.admission import MAX_STRANGER_MESSAGE_BYTES
from hetconv.protocol.transport import make_context, master_socket, recv_message, send_message
from tests.conftest import REPO, child_env

pytestmark = [pytest.mark.integration]

MIB = 1 << 20
FRAME_BYTES = 64 * MIB
FRAMES = 4
"""A stranger's message: a header and FRAMES frames of FRAME_BYTES (256 MiB)."""
RELEASED_MIB = 48
"""After a refusal the receiver's RSS is within this of where it was before."""


def big_message() -> list[Any]:
    block = memoryview(bytes(FRAME_BYTES))  # one buffer, sent FRAMES times without copies
    return [b"\x93garbage", *([block] * FRAMES)]


def rss_mib(pid: int) -> float:
    return float(psutil.Process(pid).memory_info().rss) / MIB


# --- the reader: a ROUTER as the master reads it ---------------------------------------------
READER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import zmq
from hetconv.protocol import ProtocolError
from hetconv.protocol.transport import make_context, master_socket, recv_routed
ctx = make_context()
sock = master_socket(ctx, "tcp://127.0.0.1:*")
print(sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
admitted = {b"worker-1"}
for command in sys.stdin:  # one line per message to read: nothing is read before it
    if not sock.poll(10_000):
        print(json.dumps({"read": "nothing"}), flush=True)
        continue
    try:
        received = recv_routed(sock, admitted=admitted)
    except ProtocolError as error:
        print(json.dumps({"refused": str(error), "identity": error.identity.decode()}),
              flush=True)
        continue
    print(json.dumps({"read": received.message.TYPE, "identity": received.identity.decode()}),
          flush=True)
"""


def dealer(ctx: zmq.Context[Any], endpoint: str, identity: bytes) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.connect(endpoint)
    return sock


def read_one(reader: subprocess.Popen[str]) -> dict[str, str]:
    assert reader.stdin is not None and reader.stdout is not None
    reader.stdin.write("read\n")
    reader.stdin.flush()
    line = reader.stdout.readline()
    assert line, "the reader died"
    result: dict[str, str] = json.loads(line)
    return result


@pytest.mark.timeout(120)
def test_a_strangers_big_message_is_released_while_read_and_refused() -> None:
    reader = subprocess.Popen([sys.executable, "-c", READER, str(REPO)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=child_env(), cwd=REPO)
    ctx = zmq.Context()
    try:
        assert reader.stdout is not None
        endpoint = reader.stdout.readline().strip()
        stranger = dealer(ctx, endpoint, b"stranger")
        worker = dealer(ctx, endpoint, b"worker-1")
        time.sleep(0.5)
        before = rss_mib(reader.pid)
        stranger.send_multipart(big_message(), copy=False)
        held = before
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and held < before + 0.9 * FRAMES * FRAME_BYTES / MIB:
            time.sleep(0.05)
            held = max(held, rss_mib(reader.pid))
        refused = read_one(reader)
        time.sleep(0.3)
        after = rss_mib(reader.pid)
        print(f"reader RSS: {before:.0f} MiB before, {held:.0f} MiB while libzmq held the "
              f"unread {FRAMES * FRAME_BYTES // MIB} MiB message, {after:.0f} MiB after")
        assert refused["identity"] == "stranger"
        assert (f"exceeds the limit of {MAX_STRANGER_MESSAGE_BYTES} bytes for a sender that "
                "has not said Hello") in refused["refused"]
        assert after < before + RELEASED_MIB, (before, held, after)
        assert held < before + FRAMES * FRAME_BYTES / MIB + RELEASED_MIB  # never a 2nd copy

        # the limit is the stranger's: a known worker's message of the same 100 KiB is read
        payload = np.zeros(100 * 1024, np.uint8)
        stranger.send_multipart(encode(LinkProbeReply(request_id=1, received_bytes=0,
                                                      payload=payload)))
        worker.send_multipart(encode(LinkProbeReply(request_id=2, received_bytes=0,
                                                    payload=payload)))
        first, second = read_one(reader), read_one(reader)
        by_sender = {result["identity"]: result for result in (first, second)}
        assert "exceeds the limit" in by_sender["stranger"]["refused"]
        assert by_sender["worker-1"]["read"] == "link_probe_reply"
        stranger.close()
        worker.close()
    finally:
        ctx.term()
        reader.kill()
        reader.communicate()


# --- a real worker ----------------------------------------------------------------------------
def welcomed_worker(router: zmq.Socket[Any], workers: Any, *extra: str) -> tuple[Any, bytes]:
    """Start a worker, answer its Hello; (the LocalWorker, its identity)."""
    (worker,) = workers("victim", extra_args=tuple(extra))
    received = recv_message(router, 30, with_identity=True)
    assert received is not None, worker.output()[-3000:]
    identity, hello = received
    assert isinstance(hello, Hello)
    send_message(router, Welcome(worker_id=hello.worker_id, run_id="t",
                                 heartbeat_interval_s=0.2, protocol_version=PROTOCOL_VERSION),
                 identity=identity)
    return worker, identity


def reply_to(router: zmq.Socket[Any], request: Message, identity: bytes,
             timeout_s: float = 20) -> Message:
    """Send ``request`` and return the worker's answer (heartbeats and its data endpoint
    announcement skipped)."""
    send_message(router, request, identity=identity)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        received = recv_message(router, max(0.0, deadline - time.monotonic()), with_identity=True)
        if received is not None and not isinstance(received[1], (Heartbeat, DataEndpoint)):
            return received[1]
    raise AssertionError(f"no reply to {request.TYPE} within {timeout_s} s")


def heartbeats(router: zmq.Socket[Any], count: int, timeout_s: float = 5) -> int:
    seen = 0
    deadline = time.monotonic() + timeout_s
    while seen < count and time.monotonic() < deadline:
        got = recv_message(router, 1.0, with_identity=True)
        seen += got is not None and isinstance(got[1], Heartbeat)
    return seen


@pytest.mark.timeout(120)
def test_worker_releases_what_a_stranger_sends_its_data_endpoint(endpoint: str,
                                                                 workers: Any) -> None:
    data_port = free_port()
    ctx = make_context()
    router = master_socket(ctx, endpoint)
    pusher_ctx = zmq.Context()
    try:
        worker, _ = welcomed_worker(router, workers, "--data-port", str(data_port))
        assert heartbeats(router, 3) == 3
        pid = worker.process.pid
        before = rss_mib(pid)
        pusher = pusher_ctx.socket(zmq.PUSH)
        # close() does not wait: libzmq goes on sending for LINGER ms, then drops what is
        # left and the connection (the worker then discards a partial message unread, no
        # line logged: seen in CI with 5 s on a loaded machine). 30 s covers a slow machine.
        pusher.setsockopt(zmq.LINGER, 30_000)
        pusher.connect(f"tcp://127.0.0.1:{data_port}")
        pusher.send_multipart(big_message(), copy=False)
        pusher.close()
        # Done when the worker has logged the drop and its memory is back: waiting on both
        # (not on the RSS peak alone, which a 50 ms sample can miss or see before the
        # message is read) keeps a loaded machine from reading the log too early.
        peak, after = before, before
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.05)
            after = rss_mib(pid)
            peak = max(peak, after)
            if "outside a run" in worker.output() and after < before + RELEASED_MIB:
                break
        print(f"worker RSS: {before:.0f} MiB before, peak {peak:.0f} MiB, {after:.0f} MiB after")
        assert "outside a run" in worker.output(), (before, peak, after, worker.output()[-3000:])
        assert after < before + RELEASED_MIB, (before, peak, after)
        assert heartbeats(router, 3) == 3, worker.output()[-3000:]
        assert worker.process.poll() is None
        output = worker.output()
        assert output.count("outside a run") == 1, output[-3000:]
        assert "Traceback" not in output
    finally:
        router.close(linger=0)
        ctx.term()
        pusher_ctx.term()


def assign(**changes: Any) -> AssignShard:
    rng = np.random.default_rng(0)
    kernels, channels = 2, 3
    weight = rng.standard_normal((kernels, channels, 3, 3)).astype(np.float32)
    vector = np.zeros(kernels, np.float32)
    fields: dict[str, Any] = dict(
        request_id=1, layer=0, kernel_start=0, kernel_stop=kernels, stride=1, padding=1,
        need_dx=False, bn_momentum=0.1, bn_eps=1e-5, momentum=0.9, weight_decay=5e-4,
        weight=weight, gamma=np.ones(kernels, np.float32), beta=vector,
        running_mean=vector, running_var=np.ones(kernels, np.float32),
        velocity_weight=np.zeros_like(weight), velocity_gamma=vector, velocity_beta=vector,
        pool="none")
    fields.update(changes)
    return AssignShard(**fields)


@pytest.mark.timeout(120)
def test_worker_answers_bad_request_to_nonsense_and_keeps_serving(endpoint: str,
                                                                  workers: Any) -> None:
    ctx = make_context()
    router = master_socket(ctx, endpoint)
    try:
        worker, identity = welcomed_worker(router, workers)
        x = np.ones((2, 3, 8, 8), np.float32)
        nonsense: list[Message] = [
            assign(request_id=11, stride=0), assign(request_id=12, padding=-3),
            assign(request_id=13, bn_eps=-1.0),
            ForwardRequest(request_id=14, step=0, layer=0, attempt=0, train=True,
                           x=np.full((2, 3, 8, 8), np.nan, np.float32)),
            CalibrateRequest(request_id=15, layer=0, batch=1024, in_channels=64, height=128,
                             width=128, kernels=64, kernel_size=3, stride=1, padding=1,
                             repeats=3)]  # a 4 GiB input: refused before anything is built
        for request in nonsense:
            start = time.monotonic()
            reply = reply_to(router, request, identity)
            assert isinstance(reply, ErrorReply), reply
            assert reply.code == ERR_BAD_REQUEST and reply.request_id == request.request_id
            assert time.monotonic() - start < 5, f"{request.TYPE} took long to refuse"
        assert isinstance(reply_to(router, assign(request_id=20), identity), Ack)
        reply = reply_to(router, ForwardRequest(request_id=21, step=0, layer=0, attempt=0,
                                                train=True, x=x), identity)
        assert isinstance(reply, ForwardReply) and reply.y.shape == (2, 2, 8, 8)
        assert np.isfinite(reply.y).all()
        assert psutil.Process(worker.process.pid).memory_info().rss < 1 << 30
        output = worker.output()
        assert 1 <= output.count("refused a request from the master") <= 3, output[-3000:]
        assert "Traceback" not in output
    finally:
        router.close(linger=0)
        ctx.term()
