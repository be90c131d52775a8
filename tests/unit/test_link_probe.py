"""The worker's side of the link probe: answered at once, sized as asked, bounded."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hetconv.config import WorkerConfig
from hetconv.protocol import (
    ERR_BAD_REQUEST,
    PROTOCOL_VERSION,
    ErrorReply,
    LinkProbeReply,
    LinkProbeRequest,
    Welcome,
    limits,
)
from hetconv.worker.session import (
    Compute,
    MessageReceived,
    Send,
    WorkerSession,
    link_probe_reply,
)


def test_reply_carries_the_asked_bytes_and_counts_what_came() -> None:
    reply = link_probe_reply(LinkProbeRequest(request_id=7, reply_bytes=1000,
                                              payload=np.zeros(300, np.uint8)))
    assert isinstance(reply, LinkProbeReply)
    assert reply.request_id == 7 and reply.received_bytes == 300
    assert reply.payload is not None and reply.payload.nbytes == 1000
    empty = link_probe_reply(LinkProbeRequest(request_id=8, reply_bytes=0))
    assert isinstance(empty, LinkProbeReply) and empty.payload is None
    assert empty.received_bytes == 0


def test_oversized_or_negative_requests_are_refused() -> None:
    for size in (limits.MAX_LINK_PROBE_BYTES + 1, -1):
        reply = link_probe_reply(LinkProbeRequest(request_id=9, reply_bytes=size))
        assert isinstance(reply, ErrorReply) and reply.code == ERR_BAD_REQUEST


def test_the_session_answers_a_probe_itself_never_through_the_compute_thread() -> None:
    session = WorkerSession(WorkerConfig(master="tcp://127.0.0.1:1"), worker_id="w",
                            device={"device": "cpu"})
    session.handle(MessageReceived(Welcome(worker_id="w", run_id="r", heartbeat_interval_s=1.0,
                                           protocol_version=PROTOCOL_VERSION), 0.0))
    actions = session.handle(MessageReceived(LinkProbeRequest(request_id=3, reply_bytes=10),
                                             0.1))
    assert not [a for a in actions if isinstance(a, Compute)]
    sent = [a.message for a in actions if isinstance(a, Send)]
    assert len(sent) == 1 and isinstance(sent[0], LinkProbeReply)


def test_every_request_type_has_a_reply_type_the_master_accepts() -> None:
    """A request whose reply the master does not match hangs until the request deadline."""
    from hetconv.master.membership import REPLY_TYPES, expected_reply
    from hetconv.protocol.messages import MESSAGE_TYPES

    requests = [cls for cls in MESSAGE_TYPES.values() if cls.__name__.endswith("Request")]
    assert LinkProbeRequest in requests and len(requests) >= 6
    for cls in requests:
        reply = expected_reply(object.__new__(cls))
        assert reply is not None and reply in REPLY_TYPES, cls.__name__


def test_a_paused_first_transfer_does_not_set_the_rate(monkeypatch: Any) -> None:
    """The master's side: a busy host delays one 256 KiB transfer by 50 ms (40 Mbit/s on
    loopback); the rate is the fastest of the timings at the final size, not that one."""
    from hetconv.master import link_probe

    rate_bytes_per_s, rtt_s = 1e9, 1e-4
    delays = iter([0.05])  # only the first transfer is paused

    def round_trip_s(cluster: object, worker: object, send_bytes: int,
                     reply_bytes: int) -> float:
        return rtt_s + (send_bytes or reply_bytes) / rate_bytes_per_s + next(delays, 0.0)

    monkeypatch.setattr(link_probe, "_round_trip_s", round_trip_s)
    for down in (True, False):
        delays = iter([0.05])
        rate = link_probe._rate(None, None, rtt_s, down=down)  # type: ignore[arg-type]
        assert rate == pytest.approx(rate_bytes_per_s, rel=1e-6), (down, rate)


def test_a_slow_link_is_measured_at_its_rate(monkeypatch: Any) -> None:
    from hetconv.master import link_probe

    def round_trip_s(cluster: object, worker: object, send_bytes: int,
                     reply_bytes: int) -> float:
        return 2e-4 + (send_bytes or reply_bytes) / 1.25e6  # 10 Mbit/s

    monkeypatch.setattr(link_probe, "_round_trip_s", round_trip_s)
    rate = link_probe._rate(None, None, 2e-4, down=True)  # type: ignore[arg-type]
    assert rate == pytest.approx(1.25e6, rel=1e-6)


def test_a_fast_link_is_timed_once_at_the_largest_probe(monkeypatch: Any) -> None:
    """Loopback-fast: the probe reaches MAX_PROBE_BYTES under the target; no repeat
    (each would cost the run's start another largest transfer per direction)."""
    from hetconv.master import link_probe

    sizes: list[int] = []

    def round_trip_s(cluster: object, worker: object, send_bytes: int,
                     reply_bytes: int) -> float:
        sizes.append(send_bytes or reply_bytes)
        return 1e-4 + (send_bytes or reply_bytes) / 1e10

    monkeypatch.setattr(link_probe, "_round_trip_s", round_trip_s)
    rate = link_probe._rate(None, None, 1e-4, down=False)  # type: ignore[arg-type]
    assert rate == pytest.approx(1e10, rel=1e-6)
    assert sizes.count(link_probe.MAX_PROBE_BYTES) == 1, sizes
