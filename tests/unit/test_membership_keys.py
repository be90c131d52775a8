"""CURVE: the master's membership binds each routing id to the key that first said Hello
under it, and refuses messages under it from any other key (no sockets, no clocks)."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from hetconv.master.membership import (
    Action,
    BadMessage,
    ClusterSettings,
    Completed,
    Fail,
    Log,
    Membership,
    MessageReceived,
    RequestsAwaited,
    RequestSent,
    Send,
    Tick,
    WorkerHandle,
)
from hetconv.protocol import (
    ERR_BAD_MESSAGE,
    ERR_INTERNAL,
    PROTOCOL_VERSION,
    Ack,
    ErrorReply,
    ForwardReply,
    ForwardRequest,
    Goodbye,
    Heartbeat,
    Hello,
    ProtocolError,
    VersionMismatch,
    Welcome,
)

SETTINGS = ClusterSettings(heartbeat_interval_s=0.5, liveness_timeout_s=5.0,
                           request_timeout_s=60.0, forgery_log_interval_s=10.0)
KEY_B, KEY_A = "B" * 40, "A" * 40  # z85 public keys as the ZAP User-Id carries them


def hello(worker_id: str) -> Hello:
    return Hello(worker_id=worker_id, device={"device": "cpu"}, protocol_version=PROTOCOL_VERSION)


def warnings(actions: list[Action]) -> list[Log]:
    return [a for a in actions if isinstance(a, Log) and a.level >= logging.WARNING]


@pytest.fixture
def membership() -> Membership:
    return Membership("run1", SETTINGS)


@pytest.fixture
def worker(membership: Membership) -> WorkerHandle:
    membership.handle(MessageReceived(b"id-b", hello("b"), 0.0, KEY_B))
    return membership.workers[b"id-b"]


def awaiting(membership: Membership, worker: WorkerHandle, now: float = 1.0) -> ForwardRequest:
    request = ForwardRequest(request_id=membership.next_request_id(), step=0, layer=0, attempt=0,
                             train=True, x=np.zeros((1, 1, 2, 2), np.float32))
    membership.handle(RequestSent(worker, request, now))
    membership.handle(RequestsAwaited({request.request_id: worker}, "forward of layer 1", now))
    return request


def test_the_key_of_the_first_hello_is_bound(membership: Membership,
                                             worker: WorkerHandle) -> None:
    assert worker.curve_key == KEY_B and membership.bindings[b"id-b"].key == KEY_B
    assert membership.handle(MessageReceived(b"id-b", Heartbeat(sent_at=0.0), 1.0, KEY_B)) == []
    assert worker.last_seen == 1.0


def test_forged_messages_are_refused_and_never_acted_on(membership: Membership,
                                                        worker: WorkerHandle) -> None:
    request = awaiting(membership, worker)
    reply = ForwardReply(request_id=request.request_id, step=0, layer=0, attempt=0,
                         compute_s=0.0, y=np.zeros((1, 1, 1, 1), np.float32))
    forged = [reply, ErrorReply(request_id=request.request_id, code=ERR_INTERNAL, message="x"),
              Goodbye(worker_id="b", reason="forged"), Heartbeat(sent_at=0.0), hello("a")]
    for index, message in enumerate(forged):
        actions = membership.handle(MessageReceived(b"id-b", message, 2.0 + index, KEY_A))
        assert not any(isinstance(a, (Send, Fail, Completed)) for a in actions), message
    assert worker.last_seen == 0.0 and worker.forgeries == len(forged)
    assert membership.workers[b"id-b"] is worker and worker.curve_key == KEY_B
    assert membership.replies_for([request.request_id]) is None
    # another key's connection holds the id, so the worker's own does not: it counts as
    # having lost its connection (nothing more goes to the id), not as having left
    assert worker.gone and worker.connection_lost
    assert not any(isinstance(a, Send) for a in membership.handle(Tick(30.0, 0.0)))
    [fail] = fails_now(membership)
    assert "worker b (cpu) lost its connection" in fail.reason and not fail.evict


def test_a_forgery_is_logged_once_per_interval_with_a_count(membership: Membership,
                                                            worker: WorkerHandle) -> None:
    def forge(now: float) -> list[Log]:
        return warnings(membership.handle(MessageReceived(b"id-b", Heartbeat(sent_at=0.0),
                                                          now, KEY_A)))

    [first] = forge(1.0)
    assert "worker b (cpu)" in first.text and "another CURVE key" in first.text
    assert all(forge(1.0 + i / 10) == [] for i in range(1, 50))  # 49 more within 10 s
    [summary] = forge(11.5)
    assert "49 more refused since the last warning" in summary.text
    assert membership.bindings[b"id-b"].refused == 51


def test_undecodable_forgeries_get_no_reply_and_blame_nothing(membership: Membership,
                                                            worker: WorkerHandle) -> None:
    request = awaiting(membership, worker)
    error = ProtocolError(ERR_BAD_MESSAGE, "garbage", request_id=request.request_id,
                          identity=b"id-b")
    actions = membership.handle(BadMessage(error, KEY_A, 2.0))
    assert [type(a) for a in actions] == [Log] and worker.forgeries == 1
    mismatch = VersionMismatch(PROTOCOL_VERSION, 99, identity=b"id-b")
    assert membership.handle(BadMessage(mismatch, KEY_A, 3.0)) == []
    # not the worker's fault: its own connection no longer holds the id
    assert worker.gone and worker.connection_lost
    assert [("lost its connection" in f.reason, f.evict, f.culprit)
            for f in fails_now(membership)] == [(True, False, None)]
    # from the bound key, or where the transport did not say whose it is: as before
    assert any(isinstance(a, Fail) for a in membership.handle(BadMessage(error, KEY_B, 4.0)))
    assert any(isinstance(a, Fail) for a in membership.handle(BadMessage(error)))


def fails_now(membership: Membership) -> list[Fail]:
    return [a for a in membership.handle(Tick(2.5, 0.0)) if isinstance(a, Fail)]


def test_the_binding_outlives_the_worker(membership: Membership, worker: WorkerHandle) -> None:
    membership.handle(MessageReceived(b"id-b", Goodbye(worker_id="b", reason="bye"), 1.0, KEY_B))
    assert worker.gone
    assert warnings(membership.handle(MessageReceived(b"id-b", hello("b"), 2.0, KEY_A)))
    assert membership.workers[b"id-b"] is worker and worker.gone
    # the worker itself, back with its own key (reconnected or restarted), is welcome
    actions = membership.handle(MessageReceived(b"id-b", hello("b"), 3.0, KEY_B))
    assert any(isinstance(a, Send) and isinstance(a.message, Welcome) for a in actions)
    back = membership.workers[b"id-b"]
    assert not back.gone and back.curve_key == KEY_B


def test_another_routing_id_is_free_to_any_allowed_key(membership: Membership,
                                                       worker: WorkerHandle) -> None:
    actions = membership.handle(MessageReceived(b"id-a", hello("a"), 1.0, KEY_A))
    assert any(isinstance(a, Send) and isinstance(a.message, Welcome) for a in actions)
    assert membership.bindings[b"id-a"].key == KEY_A and not worker.forgeries


def test_a_stranger_binds_nothing_before_its_hello(membership: Membership) -> None:
    membership.handle(MessageReceived(b"id-x", Ack(request_id=1), 0.0, KEY_A))
    assert b"id-x" not in membership.bindings
    membership.handle(MessageReceived(b"id-x", hello("x"), 1.0, KEY_B))
    assert membership.bindings[b"id-x"].key == KEY_B
