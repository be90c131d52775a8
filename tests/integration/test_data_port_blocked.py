"""A firewall that blocks a worker's data port (issue 16): one line on both sides naming
the port, and the run goes on without that worker.

Real ``hetconv worker`` daemons and a real ``hetconv train`` with the defaults a user
gets (the peer data plane), all in a private network namespace whose loopback drops
every packet to worker a's data port (``iptables -j DROP``, as a host firewall does):
the rule dies with the namespace and touches no other test. Before any piece moves,
the participants check every worker's data port, whether the plan gives that worker
kernels or not (on a busy host the planner may leave a out; CI once saw it); the one that cannot reach a's says so
in one line (the master when it computes too, the other workers with ``--no-local``),
the master prints it and evicts a, a is told why, and training completes on the rest.
Needs root, iproute2 and iptables; skips with the reason otherwise (the last test, the
check itself against a port that refuses, runs anywhere).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from hetconv.lab import LocalWorkers, netns_unavailable_reason
from hetconv.participant.peer_sockets import check_reachable, unreachable_line
from hetconv.participant.ports import PeerLost
from tests.conftest import child_env, hetconv_command

pytestmark = [pytest.mark.integration, pytest.mark.lab]

BLOCKED_PORT = 5601  # worker a's --data-port; the namespace is private, so it is free
RUN = ["--data", "synthetic", "--limit", "3200", "--test-limit", "256", "--arch", "8:16",
       "--kernel-size", "4", "--epochs", "1", "--batch", "64", "--threads", "1",
       "--no-progress", "--seed", "5", "--fall-back", "off"]
# --fall-back off: on this one machine the master alone measures faster than any plan
# with workers, and the default --fall-back on would rightly train alone from set-up
# (master/alone_first.py), with no data port to block. Nothing else is pinned
# (--split-by, --data-plane, --split, --wire-dtype: the defaults). A 4x4
# kernel makes layer 1's map odd (25x25), which the sample split cannot pool, so
# --split-by auto splits by kernels over the peer data plane, the one that uses data
# ports (KERNEL_SPLIT is checked in the output).
KERNEL_SPLIT = "hetconv: split by kernels"


def blocking_unavailable_reason() -> str | None:
    reason = netns_unavailable_reason()
    if reason is not None:
        return reason
    if shutil.which("iptables") is None:
        return "iptables is not installed (apt-get install iptables)"
    return None


REASON = blocking_unavailable_reason()


@contextmanager
def private_netns(name: str) -> Iterator[str]:
    """A private network namespace (its own loopback), removed at the end."""
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
                       check=True, capture_output=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture
def netns() -> Iterator[str]:
    with private_netns(f"hcfw{os.getpid() % 100000}") as name:
        yield name


def firewall(netns: str, *match: str) -> None:
    """Drop the TCP packets ``match`` selects on the namespace's loopback (skip if refused)."""
    rule = subprocess.run(["ip", "netns", "exec", netns, "iptables", "-I", "INPUT", "-p", "tcp",
                           *match, "-j", "DROP"], capture_output=True, text=True)
    if rule.returncode != 0:
        pytest.skip(f"cannot add a firewall rule: {rule.stderr.strip()}")


def start_train(netns: str, endpoint: str, run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    """``hetconv train`` in ``netns`` for 3 workers."""
    return subprocess.Popen(
        ["ip", "netns", "exec", netns,
         *hetconv_command("train", "--listen", endpoint, "--min-workers", "3", "--wait", "30",
                          *RUN, *extra, "--run-dir", str(run_dir))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())


def finish_train(master: subprocess.Popen[str], began: float) -> tuple[int, str, str, float]:
    """(status, stdout, stderr, seconds since ``began``) of a ``start_train`` process."""
    try:
        out, err = master.communicate(timeout=90)
    finally:
        if master.poll() is None:
            master.kill()
            master.communicate()
    assert "Traceback" not in err, err[-3000:]
    return master.returncode, out, err, time.monotonic() - began


def stop_train(master: subprocess.Popen[str]) -> None:
    if master.poll() is None:
        master.kill()
        master.communicate()


def train(netns: str, endpoint: str, run_dir: Path, *extra: str) -> tuple[int, str, str, float]:
    """``hetconv train`` in ``netns`` for 3 workers: (status, stdout, stderr, seconds)."""
    began = time.monotonic()
    return finish_train(start_train(netns, endpoint, run_dir, *extra), began)


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_kernel_split_case(prober: str, started: dict[str, Any], run_dir: Path, status: int,
                            out: str, err: str, seconds: float) -> None:
    """The kernel split (the defaults): the one that found a's port blocked (``prober``)
    says so in one line, the master prints it and evicts a, a is told why, and the run
    completes on the rest, a holding no kernels."""
    assert status == 0, err[-3000:]
    assert KERNEL_SPLIT in out, out[-3000:]
    if re.search(r"hetconv: plan: a \(.*\); not used: b, c", out):
        # seen in CI under load (a calibrated 13 ms against b's 173): every kernel on a,
        # so no participant ever needs a's data port and nothing is blocked; the run
        # completes with no fault
        events = records(run_dir)
        assert events[-1]["type"] == "run_end" and events[-1]["status"] == "completed"
        assert not [r for r in events if r["type"] == "recovery"], out[-3000:]
        return

    line = re.compile(rf"({prober}) cannot reach worker a's data port "
                      rf"tcp://127\.0\.0\.1:{BLOCKED_PORT} \(no answer in 3\.0 s: a firewall "
                      rf"blocking TCP port {BLOCKED_PORT}\?\)")
    said = line.search(err)
    assert said is not None, err[-3000:] + out[-3000:]  # the master's ERROR line
    assert line.search(out), out[-3000:]  # and its recovery line
    who = said.group(1)
    if who != "the master":  # the worker that found it said so in its own log
        assert line.search(started[who.split()[1]].output()), started[who.split()[1]].output()
    victim = started["a"].output()
    assert re.search(r"run over: evicted: " + line.pattern, victim), victim

    events = records(run_dir)
    assert events[-1]["type"] == "run_end" and events[-1]["status"] == "completed", events[-1]
    recoveries = [r for r in events if r["type"] == "recovery"]
    assert all(r["participant"] == "a" for r in recoveries), recoveries
    if not recoveries:  # found in set-up's rehearsal of the plan: recovered there, before
        # any training step (master/kernels/rehearsal.py), so no step is replayed
        assert "hetconv: the plan's rehearsal stopped: " in out, out[-3000:]
        assert any(r["type"] == "replan" and r["reason"].startswith("recovery from: ")
                   and line.search(r["reason"]) for r in events), events
    steps = [r for r in events if r["type"] == "step"]
    assert steps and all(d["kernels"] == 0 for s in steps for layer in s["layers"]
                         for d in layer["participants"] if d["participant"] == "a")
    assert seconds < 60, f"the run took {seconds:.0f} s"


def check_sample_split_case(started: dict[str, Any], run_dir: Path, status: int, out: str,
                            err: str, seconds: float) -> None:
    """The sample split pinned: its dense part is handed out again when the trainer
    starts, and a port found blocked then is a recovery too, not the end."""
    assert status == 0, err[-3000:]
    assert "hetconv: split by samples" in out, out[-3000:]
    # --wire-dtype auto on loopback: the samples' inputs are a small part of the step
    assert re.search(r"hetconv: wire dtype for the samples' inputs[^:]*: float32 on every link",
                     out), out[-3000:]
    line = re.compile(rf"cannot reach worker a's data port tcp://127\.0\.0\.1:{BLOCKED_PORT} ")
    assert line.search(err), err[-3000:]
    assert re.search(r"run over: evicted: .*" + line.pattern, started["a"].output()), \
        started["a"].output()
    events = records(run_dir)
    assert events[-1]["type"] == "run_end" and events[-1]["status"] == "completed", events[-1]
    recoveries = [r for r in events if r["type"] == "recovery"]
    assert recoveries and all(r["participant"] == "a" for r in recoveries), recoveries


EVICTION_CASES: list[tuple[str, tuple[str, ...]]] = [
    ("defaults", ()),
    ("no-local", ("--no-local",)),
    ("samples", ("--kernel-size", "5", "--split-by", "samples")),
]
"""Worker a's data port blocked: the kernel split with the master computing (the master
finds it), with ``--no-local`` (worker b or c finds it), and the sample split pinned."""


@pytest.mark.timeout(150)
@pytest.mark.skipif(REASON is not None, reason=f"cannot block a data port here: {REASON}")
def test_a_blocked_data_port_is_one_line_on_both_sides_and_the_run_goes_on(
        endpoint: str, tmp_path: Path) -> None:
    """Each of EVICTION_CASES in a namespace of its own, all three at once: most of each
    run is waiting on the 3 s probes of a's port (the defaults' timeout), twice
    before a is evicted and again when it rejoins, so side by side they take the time of
    one (about 20 s, where one after the other took 50-75 s). Every case is checked on
    its own; the test fails naming each case that failed."""
    began = time.monotonic()  # each run's seconds count from here: its workers' start too
    with ExitStack() as stack:
        runs: dict[str, tuple[dict[str, Any], Path, subprocess.Popen[str]]] = {}
        for index, (case, extra) in enumerate(EVICTION_CASES):
            netns = stack.enter_context(private_netns(f"hcfw{os.getpid() % 100000}x{index}"))
            firewall(netns, "--dport", str(BLOCKED_PORT))
            log_dir = tmp_path / case
            log_dir.mkdir()
            groups = [LocalWorkers(endpoint, [{"name": "a", "netns": netns, "extra_args":
                                               ("--data-port", str(BLOCKED_PORT))}],
                                   log_dir=log_dir),
                      LocalWorkers(endpoint, [{"name": name, "netns": netns}
                                              for name in ("b", "c")], log_dir=log_dir)]
            started = {w.name: w for group in groups for w in stack.enter_context(group)}
            master = start_train(netns, endpoint, log_dir / "run", *extra)
            stack.callback(stop_train, master)  # on a failure before finish_train
            runs[case] = (started, log_dir / "run", master)
        failed: list[str] = []
        for case, (started, run_dir, master) in runs.items():
            try:
                status, out, err, seconds = finish_train(master, began)
                if case == "samples":
                    check_sample_split_case(started, run_dir, status, out, err, seconds)
                else:
                    check_kernel_split_case("the master" if case == "defaults"
                                            else r"worker [bc]", started, run_dir, status,
                                            out, err, seconds)
            except AssertionError as error:
                failed.append(f"{case}: {error}")
        assert not failed, "\n".join(failed)


@pytest.mark.timeout(120)
@pytest.mark.skipif(REASON is not None, reason=f"cannot block a data port here: {REASON}")
def test_workers_that_cannot_reach_the_masters_data_port_stop_the_run_with_that_line(
        netns: str, workers: Any, endpoint: str, tmp_path: Path) -> None:
    """The master's own data port (a free port, new every run) blocked: it cannot be
    evicted, so the run stops at once with the line and what to do."""
    ports = {"a": BLOCKED_PORT, "b": BLOCKED_PORT + 1, "c": BLOCKED_PORT + 2}
    control = endpoint.rsplit(":", 1)[1]
    open_ports = ",".join([control, *(str(port) for port in ports.values())])
    firewall(netns, "--syn", "-m", "multiport", "!", "--dports", open_ports)  # all but these
    started = {w.name: w for name, port in ports.items()
               for w in workers(name, netns=netns, extra_args=("--data-port", str(port)))}
    status, out, err, seconds = train(netns, endpoint, tmp_path / "run")
    assert KERNEL_SPLIT in out, out[-3000:]
    line = re.compile(r"worker [abc] cannot reach the master's data port tcp://127\.0\.0\.1:"
                      r"(\d+) \(no answer in 3\.0 s: a firewall blocking TCP port \1\?\)")
    assert status != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith("hetconv: error: ") and line.search(last), err[-3000:]
    assert "--data-plane star" in last, last
    # every worker that got to probe says so; one whose probe the run's end overtook (the
    # master stops at the first report: under load a worker's AssignPeers or probe can
    # come later than another's whole report) says the run is over instead
    outputs = {name: w.output() for name, w in started.items()}
    assert any(line.search(text) for text in outputs.values()), outputs
    assert all(line.search(text) or "run over: master failed during setup" in text
               for text in outputs.values()), outputs
    assert seconds < 60, f"the run took {seconds:.0f} s to stop"


@pytest.mark.timeout(30)
def test_the_check_names_the_peer_at_fault_or_itself_when_it_reaches_nobody() -> None:
    """Without root: a port where nothing listens refuses at once (the same line, with
    ``connection refused``); a participant that reaches none of two peers blames itself."""
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        good = f"tcp://127.0.0.1:{listening.getsockname()[1]}"
        bad = f"tcp://127.0.0.1:{closed.getsockname()[1]}"
        check_reachable("b", {"b": bad, "master": good}, 3.0)  # its own endpoint is skipped
        with pytest.raises(PeerLost) as lost:
            check_reachable("b", {"master": good, "a": bad, "c": good}, 3.0)
        assert lost.value.peers == ["a"]
        assert str(lost.value) == unreachable_line("b", "a", bad, "connection refused")
        assert str(lost.value).startswith(f"worker b cannot reach worker a's data port {bad} "
                                          "(connection refused: a firewall blocking TCP port")
        with pytest.raises(PeerLost) as lost:
            check_reachable("master", {"a": bad, "c": bad}, 3.0)
        assert lost.value.peers == ["master"]
        assert "the master reaches none of its 2 peers' data ports" in str(lost.value)
