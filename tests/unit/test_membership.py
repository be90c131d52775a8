"""The master's membership state machine, driven by events without sockets or clocks."""
from __future__ import annotations

import numpy as np
import pytest

from hetconv.master.membership import (
    Action,
    BadMessage,
    ClusterSettings,
    Completed,
    Fail,
    Membership,
    MessageReceived,
    RequestsAwaited,
    RequestSent,
    Send,
    SendFailed,
    Tick,
    WorkerHandle,
    expected_reply,
    reply_mismatch,
)
from hetconv.protocol import (
    ERR_BAD_MESSAGE,
    ERR_UNEXPECTED,
    ERR_UNKNOWN_LAYER,
    ERR_UNKNOWN_WORKER,
    PROTOCOL_VERSION,
    Ack,
    CalibrateReply,
    CalibrateRequest,
    EndRun,
    ErrorReply,
    ForwardReply,
    ForwardRequest,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    Refuse,
    VersionMismatch,
    Welcome,
)

SETTINGS = ClusterSettings(heartbeat_interval_s=0.5, liveness_timeout_s=5.0,
                           request_timeout_s=60.0)


def hello(worker_id: str, version: int = PROTOCOL_VERSION) -> Hello:
    return Hello(worker_id=worker_id, device={"device": "cpu", "name": "test cpu"},
                 protocol_version=version)


def sends(actions: list[Action]) -> list[Send]:
    return [a for a in actions if isinstance(a, Send)]


def fails(actions: list[Action]) -> list[Fail]:
    return [a for a in actions if isinstance(a, Fail)]


def completed(actions: list[Action]) -> list[Completed]:
    return [a for a in actions if isinstance(a, Completed)]


def join(membership: Membership, worker_id: str, now: float = 0.0) -> WorkerHandle:
    identity = worker_id.encode()
    membership.handle(MessageReceived(identity, hello(worker_id), now))
    return membership.workers[identity]


def forward_request(membership: Membership, step: int = 3, layer: int = 1) -> ForwardRequest:
    return ForwardRequest(request_id=membership.next_request_id(), step=step, layer=layer,
                          attempt=0, train=True, x=np.zeros((1, 1, 2, 2), np.float32))


def forward_reply(request: ForwardRequest, **changes: int) -> ForwardReply:
    fields = {"step": request.step, "layer": request.layer, "attempt": request.attempt}
    fields.update(changes)
    return ForwardReply(request_id=request.request_id, compute_s=0.01,
                        y=np.zeros((1, 2, 1, 1), np.float32), **fields)


def send_request(membership: Membership, worker: WorkerHandle, now: float = 1.0,
                 what: str = "forward of layer 2 (step 3)") -> ForwardRequest:
    request = forward_request(membership)
    membership.handle(RequestSent(worker, request, now))
    membership.handle(RequestsAwaited({request.request_id: worker}, what, now))
    return request


@pytest.fixture
def membership() -> Membership:
    return Membership("run1", SETTINGS)


# --- handshake ----------------------------------------------------------------------
def test_hello_is_welcomed(membership: Membership) -> None:
    actions = membership.handle(MessageReceived(b"w1", hello("w1"), 0.0))
    [send] = sends(actions)
    assert send.identity == b"w1"
    assert isinstance(send.message, Welcome)
    assert send.message.worker_id == "w1" and send.message.run_id == "run1"
    assert send.message.heartbeat_interval_s == SETTINGS.heartbeat_interval_s
    assert send.message.protocol_version == PROTOCOL_VERSION
    assert [w.worker_id for w in membership.live_workers(0.0)] == ["w1"]


def test_version_mismatch_is_refused_naming_both_versions(membership: Membership) -> None:
    actions = membership.handle(MessageReceived(b"old", hello("old", version=99), 0.0))
    [send] = sends(actions)
    assert isinstance(send.message, Refuse) and send.identity == b"old"
    assert f"master speaks {PROTOCOL_VERSION}, worker old speaks 99" in send.message.reason
    assert send.message.protocol_version == PROTOCOL_VERSION
    assert membership.workers == {}


def test_undecodable_version_mismatch_is_refused(membership: Membership) -> None:
    error = VersionMismatch(PROTOCOL_VERSION, 99, message_type="heartbeat", identity=b"w9")
    [send] = sends(membership.handle(BadMessage(error)))
    assert isinstance(send.message, Refuse) and send.identity == b"w9"
    assert "99" in send.message.reason and str(PROTOCOL_VERSION) in send.message.reason


def test_undecodable_message_is_answered_with_its_code(membership: Membership) -> None:
    error = ProtocolError(ERR_BAD_MESSAGE, "header is not msgpack", request_id=7,
                          identity=b"stranger")
    [send] = sends(membership.handle(BadMessage(error)))
    assert send.identity == b"stranger"
    assert isinstance(send.message, ErrorReply)
    assert send.message.code == ERR_BAD_MESSAGE and send.message.request_id == 7
    assert sends(membership.handle(BadMessage(ProtocolError(ERR_BAD_MESSAGE, "no peer")))) == []


def test_message_from_unknown_identity_gets_unknown_worker(membership: Membership) -> None:
    actions = membership.handle(MessageReceived(b"stranger", Heartbeat(sent_at=0.0), 0.0))
    [send] = sends(actions)
    assert send.identity == b"stranger"
    assert isinstance(send.message, ErrorReply) and send.message.code == ERR_UNKNOWN_WORKER
    assert membership.workers == {}


def test_message_the_master_does_not_serve_is_unexpected(membership: Membership) -> None:
    join(membership, "w1")
    request = forward_request(membership)
    [send] = sends(membership.handle(MessageReceived(b"w1", request, 1.0)))
    assert isinstance(send.message, ErrorReply) and send.message.code == ERR_UNEXPECTED
    assert send.message.request_id == request.request_id


def test_re_hello_from_known_worker_refreshes_it(membership: Membership) -> None:
    worker = join(membership, "w1", now=0.0)
    again = Hello(worker_id="w1", device={"device": "gpu:0", "name": "restarted"},
                  protocol_version=PROTOCOL_VERSION)
    actions = membership.handle(MessageReceived(b"w1", again, 4.0))
    assert isinstance(sends(actions)[0].message, Welcome)
    assert membership.workers[b"w1"] is worker and worker.last_seen == 4.0
    assert worker.device["device"] == "gpu:0" and worker.name == "w1 (gpu:0)"
    assert membership.live_workers(8.0) == [worker]


# --- liveness -------------------------------------------------------------------------
def test_heartbeat_keeps_a_worker_alive(membership: Membership) -> None:
    worker = join(membership, "w1", now=0.0)
    request = send_request(membership, worker, now=0.0)
    for now in (2.0, 4.0, 6.0, 8.0):
        assert membership.handle(MessageReceived(b"w1", Heartbeat(sent_at=0.0), now)) == []
        assert fails(membership.handle(Tick(now + 1.0, 0.0))) == []
    assert membership.live_workers(9.0) == [worker] and not worker.gone
    assert membership.replies_for([request.request_id]) is None


def test_tick_heartbeats_every_interval(membership: Membership) -> None:
    join(membership, "w1")
    beats = sends(membership.handle(Tick(1.0, 1234.5)))
    assert [(s.identity, type(s.message)) for s in beats] == [(b"w1", Heartbeat)]
    assert isinstance(beats[0].message, Heartbeat) and beats[0].message.sent_at == 1234.5
    assert sends(membership.handle(Tick(1.2, 0.0))) == []
    assert len(sends(membership.handle(Tick(1.5, 0.0)))) == 1


def test_liveness_timeout_names_the_worker(membership: Membership) -> None:
    worker = join(membership, "w1", now=0.0)
    send_request(membership, worker, now=0.0)
    assert fails(membership.handle(Tick(4.9, 0.0))) == []
    [fail] = fails(membership.handle(Tick(5.5, 0.0)))
    assert fail.worker is worker and worker.gone
    assert "worker w1 (cpu) stopped responding during forward of layer 2" in fail.reason
    assert "silent for 5.5 s" in fail.reason


def test_request_timeout_names_the_worker(membership: Membership) -> None:
    worker = join(membership, "w1", now=0.0)
    send_request(membership, worker, now=0.0)
    for now in range(1, 61):  # heartbeating, but never answering
        membership.handle(MessageReceived(b"w1", Heartbeat(sent_at=0.0), float(now)))
        assert fails(membership.handle(Tick(float(now), 0.0))) == []
    [fail] = fails(membership.handle(Tick(60.5, 0.0)))
    assert fail.worker is worker
    assert fail.reason.startswith("worker w1 (cpu) did not answer forward of layer 2")
    assert "within 60 s" in fail.reason


def test_a_deadline_defers_to_a_silent_worker_awaited_with_it() -> None:
    """A live worker whose answer waits on a stopped one (a weight reduction among the
    peers) is not blamed at its deadline: the stopped one is, at the liveness limit."""
    membership = Membership("run1", ClusterSettings(heartbeat_interval_s=0.5,
                                                    liveness_timeout_s=5.0,
                                                    request_timeout_s=5.0))
    waiting = join(membership, "waiting", now=0.0)
    stopped = join(membership, "stopped", now=0.0)
    membership.handle(MessageReceived(b"stopped", Heartbeat(sent_at=0.0), 0.8))  # then frozen
    for worker in (waiting, stopped):
        send_request(membership, worker, now=0.5)
    for tenth in range(1, 59):  # "waiting" heartbeats all along and never answers
        now = tenth / 10
        membership.handle(MessageReceived(b"waiting", Heartbeat(sent_at=0.0), now))
        assert fails(membership.handle(Tick(now, 0.0))) == [], now
    failed = fails(membership.handle(Tick(5.9, 0.0)))
    assert [f.worker for f in failed] == [stopped], [f.reason for f in failed]
    assert "stopped responding" in failed[0].reason


def test_a_deadline_still_fails_a_worker_nobody_else_holds_back(membership: Membership) -> None:
    alone = join(membership, "alone", now=0.0)
    send_request(membership, alone, now=0.0)
    membership.handle(MessageReceived(b"alone", Heartbeat(sent_at=0.0), 60.0))
    [fail] = fails(membership.handle(Tick(60.5, 0.0)))
    assert fail.worker is alone and "did not answer" in fail.reason


def test_waiting_counts_only_live_workers(membership: Membership) -> None:
    silent = join(membership, "silent", now=0.0)
    leaving = join(membership, "leaving", now=0.0)
    steady = join(membership, "steady", now=0.0)
    assert len(membership.live_workers(1.0)) == 3
    membership.handle(MessageReceived(b"leaving", Goodbye(worker_id="leaving", reason="bye"),
                                      2.0))
    membership.handle(MessageReceived(b"steady", Heartbeat(sent_at=0.0), 4.0))
    assert membership.live_workers(6.0) == [steady]
    assert silent not in membership.live_workers(6.0) and leaving.gone
    assert membership.fix_members([steady]) == [steady]


# --- replies --------------------------------------------------------------------------
def test_reply_completes_its_request(membership: Membership) -> None:
    worker = join(membership, "w1")
    request = send_request(membership, worker)
    actions = membership.handle(MessageReceived(b"w1", forward_reply(request), 2.0))
    [done] = completed(actions)
    assert done.request_id == request.request_id and done.reply.worker is worker
    assert done.reply.received_at == 2.0 and done.reply.payload_bytes == 8
    replies = membership.replies_for([request.request_id])
    assert replies is not None and replies[request.request_id] is done.reply


def test_stale_reply_with_unknown_id_is_dropped(membership: Membership) -> None:
    worker = join(membership, "w1")
    request = send_request(membership, worker)
    stale = CalibrateReply(request_id=request.request_id + 100, layer=0, seconds=0.1)
    actions = membership.handle(MessageReceived(b"w1", stale, 2.0))
    assert completed(actions) == [] and fails(actions) == []
    assert membership.replies_for([request.request_id]) is None


def test_reply_with_right_id_from_another_worker_is_dropped(membership: Membership) -> None:
    asked = join(membership, "w1")
    join(membership, "w2")
    request = send_request(membership, asked)
    actions = membership.handle(MessageReceived(b"w2", forward_reply(request), 2.0))
    assert completed(actions) == [] and fails(actions) == []
    assert membership.replies_for([request.request_id]) is None
    assert completed(membership.handle(MessageReceived(b"w1", forward_reply(request), 2.5)))


def test_duplicate_reply_is_dropped(membership: Membership) -> None:
    worker = join(membership, "w1")
    request = send_request(membership, worker)
    first = membership.handle(MessageReceived(b"w1", forward_reply(request), 2.0))
    again = membership.handle(MessageReceived(b"w1", forward_reply(request), 2.1))
    assert len(completed(first)) == 1 and completed(again) == [] and fails(again) == []
    replies = membership.replies_for([request.request_id])
    assert replies is not None and replies[request.request_id].received_at == 2.0


def test_late_reply_to_a_forgotten_request_is_dropped(membership: Membership) -> None:
    worker = join(membership, "w1")
    request = send_request(membership, worker)
    membership.forget([request.request_id])
    actions = membership.handle(MessageReceived(b"w1", forward_reply(request), 2.0))
    assert completed(actions) == [] and fails(actions) == []


def test_error_reply_fails_naming_the_worker(membership: Membership) -> None:
    worker = join(membership, "w1")
    request = send_request(membership, worker)
    error = ErrorReply(request_id=request.request_id, code=ERR_UNKNOWN_LAYER,
                       message="no shard for layer 1")
    [fail] = fails(membership.handle(MessageReceived(b"w1", error, 2.0)))
    assert fail.worker is worker
    assert fail.reason == ("worker w1 (cpu) failed forward of layer 2 (step 3): "
                           "unknown_layer: no shard for layer 1")


@pytest.mark.parametrize("changes", [{"step": 4}, {"layer": 0}, {"attempt": 1}])
def test_reply_echoing_another_step_layer_or_attempt_fails(membership: Membership,
                                                           changes: dict[str, int]) -> None:
    worker = join(membership, "w1")
    request = send_request(membership, worker)
    actions = membership.handle(MessageReceived(b"w1", forward_reply(request, **changes), 2.0))
    [fail] = fails(actions)
    [(key, value)] = changes.items()
    assert fail.worker is worker and f"with {key} {value}, expected" in fail.reason
    assert completed(actions) == []


def test_reply_of_the_wrong_type_fails(membership: Membership) -> None:
    worker = join(membership, "w1")
    request = send_request(membership, worker)
    [fail] = fails(membership.handle(MessageReceived(b"w1", Ack(request_id=request.request_id),
                                                     2.0)))
    assert "with ack, expected forward_reply" in fail.reason


def test_request_registered_only_by_awaiting_takes_any_reply(membership: Membership) -> None:
    worker = join(membership, "w1")
    membership.handle(RequestsAwaited({41: worker}, "shard assignment", 1.0))
    assert completed(membership.handle(MessageReceived(b"w1", Ack(request_id=41), 2.0)))


def test_goodbye_marks_the_worker_gone_and_fails_its_requests(membership: Membership) -> None:
    worker = join(membership, "w1")
    other = join(membership, "w2")
    send_request(membership, worker, what="backward of layer 1 (step 0)")
    send_request(membership, other)
    actions = membership.handle(MessageReceived(b"w1", Goodbye(worker_id="w1", reason="SIGTERM"),
                                                2.0))
    [fail] = fails(actions)
    assert worker.gone and not other.gone and fail.worker is worker
    assert fail.reason == "worker w1 (cpu) left during backward of layer 1 (step 0): SIGTERM"
    assert fails(membership.handle(Tick(2.1, 0.0)))[0].worker is worker
    [send] = sends(membership.handle(MessageReceived(b"w1", Heartbeat(sent_at=0.0), 2.2)))
    assert isinstance(send.message, ErrorReply) and send.message.code == ERR_UNKNOWN_WORKER


def test_send_failure_marks_the_worker_gone(membership: Membership) -> None:
    worker = join(membership, "w1")
    [fail] = fails(membership.handle(SendFailed(worker, "peer unreachable")))
    assert worker.gone and fail.reason == "worker w1 (cpu) is unreachable: peer unreachable"


def test_undecodable_reply_to_an_awaited_request_fails(membership: Membership) -> None:
    worker = join(membership, "w1")
    request = send_request(membership, worker)
    error = ProtocolError(ERR_BAD_MESSAGE, "frame 1 has 3 bytes, expected 8",
                          request_id=request.request_id, identity=b"w1")
    [fail] = fails(membership.handle(BadMessage(error)))
    assert fail.worker is worker and "undecodable reply to forward of layer 2" in fail.reason


# --- pure helpers -----------------------------------------------------------------------
def test_expected_reply_types() -> None:
    calibrate = CalibrateRequest(request_id=1, layer=0, batch=1, in_channels=1, height=4,
                                 width=4, kernels=1, kernel_size=3, stride=1, padding=0,
                                 repeats=1)
    assert expected_reply(calibrate) is CalibrateReply
    assert expected_reply(EndRun(request_id=1, reason="done")) is Ack
    assert expected_reply(Heartbeat(sent_at=0.0)) is None


def test_reply_mismatch_checks_only_shared_fields() -> None:
    request = ForwardRequest(request_id=1, step=3, layer=1, attempt=0, train=True,
                             x=np.zeros((1, 1, 1, 1), np.float32))
    assert reply_mismatch(request, forward_reply(request)) is None
    assert reply_mismatch(request, forward_reply(request, attempt=2)) == "attempt 2, expected 0"
    message: Message = Ack(request_id=1)
    assert reply_mismatch(request, message) is None
