"""Faults a LAN brings (root: network namespaces, tc, CPU quotas; skipped otherwise):
a short link cut costs no failover, a long one costs a failover and a rejoin, and a
machine that slows down loses kernels (docs/resilience.md, "Liveness bounds").

The link cuts run first under the defaults a user gets (``--split model``,
``--wire-dtype auto``, rebalancing on, the peer data plane): a switched LAN
(:class:`hetconv.lab.network.SwitchedLan`, the master on a machine of its own), a
worker holding kernels cut off at its switch port, in one run, for 2, 3, 4, 6 and then
20 s: no failover for the short ones, a failover after ``LINK_RETRY_S`` and a rejoin for
the long one. The pinned settings (equal split, float32 wire, star plane, exact against
the local run) are the second cases."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetconv.lab import LanHost, LocalWorkers, free_port, netns_unavailable_reason, wait_for
from hetconv.lab.network import SwitchedLan
from hetconv.lab.quota import CpuQuota, cpu_quota_unavailable_reason
from hetconv.master.membership import LINK_RETRY_S
from tests.conftest import child_env, epoch_records, hetconv_command, run_hetconv
from tests.integration.test_failover import final_losses, records, steps_done
from tests.support.faulty_worker import WorkerFaults

pytestmark = [pytest.mark.lab, pytest.mark.integration]
# serial (deploy/test.sh's part 2, alone): only the machine that slows down (it times how
# soon a quota cut moves kernels). The rest time nothing that load moves (the kernel's
# retransmissions, the 5 s / 10 s liveness bounds, the cuts' lengths, the loss trace) and
# run in part 1, beside other tests, mostly waiting: the run under the defaults caps its
# machines at MACHINE_CORES each (a cap, not a share: beside busy tests they get less, its
# steps are slower and the join after the 20 s cut comes earlier in the run, step 434 of
# 950 in a run beside four busy xdist workers, load average 7.6, which passed with the
# failover 10.1 s after the cut). About 110 s of wall time that part 2 no longer spends
# alone: the cut run and its reference 71 s, the pinned run 39 s, the TCP tables 10 s.
REASON = netns_unavailable_reason()
QUOTA_REASON = cpu_quota_unavailable_reason()

# --- under the defaults: the peer plane over a switched LAN ---------------------------------
# Nothing here pins --split, --wire-dtype, --data-plane or rebalancing. One exception:
# --fall-back off, since on this small network the default rightly trains on alone after
# the first snapshot (measured 21.6 ms per step with the workers, 17.3 ms estimated
# alone), and a cut needs a run that keeps its workers. Every machine runs in a quota of
# MACHINE_CORES. One run takes every cut in CUTS_S in turn, each at the
# switch port of a worker then holding kernels, STEPS_BETWEEN_CUTS steps after the last
# one healed; the 20 s cut comes last, so that its failover and rejoin end the story.
DEFAULT_RUN = ["--data", "synthetic", "--limit", "3200", "--test-limit", "256", "--arch",
               "8:16", "--batch", "64", "--threads", "1", "--no-progress", "--seed", "7",
               "--fall-back", "off"]
LONG_EPOCHS = 19  # 950 steps: the join after the 20 s cut came at step 639-739 (about
# 50-60 s in, at 24 ms a step between the cuts; 711 in a run on a quiet machine), so
# 200-300 steps, about 5-7 s at the 20-25 ms steps after it, are left after it (22 epochs
# left 9-11 s: the suite's time, 5 s of part 2 with the shorter reference run)
MACHINE_CORES = 0.5
CUT_AT_STEP = 60
STEPS_BETWEEN_CUTS = 40
SHORT_CUTS_S = (2.0, 3.0, 4.0, 6.0)
"""Cuts that TCP heals within LINK_RETRY_S (its retransmissions come about 3.0 and 6.2 s
after a cut began; docs/resilience.md): none of those up to NO_FAILOVER_UP_TO_S may
cost a failover."""
NO_FAILOVER_UP_TO_S = 4.0
LONG_CUT_S = 20.0
CUTS_S = (*SHORT_CUTS_S, LONG_CUT_S)
MAX_RECOVERIES = 2
ACCURACY_TOLERANCE = {"float32": 0.01, "float16": 0.03}
"""Final test accuracy against the local run's, by the wire dtype the planner chose."""


@dataclass(frozen=True)
class Cut:
    """One link cut of the run: how long, whose switch port, and when (Unix times): it
    began ``at``, the link was back ``healed``, and the next cut (or the end of the run)
    came ``until``; what happens in [at, until) is this cut's doing."""

    seconds: float
    victim: str
    at: float
    healed: float
    until: float = float("inf")


def holders_now(run_dir: Path) -> list[str]:
    """The workers holding kernels now: in the last step recorded, or in the split that
    came after it (a re-split, a re-plan)."""
    splits = [r for r in records(run_dir) if r["type"] in ("step", "rebalance", "replan")]
    if not splits:
        return []
    layers = splits[-1]["layers" if splits[-1]["type"] == "step" else "counts"]
    return sorted({d["participant"] for layer in layers for d in layer["participants"]
                   if d["kernels"] > 0 and d["participant"] != "master"})


def nobody_away(run_dir: Path, since: float) -> bool:
    """Whether every worker lost after ``since`` (Unix time) has joined again."""
    events = [r for r in records(run_dir) if r["time"] >= since]
    lost = [r["time"] for r in events if r["type"] == "recovery" and r["gone"]]
    return not lost or any(r["type"] == "replan" and r["reason"].startswith("join")
                           and r["time"] > lost[-1] for r in events)


def gives_kernels(record: dict[str, Any], name: str) -> bool:
    return any(d["participant"] == name and d["kernels"] > 0
               for layer in record["counts"] for d in layer["participants"])


@pytest.fixture(scope="module")
def default_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("ref-defaults") / "run"
    result = run_hetconv("train", "--local", *DEFAULT_RUN, "--epochs", str(LONG_EPOCHS),
                         "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    return run_dir


def cut_link(interface: str, seconds: float) -> float:
    """Take ``interface`` down for ``seconds``, then up again (also on an error); the
    Unix time the cut began."""
    subprocess.run(["ip", "link", "set", interface, "down"], check=True)
    at = time.time()
    try:
        time.sleep(seconds)
    finally:
        subprocess.run(["ip", "link", "set", interface, "up"], check=True)
    return at


def cut_holders_in_turn(lan: SwitchedLan, tmp_path: Path, cuts_s: tuple[float, ...],
                        epochs: int) -> tuple[Path, list[Cut]]:
    """Three workers and the master on ``lan``, under the defaults; from step CUT_AT_STEP
    on, the switch port of a worker holding kernels goes down for each of ``cuts_s`` in
    turn, the next STEPS_BETWEEN_CUTS steps after the last link came back and a worker
    it cost (if any) joined again. The run dir and the cuts."""
    endpoint = f"tcp://{lan.machines[0].address}:{free_port()}"
    names = {f"w{index}": lan.machines[index] for index in (1, 2, 3)}
    run_dir, log = tmp_path / "run", tmp_path / "master.log"
    quota = CpuQuota(MACHINE_CORES)
    cuts: list[Cut] = []
    with LocalWorkers(endpoint, [{"name": name, "netns": machine.netns,
                                  "cpu_fraction": MACHINE_CORES}
                                 for name, machine in names.items()], log_dir=tmp_path), \
            open(log, "w") as output:
        master = subprocess.Popen(
            lan.machines[0].command(hetconv_command(
                "train", "--listen", endpoint, "--min-workers", "3", "--wait", "30",
                *DEFAULT_RUN, "--epochs", str(epochs), "--run-dir", str(run_dir))),
            stdout=output, stderr=subprocess.STDOUT, text=True, env=child_env())
        try:
            quota.add(master.pid)  # `ip netns exec` execs: this is the master
            target = CUT_AT_STEP
            for cut_s in cuts_s:
                since = cuts[-1].at if cuts else 0.0
                reached = wait_for(lambda: steps_done(run_dir) >= target  # noqa: B023
                                   and nobody_away(run_dir, since)  # noqa: B023
                                   and bool(holders_now(run_dir)), 120)
                assert reached, (
                    f"no worker held kernels at step {steps_done(run_dir)} (the planner kept "
                    f"everything on the master?), or the run ended: nothing to cut for the "
                    f"{cut_s:.0f} s cut; master exit code {master.poll()}")
                victim = holders_now(run_dir)[-1]
                cut_at = cut_link(names[victim].port, cut_s)
                if cuts:
                    cuts[-1] = replace(cuts[-1], until=cut_at)
                cuts.append(Cut(cut_s, victim, cut_at, time.time()))
                target = steps_done(run_dir) + STEPS_BETWEEN_CUTS
            master.wait(timeout=300)
        finally:
            if master.poll() is None:
                master.kill()
                master.wait()
            quota.remove()
    text = log.read_text(errors="replace")
    assert master.returncode == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    events = records(run_dir)
    assert events[-1]["type"] == "run_end" and events[-1]["status"] == "completed", events[-1]
    return run_dir, cuts


def wire_dtype(run_dir: Path) -> str:
    plans = [r for r in records(run_dir) if r["type"] == "plan"]
    return str(plans[-1]["wire_dtype"]) if plans else "float32"


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[float, Cut]]:
    """One run under the defaults with every cut of CUTS_S (its tests share it)."""
    if REASON is not None:
        pytest.skip(f"cannot emulate a LAN here: {REASON}")
    if QUOTA_REASON is not None:
        pytest.skip(f"no CPU quotas here: {QUOTA_REASON}")
    with SwitchedLan(4, rate="1gbit", lan=7) as lan:
        run_dir, cuts = cut_holders_in_turn(lan, tmp_path_factory.mktemp("cuts"), CUTS_S,
                                            LONG_EPOCHS)
    return run_dir, {cut.seconds: cut for cut in cuts}


def during(run_dir: Path, cut: Cut, kind: str) -> list[dict[str, Any]]:
    """The records of type ``kind`` written while ``cut`` was the last cut."""
    return [r for r in records(run_dir) if r["type"] == kind and cut.at <= r["time"] < cut.until]


def longest_stall_s(run_dir: Path, cut: Cut) -> float:
    """The longest wait for progress while ``cut`` was the last cut: the longest step
    recorded then, or the longest gap between two step records (a cut that lands on a
    snapshot's audit or an evaluation stalls the run between steps: with the sample
    split's short steps, that is often)."""
    times = sorted(float(r["time"]) for r in records(run_dir) if r["type"] == "step"
                   and cut.at - 1.0 <= r["time"] < cut.until)
    gaps = [later - earlier for earlier, later in zip(times, times[1:])]
    steps = [float(r["step_s"]) for r in during(run_dir, cut, "step")]
    return max(steps + gaps, default=0.0)


def check_a_short_link_cut_costs_no_failover(run_dir: Path, cut: Cut) -> None:
    cut_s = cut.seconds
    recoveries = during(run_dir, cut, "recovery")
    stall_s = longest_stall_s(run_dir, cut)
    print(f"{cut_s:.0f} s cut of {cut.victim}: longest step {stall_s:.2f} s, "
          f"recoveries {[round(r['time'] - cut.at, 1) for r in recoveries]} s after the cut")
    assert stall_s >= cut_s - 0.5, f"the {cut_s:.0f} s cut stalled no step: {stall_s:.2f} s"
    if cut_s <= NO_FAILOVER_UP_TO_S:
        # late, not lost: no replay, nobody evicted
        assert not recoveries, [(round(r["time"] - cut.at, 1), r["reason"]) for r in recoveries]
        return
    # 6 s is at TCP's retransmission 6.2 s after the cut began: no failover is expected
    # (and measured), but a link that comes back a little late makes the next one 12.6 s,
    # past LINK_RETRY_S: then one failover, by the dead-link rule, and a join
    assert len(recoveries) <= 1, recoveries
    for recovery in recoveries:
        assert recovery["participant"] == cut.victim, recovery
        assert recovery["time"] - cut.at >= LINK_RETRY_S - 0.5, recovery  # not after 5 s
        assert nobody_away(run_dir, cut.at), f"{cut.victim} did not join again"


def check_a_20_s_link_cut_fails_over_then_the_worker_joins(run_dir: Path, cut: Cut,
                                                            default_reference: Path) -> None:
    victim = cut.victim
    recoveries = during(run_dir, cut, "recovery")
    assert 1 <= len(recoveries) <= MAX_RECOVERIES, recoveries
    failover_s = recoveries[0]["time"] - cut.at
    print(f"20 s cut of {victim}: failover {failover_s:.1f} s after the cut: "
          f"{recoveries[0]['reason']}")
    assert recoveries[0]["participant"] == victim and recoveries[0]["gone"], recoveries
    # lost after LINK_RETRY_S behind a link that retransmits, not after the 5 s limit
    assert LINK_RETRY_S - 0.5 <= failover_s <= LINK_RETRY_S + 3, (failover_s, recoveries)
    assert all(r["participant"] in (victim, None) for r in recoveries), recoveries
    # nobody else was away, so a join after the cut is the victim's (named, or given
    # kernels, or "join of a returning worker" when the planner gave it none)
    back = [r for r in during(run_dir, cut, "replan") if r["reason"].startswith("join")
            and r["time"] > cut.healed]
    assert back, f"{victim} did not come back as a join after the cut"
    print(f"20 s cut of {victim}: join {back[0]['time'] - cut.at:.1f} s after the cut")
    assert not any(gives_kernels(r, victim) for r in records(run_dir)
                   if r["type"] in ("replan", "rebalance")
                   and recoveries[0]["time"] <= r["time"] < back[0]["time"]), (
        f"{victim} was given kernels before it joined again")
    accuracy = epoch_records(run_dir)[-1]["test_accuracy"]
    reference = epoch_records(default_reference)[-1]["test_accuracy"]
    assert abs(accuracy - reference) <= ACCURACY_TOLERANCE[wire_dtype(run_dir)], (
        accuracy, reference, wire_dtype(run_dir))


@pytest.mark.timeout(600)
def test_under_the_defaults_short_link_cuts_cost_no_failover_a_20_s_one_a_failover_and_a_join(
        cut_run: tuple[Path, dict[float, Cut]], default_reference: Path) -> None:
    """Each cut of the one run, judged on its own (the 2, 3, 4 and 6 s cuts, then the 20 s
    one); one test, not one per cut, so that pytest-xdist (deploy/test.sh's part 1) makes
    the run once, not again on each worker that takes one of its cuts. Every cut is
    checked, and the test fails naming each cut that failed."""
    run_dir, cuts = cut_run
    assert sorted(cuts) == sorted(CUTS_S), cuts
    failed: list[str] = []
    for cut_s in SHORT_CUTS_S:
        try:
            check_a_short_link_cut_costs_no_failover(run_dir, cuts[cut_s])
        except AssertionError as error:
            failed.append(f"the {cut_s:.0f} s cut: {error}")
    try:
        check_a_20_s_link_cut_fails_over_then_the_worker_joins(run_dir, cuts[LONG_CUT_S],
                                                                default_reference)
    except AssertionError as error:
        failed.append(f"the {LONG_CUT_S:.0f} s cut: {error}")
    assert not failed, "\n".join(failed)


@pytest.mark.timeout(60)
@pytest.mark.skipif(REASON is not None, reason=f"cannot emulate a LAN here: {REASON}")
def test_the_tcp_tables_tell_a_cut_link_from_a_stopped_reader() -> None:
    """master/liveness.py against the kernel: a reader stopped for 3 s (its kernel still
    acknowledges, then closes the window) is never stalled; a link cut for 3 s is,
    from its first second on."""
    port = free_port()
    probe = [sys.executable, "-m", "tests.support.tcp_stall_probe"]
    with SwitchedLan(2, rate="1gbit", lan=8) as lan:
        address = lan.machines[1].address
        sender = subprocess.Popen(lan.machines[0].command([*probe, "serve", str(port), "10"]),
                                  stdout=subprocess.PIPE, text=True, env=child_env())
        reader = subprocess.Popen(lan.machines[1].command(
            [*probe, "read", lan.machines[0].address, str(port)]), env=child_env())
        try:
            time.sleep(1.5)
            reader.send_signal(signal.SIGSTOP)  # `ip netns exec` execs: this is the reader
            stopped = time.time()
            time.sleep(3)
            reader.send_signal(signal.SIGCONT)
            time.sleep(1.5)
            subprocess.run(["ip", "link", "set", lan.machines[1].port, "down"], check=True)
            cut = time.time()
            time.sleep(3)
            subprocess.run(["ip", "link", "set", lan.machines[1].port, "up"], check=True)
            out, _ = sender.communicate(timeout=30)
        finally:
            for process in (sender, reader):
                process.send_signal(signal.SIGCONT)
                process.kill()
                process.wait()
    lines = [json.loads(line) for line in out.splitlines()]
    while_stopped = [line for line in lines if stopped <= line["t"] <= stopped + 3]
    while_cut = [line for line in lines if cut + 1 <= line["t"] <= cut + 3]
    assert while_stopped and while_cut, lines
    assert not [line for line in while_stopped if address in line["stalled"]], while_stopped
    assert all(line["stalled"] == [address] for line in while_cut), while_cut


# --- pinned settings (second cases): the star plane on LanHost namespaces, exact ------------
RUN = ["--data", "synthetic", "--limit", "3200", "--test-limit", "128", "--arch", "4:8",
       "--epochs", "4", "--batch", "64", "--threads", "1", "--no-progress", "--seed", "7",
       "--checkpoint-every", "10", "--wire-dtype", "float32", "--split", "equal",
       "--data-plane", "star", "--split-by", "kernels"]
# the star plane pinned here, a second case (the default peer plane over capped links is
# tests/lab/test_lan.py's; over a switched LAN, `hetconv bench scale` and tests/lab/
# test_bench_scale.py's)
SLOW = WorkerFaults(delay_per_kernel_s=0.008)


@pytest.fixture
def lan() -> Iterator[list[LanHost]]:
    hosts: list[LanHost] = []
    try:
        hosts = [LanHost(11, rate="1gbit"), LanHost(12, rate="1gbit")]
        yield hosts
    finally:
        for host in hosts:
            host.remove()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    local = [a for a in RUN if a not in ("--split", "equal", "--data-plane", "star",
                                         "--split-by", "kernels")]
    assert run_hetconv("train", "--local", *local, "--run-dir", str(run_dir)).returncode == 0
    return final_losses(run_dir)


PINNED_SHORT_CUT_S = 3.0
"""The short cut of the pinned run: the one that meets TCP's first retransmission, the
hardest of the short ones (2, 4 and 6 s: the run under the defaults)."""
PINNED_LONG_CUT_S = 20.0
PINNED_SHORT_AT_STEP, PINNED_LONG_AFTER_STEPS = 10, 15  # the long cut near step 28 of 200,
# where the single long-cut run had it at 20: the join still comes before the end


def train_with_cuts(lan: list[LanHost], tmp_path: Path) -> tuple[Path, float, float]:
    """Two workers on LAN hosts; w2's link goes down for PINNED_SHORT_CUT_S at step
    PINNED_SHORT_AT_STEP, then for PINNED_LONG_CUT_S PINNED_LONG_AFTER_STEPS steps
    after it healed. (run dir, Unix time of the short cut, of the long one)."""
    port = free_port()
    groups = [LocalWorkers(f"tcp://{host.host_address}:{port}",
                           [{"name": f"w{i + 1}", "netns": host.netns, **SLOW.spec()}],
                           log_dir=tmp_path) for i, host in enumerate(lan)]
    for group in groups:
        group.__enter__()
    run_dir = tmp_path / "run"
    link = lan[1].host_if

    try:
        master = subprocess.Popen(
            hetconv_command("train", "--listen", f"tcp://*:{port}", "--min-workers", "2",
                            "--wait", "30", *RUN, "--run-dir", str(run_dir)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
        assert wait_for(lambda: steps_done(run_dir) >= PINNED_SHORT_AT_STEP, 90), \
            f"the run never reached step {PINNED_SHORT_AT_STEP}: exit code {master.poll()}"
        short_at = cut_link(link, PINNED_SHORT_CUT_S)
        target = steps_done(run_dir) + PINNED_LONG_AFTER_STEPS
        assert wait_for(lambda: steps_done(run_dir) >= target, 90), \
            f"the run never reached step {target} after the short cut: exit code {master.poll()}"
        long_at = cut_link(link, PINNED_LONG_CUT_S)
        out, err = master.communicate(timeout=240)
        assert master.returncode == 0, err
        return run_dir, short_at, long_at
    finally:
        for group in groups:  # every worker told first: they wind down together
            for worker in group.workers:
                worker.terminate()
        for group in groups:
            group.__exit__()


@pytest.mark.timeout(360)
@pytest.mark.skipif(REASON is not None, reason=f"cannot emulate a LAN here: {REASON}")
def test_pinned_a_short_cut_costs_no_failover_a_long_one_a_failover_and_a_rejoin(
        lan: list[LanHost], tmp_path: Path, reference: list[float]) -> None:
    """One run (the suite's time): the 3 s cut evicts nobody (late, not lost); the 20 s
    cut fails w2 over within 12 s and it joins again after the link is back; the loss
    trace stays the local run's."""
    run_dir, short_at, long_at = train_with_cuts(lan, tmp_path)
    events = records(run_dir)
    evictions = [r for r in events if r["type"] == "recovery" and r["gone"]
                 and short_at <= r["time"] < long_at]
    assert not evictions, evictions  # late, not lost: nobody was evicted
    lost = [r for r in events if r["type"] == "recovery" and r["participant"] == "w2"
            and r["time"] >= long_at]
    assert lost and lost[0]["time"] - long_at < 12, lost
    joins = [r for r in events if r["type"] == "replan" and "join" in r["reason"]
             and r["time"] >= long_at]
    assert joins and joins[0]["time"] > long_at + PINNED_LONG_CUT_S, joins
    np.testing.assert_allclose(final_losses(run_dir), reference, rtol=1e-4)


@pytest.mark.serial
@pytest.mark.timeout(300)
@pytest.mark.skipif(cpu_quota_unavailable_reason() is not None,
                    reason=f"no CPU quotas here: {cpu_quota_unavailable_reason()}")
def test_a_machine_that_slows_down_loses_kernels(endpoint: str, workers: Any,
                                                 tmp_path: Path) -> None:
    busy, steady = workers("busy", cpu_fraction=0.9), workers("steady", cpu_fraction=0.9)
    run_dir = tmp_path / "run"
    args = [a for a in RUN if a not in ("--split", "equal")]
    args[args.index("--arch") + 1] = "16:64"
    slowed: list[int] = []
    slowed_at: list[float] = []  # Unix seconds, the records' clock

    def slow_down() -> None:
        deadline = time.monotonic() + 120
        while steps_done(run_dir) < 25 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert busy[0].quota is not None
        busy[0].quota.set(0.2)
        slowed_at.append(time.time())
        slowed.append(steps_done(run_dir))
    thread = threading.Thread(target=slow_down, daemon=True)
    thread.start()
    result = run_hetconv("train", "--listen", endpoint, "--min-workers", "2", "--wait", "30",
                         "--no-local", *args, "--run-dir", str(run_dir), timeout=280)
    thread.join(5)
    assert result.returncode == 0, result.stderr
    assert steady[0].process.poll() is None
    resplits = [r for r in records(run_dir) if r["type"] == "rebalance"]

    def kernels(record: dict[str, Any], who: str) -> int:
        return sum(d["kernels"] for layer in record["counts"] for d in layer["participants"]
                   if d["participant"] == who)
    # decided after the slow-down (a re-split of the same step may have been decided on
    # the steps before it: CI once saw one at step 25 give busy more kernels), and busy
    # down to fewer kernels than steady within a few windows
    moved = [r for r in resplits if slowed_at and r["time"] > slowed_at[0]
             and kernels(r, "busy") < kernels(r, "steady")]
    assert moved, resplits
    assert moved[0]["step"] - slowed[0] <= 30, (slowed, resplits)
