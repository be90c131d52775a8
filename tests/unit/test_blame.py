"""Whom the master blames for an overdue request (hetconv/master/blame.py), what a worker's
heartbeat says of its compute thread (hetconv/participant/progress.py), and the
membership's use of both (master/membership.py): without sockets or clocks."""
from __future__ import annotations

from hetconv.config import MASTER_PARTICIPANT
from hetconv.master.blame import Blame, blame
from hetconv.master.membership import Membership
from hetconv.master.membership_types import (
    ClusterSettings,
    Fail,
    MessageReceived,
    RequestsAwaited,
    Tick,
)
from hetconv.participant.progress import ComputeProgress, ComputeReport
from hetconv.protocol import PROTOCOL_VERSION, Heartbeat, Hello

M = MASTER_PARTICIPANT


def waits(*peers: str, s: float) -> ComputeReport:
    return ComputeReport(tuple(peers), s, 0.0)


def computing(stalled: float) -> ComputeReport:
    return ComputeReport((), 0.0, stalled)


# --- the rule ------------------------------------------------------------------------------
def test_an_overdue_worker_that_waits_for_nobody_is_the_one() -> None:
    found = blame("a", {"a": computing(7.0), "b": waits("a", s=6.0)}, M)
    assert found.participant == "a" and "no progress for 7.0 s" in found.why
    assert blame("a", {}, M) == Blame("a")  # no heartbeat said otherwise


def test_a_hung_compute_thread_is_blamed_not_the_workers_waiting_for_it() -> None:
    reports = {"a": waits("b", s=6.0), "b": computing(6.2), M: waits("b", s=6.0)}
    found = blame("a", reports, M)
    assert found.participant == "b"
    assert "no progress for 6.2 s" in found.why


def test_a_silent_sender_is_blamed_by_those_it_left_waiting() -> None:
    # b got everyone's pieces and moved on; its own never arrived
    reports = {"a": waits("b", s=6.0), M: waits("b", s=5.9), "b": waits("a", M, s=5.8)}
    for overdue in ("a", "b"):
        found = blame(overdue, reports, M)
        assert found.participant == "b", found
        assert "never arrived" in found.why


def test_a_cut_link_between_two_workers_costs_one_of_its_ends_never_a_third() -> None:
    # a and b wait for each other at the same barrier; c got both and waits further on
    reports = {"a": waits("b", s=6.0), "b": waits("a", s=5.99), "c": waits("a", "b", s=5.0),
               M: waits("a", "b", s=5.0)}
    for overdue in ("a", "b", "c"):
        found = blame(overdue, reports, M)
        assert found.participant == "b" and "a cut link between a and b" in found.why
    reports["b"] = waits("a", s=6.5)  # the other end waited longer this time: same end
    assert blame("a", reports, M).participant == "b"


def test_the_master_is_never_blamed_the_other_end_of_its_link_is() -> None:
    reports = {"a": waits(M, s=6.0), M: waits("a", s=5.0)}
    found = blame("a", reports, M)
    assert found.participant == "a"
    assert "is the end that goes" in found.why


def test_a_worker_that_receives_from_nobody_is_the_one() -> None:
    reports = {"a": waits("b", "c", s=6.0), "b": waits("a", s=5.0), "c": waits("a", s=5.0)}
    assert blame("b", reports, M).participant == "a"


def test_an_idle_peer_whose_piece_never_left_is_blamed() -> None:
    reports = {"a": waits("b", s=6.0), "b": ComputeReport()}
    found = blame("a", reports, M)
    assert found.participant == "b" and "never left" in found.why


# --- the compute thread's marks ------------------------------------------------------------
def test_progress_reports_waits_and_stalls() -> None:
    now = [10.0]
    progress = ComputeProgress(clock=lambda: now[0])
    assert progress.report(now[0]) == ComputeReport()
    progress.started()
    now[0] = 12.0
    assert progress.report(now[0]) == ComputeReport((), 0.0, 2.0)
    progress.waiting(["a", "b"])
    now[0] = 13.0
    progress.waiting(["b"])  # a piece came: the wait keeps its start
    assert progress.report(14.0) == ComputeReport(("b",), 2.0, 0.0)
    progress.progressed()
    assert progress.report(15.0) == ComputeReport((), 0.0, 2.0)
    progress.finished()
    assert progress.report(20.0) == ComputeReport()
    assert ComputeReport(("b",), 1.0).aged(2.0) == ComputeReport(("b",), 3.0)
    assert ComputeReport((), 0.0, 1.0).aged(2.0) == ComputeReport((), 0.0, 3.0)


# --- the membership ------------------------------------------------------------------------
def joined(membership: Membership, name: str, now: float = 0.0) -> bytes:
    identity = name.encode()
    membership.handle(MessageReceived(identity, Hello(worker_id=name, device={"device": "cpu"},
                                                      protocol_version=PROTOCOL_VERSION), now))
    return identity


def beat(membership: Membership, identity: bytes, now: float, waiting: list[str] | None = None,
         waited: float = 0.0, stalled: float = 0.0) -> None:
    membership.handle(MessageReceived(identity, Heartbeat(
        sent_at=now, waiting_for=waiting or [], waited_s=waited, stalled_s=stalled), now))


def fails(membership: Membership, now: float) -> list[Fail]:
    return [a for a in membership.handle(Tick(now, now)) if isinstance(a, Fail)]


def test_an_overdue_request_is_blamed_on_the_silent_peer_its_worker_waits_for() -> None:
    membership = Membership("run", ClusterSettings())
    a, b = joined(membership, "a"), joined(membership, "b")
    workers = {w.identity: w for w in membership.fix_members(membership.workers.values())}
    membership.handle(RequestsAwaited({1: workers[a], 2: workers[b]}, "step chain (step 50)",
                                      0.0, timeout_s=5.0))
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        beat(membership, a, t, ["b"], waited=t - 0.5)
        beat(membership, b, t, ["a", M], waited=t - 0.6)
    failed = fails(membership, 5.1)
    assert failed and all(f.culprit == "b" or (f.culprit is None and f.worker.worker_id == "b")
                          for f in failed), failed
    assert "never arrived" in failed[0].reason


def test_a_worker_whose_compute_thread_stalls_fails_its_request_before_the_deadline() -> None:
    membership = Membership("run", ClusterSettings())
    a = joined(membership, "a")
    worker = membership.fix_members(membership.workers.values())[0]
    membership.compute_stall_limit_s = 5.0
    membership.handle(RequestsAwaited({1: worker}, "re-split shard assignment", 0.0))
    beat(membership, a, 1.0, stalled=3.0)
    assert fails(membership, 2.0) == []  # 4 s stalled so far
    beat(membership, a, 2.5, stalled=4.5)
    failed = fails(membership, 3.2)
    assert len(failed) == 1 and "made no progress for 5.2 s" in failed[0].reason
    assert failed[0].culprit is None and failed[0].worker is worker
