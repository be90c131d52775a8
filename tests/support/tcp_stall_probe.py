"""A TCP sender and reader for checking ``hetconv.master.liveness`` against the kernel.

``serve PORT SECONDS``: accept one connection on ``PORT``, send it 20 KB every 50 ms
without blocking (enough to fill a stopped reader's receive buffer) and print, each
time, one JSON line ``{"t": <unix time>, "stalled": [<addresses>]}`` with what
:func:`~hetconv.master.liveness.read_stalled_peers` sees on ``PORT``.
``read HOST PORT``: connect and read until the connection ends.
Run each in its own network namespace (``tests/lab/test_faults.py``).
"""
from __future__ import annotations

import json
import socket
import sys
import time

from hetconv.master.liveness import read_stalled_peers

CHUNK = b"x" * 20_000
INTERVAL_S = 0.05


def serve(port: int, seconds: float) -> None:
    with socket.create_server(("0.0.0.0", port)) as server:
        server.settimeout(30)
        conn, _ = server.accept()
        conn.setblocking(False)
        deadline = time.time() + seconds
        while time.time() < deadline:
            try:
                conn.send(CHUNK)
            except BlockingIOError:
                pass  # the window is closed or the send buffer full: keep probing
            print(json.dumps({"t": time.time(), "stalled": sorted(read_stalled_peers(port))}),
                  flush=True)
            time.sleep(INTERVAL_S)
        conn.close()


def read(host: str, port: int) -> None:
    for _ in range(100):
        try:
            conn = socket.create_connection((host, port), timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    else:
        raise SystemExit(f"cannot connect to {host}:{port}")
    conn.settimeout(None)
    while conn.recv(65536):
        pass


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(int(sys.argv[2]), float(sys.argv[3]))
    else:
        read(sys.argv[2], int(sys.argv[3]))
