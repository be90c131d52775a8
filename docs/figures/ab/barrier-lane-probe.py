"""Barrier delivery under CFS quotas: ZeroMQ PUSH/PULL against a plain TCP socket.

A probe for docs/sample-split.md ("Tried and not kept": a lane of its own for the
batch-norm barrier pieces). N processes, each in a cgroup v1 CPU quota of Q cores
(10 ms period, as the lab's machines), run ROUNDS rounds: compute about W ms of wall
time of numpy products (plus 0-1.4 ms more by rank, a skew), share a 512-byte piece
with every peer and wait for all of theirs (a barrier). With ``zmq`` each piece goes
the way hetconv's pieces go (one bound PULL per process, one PUSH per peer: both
processes' libzmq I/O threads on the path); with ``tcp`` the computing thread writes it
into a plain TCP connection per peer and reads its own with ``selectors`` (no I/O
thread). Prints the median round and the delivery of a piece (the reader's time of
reading it minus the sender's time of sending it, one clock; it includes a reader
still computing). Root only (cgroups); loopback only.

    python docs/figures/ab/barrier-lane-probe.py {zmq|tcp} [N] [Q]   (W from the environment)
"""
from __future__ import annotations

import multiprocessing as mp
import os
import selectors
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

N = int(sys.argv[2]) if len(sys.argv) > 2 else 4
Q = float(sys.argv[3]) if len(sys.argv) > 3 else 0.45
W = float(os.environ.get("W", "3"))
ROUNDS, WARM_UP = 300, 20
BASE_PORT = 46000
HEADER = struct.Struct("!id")  # round, sender's send time (Unix s)
PAYLOAD = bytes(512)


def join_quota(rank: int) -> None:
    path = f"/sys/fs/cgroup/cpu/barrier-lane-probe{rank}"
    os.makedirs(path, exist_ok=True)
    with open(f"{path}/cpu.cfs_period_us", "w") as f:
        f.write("10000")
    with open(f"{path}/cpu.cfs_quota_us", "w") as f:
        f.write(str(int(10000 * Q)))
    with open(f"{path}/tasks", "w") as f:
        f.write(str(os.getpid()))


def compute(ms: float) -> None:
    a = np.ones((64, 64), dtype=np.float32)
    started = time.perf_counter()
    while (time.perf_counter() - started) * 1000 < ms:
        a @ a


Transport = tuple[Callable[[int], None], Callable[[], tuple[int, float]]]


def zmq_transport(rank: int) -> Transport:
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"tcp://127.0.0.1:{BASE_PORT + rank}")
    pushes = []
    for peer in range(N):
        if peer != rank:
            push = ctx.socket(zmq.PUSH)
            push.connect(f"tcp://127.0.0.1:{BASE_PORT + peer}")
            pushes.append(push)
    time.sleep(1.0)

    def send(round_: int) -> None:
        for push in pushes:
            push.send(HEADER.pack(round_, time.time()) + PAYLOAD)

    def receive() -> tuple[int, float]:
        round_, sent = HEADER.unpack(pull.recv()[:HEADER.size])
        return round_, time.time() - sent

    return send, receive


def tcp_transport(rank: int) -> Transport:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", BASE_PORT + 100 + rank))
    server.listen(16)
    time.sleep(0.5)
    outs = []
    for peer in range(N):
        if peer != rank:
            out = socket.create_connection(("127.0.0.1", BASE_PORT + 100 + peer))
            out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            outs.append(out)
    selector = selectors.DefaultSelector()
    buffers: dict[Any, bytes] = {}
    for _ in range(N - 1):
        conn = server.accept()[0]
        selector.register(conn, selectors.EVENT_READ)
        buffers[conn] = b""
    size = HEADER.size + len(PAYLOAD)
    ready: list[tuple[int, float]] = []

    def send(round_: int) -> None:
        for out in outs:
            out.sendall(HEADER.pack(round_, time.time()) + PAYLOAD)

    def receive() -> tuple[int, float]:
        while not ready:
            for key, _ in selector.select():
                conn = key.fileobj
                buffers[conn] += conn.recv(65536)  # type: ignore[union-attr]
                while len(buffers[conn]) >= size:
                    message, buffers[conn] = buffers[conn][:size], buffers[conn][size:]
                    round_, sent = HEADER.unpack(message[:HEADER.size])
                    ready.append((round_, time.time() - sent))
        return ready.pop(0)

    return send, receive


def run(rank: int, kind: str, results: Any) -> None:
    join_quota(rank)
    send, receive = (zmq_transport if kind == "zmq" else tcp_transport)(rank)
    time.sleep(0.5)
    early: dict[int, int] = {}  # round -> pieces that came before this process got there
    delays, rounds = [], []
    for round_ in range(ROUNDS):
        started = time.perf_counter()
        compute(W + (rank * 0.7) % 2)
        send(round_)
        got = early.pop(round_, 0)
        while got < N - 1:
            of, delay = receive()
            if of == round_:
                got += 1
                if round_ >= WARM_UP:
                    delays.append(delay)
            else:
                early[of] = early.get(of, 0) + 1
        if round_ >= WARM_UP:
            rounds.append(time.perf_counter() - started)
    results.put((delays, rounds))


def main() -> None:
    kind = sys.argv[1]
    results: Any = mp.Queue()
    processes = [mp.Process(target=run, args=(rank, kind, results)) for rank in range(N)]
    for process in processes:
        process.start()
    gathered = [results.get() for _ in processes]
    for process in processes:
        process.join()
    delays = sorted(d for ds, _ in gathered for d in ds)
    rounds = [r for _, rs in gathered for r in rs]
    print(f"{kind} N={N} Q={Q}: round median {statistics.median(rounds) * 1000:.2f} ms; "
          f"delivery p50 {delays[len(delays) // 2] * 1000:.2f} "
          f"p90 {delays[int(len(delays) * 0.9)] * 1000:.2f} "
          f"mean {statistics.mean(delays) * 1000:.2f} ms")


if __name__ == "__main__":
    main()
