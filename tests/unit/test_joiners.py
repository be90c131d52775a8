"""Joiners calibrated beside training (master/joiners.py) and the membership's background
requests (master/membership.py): a joiner's failure never becomes a training fault."""
from __future__ import annotations

from typing import Any

from hetconv.master.joiners import JoinCalibration
from hetconv.master.membership import Membership
from hetconv.master.membership_types import (
    ClusterSettings,
    Fail,
    MessageReceived,
    Reply,
    RequestsAwaited,
    Tick,
    WorkerHandle,
)
from hetconv.model import conv_layer_shapes, model_config, parse_network
from hetconv.protocol import (
    PROTOCOL_VERSION,
    CalibrateReply,
    CalibrateRequest,
    ErrorReply,
    Hello,
    Message,
)

SHAPES = conv_layer_shapes(model_config(parse_network("c4k3p1,c8k3p1"), (1, 8, 8)))


class BesideCluster:
    """The cluster calls JoinCalibration makes, answered by the test."""

    def __init__(self) -> None:
        self.next_id = 0
        self.sent: dict[int, tuple[WorkerHandle, Message]] = {}
        self.replies: dict[int, Reply] = {}
        self.failures: dict[int, str] = {}
        self.dropped: list[tuple[str, str, bool]] = []
        self.forgotten: list[int] = []
        self.workers: list[WorkerHandle] = []

    def request_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def send_beside(self, requests: Any, what: str, timeout_s: float) -> list[int]:
        for worker, message in requests:
            self.sent[message.request_id] = (worker, message)
        return [m.request_id for _, m in requests]

    def beside_results(self, ids: list[int]) -> tuple[dict[int, Reply] | None, str]:
        failure = next((self.failures[i] for i in ids if i in self.failures), "")
        if any(i not in self.replies for i in ids):
            return None, failure
        return {i: self.replies[i] for i in ids}, failure

    def answer(self, worker: str, seconds: float) -> None:
        for rid, (handle, message) in self.sent.items():
            if handle.worker_id == worker and isinstance(message, CalibrateRequest):
                self.replies[rid] = Reply(handle, CalibrateReply(
                    request_id=rid, layer=message.layer, seconds=seconds), 0.0, 0)

    def pump(self, timeout_s: float) -> list[Reply]:
        return []

    def forget(self, ids: list[int]) -> None:
        self.forgotten += ids

    def known_workers(self) -> list[WorkerHandle]:
        return self.workers

    def drop(self, worker: WorkerHandle, reason: str, misbehaved: bool = False) -> None:
        worker.gone = True
        self.dropped.append((worker.worker_id, reason, misbehaved))


def handle(name: str) -> WorkerHandle:
    return WorkerHandle(name.encode(), name, {"device": "cpu"}, 0.0)


def test_a_joiner_is_timed_beside_training_and_taken_in_once_it_answered() -> None:
    cluster = BesideCluster()
    lines: list[str] = []
    joining = JoinCalibration(cluster, SHAPES, lambda shape: [(16, shape.kernels)],  # type: ignore[arg-type]
                              report=lines.append)
    w3 = handle("w3")
    cluster.workers.append(w3)
    joining.start([w3])
    assert len(cluster.sent) == 2 and joining.calibrating() == ["w3"]
    joining.start([w3])  # asked again at the next point: nothing sent twice
    assert len(cluster.sent) == 2
    assert joining.collect() == ({}, {})  # still computing: the step goes on
    cluster.answer("w3", 0.25)
    done, failed = joining.collect()
    assert failed == {} and done == {"w3": {(0, 16, 4): 0.25, (1, 16, 8): 0.25}}
    assert joining.calibrating() == [] and sorted(cluster.forgotten) == [1, 2]
    assert "beside training" in lines[0]


def test_a_joiner_that_fails_its_calibration_is_dropped_and_told_why() -> None:
    cluster = BesideCluster()
    joining = JoinCalibration(cluster, SHAPES, lambda shape: [(16, shape.kernels)],  # type: ignore[arg-type]
                              report=lambda line: None)
    mute = handle("mute")
    cluster.workers.append(mute)
    joining.start([mute])
    cluster.failures[1] = "worker mute did not answer the calibration of a joiner within 60 s"
    done, failed = joining.collect()
    assert done == {} and "within 60 s" in failed["mute"]
    joining.drop_failed(failed)
    assert cluster.dropped == [("mute", "not taken in: " + failed["mute"], True)]


def joined(name: str) -> tuple[Membership, WorkerHandle]:
    """A membership that ``name`` said Hello to, and its handle."""
    membership = Membership("run", ClusterSettings())
    membership.handle(MessageReceived(name.encode(), Hello(
        worker_id=name, device={"device": "cpu"}, protocol_version=PROTOCOL_VERSION), 0.0))
    return membership, membership.workers[name.encode()]


def test_a_background_request_past_its_deadline_is_kept_failed_never_a_fail() -> None:
    membership, joiner = joined("j")
    membership.handle(RequestsAwaited({7: joiner}, "the calibration of a joiner", 0.0,
                                      timeout_s=3.0, background=True))
    for now in (1.0, 2.0, 3.5):
        membership.handle(MessageReceived(b"j", Hello(  # heard from: only the deadline
            worker_id="j", device={"device": "cpu"}, protocol_version=PROTOCOL_VERSION), now))
        actions = membership.handle(Tick(now, now))
        assert not [a for a in actions if isinstance(a, Fail)]
    assert "within 3 s" in membership.background_failure(7)
    assert membership.replies_for([7]) is None


def test_a_background_error_reply_is_kept_failed_never_a_fail() -> None:
    membership, joiner = joined("j")
    membership.handle(RequestsAwaited({7: joiner}, "the calibration of a joiner", 0.0,
                                      timeout_s=30.0, background=True))
    actions = membership.handle(MessageReceived(b"j", ErrorReply(
        request_id=7, code="bad_request", message="layer 1: too big"), 0.5))
    assert not [a for a in actions if isinstance(a, Fail)]
    assert "too big" in membership.background_failure(7)


def test_a_point_waits_a_moment_for_the_calibration_it_sent_and_no_more() -> None:
    import time

    cluster = BesideCluster()
    joining = JoinCalibration(cluster, SHAPES, lambda shape: [(16, shape.kernels)],  # type: ignore[arg-type]
                              report=lambda line: None)
    quick, mute = handle("quick"), handle("mute")
    cluster.workers += [quick, mute]
    assert joining.start([quick]) == ["quick"]
    cluster.answer("quick", 0.1)
    began = time.monotonic()
    joining.settle(["quick"], within_s=5.0)
    assert time.monotonic() - began < 1.0  # answered: no wait
    assert joining.start([quick, mute]) == ["mute"]  # quick is being timed already
    began = time.monotonic()
    joining.settle(["mute"], within_s=0.1)
    assert 0.1 <= time.monotonic() - began < 1.0  # a joiner that never answers: once
    done, failed = joining.collect()
    assert set(done) == {"quick"} and failed == {}
