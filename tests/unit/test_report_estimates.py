"""The report's estimates: the single-device time uses the cost fit; the plan's prediction."""
from __future__ import annotations

import pytest

from hetconv.analysis.report.analysis import single_device_conv_s
from hetconv.analysis.report.records import ParticipantTiming


def timing(kernels: int, compute_s: float) -> ParticipantTiming:
    return ParticipantTiming(participant="w", kernels=kernels, forward_s=compute_s / 3,
                        backward_s=2 * compute_s / 3, peer_bytes_sent=5, peer_bytes_received=7)


def test_the_fixed_cost_counts_once_not_per_share() -> None:
    timings = {("w", 0): [timing(20, 0.030)] * 3}
    # fit a = 10 ms, b = 1 ms/kernel: 30 ms at 20 kernels -> 50 ms at 40 (linear would say 60)
    assert single_device_conv_s(timings, "w", {0: 40}, {0: (0.010, 0.001)}) == pytest.approx(
        0.050)
    assert single_device_conv_s(timings, "w", {0: 40}) == pytest.approx(0.060)  # no fit
    assert single_device_conv_s(timings, "w", {0: 40, 1: 8}) is None  # not in every layer
    assert timings[("w", 0)][0].peer_bytes == 12
