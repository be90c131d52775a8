"""The worker's request handling, without sockets."""
from __future__ import annotations

import numpy as np

from hetconv.engine.shard import ConvShard, LayerSettings
from hetconv.model import ModelConfig, init_parameters
from hetconv.protocol import (
    Ack,
    AssignShard,
    BackwardReply,
    BackwardRequest,
    CalibrateReply,
    CalibrateRequest,
    EndRun,
    ErrorReply,
    ForwardReply,
    ForwardRequest,
    Heartbeat,
    SnapshotReply,
    SnapshotRequest,
)
from hetconv.worker.service import WorkerService


def assign(layer: int = 0, start: int = 2, stop: int = 5) -> AssignShard:
    params = init_parameters(ModelConfig((6, 4), (3, 16, 16)), 0)
    state = {name: np.ascontiguousarray(params[f"conv0.{name}"][start:stop])
             for name in ("weight", "gamma", "beta", "running_mean", "running_var")}
    return AssignShard(request_id=1, layer=layer, kernel_start=start, kernel_stop=stop, stride=1,
                       padding=0, need_dx=False, bn_momentum=0.1, bn_eps=1e-5, momentum=0.9,
                       weight_decay=5e-4, velocity_weight=np.zeros_like(state["weight"]),
                       velocity_gamma=np.zeros_like(state["gamma"]),
                       velocity_beta=np.zeros_like(state["beta"]), **state)


def test_full_cycle_matches_a_local_shard() -> None:
    service = WorkerService("cpu")
    message = assign()
    assert isinstance(service.handle(message), Ack)
    local = ConvShard(0, 2, 5, LayerSettings(), {n: getattr(message, n) for n in
                                                 ("weight", "gamma", "beta", "running_mean",
                                                  "running_var")})
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    reply = service.handle(ForwardRequest(request_id=2, step=0, layer=0, attempt=0, train=True, x=x))
    assert isinstance(reply, ForwardReply) and reply.request_id == 2 and reply.compute_s > 0
    np.testing.assert_array_equal(reply.y, local.forward(x, True))
    dy = np.ones_like(reply.y)
    back = service.handle(BackwardRequest(request_id=3, step=0, layer=0, attempt=0,
                                          learning_rate=0.1, dy=dy))
    assert isinstance(back, BackwardReply) and back.dx is None  # first layer: need_dx false
    local.backward(dy, False, 0.1)
    snap = service.handle(SnapshotRequest(request_id=4, layer=0))
    assert isinstance(snap, SnapshotReply) and (snap.kernel_start, snap.kernel_stop) == (2, 5)
    np.testing.assert_array_equal(snap.weight, local.snapshot()["weight"])
    assert isinstance(service.handle(EndRun(request_id=5, reason="done")), Ack)
    assert service.shards == {}


def test_bad_requests_become_error_replies() -> None:
    service = WorkerService("cpu")
    missing = service.handle(ForwardRequest(request_id=7, step=0, layer=9, attempt=0, train=True,
                                            x=np.zeros((1, 3, 16, 16), np.float32)))
    assert isinstance(missing, ErrorReply) and missing.code == "unknown_layer"
    assert missing.request_id == 7
    service.handle(assign())
    wrong = service.handle(ForwardRequest(request_id=8, step=0, layer=0, attempt=0, train=True,
                                          x=np.zeros((1, 7, 16, 16), np.float32)))
    assert isinstance(wrong, ErrorReply) and wrong.code == "bad_request"
    early = service.handle(BackwardRequest(request_id=9, step=0, layer=0, attempt=0,
                                           learning_rate=0.1, dy=np.zeros((1, 3, 6, 6), np.float32)))
    assert isinstance(early, ErrorReply)
    unexpected = service.handle(Heartbeat(sent_at=0.0))
    assert isinstance(unexpected, ErrorReply) and unexpected.code == "bad_request"
    silly = service.handle(CalibrateRequest(request_id=10, layer=0, batch=1, in_channels=1,
                                            height=8, width=8, kernels=1, kernel_size=3,
                                            stride=1, padding=0, repeats=1000))
    assert isinstance(silly, ErrorReply)
    ok = service.handle(CalibrateRequest(request_id=11, layer=0, batch=1, in_channels=1, height=8,
                                         width=8, kernels=1, kernel_size=3, stride=1, padding=0,
                                         repeats=1))
    assert isinstance(ok, CalibrateReply) and ok.seconds > 0


def test_a_duplicate_update_is_refused() -> None:
    service = WorkerService("cpu")
    service.handle(assign())
    x = np.ones((1, 3, 16, 16), np.float32)
    for step, expect_error in [(0, False), (0, True), (1, False)]:
        service.handle(ForwardRequest(request_id=20 + step, step=step, layer=0, attempt=0,
                                      train=True, x=x))
        reply = service.handle(BackwardRequest(request_id=30 + step, step=step, layer=0,
                                               attempt=0, learning_rate=0.1,
                                               dy=np.ones((1, 3, 6, 6), np.float32)))
        assert isinstance(reply, ErrorReply) == expect_error


def test_wire_dtypes() -> None:
    service = WorkerService("cpu")
    service.handle(assign())
    half = service.handle(ForwardRequest(request_id=40, step=0, layer=0, attempt=0, train=True,
                                         x=np.ones((1, 3, 16, 16), np.float16)))
    assert isinstance(half, ForwardReply) and half.y.dtype == np.float16
    back = service.handle(BackwardRequest(request_id=41, step=0, layer=0, attempt=0,
                                          learning_rate=0.1, dy=np.ones((1, 3, 6, 6), np.float16)))
    assert isinstance(back, BackwardReply)
    bad = service.handle(ForwardRequest(request_id=42, step=1, layer=0, attempt=0, train=True,
                                        x=np.ones((1, 3, 16, 16), np.int32)))
    assert isinstance(bad, ErrorReply) and "float32 or float16" in bad.message


def test_an_assignment_of_no_kernels_takes_the_layer_away() -> None:
    service = WorkerService()
    assert isinstance(service.handle(assign(start=2, stop=5)), Ack)
    assert isinstance(service.handle(assign(start=4, stop=4)), Ack)  # a re-split took it
    assert 0 not in service.shards
    x = np.zeros((2, 3, 16, 16), dtype=np.float32)
    reply = service.handle(ForwardRequest(request_id=2, step=0, layer=0, attempt=0, train=True,
                                          x=x))
    assert isinstance(reply, ErrorReply) and reply.code == "unknown_layer"
