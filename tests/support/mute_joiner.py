"""A peer that joins a run and never answers, for the tests (issue 49 part 2).

``python -m tests.support.mute_joiner --master tcp://HOST:PORT [--flood N]`` says Hello
under the current protocol, announces a data endpoint (a bound PULL it never reads),
heartbeats every 0.5 s and answers nothing: no calibration, no link probe. ``--flood N``:
it sends N heartbeats a second instead (in bursts every 10 ms). It runs until killed.
"""
from __future__ import annotations

import argparse
import os
import time
import uuid
from collections.abc import Sequence

import zmq

from hetconv.protocol import PROTOCOL_VERSION, DataEndpoint, Heartbeat, Hello, transport


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.mute_joiner")
    parser.add_argument("--master", required=True)
    parser.add_argument("--name", default="mute")
    parser.add_argument("--flood", type=int, default=0, help="heartbeats a second")
    options = parser.parse_args(argv)
    ctx = transport.make_context()
    sock = transport.worker_socket(ctx, options.master,
                                   f"{options.name}-{uuid.uuid4().hex[:6]}".encode())
    data = ctx.socket(zmq.PULL)
    port = data.bind_to_random_port("tcp://127.0.0.1")
    transport.send_message(sock, Hello(worker_id=options.name,
                                       device={"device": "cpu", "name": "mute", "pid": os.getpid()},
                                       protocol_version=PROTOCOL_VERSION))
    transport.send_message(sock, DataEndpoint(worker_id=options.name,
                                              endpoint=f"tcp://127.0.0.1:{port}", public_key=""))
    burst = max(1, options.flood // 100)
    while True:
        while sock.poll(0):
            sock.recv_multipart()  # read and ignore: Welcome, requests, heartbeats
        if options.flood:
            for _ in range(burst):
                transport.send_message(sock, Heartbeat(sent_at=time.time()))
            time.sleep(0.01)
        else:
            transport.send_message(sock, Heartbeat(sent_at=time.time()))
            time.sleep(0.5)


if __name__ == "__main__":
    raise SystemExit(main())
