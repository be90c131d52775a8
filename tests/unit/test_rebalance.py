"""The rebalancer: re-splits from measured step times (pure, no sockets)."""
from __future__ import annotations

import random

import pytest

from hetconv.master.kernels.planner import ParticipantProfile, choose_plan
from hetconv.master.kernels.rebalance import (
    Rebalancer,
    RebalanceSettings,
    measured_compute,
)
from hetconv.master.plan import Shard, reshard
from hetconv.planning.perf_model import LayerTraffic, Link

GBIT = 1e9 / 8
TRAFFIC = (LayerTraffic(401_408, 2_359_296, 32, need_dx=False),
           LayerTraffic(2_359_296, 524_288, 64, need_dx=True))
COSTS = ((0.004, 0.0020), (0.006, 0.0025))  # per layer (fixed_s, per_kernel_s)
FAST = Link(10 * GBIT, 10 * GBIT, 1e-4)


def profiles() -> list[ParticipantProfile]:
    return [ParticipantProfile("master", COSTS, None)] + [
        ParticipantProfile(f"w{i}", COSTS, FAST) for i in (1, 2)]


def start(settings: RebalanceSettings | None = None) -> Rebalancer:
    calibrated = profiles()
    plan = choose_plan(calibrated, TRAFFIC, "star")
    assert all(count > 0 for row in plan.counts for count in row)
    return Rebalancer(calibrated, TRAFFIC, plan.counts, "star", settings)


def measure(rebalancer: Rebalancer, slowdown: dict[str, float],
            noise: random.Random | None = None, noise_fraction: float = 0.0
            ) -> list[dict[str, tuple[int, float]]]:
    """What the participants would measure at the current counts, ``slowdown`` times
    their calibrated cost (and within +-noise_fraction of it)."""
    layers = []
    for layer, row in enumerate(rebalancer.counts):
        entries = {}
        for profile, count in zip(rebalancer.calibrated, row):
            if count == 0:
                continue
            fixed_s, per_kernel_s = profile.costs[layer]
            jitter = 1 + (noise.uniform(-noise_fraction, noise_fraction) if noise else 0.0)
            seconds = (fixed_s + per_kernel_s * count) * slowdown.get(profile.participant, 1.0)
            entries[profile.participant] = (count, seconds * jitter)
        layers.append(entries)
    return layers


def kernels_of(counts: tuple[tuple[int, ...], ...], index: int) -> int:
    return sum(row[index] for row in counts)


def run(rebalancer: Rebalancer, steps: range, slowdown: dict[str, float]) -> list[int]:
    """The steps at which it decided to re-split."""
    decided = []
    for step in steps:
        decision = rebalancer.observe(step, measure(rebalancer, slowdown))
        if decision is not None:
            decided.append(step)
            for row, t in zip(decision.counts, TRAFFIC):
                assert sum(row) == t.kernels
    return decided


def test_a_participant_measured_twice_as_slow_loses_kernels() -> None:
    rebalancer = start()
    before = rebalancer.counts
    decision = None
    for step in range(20):
        decision = rebalancer.observe(step, measure(rebalancer, {"w2": 2.0}))
        if decision is not None:
            break
    assert decision is not None
    assert decision.step == 7  # 3 warm-up steps ignored, then a window of 5
    assert kernels_of(decision.counts, 2) < kernels_of(before, 2)
    assert kernels_of(decision.counts, 0) > kernels_of(before, 0)
    assert decision.new_predicted_step_s < 0.9 * decision.old_predicted_step_s
    assert "w2 x2.00" in decision.reason
    assert rebalancer.counts == decision.counts  # adopted
    for row, t in zip(decision.counts, TRAFFIC):
        assert sum(row) == t.kernels
    record = decision.record()
    assert record["step"] == 7 and record["counts"][0]["participants"][2]["participant"] == "w2"
    assert sum(d["kernels"] for d in record["counts"][1]["participants"]) == 64


def test_noise_within_the_threshold_changes_nothing() -> None:
    rebalancer = start()
    noise = random.Random(0)
    for step in range(200):
        assert rebalancer.observe(step, measure(rebalancer, {"w1": 1.03}, noise, 0.05)) is None


def test_no_re_split_during_warm_up_or_inside_the_interval() -> None:
    settings = RebalanceSettings(warmup_steps=3, window_steps=5, min_interval_steps=20)
    rebalancer = start(settings)
    for step in range(7):  # warm-up (3) and an unfilled window (4)
        assert rebalancer.observe(step, measure(rebalancer, {"w2": 3.0})) is None
    assert rebalancer.observe(7, measure(rebalancer, {"w2": 3.0})) is not None
    # the machine changes again at once: no re-split before step 7 + 20
    decided = run(rebalancer, range(8, 60), {"w2": 3.0, "w1": 3.0})
    assert decided and decided[0] >= 27


def test_a_participant_that_improved_gets_kernels_back() -> None:
    rebalancer = start()
    before = rebalancer.counts
    assert run(rebalancer, range(10), {"w2": 2.0}) == [7]
    slowed = rebalancer.counts
    assert kernels_of(slowed, 2) < kernels_of(before, 2)
    decided = run(rebalancer, range(10, 60), {})
    assert decided and decided[0] >= 27
    assert kernels_of(rebalancer.counts, 2) > kernels_of(slowed, 2)


def test_steps_measured_with_other_counts_are_ignored() -> None:
    rebalancer = start()
    wrong = measure(rebalancer, {"w2": 2.0})
    wrong[0] = {name: (kernels + 1, seconds) for name, (kernels, seconds) in wrong[0].items()}
    for step in range(30):
        assert rebalancer.observe(step, wrong) is None


def test_a_participant_without_kernels_keeps_its_profile() -> None:
    calibrated = profiles()
    counts = ((32, 0, 0), (40, 24, 0))  # w2 holds nothing, w1 nothing of layer 0
    rebalancer = Rebalancer(calibrated, TRAFFIC, counts, "star",
                            RebalanceSettings(warmup_steps=0, window_steps=1))
    rebalancer.observe(0, measure(rebalancer, {"master": 1.5}))
    assert rebalancer.profiles[2] == calibrated[2]
    assert rebalancer.profiles[1].costs[0] == calibrated[1].costs[0]
    assert rebalancer.profiles[1].costs[1] == calibrated[1].costs[1]  # measured as calibrated
    assert rebalancer.profiles[0].costs[0] == pytest.approx((0.006, 0.003))


def test_measured_compute_reads_the_stage_timings() -> None:
    timings = {"comm_s": 0.0, "layers": [
        {"layer": 0, "participants": [{"participant": "master", "kernels": 3, "forward_s": 0.01,
                                  "backward_s": 0.02},
                                 {"participant": "w1", "kernels": 1, "forward_s": 0.005,
                                  "backward_s": 0.01}]},
        {"layer": 1, "participants": [{"participant": "w1", "kernels": 8, "forward_s": 0.1,
                                  "backward_s": 0.2}]}]}
    layers = measured_compute(timings)
    assert layers[0]["master"] == (3, pytest.approx(0.03))
    assert layers[1] == {"w1": (8, pytest.approx(0.3))}


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        RebalanceSettings(window_steps=0)
    with pytest.raises(ValueError):
        RebalanceSettings(threshold=1.5)


def test_reshard_keeps_the_participants_and_tiles_the_kernels() -> None:
    shards = [[Shard("master", None, 0, 2), Shard("w1", None, 2, 3), Shard("w2", None, 3, 4)]]
    moved = reshard(shards, [[3, 1, 0]])
    assert [(s.participant, s.start, s.stop) for s in moved[0]] == [
        ("master", 0, 3), ("w1", 3, 4), ("w2", 4, 4)]
    with pytest.raises(ValueError):
        reshard(shards, [[3, 2, 0]])  # 5 kernels of a 4-kernel layer
    with pytest.raises(ValueError):
        reshard(shards, [[4, 0]])


def test_cost_line_fit_from_measured_points() -> None:
    from hetconv.master.kernels.rebalance import fit_cost_line
    assert fit_cost_line({8: 0.05}) is None  # one kernel count: nothing to fit
    fixed, per_kernel = fit_cost_line({4: 0.014, 8: 0.018, 16: 0.026})  # type: ignore[misc]
    assert abs(fixed - 0.010) < 1e-9 and abs(per_kernel - 0.001) < 1e-9
    assert fit_cost_line({4: 0.02, 8: 0.01}) is None  # falling: noise, not a cost line
    fixed, _ = fit_cost_line({10: 0.001, 20: 0.030})  # type: ignore[misc]
    assert 0.0 <= fixed <= 0.001  # the fixed part never goes negative nor above a point


def test_re_splits_converge_instead_of_swinging() -> None:
    """Calibration says a and b are equal; in truth b's fixed cost is large. The
    rebalancer must settle within a few re-splits, not alternate."""
    from hetconv.master.kernels.planner import ParticipantProfile
    from hetconv.master.kernels.rebalance import Rebalancer, RebalanceSettings
    from hetconv.planning.perf_model import LayerTraffic
    truth = {"a": (0.002, 0.001), "b": (0.020, 0.0008)}
    profiles = [ParticipantProfile(p, ((0.005, 0.001),), None) for p in ("a", "b")]
    traffic = [LayerTraffic(1000, 1000, 64, False)]
    rebalancer = Rebalancer(profiles, traffic, [[32, 32]], "star",
                            RebalanceSettings(warmup_steps=0, window_steps=2,
                                              min_interval_steps=2))
    counts = [[32, 32]]
    history = []
    for step in range(60):
        layer = {p: (k, truth[p][0] + truth[p][1] * k) for p, k in zip(("a", "b"), counts[0])}
        decision = rebalancer.observe(step, [layer])
        if decision is not None:
            counts = [list(row) for row in decision.counts]
            history.append(tuple(counts[0]))
    assert 1 <= len(history) <= 3, history
    a, b = history[-1]
    finish = [truth["a"][0] + truth["a"][1] * a, truth["b"][0] + truth["b"][1] * b]
    assert max(finish) / min(finish) < 1.1  # balanced by the measured lines


def test_a_worker_left_out_by_its_calibration_borrows_its_peers_correction() -> None:
    """Calibration overstated every worker 2x; w3 got no kernels. Once w1 and w2 are
    measured at half their calibrated cost, w3 (never measured) is given kernels."""
    costly = tuple((2 * fixed, 2 * per_kernel) for fixed, per_kernel in COSTS)
    calibrated = [ParticipantProfile("master", COSTS, None)] + [
        ParticipantProfile(f"w{i}", costly, FAST) for i in (1, 2, 3)]
    counts = [[row[0], row[1], row[2], 0] for row in
              choose_plan(calibrated[:3], TRAFFIC, "star").counts]
    rebalancer = Rebalancer(calibrated, TRAFFIC, counts, "star")
    decision = None
    for step in range(12):
        layers = [{p.participant: (k, (p.costs[layer][0] + p.costs[layer][1] * k)
                                   * (0.5 if p.link is not None else 1.0))
                   for p, k in zip(calibrated, row) if k > 0}
                  for layer, row in enumerate(rebalancer.counts)]
        decision = rebalancer.observe(step, layers) or decision
    assert decision is not None
    assert all(row[3] > 0 for row in decision.counts)  # w3 now computes
