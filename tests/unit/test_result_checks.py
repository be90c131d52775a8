"""Issue 20's pure parts, without sockets: results checked for shape and sense (the
master's checked_result, the peer plane's piece check, the snapshot audit's
comparison) and a rebalancer that never hands kernels to an evicted participant."""
from __future__ import annotations

import numpy as np
import pytest

from hetconv.master.audit import AUDIT_SAMPLES, audit_input, audit_mismatch
from hetconv.master.cluster import WorkerLost
from hetconv.master.kernels.planner import ParticipantProfile
from hetconv.master.kernels.rebalance import Rebalancer, RebalanceSettings
from hetconv.master.plan import Shard
from hetconv.master.results import checked_result
from hetconv.model import ConvLayerShape
from hetconv.participant.peer_pieces import RowGather
from hetconv.participant.peer_plan import KernelRange, PeerPlan
from hetconv.planning.perf_model import LayerTraffic
from hetconv.protocol import PeerPiece

SHARD = Shard("b", None, 0, 3)


def test_checked_result_takes_the_expected_shape() -> None:
    y = np.ones((4, 3, 6, 6), np.float32)
    assert checked_result("b", 0, "y", y, (4, 3, 6, 6)) is y
    assert checked_result("b", 0, "dx", y, (4, None, None, None)) is y


@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (4, 3, 6, 5), (4, 2, 6, 6), (3, 3, 6, 6),
                                   (4, 3, 6)])
def test_checked_result_evicts_a_wrong_shape(shape: tuple[int, ...]) -> None:
    with pytest.raises(WorkerLost) as caught:
        checked_result("b", 0, "y", np.ones(shape, np.float32), (4, 3, 6, 6))
    assert caught.value.evict and caught.value.participant == "b"
    assert "expected (4, 3, 6, 6)" in str(caught.value)


def test_checked_result_evicts_non_finite() -> None:
    y = np.ones((1, 3, 2, 2), np.float32)
    y[0, 1, 1, 1] = np.inf
    with pytest.raises(WorkerLost, match="NaN or Inf"):
        checked_result("b", 0, "y", y, (1, 3, 2, 2))


def test_audit_accepts_rounding_and_refuses_a_scaled_answer() -> None:
    reference = np.random.default_rng(0).standard_normal((4, 3, 5, 5)).astype(np.float32)
    assert audit_mismatch(reference.astype(np.float16).astype(np.float32), reference) is None
    assert audit_mismatch(reference * 1000, reference) is not None
    assert audit_mismatch(reference + 0.1 * np.abs(reference).max(), reference) is not None
    assert "shape" in (audit_mismatch(reference[:, :, :4], reference) or "")
    nan = reference.copy()
    nan[0, 0, 0, 0] = np.nan
    assert "NaN" in (audit_mismatch(nan, reference) or "")


def test_audit_input_is_seeded_and_shaped() -> None:
    shape = ConvLayerShape(index=1, in_channels=3, height=7, width=9, kernels=4, kernel_size=3,
                           padding=1, conv_height=7, conv_width=9, pooled_height=3,
                           pooled_width=4)
    x = audit_input(shape, 12, 1)
    assert x.shape == (AUDIT_SAMPLES, 3, 7, 9) and x.dtype == np.float32
    np.testing.assert_array_equal(x, audit_input(shape, 12, 1))
    assert not np.array_equal(x, audit_input(shape, 13, 1))
    assert audit_input(shape, -1, 0).shape == x.shape  # evaluation steps may be negative


def piece(sender: str, shape: tuple[int, ...]) -> PeerPiece:
    data = np.zeros(shape, np.float32)
    return PeerPiece(sender=sender, pass_id=1, step=0, layer=0, phase="forward", attempt=0,
                     kernel_start=0, kernel_stop=shape[1], batch_start=0,
                     batch_stop=shape[0], batch_size=shape[0], data=data)


def test_the_plan_carries_input_sizes_on_the_wire() -> None:
    plan = PeerPlan([[KernelRange("m", 0, 2), KernelRange("a", 2, 4)],
                     [KernelRange("a", 0, 8)]], [(28, 28), (12, 12)])
    back = PeerPlan.from_wire(plan.to_wire())
    assert back.layers == plan.layers and back.input_sizes == [(28, 28), (12, 12)]
    assert back.input_size(1) == (12, 12) and back.input_size(2) is None
    assert PeerPlan.from_wire([[["m", 0, 2]]]).input_size(0) is None  # sizes are optional
    with pytest.raises(ValueError):
        PeerPlan.from_wire([[["m", 0, 2]], {"input_sizes": [[0, 3]]}])


def test_a_piece_of_the_wrong_size_is_blamed_on_its_sender_whoever_came_first() -> None:
    sources = [KernelRange("a", 0, 2), KernelRange("b", 2, 4)]
    gather = RowGather(sources, concat=True, spatial=(6, 6))
    assert gather.misfit("b", piece("b", (4, 2, 5, 5))) is not None  # first, and wrong
    assert gather.misfit("a", piece("a", (4, 2, 6, 6))) is None
    assert gather.misfit("a", piece("a", (4, 3, 6, 6))) is not None  # channels
    assert gather.misfit("stranger", piece("stranger", (4, 2, 5, 5))) is None  # dropped later


def profile(name: str, per_kernel_s: float) -> ParticipantProfile:
    return ParticipantProfile(name, ((0.0, per_kernel_s),), None)


def test_a_rebalancer_never_hands_kernels_to_an_evicted_participant() -> None:
    traffic = [LayerTraffic(input_bytes=0, output_bytes=0, kernels=12, need_dx=False)]
    rebalancer = Rebalancer([profile("master", 1e-3), profile("a", 1e-3), profile("b", 1e-3)],
                            traffic, [[4, 4, 4]],
                            settings=RebalanceSettings(warmup_steps=0, window_steps=1,
                                                       min_interval_steps=1))
    rebalancer.restrict({"master", "a"})  # b was evicted
    rebalancer.adopt([[6, 6, 0]])
    decisions = [rebalancer.observe(step, [{"master": (6, 0.012), "a": (6, 0.003)}])
                 for step in range(5)]
    made = [d for d in decisions if d is not None]
    assert made, "the measured imbalance should move kernels"
    assert all(row[2] == 0 for d in made for row in d.counts)
    rebalancer.add_participant(profile("b", 1e-3))  # back through a join
    assert "b" in rebalancer.active
    with pytest.raises(ValueError):
        rebalancer.restrict({"nobody"})
