"""The split rule: the first split and every re-plan (a fault, a join) follow --split."""
from __future__ import annotations

import pytest

from hetconv.master.calibration import LayerCalibration
from hetconv.master.kernels.planner import ParticipantProfile
from hetconv.master.kernels.rebalance import Rebalancer
from hetconv.master.kernels.split import SplitRule
from hetconv.planning.partition import equal_counts, kernel_counts
from hetconv.planning.perf_model import LayerTraffic, Link

KERNELS = (30, 60)
TRAFFIC = [LayerTraffic(input_bytes=10_000, output_bytes=20_000, kernels=k, need_dx=i > 0)
           for i, k in enumerate(KERNELS)]
LINK = Link(down_bytes_per_s=1e8, up_bytes_per_s=1e8, rtt_s=1e-4)
NAMES = ("master", "w1", "w2")
# equal-share timings (10 and 20 kernels) and quarter-share ones, per participant
CALIBRATION = [LayerCalibration(0, 10, [0.010, 0.020, 0.040], 2, [0.003, 0.005, 0.012]),
               LayerCalibration(1, 20, [0.050, 0.030, 0.100], 5, [0.015, 0.009, 0.030])]


def profiles() -> list[ParticipantProfile]:
    return [ParticipantProfile(name, tuple(cal.cost_models()[i] for cal in CALIBRATION),
                               None if name == "master" else LINK)
            for i, name in enumerate(NAMES)]


def rule(mode: str) -> SplitRule:
    return SplitRule(mode, "star", tuple(cal.calibrated_kernels for cal in CALIBRATION))


def test_the_first_calibrated_split_is_equation_one_on_the_calibration_times() -> None:
    counts = rule("calibrated").split(profiles(), TRAFFIC, set(NAMES)).counts
    for cal, row, kernels in zip(CALIBRATION, counts, KERNELS):
        assert list(row) == kernel_counts(cal.seconds, kernels)


def test_a_fault_under_calibrated_re_splits_the_survivors_with_equation_one() -> None:
    rebalancer = Rebalancer(profiles(), TRAFFIC, [[10, 10, 10], [20, 20, 20]])
    rebalancer.restrict({"master", "w2"})  # w1 evicted
    counts = rule("calibrated").split(rebalancer.profiles, rebalancer.traffic,
                                      rebalancer.active).counts
    for cal, row, kernels in zip(CALIBRATION, counts, KERNELS):
        assert row[1] == 0
        assert [row[0], row[2]] == kernel_counts([cal.seconds[0], cal.seconds[2]], kernels)


def test_a_join_under_calibrated_reads_the_joiner_at_the_reference_share() -> None:
    rebalancer = Rebalancer(profiles(), TRAFFIC, [[10, 10, 10], [20, 20, 20]])
    # the joiner was calibrated alone: a whole layer's share, not the reference one
    joiner_cal = [LayerCalibration(0, 30, [0.030], 7, [0.008]),
                  LayerCalibration(1, 60, [0.060], 15, [0.016])]
    joiner = ParticipantProfile("w3", tuple(cal.cost_models()[0] for cal in joiner_cal), LINK)
    rebalancer.add_participant(joiner)
    counts = rule("calibrated").split(rebalancer.profiles, rebalancer.traffic,
                                      rebalancer.active).counts
    for layer, (cal, row, kernels) in enumerate(zip(CALIBRATION, counts, KERNELS)):
        fixed, per_kernel = joiner.costs[layer]
        joiner_s = fixed + per_kernel * cal.calibrated_kernels  # read at the reference share
        assert list(row) == kernel_counts([*cal.seconds, joiner_s], kernels)


def test_equal_and_model_splits_over_the_alive_only() -> None:
    alive = {"w1", "w2"}
    equal = rule("equal").split(profiles(), TRAFFIC, alive).counts
    assert [list(row) for row in equal] == [[0, *equal_counts(2, k)] for k in KERNELS]
    model = rule("model").split(profiles(), TRAFFIC, alive)
    assert model.plan is not None
    assert all(row[0] == 0 and sum(row) == k for row, k in zip(model.counts, KERNELS))


def test_nobody_alive_or_an_unknown_mode_is_an_error() -> None:
    with pytest.raises(ValueError, match="no participant"):
        rule("calibrated").split(profiles(), TRAFFIC, set())
    with pytest.raises(ValueError, match="unknown split"):
        SplitRule("fastest")
