"""Whom to blame when a request is overdue: the wait-for graph of the heartbeats.

Every worker's heartbeat says what its compute thread is doing
(:class:`~hetconv.participant.progress.ComputeReport`): whom it waits for a piece from and
for how long, or for how long it has made no progress. When a request is overdue, the
one that did not answer is often only the one left waiting: an honest worker waits for a
peer that stopped sending, whose compute thread hangs, or whose link to it is cut. This
module follows the waits from the overdue worker to the one at fault, in one pure
function (no sockets, no clock), so that the master evicts that one and never an honest
third:

1. the overdue worker is not waiting for anyone: it is the one (slow, or its compute
   thread hangs: ``stalled_s`` says for how long);
2. otherwise take the longest waiter among the participants its waits lead to (it waits
   for the piece that went missing first); among the peers it waits for,
   - one that is waiting for nobody (computing without progress, or idle: its piece
     never left) is the one at fault;
   - else every one of them moved on to a later wait, so their pieces were sent and
     never arrived: with one such peer, that peer is blamed (it sends nothing, or the
     link between the two is cut: one of its two ends goes, and the run goes on
     without it); with several, the waiter itself receives from nobody (its own link).

The master (``master_name``) is never blamed: where the rule points at it, the other end
of its link is.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hetconv.participant.progress import ComputeReport


@dataclass(frozen=True)
class Blame:
    """The participant at fault and one line saying why (``""``: the overdue one itself,
    for the usual reason: it did not answer)."""

    participant: str
    why: str = ""


def _reachable(start: str, reports: Mapping[str, ComputeReport]) -> list[str]:
    """``start`` and every participant its waits lead to (in the order found)."""
    seen = [start]
    index = 0
    while index < len(seen):
        report = reports.get(seen[index])
        index += 1
        for peer in report.waiting_for if report is not None else ():
            if peer not in seen:
                seen.append(peer)
    return seen


def blame(overdue: str, reports: Mapping[str, ComputeReport], master_name: str) -> Blame:
    """The participant at fault for ``overdue``'s request being late (module doc).

    ``reports``: every participant's latest report, aged to now (a participant without one
    counts as waiting for nobody)."""
    own = reports.get(overdue)
    if own is None or not own.waiting:
        stalled = own.stalled_s if own is not None else 0.0
        return Blame(overdue, f"its compute thread has made no progress for {stalled:.1f} s"
                              if stalled > 0 else "")
    waiters = [p for p in _reachable(overdue, reports)
               if (r := reports.get(p)) is not None and r.waiting]
    longest = max(waiters, key=lambda p: (reports[p].waited_s, p == overdue))
    report = reports[longest]
    owed = list(report.waiting_for)
    quiet = [p for p in owed if p != master_name
             and not (r := reports.get(p, ComputeReport())).waiting]
    if quiet:
        culprit = max(quiet, key=lambda p: reports.get(p, ComputeReport()).stalled_s)
        stalled = reports.get(culprit, ComputeReport()).stalled_s
        state = (f"its compute thread has made no progress for {stalled:.1f} s"
                 if stalled > 0 else "it waits for nobody: its piece never left")
        return Blame(culprit, f"{longest} has waited {report.waited_s:.1f} s for a "
                                        f"piece from {culprit}, and {state}")
    ahead = ", ".join(owed)
    if len(owed) == 1:
        culprit = owed[0]
        other = reports.get(culprit, ComputeReport())
        if other.waiting_for == (longest,) and master_name not in (longest, culprit):
            # the two wait for each other only: the link between them is cut (which end
            # waited longer varies from fault to fault: the same end goes every time)
            end = max(longest, culprit)
            return Blame(end, f"{longest} and {culprit} have waited {report.waited_s:.1f} s "
                              f"for each other's piece: a cut link between {min(longest, culprit)} "
                              f"and {end}; {end} is the end that goes")
        line = (f"{longest} has waited {report.waited_s:.1f} s for a piece from {culprit}, "
                f"which has moved on to wait for {', '.join(other.waiting_for) or '?'}: "
                f"the piece was sent and never arrived (a silent sender or a cut link "
                f"between {longest} and {culprit})")
        if culprit == master_name:
            return Blame(longest, line + f"; {longest} is the end that goes")
        return Blame(culprit, line)
    line = (f"{longest} has waited {report.waited_s:.1f} s for pieces from {ahead}, who have "
            f"all moved on: nothing reaches {longest} (its own link?)")
    if longest == master_name:
        return Blame(overdue, line)
    return Blame(longest, line)
