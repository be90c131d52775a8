"""Round-trip benchmark: our codec + transport against bare pyzmq, side by side.

A ``ForwardRequest`` carrying an N MiB float32 array goes over loopback TCP from the
master's ROUTER to a DEALER echo peer in a thread, which answers with a
``ForwardReply`` whose ``y`` is the received array (sent on without a copy). The
baseline ("bare") sends the same header bytes and array buffer with plain
``send_multipart(copy=False)`` / ``recv_multipart(copy=False)``, and the echo sends
the received buffers back the same way.

Both paths share one TCP connection, one echo thread and one I/O thread (the echo
tells them apart by the first bytes of frame 0), so that thread placement on a
small machine cannot favour one path; samples are interleaved in a random order
that changes every repeat, and the medians are compared. A sample of a small size
is the mean of a batch of round trips lasting at least ``MIN_SAMPLE_S``. Besides
wall time the process CPU time per round trip is reported: it is much less
disturbed by other load on a shared machine.

Run: ``hetconv bench protocol --sizes 4 64 --repeats 9`` (add ``--markdown
docs/figures/protocol.md`` to update the figures the docs quote), or
``python -m hetconv.bench.protocol_roundtrip --sizes 4 64 --repeats 9``.
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

from hetconv.protocol.codec import decode, encode
from hetconv.protocol.messages import ForwardReply, ForwardRequest
from hetconv.protocol.transport import (
    bound_endpoint,
    make_context,
    master_socket,
    recv_message,
    send_message,
    worker_socket,
)

ECHO_IDENTITY = b"echo"
BARE_MARK = b"\x00bare"  # frame 0 of a bare message starts with this (never msgpack map)
POLL_MS = 50
REPLY_TIMEOUT_S = 60.0
MIN_SAMPLE_S = 0.05

Runner = Callable[[int], float]


def _echo(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, stop: threading.Event) -> None:
    """Echo peer: codec messages get a ForwardReply, bare ones their bytes back."""
    sock = worker_socket(ctx, endpoint, ECHO_IDENTITY)
    try:
        sock.send(b"ready")
        while not stop.is_set():
            if not sock.poll(POLL_MS, zmq.POLLIN):
                continue
            frames = sock.recv_multipart(copy=False)
            if frames[0].bytes[: len(BARE_MARK)] == BARE_MARK:
                sock.send_multipart([frame.buffer for frame in frames], copy=False)
            else:  # what recv_message does after receiving, then the reply
                msg = decode(frames)
                if isinstance(msg, ForwardRequest):
                    send_message(sock, ForwardReply(msg.request_id, msg.step, msg.layer,
                                                    msg.attempt, 0.0, msg.x))
                del msg  # as a worker would: let go of the request's buffer at once
            del frames
    finally:
        sock.close()


def _codec_runner(sock: zmq.Socket[bytes], x: np.ndarray) -> Runner:
    def run(batch: int) -> float:
        start = time.perf_counter()
        for request_id in range(batch):
            send_message(sock, ForwardRequest(request_id, request_id, 0, 0, True, x),
                         identity=ECHO_IDENTITY)
            reply = recv_message(sock, REPLY_TIMEOUT_S, with_identity=True)
            if reply is None or not isinstance(reply[1], ForwardReply):
                raise RuntimeError("codec echo did not answer")
            if reply[1].request_id != request_id or reply[1].y.shape != x.shape:
                raise RuntimeError("codec echo answered the wrong thing")
            del reply
        return (time.perf_counter() - start) / batch

    return run


def _bare_runner(sock: zmq.Socket[bytes], x: np.ndarray) -> Runner:
    header = BARE_MARK + encode(ForwardRequest(0, 0, 0, 0, True, x))[0]
    buffer = x.reshape(-1).view(np.uint8).data

    def run(batch: int) -> float:
        start = time.perf_counter()
        for _ in range(batch):
            sock.send_multipart([ECHO_IDENTITY, header, buffer], copy=False)
            if not sock.poll(int(REPLY_TIMEOUT_S * 1000), zmq.POLLIN):
                raise RuntimeError("bare echo did not answer")
            frames = sock.recv_multipart(copy=False)
            if len(frames) != 3 or len(frames[2]) != x.nbytes:
                raise RuntimeError("bare echo answered the wrong thing")
            del frames
        return (time.perf_counter() - start) / batch

    return run


def _median_times(runners: list[Runner], repeats: int) -> list[tuple[float, float]]:
    """(median wall seconds, median process CPU seconds) per round trip of each
    runner, sampled interleaved. CPU time counts every thread of this process (both
    ends, ZeroMQ's I/O thread): it is less disturbed by other load than wall time."""
    for _ in range(2):  # warm up connection, allocator and caches
        warm_s = [run(1) for run in runners]
    batch = max(1, math.ceil(MIN_SAMPLE_S / min(warm_s)))
    wall: list[list[float]] = [[] for _ in runners]
    cpu: list[list[float]] = [[] for _ in runners]
    order_rng = np.random.default_rng(len(runners) * 1000 + repeats)
    for _ in range(repeats):  # a fresh random order each time: no path always goes
        for index in order_rng.permutation(len(runners)):  # first or after the same one
            cpu_start = time.process_time()
            wall[index].append(runners[index](batch))
            cpu[index].append((time.process_time() - cpu_start) / batch)
    return [(statistics.median(w), statistics.median(c)) for w, c in zip(wall, cpu, strict=True)]


def run_roundtrip_bench(
    sizes_mib: Sequence[float] = (4, 64),
    repeats: int = 9,
    out: Callable[[str], Any] = print,
) -> list[dict[str, float]]:
    """Median round-trip seconds, codec vs bare pyzmq, for each array size.

    Returns one dict per size: ``size_mib``, ``repeats``, ``codec_median_s``,
    ``bare_median_s`` (bare pyzmq echoing the received buffers),
    ``overhead_pct`` (codec over bare, in percent),
    ``codec_cpu_s`` / ``bare_cpu_s`` (process CPU seconds per round trip),
    ``cpu_overhead_pct`` and ``codec_gib_per_s`` (payload bytes both ways per second).
    """
    ctx = make_context()
    stop = threading.Event()
    sock = master_socket(ctx, "tcp://127.0.0.1:*")
    thread = threading.Thread(target=_echo, args=(ctx, bound_endpoint(sock), stop))
    thread.start()
    results: list[dict[str, float]] = []
    try:
        if not sock.poll(int(REPLY_TIMEOUT_S * 1000), zmq.POLLIN):
            raise RuntimeError("the echo peer did not connect")
        sock.recv_multipart()
        rng = np.random.default_rng(0)
        out(f"round trip of a float32 array over loopback TCP, median of {repeats} "
            "interleaved samples; codec = ForwardRequest/ForwardReply via protocol, "
            "bare = pyzmq send_multipart/recv_multipart(copy=False)")
        out(f"{'MiB':>8} {'codec ms':>10} {'bare ms':>10} {'overhead':>9} "
            f"{'codec CPU ms':>13} {'bare CPU ms':>12} {'CPU ovh':>8} {'GiB/s':>7}")
        for size_mib in sizes_mib:
            count = int(size_mib * 1024 * 1024) // 4
            x = rng.standard_normal(count, dtype=np.float32).reshape(-1, 256)
            runners = [_codec_runner(sock, x), _bare_runner(sock, x)]
            (codec_s, codec_cpu), (bare_s, bare_cpu) = _median_times(runners, repeats)
            row = {
                "size_mib": float(size_mib),
                "repeats": float(repeats),
                "codec_median_s": codec_s,
                "bare_median_s": bare_s,
                "overhead_pct": 100.0 * (codec_s - bare_s) / bare_s,
                "codec_cpu_s": codec_cpu,
                "bare_cpu_s": bare_cpu,
                "cpu_overhead_pct": 100.0 * (codec_cpu - bare_cpu) / bare_cpu,
                "codec_gib_per_s": 2 * x.nbytes / codec_s / 2**30,
            }
            results.append(row)
            out(f"{size_mib:>8g} {codec_s * 1e3:>10.2f} {bare_s * 1e3:>10.2f} "
                f"{row['overhead_pct']:>8.1f}% {codec_cpu * 1e3:>13.2f} {bare_cpu * 1e3:>12.2f} "
                f"{row['cpu_overhead_pct']:>7.1f}% {row['codec_gib_per_s']:>7.2f}")
    finally:
        stop.set()
        thread.join(timeout=5)
        sock.close()
        ctx.term()
    return results


def markdown_table(rows: list[dict[str, float]]) -> list[str]:
    """The result of :func:`run_roundtrip_bench` as markdown lines (for ``--markdown``)."""
    if not rows:
        return ["No size was timed."]
    lines = [f"Round trip of a float32 array over loopback TCP, median of "
             f"{rows[0]['repeats']:g} interleaved samples per size: codec = "
             "`ForwardRequest`/`ForwardReply` through `hetconv.protocol`, bare = pyzmq "
             "`send_multipart`/`recv_multipart(copy=False)` of the same bytes. The echo is a "
             "thread of the same process. Times in ms per round trip; CPU = process CPU "
             "time (all threads) per round trip.", "",
             "| MiB | codec | bare | wall overhead % | codec CPU | bare CPU | CPU overhead % "
             "| codec GiB/s |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['size_mib']:g} | {row['codec_median_s'] * 1e3:.2f} | "
            f"{row['bare_median_s'] * 1e3:.2f} | {row['overhead_pct']:+.1f} | "
            f"{row['codec_cpu_s'] * 1e3:.2f} | {row['bare_cpu_s'] * 1e3:.2f} | "
            f"{row['cpu_overhead_pct']:+.1f} | {row['codec_gib_per_s']:.2f} |")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry: ``python -m hetconv.bench.protocol_roundtrip``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=float, nargs="+", default=[4, 64], help="array MiB")
    parser.add_argument("--repeats", type=int, default=9, help="timed samples per size")
    args = parser.parse_args(argv)
    run_roundtrip_bench(tuple(args.sizes), args.repeats)


if __name__ == "__main__":
    main()
