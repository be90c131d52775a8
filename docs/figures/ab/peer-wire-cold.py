"""CPU of one peer piece, sent and received, with cold caches: the generic codec
against the packed piece (protocol/peer_wire.py).

Between two pieces a participant of the sample split computes convolutions, which
evict the interpreter's code and data from the caches; so here 16 MB pass through the
caches (a numpy multiply) before every send and every receive. A (2, 64) float32
PeerPiece (a batch-norm barrier's) and a 36 KB one (a small layer's weight gradient)
over TCP on loopback, thread CPU time of the sending and the receiving call, ROUNDS
rounds of PIECES pieces each way, the two ways alternated.

    .venv-test/bin/python docs/figures/ab/peer-wire-cold.py
"""
from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from hetconv.protocol import PeerPiece, peer_wire, transport  # noqa: E402

ROUNDS = 5
PIECES = 200


def main() -> None:
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    big = np.ones((4096, 1024), np.float32)
    scratch = np.empty_like(big)
    pull.setsockopt(zmq.RCVTIMEO, 500)  # PeerSockets sets it only when it changes
    time.sleep(0.2)
    ways: dict[str, tuple[Callable[[PeerPiece], object], Callable[[], object]]] = {
        "generic codec": (lambda piece: transport.send_message(push, piece),
                          lambda: transport.recv_message(pull, 0.5)),
        "packed (PeerSockets' way)": (
            lambda piece: transport.send_frames(push, peer_wire.pack_piece(piece),
                                                PeerPiece.TYPE),
            lambda: peer_wire.decode_frames(transport.recv_frames(pull) or [])),
    }
    for shape in ((2, 64), (9, 32, 32)):
        piece = PeerPiece(pass_id=1, step=7, layer=2, phase="sums", attempt=0, sender="w1",
                          kernel_start=0, kernel_stop=64, batch_start=0, batch_stop=1,
                          batch_size=1, data=np.ones(shape, np.float32))
        figures: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
        for _ in range(ROUNDS):
            for name, (send, receive) in ways.items():
                sent = received = 0.0
                for _ in range(PIECES):
                    np.multiply(big, 1.0001, out=scratch)
                    started = time.thread_time()
                    send(piece)
                    sent += time.thread_time() - started
                    time.sleep(0.0005)
                    np.multiply(big, 1.0001, out=scratch)
                    started = time.thread_time()
                    got = receive()
                    received += time.thread_time() - started
                    assert isinstance(got, PeerPiece) and np.array_equal(got.data, piece.data)
                figures[name].append((sent / PIECES * 1e6, received / PIECES * 1e6))
        for name, rounds in figures.items():
            send_us = statistics.median(r[0] for r in rounds)
            receive_us = statistics.median(r[1] for r in rounds)
            print(f"{shape} float32, {name}: send {send_us:.1f} us, receive {receive_us:.1f} "
                  f"us, both {send_us + receive_us:.1f} us CPU (medians of {ROUNDS} rounds "
                  f"of {PIECES})", flush=True)
    context.destroy(linger=0)


if __name__ == "__main__":
    main()
