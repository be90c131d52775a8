"""Round-trip benchmark: our codec + transport against bare pyzmq, side by side.

A ``ForwardRequest`` carrying an N MiB float32 array goes over loopback TCP from a
ROUTER (the master side) to a DEALER echo peer in a thread, which answers with a
``ForwardReply`` whose ``y`` is the received array (sent on without a copy). The
baseline sends the same header bytes and array buffer with plain
``send_multipart(copy=False)`` / ``recv_multipart(copy=False)`` and echoes the frames
back unchanged. A sample of a small size is the mean of a short batch of round
trips (at least ``MIN_SAMPLE_S`` long) to tame scheduler noise. Both run in the same process and the same run, interleaved, and the
medians are compared: the overhead is what encode, validation, decode and our
socket helpers cost on top of moving the bytes.

Run: ``python -m protocol.bench_roundtrip --sizes 4 64 --repeats 9``.
"""
from __future__ import annotations

import argparse
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from protocol.codec import encode
from protocol.messages import ForwardReply, ForwardRequest, Hello
from protocol.transport import (
    bound_endpoint,
    make_context,
    master_socket,
    recv_message,
    send_message,
    worker_socket,
)
from protocol.version import PROTOCOL_VERSION

ECHO_IDENTITY = b"echo"
POLL_MS = 50
REPLY_TIMEOUT_S = 60.0
MIN_SAMPLE_S = 0.05


def _codec_echo(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str,
                stop: threading.Event) -> None:
    sock = worker_socket(ctx, endpoint, ECHO_IDENTITY)
    try:
        send_message(sock, Hello("echo", {"kind": "cpu"}, PROTOCOL_VERSION))
        while not stop.is_set():
            msg = recv_message(sock, POLL_MS / 1000)
            if isinstance(msg, ForwardRequest):
                send_message(sock, ForwardReply(msg.request_id, msg.step, msg.layer,
                                                msg.attempt, 0.0, msg.x))
    finally:
        sock.close()


def _bare_echo(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str,
               stop: threading.Event) -> None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, ECHO_IDENTITY)
    sock.setsockopt(zmq.LINGER, 500)
    sock.connect(endpoint)
    try:
        sock.send(b"ready")
        while not stop.is_set():
            if sock.poll(POLL_MS, zmq.POLLIN):
                sock.send_multipart(sock.recv_multipart(copy=False), copy=False)
    finally:
        sock.close()


def _median_pair(
    x: np.ndarray, repeats: int, codec_sock: zmq.Socket[bytes], bare_sock: zmq.Socket[bytes]
) -> tuple[float, float]:
    header = encode(ForwardRequest(0, 0, 0, 0, True, x))[0]
    buffer = memoryview(x.reshape(-1).view(np.uint8))

    def codec_once(request_id: int) -> float:
        start = time.perf_counter()
        for _ in range(batch):
            send_message(codec_sock, ForwardRequest(request_id, request_id, 0, 0, True, x),
                         identity=ECHO_IDENTITY)
            reply = recv_message(codec_sock, REPLY_TIMEOUT_S, with_identity=True)
            if reply is None or not isinstance(reply[1], ForwardReply):
                raise RuntimeError("codec echo did not answer")
            if reply[1].request_id != request_id or reply[1].y.shape != x.shape:
                raise RuntimeError("codec echo answered the wrong thing")
        return (time.perf_counter() - start) / batch

    def bare_once() -> float:
        start = time.perf_counter()
        for _ in range(batch):
            bare_sock.send_multipart([ECHO_IDENTITY, header, buffer], copy=False)
            if not bare_sock.poll(int(REPLY_TIMEOUT_S * 1000), zmq.POLLIN):
                raise RuntimeError("bare echo did not answer")
            frames = bare_sock.recv_multipart(copy=False)
            if len(frames) != 3 or len(frames[2]) != x.nbytes:
                raise RuntimeError("bare echo answered the wrong thing")
        return (time.perf_counter() - start) / batch

    batch = 1
    for warmup in range(2):
        codec_once(warmup)
        warm_s = bare_once()
    # Short round trips are averaged over a batch per sample so that each sample
    # lasts at least MIN_SAMPLE_S; scheduler noise on a small machine swamps them otherwise.
    batch = max(1, math.ceil(MIN_SAMPLE_S / warm_s))
    codec_times: list[float] = []
    bare_times: list[float] = []
    for repeat in range(repeats):  # interleaved, order alternating, to share the noise
        if repeat % 2 == 0:
            codec_times.append(codec_once(repeat))
            bare_times.append(bare_once())
        else:
            bare_times.append(bare_once())
            codec_times.append(codec_once(repeat))
    return statistics.median(codec_times), statistics.median(bare_times)


def run_roundtrip_bench(
    sizes_mib: Sequence[float] = (4, 64),
    repeats: int = 9,
    out: Callable[[str], Any] = print,
) -> list[dict[str, float]]:
    """Median round-trip seconds, codec vs bare pyzmq, for each array size.

    Returns one dict per size: ``size_mib``, ``repeats``, ``codec_median_s``,
    ``bare_median_s``, ``overhead_pct`` (codec over bare, in percent) and
    ``codec_gib_per_s`` (payload bytes both ways per second).
    """
    codec_ctx, bare_ctx = make_context(), zmq.Context()
    stop = threading.Event()
    codec_sock = master_socket(codec_ctx, "tcp://127.0.0.1:*")
    bare_sock = bare_ctx.socket(zmq.ROUTER)
    bare_sock.setsockopt(zmq.LINGER, 500)
    bare_sock.bind("tcp://127.0.0.1:*")
    threads = [
        threading.Thread(target=_codec_echo, args=(codec_ctx, bound_endpoint(codec_sock), stop)),
        threading.Thread(target=_bare_echo, args=(bare_ctx, bound_endpoint(bare_sock), stop)),
    ]
    for thread in threads:
        thread.start()
    results: list[dict[str, float]] = []
    try:
        if recv_message(codec_sock, REPLY_TIMEOUT_S, with_identity=True) is None:
            raise RuntimeError("codec echo peer did not say hello")
        if not bare_sock.poll(int(REPLY_TIMEOUT_S * 1000), zmq.POLLIN):
            raise RuntimeError("bare echo peer did not say ready")
        bare_sock.recv_multipart()
        rng = np.random.default_rng(0)
        out(f"round trip of a float32 array over loopback, median of {repeats}")
        out(f"{'MiB':>8} {'codec ms':>10} {'bare ms':>10} {'overhead':>9} {'GiB/s':>7}")
        for size_mib in sizes_mib:
            count = int(size_mib * 1024 * 1024) // 4
            x = rng.standard_normal(count, dtype=np.float32).reshape(-1, 256)
            codec_s, bare_s = _median_pair(x, repeats, codec_sock, bare_sock)
            row = {
                "size_mib": float(size_mib),
                "repeats": float(repeats),
                "codec_median_s": codec_s,
                "bare_median_s": bare_s,
                "overhead_pct": 100.0 * (codec_s - bare_s) / bare_s,
                "codec_gib_per_s": 2 * x.nbytes / codec_s / 2**30,
            }
            results.append(row)
            out(f"{size_mib:>8g} {codec_s * 1e3:>10.2f} {bare_s * 1e3:>10.2f} "
                f"{row['overhead_pct']:>8.1f}% {row['codec_gib_per_s']:>7.2f}")
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=5)
        codec_sock.close()
        bare_sock.close()
        codec_ctx.term()
        bare_ctx.term()
    return results


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry: ``python -m protocol.bench_roundtrip``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=float, nargs="+", default=[4, 64], help="array MiB")
    parser.add_argument("--repeats", type=int, default=9, help="timed round trips per size")
    args = parser.parse_args(argv)
    run_roundtrip_bench(tuple(args.sizes), args.repeats)


if __name__ == "__main__":
    main()
