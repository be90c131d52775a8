"""A dead link against a silent peer: the kernel's TCP tables (master/liveness.py) and the
membership's limits (5 s for a stopped worker, 10 s behind a link that retransmits)."""
from __future__ import annotations

import numpy as np

from hetconv.master.liveness import canonical_address, stalled_peers
from hetconv.master.membership import (
    LINK_RETRY_S,
    ClusterSettings,
    Fail,
    Membership,
    MessageReceived,
    RequestsAwaited,
    RequestSent,
    Tick,
)
from hetconv.protocol import PROTOCOL_VERSION, ForwardRequest, Hello

HEADER = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
          "timeout inode")
# master on port 5555 (0x15B3): 10.0.0.2 retransmitting 512 bytes; 10.0.0.3 idle;
# 10.0.0.4 with bytes queued under the zero-window probe timer (a stopped reader)
TCP = "\n".join([
    HEADER,
    "   0: 0100000A:15B3 0200000A:D431 01 00000200:00000000 01:00000031 00000003  0 0 1 1",
    "   1: 0100000A:15B3 0300000A:D432 01 00000000:00000000 00:00000000 00000000  0 0 2 1",
    "   2: 0100000A:15B3 0400000A:D433 01 00000200:00000000 04:00000031 00000000  0 0 3 1",
    "   3: 0100000A:1F90 0500000A:D434 01 00000200:00000000 01:00000031 00000003  0 0 4 1",
    "   4: 00000000:15B3 00000000:0000 0A 00000000:00000000 00:00000000 00000000  0 0 5 1",
])
# the same over IPv6: a v4-mapped peer (::ffff:10.0.0.6) and a v6 one (fd00::7)
TCP6 = "\n".join([
    HEADER,
    "   0: 0000000000000000FFFF00000100000A:15B3 0000000000000000FFFF00000600000A:D435 01 "
    "00000010:00000000 01:00000031 00000001  0 0 6 1",
    "   1: 000000FD000000000000000001000000:15B3 000000FD000000000000000007000000:D436 01 "
    "00000010:00000000 01:00000031 00000001  0 0 7 1",
])


def test_only_connections_on_the_port_retransmitting_unacked_bytes_are_stalled() -> None:
    assert stalled_peers(5555, [TCP]) == {"10.0.0.2"}
    assert stalled_peers(5555, [TCP, TCP6]) == {"10.0.0.2", "10.0.0.6", "fd00::7"}
    assert stalled_peers(8080, [TCP]) == {"10.0.0.5"}
    assert stalled_peers(5555, ["garbage", HEADER + "\n   0: not a line"]) == frozenset()
    assert [canonical_address(a) for a in ("::ffff:10.0.0.6", "[fd00::7]", "10.0.0.2", "")] \
        == ["10.0.0.6", "fd00::7", "10.0.0.2", ""]


def waiting_worker(address: str) -> Membership:
    membership = Membership("run", ClusterSettings(heartbeat_interval_s=0.5,
                                                   liveness_timeout_s=5.0,
                                                   request_timeout_s=60.0))
    membership.handle(MessageReceived(b"w1", Hello(
        worker_id="w1", device={"device": "cpu"}, protocol_version=PROTOCOL_VERSION), 0.0,
        peer_address=address))
    worker = membership.workers[b"w1"]
    request = ForwardRequest(request_id=membership.next_request_id(), step=1, layer=0,
                             attempt=0, train=True, x=np.zeros((1, 1, 2, 2), np.float32))
    membership.handle(RequestSent(worker, request, 0.0))
    membership.handle(RequestsAwaited({request.request_id: worker}, "forward", 0.0))
    return membership


def failed(membership: Membership, now: float, stalled: frozenset[str]) -> bool:
    return any(isinstance(a, Fail) for a in membership.handle(Tick(now, 0.0, stalled)))


def test_a_stopped_worker_is_lost_after_five_seconds_its_link_acknowledging() -> None:
    membership = waiting_worker("10.0.0.2")
    assert not failed(membership, 4.9, frozenset())
    assert failed(membership, 5.5, frozenset({"10.0.0.3"}))  # another peer's link is down


def test_a_worker_behind_a_dead_link_gets_ten_seconds() -> None:
    membership = waiting_worker("10.0.0.2")
    stalled = frozenset({"10.0.0.2"})
    assert not failed(membership, 5.5, stalled)
    assert not failed(membership, LINK_RETRY_S - 0.1, stalled)
    assert failed(membership, LINK_RETRY_S + 0.1, stalled)


def test_a_link_that_heals_late_costs_nothing() -> None:
    membership = waiting_worker("10.0.0.2")
    assert not failed(membership, 7.0, frozenset({"10.0.0.2"}))  # cut, retransmitting
    membership.handle(MessageReceived(b"w1", Hello(
        worker_id="w1", device={"device": "cpu"}, protocol_version=PROTOCOL_VERSION), 7.5))
    assert not failed(membership, 8.0, frozenset())  # heard from again: alive


def test_an_unknown_address_keeps_the_five_second_limit() -> None:
    membership = waiting_worker("")
    assert failed(membership, 5.5, frozenset({"10.0.0.2"}))
