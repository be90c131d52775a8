"""The performance model: hand-computed cases."""
from __future__ import annotations

import pytest

from hetconv.planning.perf_model import (
    ParticipantCost,
    compute_seconds,
    ideal_speedup,
    star_step_seconds,
)


def test_compute_is_the_slowest_participant_per_layer_summed() -> None:
    layers = [[ParticipantCost(0.010, 0.001, 20), ParticipantCost(0.020, 0.002, 5)],  # 30, 30 ms
              [ParticipantCost(0.005, 0.0005, 10), ParticipantCost(0.0, 1.0, 0)]]  # 10 ms, idle
    assert compute_seconds(layers) == pytest.approx(0.030 + 0.010)


def test_star_step_adds_dense_and_master_link_time() -> None:
    layers = [[ParticipantCost(0.0, 0.001, 10)]]
    # 10 ms compute + 5 ms dense + 1.25 MB over 125 MB/s (1 Gbit/s) = 10 ms
    assert star_step_seconds(layers, 0.005, 1.25e6, 1.25e8) == pytest.approx(0.025)
    with pytest.raises(ValueError):
        star_step_seconds(layers, 0.0, 1.0, 0.0)


def test_ideal_speedup() -> None:
    assert ideal_speedup([0.45] * 4) == pytest.approx(4.0)
    assert ideal_speedup([0.6, 0.4, 0.2, 0.2]) == pytest.approx(1.4 / 0.6)
    with pytest.raises(ValueError):
        ideal_speedup([])
