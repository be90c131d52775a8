"""CURVE: encrypted, authenticated traffic with an allow-list of worker keys."""
from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hetconv.keys import client_keys, create_keypair, server_keys
from hetconv.lab import free_port, wait_for
from hetconv.master.cluster import Cluster, WorkerLost
from hetconv.master.membership import RequestsAwaited
from hetconv.protocol import PROTOCOL_VERSION, Ack, Goodbye, Heartbeat, Hello
from hetconv.protocol.transport import make_context, send_message, worker_socket
from tests.conftest import REPO, SMALL_RUN, child_env, hetconv_command, run_hetconv

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(120)
def test_only_allowed_workers_join(endpoint: str, workers: Any, tmp_path: Path) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    for name in ("master", "good", "bad"):
        result = run_hetconv("keygen", "--dir", str(keys), "--name", name)
        assert result.returncode == 0, result.stderr
    assert (keys / "good.key_secret").stat().st_mode & 0o777 == 0o600
    again = run_hetconv("keygen", "--dir", str(keys), "--name", "good")
    assert again.returncode == 2 and "never overwritten" in again.stderr
    allowed.mkdir()
    (allowed / "good.key").write_bytes((keys / "good.key").read_bytes())
    master_args = ["--curve-secret", str(keys / "master.key_secret"),
                   "--curve-allow", str(allowed)]
    # a worker whose key is not allowed is refused: the master sees nobody
    workers("bad", extra_args=("--curve-secret", str(keys / "bad.key_secret"),
                               "--master-key", str(keys / "master.key")))
    refused = run_hetconv("train", "--listen", endpoint, "--min-workers", "1", "--wait", "3",
                          *SMALL_RUN, "--run-dir", str(tmp_path / "r0"), *master_args)
    assert refused.returncode == 2 and "only 0 of 1 worker" in refused.stderr
    # the allowed worker joins and trains
    workers("good", extra_args=("--curve-secret", str(keys / "good.key_secret"),
                                "--master-key", str(keys / "master.key")))
    args = [a for a in SMALL_RUN]
    args[args.index("--limit") + 1] = "256"
    result = run_hetconv("train", "--listen", endpoint, "--split-by", "kernels", "--min-workers", "1", "--wait", "30",
                         "--no-local", *args, "--run-dir", str(tmp_path / "r1"), *master_args)
    assert result.returncode == 0, result.stderr
    assert "good" in result.stdout and "bad" not in result.stdout


@pytest.mark.timeout(30)
def test_half_configured_curve_is_a_clear_error(endpoint: str, tmp_path: Path) -> None:
    result = run_hetconv("worker", "--master", endpoint, "--curve-secret", "x.key_secret")
    assert result.returncode == 2
    assert result.stderr.strip() == ("hetconv: error: CURVE needs both --curve-secret (this "
                                     "worker's NAME.key_secret) and --master-key (the master's "
                                     "NAME.key)")
    start = time.monotonic()
    result = run_hetconv("train", "--listen", endpoint, "--curve-secret", str(tmp_path / "nope"),
                         "--curve-allow", str(tmp_path), *SMALL_RUN,
                         "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 2 and "cannot read CURVE key file" in result.stderr
    assert time.monotonic() - start < 20


# --- a routing id belongs to the CURVE key that first used it --------------------------------
FIXED_IDENTITY = """import sys, types, uuid
import hetconv.worker.daemon as daemon
daemon.uuid = types.SimpleNamespace(uuid4=lambda: uuid.UUID(int=0xabcdef << 104))
from hetconv.commands.cli import main
sys.exit(main(sys.argv[1:]))"""
"""``hetconv worker`` whose routing id is known in advance: NAME-abcdef."""


def curve_keys(tmp_path: Path, *names: str) -> tuple[Path, Path]:
    """``keygen`` for the master and ``names``, whose public keys are all allowed."""
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    allowed.mkdir()
    for name in ("master", *names):
        create_keypair(keys, name)
        if name != "master":
            (allowed / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    return keys, allowed


def step_count(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return metrics.read_text().count('"type":"step"') if metrics.exists() else 0


@pytest.mark.timeout(150)
def test_another_key_cannot_take_over_a_live_workers_routing_id(endpoint: str,
                                                                tmp_path: Path) -> None:
    keys, allowed = curve_keys(tmp_path, "good", "other")
    log = (tmp_path / "good.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-c", FIXED_IDENTITY, "worker", "--master", endpoint, "--name", "good",
         "--threads", "1", "--curve-secret", str(keys / "good.key_secret"),
         "--master-key", str(keys / "master.key")],
        stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO)
    args = [a for a in SMALL_RUN]
    args[args.index("--limit") + 1] = "25600"
    run_dir = tmp_path / "run"
    # --split equal: the worker must hold kernels (its traffic flowing) while the forger
    # claims its routing id; the default planner may leave a worker out of a 4:8 network
    # on a loaded host ("plan: master": it trains alone), and then nothing would be left
    # to steal.
    master = subprocess.Popen(
        hetconv_command("train", "--listen", endpoint, "--split-by", "kernels", "--split", "equal",
                        "--min-workers", "1", "--wait", "30",
                        *args, "--run-dir", str(run_dir),
                        "--curve-secret", str(keys / "master.key_secret"),
                        "--curve-allow", str(allowed)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=REPO)
    ctx = make_context()
    forger = None
    try:
        assert wait_for(lambda: step_count(run_dir) >= 3 or master.poll() is not None, 60)
        # an allowed key, the live worker's routing id, forged messages while it trains
        forger = worker_socket(ctx, endpoint, b"good-abcdef",
                               curve=client_keys(keys / "other.key_secret", keys / "master.key"))
        steps_before = step_count(run_dir)
        send_message(forger, Hello(worker_id="good", protocol_version=PROTOCOL_VERSION,
                                   device={"device": "cpu"}))
        for _ in range(10):
            send_message(forger, Heartbeat(sent_at=0.0))
            time.sleep(0.1)
        send_message(forger, Goodbye(worker_id="good", reason="forged"))
        received = 0
        while forger.poll(1000):
            forger.recv_multipart()
            received += 1
        steps_during = step_count(run_dir) - steps_before
        out, err = master.communicate(timeout=120)
    finally:
        if forger is not None:
            forger.close(linger=0)
        ctx.term()
        if master.poll() is None:
            master.kill()
            master.communicate()
        worker.terminate()
        worker.wait(10)
        log.close()
    assert master.returncode == 0, err[-3000:]
    assert steps_during > 0, "the run ended before the forger claimed the routing id"
    assert received == 0, "the forger received the worker's traffic"
    assert "split of 4 kernels: master 2 (50%), good 2 (50%)" in out, out[-2000:]
    for sign in ("stopped responding", "restored the snapshot", "good (cpu) left", "is lost",
                 "evicted"):
        assert sign not in out + err, (sign, out[-2000:], err[-2000:])


@pytest.mark.timeout(60)
def test_a_free_routing_id_stays_bound_to_its_key(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The routing id of a worker whose connection is gone (the master found it lost,
    which fails the request waiting on it): another key may connect under it, but what
    it sends is refused, logged once, and cannot rebind or answer, and nothing is sent to
    the id, which now reaches the forger. (That a forgery alone counts the worker as
    lost: tests/unit/test_membership_keys.py.)"""
    keys, allowed = curve_keys(tmp_path, "good", "other")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cluster = Cluster(endpoint, curve=server_keys(keys / "master.key_secret", allowed))
    ctx = make_context()
    honest = worker_socket(ctx, endpoint, b"good-1",
                           curve=client_keys(keys / "good.key_secret", keys / "master.key"))
    forger = None
    try:
        send_message(honest, Hello(worker_id="good", protocol_version=PROTOCOL_VERSION,
                                   device={"device": "cpu"}))
        assert wait_for_pump(cluster, lambda: b"good-1" in cluster.membership.workers)
        worker = cluster.membership.workers[b"good-1"]
        request_id = cluster.request_id()
        cluster.membership.handle(RequestsAwaited({request_id: worker}, "a test",
                                                  time.monotonic()))
        honest.close(linger=0)  # its connection goes; its routing id is free on the socket
        # ... once the master's socket has let go of it: a connection arriving under an
        # id the socket still holds stays unread for good (no handover under CURVE). The
        # master's heartbeat finding no connection under the id says the id is free.
        lost = pump_past_lost_connections(cluster, lambda: worker.gone)
        assert worker.connection_lost, lost
        forger = worker_socket(ctx, endpoint, b"good-1",
                               curve=client_keys(keys / "other.key_secret", keys / "master.key"))
        with caplog.at_level(logging.WARNING, logger="hetconv.master"):
            for message in (Ack(request_id=request_id), Hello(
                    worker_id="good", protocol_version=PROTOCOL_VERSION,
                    device={"device": "cpu"}), Goodbye(worker_id="good", reason="forged")):
                send_message(forger, message)
            lost += pump_past_lost_connections(cluster, lambda: worker.forgeries >= 3)
        assert worker.forgeries >= 3, lost
        assert lost and all("good (cpu) lost its connection" in r for r in lost), lost
        refusals = [r for r in caplog.records if "another CURVE key" in r.getMessage()]
        assert len(refusals) == 1, [r.getMessage() for r in caplog.records]
        assert cluster.membership.replies_for([request_id]) is None
        assert cluster.membership.workers[b"good-1"] is worker
        assert worker.gone and worker.connection_lost, "the forged Goodbye was taken"
        pump_past_lost_connections(cluster, lambda: False, 1.2)  # heartbeats skip the id
        assert worker.curve_key == cluster.membership.bindings[b"good-1"].key
        assert forger.poll(200) == 0, "the forger was answered"
    finally:
        if forger is not None:
            forger.close(linger=0)
        honest.close(linger=0)
        ctx.term()
        cluster.close()


def pump_past_lost_connections(cluster: Cluster, predicate: Any,
                               timeout_s: float = 10.0) -> list[str]:
    """Pump until ``predicate()`` or the timeout; the reasons of the
    :class:`WorkerLost` raised meanwhile, pumping on after each."""
    reasons: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        try:
            cluster.pump(0.1)
        except WorkerLost as error:
            reasons.append(str(error))
    return reasons


def wait_for_pump(cluster: Cluster, predicate: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        cluster.pump(0.1)
    return bool(predicate())
