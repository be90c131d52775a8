"""Bad peers: garbage on the master's port, version mismatches, malformed requests."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from hetconv.protocol import PROTOCOL_VERSION, ForwardReply, Hello, encode
from tests.conftest import REPO, SMALL_RUN, child_env, hetconv_command, step_losses

pytestmark = [pytest.mark.integration]


def _garbage_sender(endpoint: str, stop: threading.Event) -> None:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    rng = np.random.default_rng(7)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    fake = ForwardReply(request_id=5, step=0, layer=0, attempt=0, compute_s=0.1,
                        y=np.zeros((1, 1, 1, 1), np.float32))
    try:
        while not stop.is_set():
            try:  # raw TCP garbage: not even ZMTP
                with socket.create_connection((host, int(port)), timeout=1) as raw:
                    raw.sendall(rng.bytes(int(rng.integers(1, 4096))))
            except OSError:
                pass
            messages = [
                [rng.bytes(int(rng.integers(0, 300)))],
                [msgpack.packb({"v": PROTOCOL_VERSION, "type": "nope", "fields": {}})],
                [msgpack.packb({"v": PROTOCOL_VERSION, "type": "forward_reply",
                                "fields": {"request_id": "x"}, "arrays": []})],
                encode(fake),  # a reply from a stranger: must be ignored
                [msgpack.packb([1, 2, 3]), rng.bytes(64)],
            ]
            for frames in messages:
                try:
                    dealer.send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
            time.sleep(0.05)
    finally:
        dealer.close()
        ctx.term()


@pytest.mark.timeout(180)
def test_garbage_during_training_changes_nothing(endpoint: str, workers: Any, tmp_path: Path,
                                                 local_reference: Path) -> None:
    workers("w1", "w2")
    stop = threading.Event()
    sender = threading.Thread(target=_garbage_sender, args=(endpoint, stop), daemon=True)
    run_dir = tmp_path / "dist"
    master = subprocess.Popen(
        hetconv_command("train", "--listen", endpoint, "--min-workers", "2", "--wait", "30",
                        *SMALL_RUN, "--run-dir", str(run_dir)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        time.sleep(0.5)
        sender.start()
        out, err = master.communicate(timeout=150)
    finally:
        stop.set()
        if master.poll() is None:
            master.kill()
    assert master.returncode == 0, err
    np.testing.assert_allclose(step_losses(run_dir), step_losses(local_reference), rtol=1e-4)


OLD_WORKER = """
import sys
from hetconv.commands.cli import main
import hetconv.worker.daemon
for module in list(sys.modules.values()):  # every module that imported the version
    if getattr(module, "__name__", "").startswith("hetconv") and hasattr(module, "PROTOCOL_VERSION"):
        module.PROTOCOL_VERSION = 99
sys.exit(main(["worker", "--master", sys.argv[1], "--name", "old", "--threads", "1"]))
"""


@pytest.mark.timeout(60)
def test_protocol_version_mismatch_is_refused_on_both_sides(endpoint: str, tmp_path: Path) -> None:
    master = subprocess.Popen(
        hetconv_command("train", "--listen", endpoint, "--min-workers", "1", "--wait", "6",
                        *SMALL_RUN, "--run-dir", str(tmp_path / "r")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        old = subprocess.run([sys.executable, "-c", OLD_WORKER, endpoint], capture_output=True,
                             text=True, timeout=30, env=child_env(), cwd=REPO)
        assert old.returncode == 3
        assert (f"protocol version mismatch: master speaks {PROTOCOL_VERSION}, worker old "
                "speaks 99") in old.stderr
        _, err = master.communicate(timeout=30)
        assert "refused worker old: protocol version mismatch" in err
        assert err.strip().splitlines()[-1].startswith("hetconv: error: only 0 of 1 worker")
    finally:
        if master.poll() is None:
            master.kill()


@pytest.mark.timeout(60)
def test_worker_answers_bad_requests_and_keeps_serving(endpoint: str, workers: Any) -> None:
    """A fake master sends malformed and unexpected messages; the worker replies with
    errors, then still serves a real calibration request."""
    from hetconv.protocol import (
        CalibrateReply,
        CalibrateRequest,
        ErrorReply,
        ForwardRequest,
        Welcome,
        recv_message,
        send_message,
    )
    from hetconv.protocol.transport import make_context, master_socket

    ctx = make_context()
    router = master_socket(ctx, endpoint)
    try:
        workers("probe")
        received = recv_message(router, 15, with_identity=True)
        assert received is not None
        identity, hello = received
        assert isinstance(hello, Hello)
        send_message(router, Welcome(worker_id=hello.worker_id, run_id="t",
                                     heartbeat_interval_s=0.5, protocol_version=PROTOCOL_VERSION),
                     identity=identity)
        router.send_multipart([identity, b"\x00garbage"])
        send_message(router, ForwardRequest(request_id=11, step=0, layer=3, attempt=0, train=True,
                                            x=np.zeros((1, 1, 4, 4), np.float32)),
                     identity=identity)
        send_message(router, CalibrateRequest(request_id=12, layer=0, batch=2, in_channels=1,
                                              height=8, width=8, kernels=2, kernel_size=3,
                                              stride=1, padding=0, repeats=1), identity=identity)
        replies: dict[int, Any] = {}
        errors = []
        deadline = time.monotonic() + 20
        while 12 not in replies and time.monotonic() < deadline:
            got = recv_message(router, 1.0, with_identity=True)
            if got is None:
                continue
            message = got[1]
            if isinstance(message, ErrorReply):
                errors.append(message)
            if hasattr(message, "request_id") and message.request_id:
                replies[message.request_id] = message
        assert any(e.code == "bad_message" for e in errors)
        assert isinstance(replies[11], ErrorReply) and replies[11].code == "unknown_layer"
        assert isinstance(replies[12], CalibrateReply) and replies[12].seconds > 0
    finally:
        router.close(linger=0)
        ctx.term()
