"""What a worker refuses before computing: every check of worker/validation.py, the
session answering bad_request without computing, and the rate-limited warnings (no
sockets)."""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import pytest

from hetconv.config import WorkerConfig
from hetconv.protocol import (
    ERR_BAD_MESSAGE,
    ERR_BAD_REQUEST,
    PROTOCOL_VERSION,
    AssignDense,
    AssignPeers,
    AssignShard,
    BackwardRequest,
    CalibrateRequest,
    ErrorReply,
    ForwardRequest,
    Message,
    PeerBackwardRequest,
    PeerForwardRequest,
    ProtocolError,
    SampleBackwardChain,
    SampleBackwardRound,
    SampleEvaluation,
    SampleForwardChain,
    SampleForwardRound,
    SampleStepChain,
    SampleUpdateRound,
    Welcome,
    limits,
)
from hetconv.protocol.admission import WarningBudget
from hetconv.worker.session import (
    Action,
    BadMessage,
    Compute,
    Log,
    MessageReceived,
    Send,
    Tick,
    WorkerSession,
)
from hetconv.worker.validation import (
    FINITE_CHUNK,
    MAX_CALIBRATION_REPEATS,
    all_finite,
    conv_size_refusal,
    refusal,
)

K, C, KSIZE = 3, 2, 3


def assign(**changes: Any) -> AssignShard:
    """A valid AssignShard of kernels [2, 5), with ``changes`` applied."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((K, C, KSIZE, KSIZE)).astype(np.float32)
    vector = np.zeros(K, np.float32)
    message = AssignShard(
        request_id=1, layer=0, kernel_start=2, kernel_stop=2 + K, stride=1, padding=1,
        need_dx=False, bn_momentum=0.1, bn_eps=1e-5, momentum=0.9, weight_decay=5e-4,
        weight=weight, gamma=np.ones(K, np.float32), beta=vector.copy(),
        running_mean=vector.copy(), running_var=np.ones(K, np.float32),
        velocity_weight=np.zeros_like(weight), velocity_gamma=vector.copy(),
        velocity_beta=vector.copy())
    return dataclasses.replace(message, **changes)


def calibrate(**changes: Any) -> CalibrateRequest:
    message = CalibrateRequest(request_id=2, layer=0, batch=8, in_channels=3, height=16,
                               width=16, kernels=4, kernel_size=3, stride=1, padding=1,
                               repeats=3)
    return dataclasses.replace(message, **changes)


def activation(value: float | None = None, dtype: Any = np.float32,
               shape: tuple[int, ...] = (2, C, 4, 4)) -> np.ndarray:
    array = np.ones(shape, dtype)
    if value is not None:
        array.flat[5] = value
    return array


def forward(**changes: Any) -> ForwardRequest:
    message = ForwardRequest(request_id=3, step=0, layer=0, attempt=0, train=True,
                             x=activation())
    return dataclasses.replace(message, **changes)


def backward(**changes: Any) -> BackwardRequest:
    message = BackwardRequest(request_id=4, step=0, layer=0, attempt=0, learning_rate=0.05,
                              dy=activation())
    return dataclasses.replace(message, **changes)


def peer_forward(**changes: Any) -> PeerForwardRequest:
    message = PeerForwardRequest(request_id=5, pass_id=1, step=0, layer=0, attempt=0,
                                 train=True, x=None)
    return dataclasses.replace(message, **changes)


def peer_backward(**changes: Any) -> PeerBackwardRequest:
    message = PeerBackwardRequest(request_id=6, pass_id=1, step=0, layer=0, attempt=0,
                                  learning_rate=0.05, dy=None)
    return dataclasses.replace(message, **changes)


def sample_backward(**changes: Any) -> SampleBackwardRound:
    message = SampleBackwardRound(
        request_id=8, step=0, attempt=0, learning_rate=0.05, finish_layer=0, start_layer=-1,
        dgamma=None, dbeta=None, dy=None, reduce_id=12, update_layer=1, dweight=None,
        update_sums=None, update_id=9, contributors=["master", "w1"])
    return dataclasses.replace(message, **changes)


def sample_update(**changes: Any) -> SampleUpdateRound:
    """The update alone (the master's flush): layers [0, 3) reduced as reduction 9."""
    message = SampleUpdateRound(
        request_id=12, step=0, attempt=0, learning_rate=0.05, update_layer=0, dweight=None,
        update_sums=None, update_id=9, contributors=["master", "w1"], update_stop=3)
    return dataclasses.replace(message, **changes)


def sample_forward(**changes: Any) -> SampleForwardRound:
    """A forward round: start layer 0 on x, the update of layer 1 riding along."""
    message = SampleForwardRound(
        request_id=13, step=0, attempt=0, total_batch=4, finish_layer=-1, start_layer=0,
        return_output=False, learning_rate=0.05, total_count=0, mean=None, var=None,
        x=activation(), update_layer=1, dweight=None, update_sums=None, update_id=9,
        contributors=["master", "w1"])
    return dataclasses.replace(message, **changes)


def sample_evaluation(**changes: Any) -> SampleEvaluation:
    message = SampleEvaluation(request_id=14, step=-1, attempt=0, total_batch=4,
                               stop_layer=2, x=activation())
    return dataclasses.replace(message, **changes)


def forward_chain(**changes: Any) -> SampleForwardChain:
    """A member's forward chain of two layers."""
    message = SampleForwardChain(
        request_id=15, step=0, attempt=0, total_batch=4, stop_layer=2, learning_rate=0.05,
        x=activation(), update_layer=-1, dweight=None, update_sums=None, update_id=0,
        contributors=[], update_stop=-1, sync_id=10, members=["w1"], member_samples=[2],
        positions=[256, 64], slice_statistics=False)
    return dataclasses.replace(message, **changes)


def backward_chain(**changes: Any) -> SampleBackwardChain:
    message = SampleBackwardChain(request_id=16, step=0, attempt=0, learning_rate=0.05,
                                  start_layer=1, dy=activation(), sync_id=11,
                                  members=["w1"], slice_statistics=True)
    return dataclasses.replace(message, **changes)


def step_chain(**changes: Any) -> SampleStepChain:
    """A member's step chain (docs/dense-replica.md): x and its labels."""
    message = SampleStepChain(
        request_id=9, step=0, attempt=0, total_batch=4, stop_layer=2, learning_rate=0.05,
        x=activation(), labels=np.array([1, 3], np.int32), update_layer=-1, dweight=None,
        update_sums=None, update_id=0, contributors=[], update_stop=-1, sync_id=10,
        members=["w1"], member_samples=[2], positions=[256, 64], slice_statistics=False)
    return dataclasses.replace(message, **changes)


def assign_dense(**changes: Any) -> AssignDense:
    """The dense part of a network with only the classifier: fc (2, 3) and (2,)."""
    message = AssignDense(request_id=11, layer=2, names=["fc.weight", "fc.bias"],
                          shapes=[[2, 3], [2]], layers=[], seed=0, momentum=0.9,
                          weight_decay=5e-4, values=np.zeros(8, np.float32),
                          velocity=np.zeros(8, np.float32))
    return dataclasses.replace(message, **changes)


def assign_peers(**changes: Any) -> AssignPeers:
    message = AssignPeers(request_id=7, participant="w1", wire_dtype="float32",
                          timeout_s=30.0, peers={}, peer_keys={}, plan=[])
    return dataclasses.replace(message, **changes)


# --- valid requests pass ------------------------------------------------------------------
@pytest.mark.parametrize("message", [
    assign(), assign(kernel_start=4, kernel_stop=4, weight=np.zeros((0, C, 3, 3), np.float32),
                     velocity_weight=np.zeros((0, C, 3, 3), np.float32),
                     **{name: np.zeros(0, np.float32) for name in
                        ("gamma", "beta", "running_mean", "running_var", "velocity_gamma",
                         "velocity_beta")}),
    calibrate(), calibrate(pool="none", height=3, width=3, padding=0),
    forward(), forward(step=-1, train=False, x=activation(dtype=np.float16)),
    backward(), backward(learning_rate=0.0), peer_forward(), peer_forward(x=activation()),
    peer_backward(), peer_backward(dy=activation(dtype=np.float16)), assign_peers(),
    sample_backward(), sample_backward(reduce_id=0, update_id=0, contributors=[]),
    sample_update(), sample_update(update_stop=-1, update_id=0, contributors=[],
                                   dweight=np.zeros((K, C, 3, 3), np.float32)),
    sample_forward(), sample_evaluation(), forward_chain(), forward_chain(x=None),
    backward_chain(), backward_chain(dy=None),
    step_chain(), step_chain(x=None, labels=None),  # a member's, a participant's without samples
    assign_dense(),
], ids=lambda message: message.TYPE)
def test_valid_requests_pass(message: Message) -> None:
    assert refusal(message) is None


# --- every refusal ------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")

REFUSED: list[tuple[Message, str]] = [
    # AssignShard: kernel range, settings, arrays
    (assign(stride=0), "stride must be at least 1"),
    (assign(padding=-3), "padding must be at least 0"),
    (assign(bn_eps=-1.0), "bn_eps must be a finite number in (0"),
    (assign(bn_eps=0.0), "bn_eps"),
    (assign(bn_eps=NAN), "bn_eps"),
    (assign(bn_momentum=1.5), "bn_momentum"),
    (assign(momentum=-0.1), "momentum"),
    (assign(momentum=INF), "momentum"),
    (assign(weight_decay=-1e-4), "weight_decay"),
    (assign(pool="median"), "pool must be one of"),
    (assign(layer=-1), "layer must be at least 0"),
    (assign(kernel_start=5, kernel_stop=2), "need 0 <= kernel_start <= kernel_stop"),
    (assign(kernel_start=-1, kernel_stop=2), "need 0 <= kernel_start <= kernel_stop"),
    (assign(kernel_stop=4), "weight of shape (3, 2, 3, 3): need (K, C, k, k) with K = 2"),
    (assign(weight=np.zeros((K, C, 9), np.float32)), "weight of shape"),
    (assign(weight=np.zeros((K, C, 3, 2), np.float32),
            velocity_weight=np.zeros((K, C, 3, 2), np.float32)), "weight of shape"),
    (assign(weight=np.zeros((K, 0, 3, 3), np.float32)), "weight of shape"),
    (assign(velocity_weight=np.zeros((K, C, 1, 1), np.float32)), "velocity_weight is"),
    (assign(gamma=np.ones(K + 1, np.float32)), "gamma is float32 of shape (4,)"),
    (assign(running_var=np.ones((K, 1), np.float32)), "running_var is"),
    (assign(beta=np.zeros(K, np.float64)), "beta is float64"),
    (assign(weight=np.full((K, C, 3, 3), np.nan, np.float32)), "weight holds NaN or Inf"),
    (assign(velocity_beta=np.array([0, np.inf, 0], np.float32)), "velocity_beta holds NaN"),
    (assign(running_mean=np.array([0, -np.inf, 0], np.float32)), "running_mean holds NaN"),
    (assign(running_var=np.array([1, -1, 1], np.float32)), "negative variance"),
    # CalibrateRequest: sizes, repeats, and what a training step could carry
    (calibrate(batch=1024, in_channels=64, height=128, width=128),  # 4 GiB of input
     "the input would hold 4294967296 bytes"),
    (calibrate(batch=1, in_channels=1, height=8, width=8, padding=20_000, stride=10_000),
     "the padded input would hold"),
    (calibrate(batch=256, in_channels=1, height=256, width=256, kernels=1024),
     "the output would hold"),
    (calibrate(height=1, width=1, kernel_size=1, padding=0, in_channels=20_000, pool="none",
               kernels=20_000), "the weights would hold"),
    (calibrate(repeats=0), "repeats must be at least 1"),
    (calibrate(repeats=MAX_CALIBRATION_REPEATS + 1), "repeats must be 1.."),
    (calibrate(stride=0), "stride must be at least 1"),
    (calibrate(padding=-1), "padding must be at least 0"),
    (calibrate(batch=0), "batch must be at least 1"),
    (calibrate(kernel_size=0), "kernel_size must be at least 1"),
    (calibrate(height=2, width=2, kernel_size=5, padding=0), "does not fit a 2x2 input"),
    (calibrate(height=3, width=3, padding=0), "2x2 pooling of a 1x1 output"),
    (calibrate(pool="median"), "pool must be one of"),
    (calibrate(layer=-2), "layer must be at least 0"),
    # ForwardRequest and BackwardRequest: finite activations of the right form
    (forward(x=activation(NAN)), "x holds NaN or Inf"),
    (forward(x=activation(INF)), "x holds NaN or Inf"),
    (forward(x=activation(-INF, np.float16)), "x holds NaN or Inf"),
    (forward(x=activation(shape=(2, C, 16))), "x must be (B, C, H, W)"),
    (forward(x=activation(dtype=np.float64)), "x must be float32 or float16"),
    (forward(x=activation(dtype=np.int32)), "x must be float32 or float16"),
    (forward(step=-2), "step must be at least -1"),
    (forward(layer=-1), "layer must be at least 0"),
    (forward(attempt=-1), "attempt must be at least 0"),
    (backward(dy=activation(NAN)), "dy holds NaN or Inf"),
    (backward(dy=activation(INF, np.float16)), "dy holds NaN or Inf"),
    (backward(learning_rate=NAN), "learning_rate"),
    (backward(learning_rate=-0.1), "learning_rate"),
    (backward(step=-1), "step must be at least 0"),
    # the peer data plane's requests: their arrays when present, the same numbers
    (peer_forward(x=activation(NAN)), "x holds NaN or Inf"),
    (peer_forward(pass_id=-1), "pass_id must be at least 0"),
    (peer_backward(dy=activation(INF)), "dy holds NaN or Inf"),
    (peer_backward(learning_rate=INF), "learning_rate"),
    (assign_peers(timeout_s=NAN), "timeout_s"),
    (assign_peers(timeout_s=0.0), "timeout_s"),
    (assign_peers(timeout_s=1e12), "timeout_s"),
    (assign_peers(wire_dtype="int8"), "wire dtype 'int8'"),
    # the sample split's weight reduction among the peers
    (sample_backward(reduce_id=-1), "reduce_id must be at least 0"),
    (sample_backward(update_id=-5), "update_id must be at least 0"),
    (sample_backward(contributors=["w1", "w1"]), "contributors must be distinct"),
    (sample_backward(contributors=["w1", 3]), "contributors must be distinct"),
    (sample_backward(contributors=[]), "needs its contributors"),
    (sample_update(update_id=0, contributors=[]), "an update of several layers is reduced"),
    (sample_update(contributors=["w1", "w1"]), "contributors must be distinct"),
    # one request type per mode (protocol 13): each one's own numbers
    (sample_forward(step=-1), "step must be at least 0"),
    (sample_forward(total_batch=0), "total_batch must be at least 1"),
    (sample_forward(update_id=-1), "update_id must be at least 0"),
    (sample_evaluation(stop_layer=0), "stop_layer must be at least 1"),
    (sample_evaluation(x=activation(NAN)), "x holds NaN or Inf"),
    (forward_chain(sync_id=0), "sync_id must be at least 1"),
    (forward_chain(member_samples=[0]), "member_samples must give each member's samples"),
    (backward_chain(sync_id=0), "sync_id must be at least 1"),
    (backward_chain(members=["w1", "w1"]), "a chain needs its members"),
    # the step chain: labels only with a member's x in it, one class id per sample
    (step_chain(labels=np.array([1, 3, 0], np.int32)), "one per sample of x (2)"),
    (step_chain(labels=np.array([1.0, 3.0], np.float32)), "labels must be integer"),
    (step_chain(x=None), "labels come only with a member's x"),
    # labels in a forward chain: no such field since protocol 13 (a class attribute, None)
    # a step chain outside a chain: the closest refusal left is its exchange's sync_id
    (step_chain(sync_id=0, members=[], member_samples=[], positions=[]),
     "sync_id must be at least 1"),
    # a step chain from a later layer: start_layer is 0 by construction since protocol 13;
    # the closest refusal left is positions that miss the layers run
    (step_chain(positions=[64]), "positions must give each of the 2 layers"),
    (assign_dense(values=np.full(8, np.nan, np.float32)), "values holds NaN or Inf"),
    (assign_dense(shapes=[[2, 3], [3]]), "must chain from the layer before"),
    (assign_dense(names=["fc.bias", "fc.weight"]), "names must be"),
]


@pytest.mark.parametrize(("message", "expected"), REFUSED,
                         ids=[f"{m.TYPE}-{i}" for i, (m, _) in enumerate(REFUSED)])
def test_every_refusal_is_one_line_naming_the_type(message: Message, expected: str) -> None:
    reason = refusal(message)
    assert reason is not None and expected in reason, reason
    assert reason.startswith(f"{message.TYPE}: ") and "\n" not in reason
    assert len(reason.encode()) <= limits.MAX_STR_LEN  # fits an ErrorReply


def test_conv_sizes_follow_the_wire_dtype() -> None:
    # 2**28 float32 values are exactly one frame; as float16 the same shape is half
    shape = (1, 1, 2**14, 2**14)
    assert conv_size_refusal(*shape, kernels=1, kernel_size=1, stride=1, padding=0) is None
    over = conv_size_refusal(*shape, kernels=1, kernel_size=1, stride=1, padding=1)
    assert over is not None and "padded input" in over
    assert conv_size_refusal(*shape, kernels=1, kernel_size=1, stride=1, padding=1,
                             itemsize=2) is None


def test_all_finite_in_chunks() -> None:
    big = np.full((3, FINITE_CHUNK), np.finfo(np.float16).max, np.float16)
    assert all_finite(big) and all_finite(np.zeros(0, np.float32))
    big[2, -1] = np.inf  # in the last chunk
    assert not all_finite(big) and not all_finite(np.array([np.nan], np.float32))
    assert all_finite(np.ones((4, 4), np.float32)[:, ::2])  # not contiguous: still right


# --- the session answers bad_request without computing -------------------------------------
def joined() -> WorkerSession:
    worker = WorkerSession(WorkerConfig(master="tcp://127.0.0.1:5555"), "w1", {"kind": "cpu"})
    worker.handle(Tick(0.0, 1000.0))
    worker.handle(MessageReceived(Welcome(worker_id="w1", run_id="r", heartbeat_interval_s=0.5,
                                          protocol_version=PROTOCOL_VERSION), 0.0))
    return worker


def sent(actions: list[Action]) -> list[Message]:
    return [a.message for a in actions if isinstance(a, Send)]


def warnings(actions: list[Action]) -> list[str]:
    return [a.text for a in actions if isinstance(a, Log) and a.level >= logging.WARNING]


@pytest.mark.parametrize("message", [assign(stride=0), assign(padding=-3), assign(bn_eps=-1.0),
                                     forward(x=activation(NAN)), backward(dy=activation(INF)),
                                     calibrate(batch=1024, in_channels=64, height=128,
                                               width=128)],
                         ids=lambda message: message.TYPE)
def test_session_refuses_without_computing(
        message: AssignShard | ForwardRequest | BackwardRequest | CalibrateRequest) -> None:
    worker = joined()
    actions = worker.handle(MessageReceived(message, 1.0))
    assert not any(isinstance(a, Compute) for a in actions) and worker.busy == 0
    (reply,) = sent(actions)
    assert isinstance(reply, ErrorReply) and reply.code == ERR_BAD_REQUEST
    assert reply.request_id == message.request_id
    assert len(warnings(actions)) == 1
    good = assign()
    assert worker.handle(MessageReceived(good, 1.1)) == [Compute(good)]  # and it goes on


def test_bad_message_warnings_are_rate_limited_with_a_summary() -> None:
    worker = joined()
    window = worker.warnings.window_s
    lines: list[str] = []
    replies: list[Message] = []
    for index in range(1000):  # a flood within one window: garbage and refused requests
        now = 1.0 + index * 1e-4
        if index % 2:
            actions = worker.handle(BadMessage(ProtocolError(ERR_BAD_MESSAGE, "garbage"), now))
        else:
            actions = worker.handle(MessageReceived(forward(request_id=index,
                                                            x=activation(NAN)), now))
        lines += warnings(actions)
        replies += sent(actions)
    assert len(lines) == worker.warnings.max_lines
    # every refused request is answered (the master waits for it); garbage without a
    # request id only as often as it is logged
    assert len(replies) == 500 + sum("garbage" in line for line in lines)
    assert warnings(worker.handle(Tick(1.0 + window / 2, 0.0))) == []  # the window is open
    (summary,) = warnings(worker.handle(Tick(1.0 + window, 0.0)))
    assert summary.startswith(f"{1000 - worker.warnings.max_lines} more bad message(s)")
    assert warnings(worker.handle(Tick(2.0 + window, 0.0))) == []  # said once
    again = worker.handle(BadMessage(ProtocolError(ERR_BAD_MESSAGE, "garbage"), 3.0 + window))
    assert len(warnings(again)) == 1  # a new window logs again


def test_bad_message_with_a_request_id_is_answered_even_when_not_logged() -> None:
    worker = joined()
    for index in range(10):
        error = ProtocolError(ERR_BAD_MESSAGE, "bad header", request_id=100 + index)
        replies = sent(worker.handle(BadMessage(error, 1.0)))
        assert [reply.request_id for reply in replies if isinstance(reply, ErrorReply)] == [
            100 + index]


def test_warning_budget() -> None:
    budget = WarningBudget(window_s=10.0, max_lines=2)
    assert [budget.admit(0.0) for _ in range(5)] == [True, True, False, False, False]
    assert budget.take_suppressed(9.9) == 0  # still the window that held them back
    assert budget.take_suppressed(10.0) == 3
    assert budget.take_suppressed(30.0) == 0
    assert budget.admit(10.0) and budget.admit(10.5) and not budget.admit(11.0)
    assert budget.take_suppressed(20.0) == 1
