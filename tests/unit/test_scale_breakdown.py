"""The per-participant breakdown of ``hetconv bench scale`` (hetconv/bench/scale_breakdown.py)."""
from __future__ import annotations

import pytest

from hetconv.bench.scale_breakdown import (
    comm_share,
    format_breakdown,
    format_layer_breakdown,
    layer_breakdown,
    merge_layer_repeats,
    merge_repeats,
    step_breakdown,
)


def _step(compute: float, latency: float, comm: float) -> dict[str, object]:
    timing = {"participant": "m1", "samples": 32, "forward_s": compute / 2,
              "backward_s": compute / 2, "forward_latency_s": latency / 2,
              "backward_latency_s": latency / 2, "wait_s": 0.001, "peer_wait_s": 0.002}
    master = {"participant": "master", "samples": 96, "forward_s": 0.010, "backward_s": 0.020}
    return {"step_s": 0.050, "comm_s": comm,
            "layers": [{"layer": 0, "participants": [master, timing]},
                       {"layer": 1, "participants": [master, timing]}]}


def test_medians_per_step_summed_over_layers() -> None:
    steps = [_step(0.010, 0.020, 0.005), _step(0.012, 0.030, 0.010), _step(0.5, 0.9, 0.04)]
    breakdown = step_breakdown(steps)
    assert breakdown["m1"]["compute_s"] == pytest.approx(2 * 0.012)  # two layers a step
    assert breakdown["m1"]["latency_s"] == pytest.approx(2 * 0.030)
    assert breakdown["m1"]["wait_s"] == pytest.approx(0.002)
    assert breakdown["m1"]["peer_wait_s"] == pytest.approx(0.004)
    assert breakdown["m1"]["units"] == 32 and breakdown["master"]["units"] == 96
    assert breakdown["master"]["latency_s"] == 0.0  # the master has no round latency
    assert comm_share(steps) == pytest.approx(0.2)
    assert comm_share([]) == 0.0


def test_repeats_merge_by_median_and_the_table_names_every_participant() -> None:
    runs = [step_breakdown([_step(c, 2 * c, 0.01)]) for c in (0.010, 0.020, 0.090)]
    merged = merge_repeats(runs)
    assert merged["m1"]["compute_s"] == pytest.approx(2 * 0.020)
    lines = format_breakdown([{"machines": "2x[0.45,0.45] samples", "breakdown": merged,
                               "comm_share": 0.2}])
    rows = [line for line in lines if line.startswith("| ") and "participant" not in line]
    assert rows[0].startswith("| 2x[0.45,0.45] samples | master | 96 |")
    assert rows[0].endswith("| 20% |") and rows[1].startswith("|  | m1 | 32 | 40.0 | 80.0 |")


def test_each_layer_keeps_its_own_compute_and_waits() -> None:
    """The fourth table: per layer, the participants' medians (where the waits are)."""
    def step(wait_1: float) -> dict[str, object]:
        return {"step_s": 0.05, "layers": [
            {"layer": 0, "participants": [
                {"participant": "master", "forward_s": 0.001, "backward_s": 0.002,
                 "peer_wait_s": 0.004},
                {"participant": "m1", "forward_s": 0.002, "backward_s": 0.002,
                 "peer_wait_s": 0.003}]},
            {"layer": 1, "participants": [
                {"participant": "master", "forward_s": 0.010, "backward_s": 0.020,
                 "peer_wait_s": wait_1},
                {"participant": "m1", "forward_s": 0.011, "backward_s": 0.021,
                 "peer_wait_s": 2 * wait_1}]}]}
    runs = [layer_breakdown([step(w), step(w), step(9.0)]) for w in (0.001, 0.002, 0.004)]
    assert runs[0][1]["m1"]["peer_wait_s"] == pytest.approx(0.002)  # the median step
    assert runs[0][0]["master"]["compute_s"] == pytest.approx(0.003)
    merged = merge_layer_repeats(runs)
    assert merged[1]["master"]["peer_wait_s"] == pytest.approx(0.002)  # the median repeat
    lines = format_layer_breakdown([{"machines": "2x[0.45,0.45] samples", "layers": merged}])
    rows = [line for line in lines if line.startswith("| ") and "participants" not in line]
    assert rows == ["| 2x[0.45,0.45] samples | 1 | 3.0-4.0 | 3.0-4.0 | 2 |",
                    "|  | 2 | 30.0-32.0 | 2.0-4.0 | 2 |"]
