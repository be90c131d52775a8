"""An overdue request's failure, blamed through the heartbeats (issue 49).

The membership (master/membership.py) finds a request past its deadline; this module
turns the members' latest heartbeats into :class:`ComputeReport`s aged to now, asks
:func:`hetconv.master.blame.blame` whom the waits lead to, and words the failure. A
blame that points at a member silent for a while is deferred (None): the liveness limit
names it gone, which lets a stopped worker rejoin.
"""
from __future__ import annotations

from collections.abc import Sequence

from hetconv.config import MASTER_PARTICIPANT
from hetconv.master.blame import blame
from hetconv.master.membership_types import Fail, WorkerHandle
from hetconv.participant.progress import ComputeReport


def report_now(worker: WorkerHandle, now: float) -> ComputeReport:
    """What ``worker``'s compute thread is doing now, from its last heartbeat."""
    return worker.compute.aged(now - worker.compute_at)


def overdue_fault(worker: WorkerHandle, what: str, timeout: float,
                  members: Sequence[WorkerHandle], own: ComputeReport | None, now: float,
                  silent_after_s: float | None) -> Fail | None:
    """The failure of ``worker``'s request for ``what``, not answered within ``timeout``:
    blamed on the one its waits lead to. ``own``: the master's participant's report.
    ``silent_after_s``: a blamed member silent longer than this defers the failure (None:
    never defer, the liveness grace is over)."""
    reports = {w.worker_id: report_now(w, now) for w in members if not w.gone}
    if own is not None:
        reports[MASTER_PARTICIPANT] = own
    found = blame(worker.worker_id, reports, MASTER_PARTICIPANT)
    text = f"worker {worker.name} did not answer {what} within {timeout:.0f} s"
    if found.participant == worker.worker_id:
        return Fail(worker, text + (f": {found.why}" if found.why else ""))
    blamed = next((w for w in members if w.worker_id == found.participant and not w.gone),
                  None)
    if (blamed is not None and silent_after_s is not None
            and now - blamed.last_seen > silent_after_s):
        return None  # the one it waits for is silent: the liveness limit names it
    return Fail(worker, f"{text}: {found.why}", found.participant)
