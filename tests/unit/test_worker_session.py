"""The worker's session state machine, driven by events with made-up times (no sockets)."""
from __future__ import annotations

import logging

import numpy as np

from hetconv.config import WorkerConfig
from hetconv.protocol import (
    ERR_BAD_MESSAGE,
    ERR_BAD_REQUEST,
    ERR_UNKNOWN_LAYER,
    ERR_UNKNOWN_WORKER,
    NO_REQUEST_ID,
    PROTOCOL_VERSION,
    Ack,
    CurveClientKeys,
    EndRun,
    ErrorReply,
    ForwardRequest,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    Refuse,
    Welcome,
)
from hetconv.worker.session import (
    WAITING_LOG_INTERVAL_S,
    Action,
    BadMessage,
    Compute,
    Exit,
    Log,
    MessageReceived,
    ReplyReady,
    Send,
    StopRequested,
    Tick,
    WorkerSession,
)

MASTER = "tcp://127.0.0.1:5555"


def session(once: bool = False, curve: CurveClientKeys | None = None) -> WorkerSession:
    config = WorkerConfig(master=MASTER, hello_backoff_s=(0.25, 2.0), master_timeout_s=30.0,
                          once=once, curve=curve)
    return WorkerSession(config, "w1", {"kind": "cpu"})


def tick(worker: WorkerSession, now: float) -> list[Action]:
    return worker.handle(Tick(now, wall_time=1000.0 + now))


def receive(worker: WorkerSession, message: Message, now: float = 0.0) -> list[Action]:
    return worker.handle(MessageReceived(message, now))


def sent(actions: list[Action]) -> list[Message]:
    return [a.message for a in actions if isinstance(a, Send)]


def logged(actions: list[Action]) -> list[str]:
    return [a.text for a in actions if isinstance(a, Log)]


def welcome(interval_s: float = 0.5, version: int = PROTOCOL_VERSION) -> Welcome:
    return Welcome(worker_id="w1", run_id="run-1", heartbeat_interval_s=interval_s,
                   protocol_version=version)


def forward(request_id: int = 7) -> ForwardRequest:
    return ForwardRequest(request_id=request_id, step=0, layer=0, attempt=0, train=True,
                          x=np.zeros((1, 1, 2, 2), np.float32))


def joined(now: float = 0.0, interval_s: float = 0.5) -> WorkerSession:
    worker = session()
    tick(worker, now)
    receive(worker, welcome(interval_s), now)
    return worker


def hello_times(worker: WorkerSession, until: float, step: float = 0.05) -> list[float]:
    times = []
    for i in range(int(until / step) + 1):
        now = i * step
        if any(isinstance(m, Hello) for m in sent(tick(worker, now))):
            times.append(round(now, 2))
    return times


def test_first_hello_goes_out_at_once() -> None:
    actions = tick(session(), 0.0)
    assert actions == [Send(Hello(worker_id="w1", device={"kind": "cpu"},
                                  protocol_version=PROTOCOL_VERSION))]


def test_hello_backs_off_doubling_up_to_the_longest_delay() -> None:
    # delays 0.25, 0.5, 1, 2 (the cap), 2, ...
    assert hello_times(session(), 8.0) == [0.0, 0.25, 0.75, 1.75, 3.75, 5.75, 7.75]


def test_waiting_log_every_interval_with_curve_hint_only_under_curve() -> None:
    worker = session()
    lines = {round(t, 2): logged(tick(worker, t)) for t in np.arange(0, 95, 0.25)}
    waiting = [t for t, texts in lines.items() if texts]
    # hellos every 2 s from 1.75 on; the first one at or after each 30 s mark logs
    assert waiting == [31.75, 61.75, 91.75]
    assert lines[31.75] == [f"no master at {MASTER} yet; still trying"]
    keys = CurveClientKeys(b"p" * 40, b"s" * 40, b"m" * 40)
    curved = session(curve=keys)
    tick(curved, 0.0)
    texts = logged(tick(curved, WAITING_LOG_INTERVAL_S + 1))
    assert len(texts) == 1 and "with CURVE" in texts[0]


def test_welcome_starts_the_session_and_heartbeats_follow_its_interval() -> None:
    worker = session()
    tick(worker, 0.0)
    assert logged(receive(worker, welcome(interval_s=0.25), 0.125)) == ["joined run run-1"]
    assert worker.in_session
    beats = []
    for i in range(2, 12):
        now = i * 0.125  # exact in binary, like the interval
        messages = sent(tick(worker, now))
        assert not any(isinstance(m, Hello) for m in messages)
        if messages:
            assert messages == [Heartbeat(sent_at=1000.0 + now)]
            beats.append(round(now, 2))
    assert beats == [0.25, 0.5, 0.75, 1.0, 1.25]  # the first at once, then every 0.25 s


def test_heartbeat_interval_from_welcome_is_clamped() -> None:
    assert joined(interval_s=60.0).heartbeat_interval_s == 5.0
    assert joined(interval_s=0.0).heartbeat_interval_s == 0.05


def test_master_silence_drops_shards_and_says_hello_again() -> None:
    worker = joined(0.0)
    assert not any(isinstance(a, Compute) for a in tick(worker, 29.0))
    actions = tick(worker, 31.0)
    assert any("master silent for 31 s" in text for text in logged(actions))
    computes = [a.request for a in actions if isinstance(a, Compute)]
    assert len(computes) == 1 and isinstance(computes[0], EndRun)
    assert any(isinstance(m, Hello) for m in sent(actions))  # at once, back-off restarted
    assert not worker.in_session and worker.busy == 1
    # the Ack of our own EndRun is not sent to anyone
    assert worker.handle(ReplyReady(Ack(request_id=0))) == []
    assert worker.busy == 0


def test_master_silence_waits_while_a_request_is_in_flight() -> None:
    worker = joined(0.0)
    request = forward()  # (messages with arrays compare equal only to themselves)
    assert receive(worker, request, 1.0) == [Compute(request)]
    assert worker.busy == 1
    actions = tick(worker, 100.0)
    assert worker.in_session and not any(isinstance(a, Compute) for a in actions)
    reply = ErrorReply(request_id=7, code=ERR_UNKNOWN_LAYER, message="no shard")
    assert worker.handle(ReplyReady(reply)) == [Send(reply)]
    assert any(isinstance(a, Compute) for a in tick(worker, 100.1))
    assert not worker.in_session


def test_any_message_counts_as_a_sign_of_life() -> None:
    worker = joined(0.0)
    receive(worker, Heartbeat(sent_at=0.0), 25.0)
    assert not any(isinstance(a, Compute) for a in tick(worker, 50.0))
    assert worker.in_session


def test_welcome_with_another_version_exits_3() -> None:
    worker = session()
    tick(worker, 0.0)
    actions = receive(worker, welcome(version=PROTOCOL_VERSION + 1))
    assert actions[-1] == Exit(3) and "upgrade one" in logged(actions)[0]
    assert worker.handle(Tick(1.0, 1.0)) == []  # nothing after the exit


def test_refuse_exits_3_with_the_reason() -> None:
    worker = session()
    tick(worker, 0.0)
    actions = receive(worker, Refuse(reason="protocol version mismatch", protocol_version=1))
    assert actions == [Log(logging.ERROR, "the master refused this worker: protocol version "
                           "mismatch"), Exit(3)]


def test_unknown_worker_error_says_hello_again_at_once() -> None:
    worker = joined(0.0)
    tick(worker, 3.0)
    actions = receive(worker, ErrorReply(request_id=0, code=ERR_UNKNOWN_WORKER, message="who?"),
                      3.5)
    assert "saying hello again" in logged(actions)[0]
    assert not worker.in_session
    assert any(isinstance(m, Hello) for m in sent(tick(worker, 3.6)))
    assert sent(tick(worker, 3.8)) == []  # then back-off from the first delay: 3.85
    assert any(isinstance(m, Hello) for m in sent(tick(worker, 3.85)))


def test_other_error_replies_are_logged_only() -> None:
    worker = joined()
    actions = receive(worker, ErrorReply(request_id=3, code=ERR_BAD_REQUEST, message="odd"))
    assert actions == [Log(logging.WARNING, "master reports an error: bad_request: odd")]
    assert worker.in_session


def test_request_outside_a_session_is_answered_bad_request() -> None:
    worker = session()
    tick(worker, 0.0)
    actions = receive(worker, forward(request_id=9))
    assert len(actions) == 1
    reply = sent(actions)[0]
    assert isinstance(reply, ErrorReply)
    assert (reply.request_id, reply.code) == (9, ERR_BAD_REQUEST)
    assert worker.busy == 0


def test_requests_in_a_session_go_to_the_compute_thread_and_replies_back() -> None:
    worker = joined()
    first, second = forward(7), forward(8)
    assert receive(worker, first) == [Compute(first)]
    assert receive(worker, second) == [Compute(second)]
    assert worker.busy == 2
    assert sent(worker.handle(ReplyReady(Ack(request_id=7)))) == [Ack(request_id=7)]
    assert sent(worker.handle(ReplyReady(Ack(request_id=8)))) == [Ack(request_id=8)]
    assert worker.busy == 0


def test_bad_message_is_answered_with_its_code() -> None:
    worker = joined()
    error = ProtocolError(ERR_BAD_MESSAGE, "header is not msgpack", request_id=4)
    actions = worker.handle(BadMessage(error))
    assert sent(actions) == [ErrorReply(request_id=4, code=ERR_BAD_MESSAGE, message=str(error))]
    unknown = sent(worker.handle(BadMessage(ProtocolError(ERR_BAD_MESSAGE, "garbage"))))
    assert isinstance(unknown[0], ErrorReply) and unknown[0].request_id == NO_REQUEST_ID


def test_duplicate_welcome_keeps_the_session() -> None:
    worker = joined(0.0)
    receive(worker, forward(), 0.5)
    actions = receive(worker, welcome(interval_s=1.0), 1.0)
    assert actions == []  # no second "joined run"
    assert worker.in_session and worker.busy == 1 and worker.heartbeat_interval_s == 1.0
    assert not any(isinstance(m, Hello) for m in sent(tick(worker, 1.1)))


def test_end_run_goes_to_the_compute_thread_and_the_session_goes_on() -> None:
    worker = joined()
    end = EndRun(request_id=20, reason="done")
    actions = receive(worker, end)
    assert logged(actions) == ["run over: done"] and Compute(end) in actions
    assert worker.handle(ReplyReady(Ack(request_id=20))) == [Send(Ack(request_id=20))]
    assert worker.in_session


def test_end_run_with_once_exits_after_the_replies_are_flushed() -> None:
    worker = session(once=True)
    tick(worker, 0.0)
    receive(worker, welcome(), 0.0)
    receive(worker, forward(7), 1.0)
    actions = receive(worker, EndRun(request_id=20, reason="done"), 1.0)
    assert not any(isinstance(a, Exit) for a in actions)
    assert receive(worker, forward(8), 1.1) == []  # stopping: no new work
    assert tick(worker, 1.5) == []
    assert worker.handle(ReplyReady(Ack(request_id=7))) == [Send(Ack(request_id=7))]
    assert worker.handle(ReplyReady(Ack(request_id=20))) == [Send(Ack(request_id=20)), Exit(0)]


def test_once_gives_up_on_replies_after_the_flush_timeout() -> None:
    worker = session(once=True)
    tick(worker, 0.0)
    receive(worker, welcome(), 0.0)
    receive(worker, EndRun(request_id=20, reason="done"), 1.0)
    assert tick(worker, 1.5) == []
    assert tick(worker, 2.5)[-1] == Exit(0)


def test_stop_exits_at_once_without_once() -> None:
    worker = joined()
    receive(worker, forward(), 0.0)
    assert worker.handle(StopRequested(0.5)) == [Exit(0)]
