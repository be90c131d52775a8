"""CPU per received barrier piece: a Poller before each receive against the receive
waiting in libzmq (RCVTIMEO), and the parts of a send and a receive (a (2, 64) float32
PeerPiece over TCP on loopback, 3000 pieces queued first; thread CPU time).

    .venv-test/bin/python docs/figures/ab/peer-receive-bench.py
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from hetconv.protocol import PeerPiece, transport  # noqa: E402
from hetconv.protocol.codec import decode, encode  # noqa: E402

N = 3000


def per_piece_us(work: Callable[[], object]) -> float:
    started = time.thread_time()
    for _ in range(N):
        work()
    return (time.thread_time() - started) / N * 1e6


def main() -> None:
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    piece = PeerPiece(pass_id=1, step=1, layer=2, phase="sums", attempt=0, sender="w1",
                      kernel_start=0, kernel_stop=64, batch_start=0, batch_stop=1,
                      batch_size=1, data=np.ones((2, 64), np.float32))

    def queue() -> None:
        for _ in range(N):
            transport.send_message(push, piece)
        time.sleep(0.3)

    def poll_then_receive() -> None:
        assert pull.poll(50)
        assert transport.recv_message(pull, 0) is not None

    def receive_waiting_in_libzmq() -> None:
        assert transport.recv_message(pull, 0.05) is not None

    for _ in range(3):
        for name, way in (("poll+recv", poll_then_receive),
                          ("recv with RCVTIMEO", receive_waiting_in_libzmq)):
            queue()
            print(f"{name}: {per_piece_us(way):.1f} us CPU per message", flush=True)
    print(f"send: {per_piece_us(lambda: transport.send_message(push, piece)):.1f} us")
    time.sleep(0.3)
    print(f"poll alone (ready): {per_piece_us(lambda: pull.poll(50)):.1f} us")
    print(f"encode: {per_piece_us(lambda: encode(piece)):.1f} us")
    frames = [bytes(frame) for frame in encode(piece)]
    print(f"decode: {per_piece_us(lambda: decode(frames)):.1f} us")
    context.destroy(linger=0)


if __name__ == "__main__":
    main()
