"""The link-aware planner and the star model it predicts with (pure, no sockets)."""
from __future__ import annotations

import pytest

from hetconv.master.kernels.planner import ParticipantProfile, choose_plan, effective_cost, predict
from hetconv.planning.perf_model import LayerTraffic, Link, ParticipantCost, predict_star_step

GBIT = 1e9 / 8  # bytes per second
# Two layers like 32:64 at batch 128 (float32): x1 0.4 MB, y1 = x2 2.4 MB, y2 0.5 MB.
TRAFFIC = (LayerTraffic(401_408, 2_359_296, 32, need_dx=False),
           LayerTraffic(2_359_296, 524_288, 64, need_dx=True))
COSTS = ((0.020, 0.0020), (0.030, 0.0025))  # per layer (fixed_s, per_kernel_s)


def link(rate_bytes_per_s: float, rtt_s: float = 2e-4) -> Link:
    return Link(rate_bytes_per_s, rate_bytes_per_s, rtt_s)


def machines(workers: list[Link], master: bool = True) -> list[ParticipantProfile]:
    profiles = [ParticipantProfile("master", COSTS, None)] if master else []
    return profiles + [ParticipantProfile(f"w{i}", COSTS, lk) for i, lk in enumerate(workers)]


def test_the_master_alone_costs_its_compute_and_nothing_else() -> None:
    plan = choose_plan(machines([]), TRAFFIC)
    assert plan.chosen == ("master",) and plan.counts == ((32,), (64,))
    assert plan.predicted_step_s == pytest.approx(0.020 + 0.002 * 32 + 0.030 + 0.0025 * 64)


def test_fast_links_use_every_machine_and_beat_one_machine() -> None:
    plan = choose_plan(machines([link(10 * GBIT)] * 3), TRAFFIC)
    assert set(plan.chosen) == {"master", "w0", "w1", "w2"}
    assert all(count > 0 for row in plan.counts for count in row)
    assert plan.predicted_step_s < 0.6 * plan.best_single_step_s
    for row, t in zip(plan.counts, TRAFFIC):
        assert sum(row) == t.kernels


def test_a_slow_link_gets_no_kernels() -> None:
    plan = choose_plan(machines([link(10 * GBIT), link(10 * GBIT), link(1e6)]), TRAFFIC)
    assert "w2" not in plan.chosen
    assert all(row[3] == 0 for row in plan.counts)
    assert plan.predicted_step_s < plan.all_step_s


def test_every_link_slow_means_the_master_trains_alone() -> None:
    plan = choose_plan(machines([link(1.25e6)] * 3), TRAFFIC)  # 10 Mbit/s links
    assert plan.chosen == ("master",)
    assert plan.predicted_step_s == plan.best_single_step_s


def test_without_the_master_the_best_single_worker_trains_alone() -> None:
    workers = [link(1.25e6), link(2.5e6), link(1.25e6)]
    plan = choose_plan(machines(workers, master=False), TRAFFIC)
    assert plan.chosen == ("w1",)  # the least slow link
    assert plan.counts == ((0, 32, 0), (0, 64, 0))


def test_a_slower_link_gets_fewer_kernels() -> None:
    plan = choose_plan(machines([link(10 * GBIT), link(0.3 * GBIT)]), TRAFFIC)
    if "w1" in plan.chosen:
        assert plan.counts[1][2] < plan.counts[1][1]


def test_effective_cost_adds_the_link() -> None:
    profile = ParticipantProfile("w", COSTS, Link(1e8, 5e7, 0.001))
    fixed, per_kernel = effective_cost(profile, 1, TRAFFIC[1])
    x = TRAFFIC[1].input_bytes
    assert fixed == pytest.approx(0.030 + x / 1e8 + x / 5e7 + 0.002)
    slice_bytes = TRAFFIC[1].output_bytes / 64
    assert per_kernel == pytest.approx(0.0025 + slice_bytes / 5e7 + slice_bytes / 1e8)
    assert effective_cost(ParticipantProfile("m", COSTS, None), 0, TRAFFIC[0]) == COSTS[0]


def test_star_model_serialises_sends_and_replies_on_the_master_link() -> None:
    traffic = [LayerTraffic(input_bytes=1000, output_bytes=1000, kernels=2, need_dx=True)]
    fast = Link(1000.0, 1000.0, 0.0)  # 1 s per 1000 bytes
    one = predict_star_step([[ParticipantCost(0.0, 1.5, 2)]], [fast], traffic)
    # forward: send x 1 s, compute 1 s, reply 1 s; backward: send dy 1 s, compute 2 s, dx 1 s
    assert one == pytest.approx(7.0)
    two = predict_star_step([[ParticipantCost(0.0, 1.5, 1)] * 2], [fast, fast], traffic)
    # forward: sends end at 1 and 2 s, computes 0.5 s, replies 0.5 s each from 1.5 and 2.5
    # -> 3.0; backward: dy 0.5 s each (arrive 0.5, 1.0), computes 1 s (ready 1.5, 2.0),
    # dx 1 s each on the incoming link: 1.5-2.5, 2.5-3.5 -> 3.5
    assert two == pytest.approx(3.0 + 3.5)
    assert predict(machines([]), ((32,), (64,)), TRAFFIC) > 0


def test_peer_model_alone_is_compute_and_links_run_in_parallel() -> None:
    from hetconv.planning.perf_model import predict_peer_step

    alone = [[ParticipantCost(0.02, 0.002, 32)], [ParticipantCost(0.03, 0.0025, 64)]]
    assert predict_peer_step(alone, [None], TRAFFIC) == pytest.approx(0.084 + 0.19)
    lk = link(GBIT)
    four = [[ParticipantCost(0.02, 0.002, 8)] * 4, [ParticipantCost(0.03, 0.0025, 16)] * 4]
    star = predict_star_step(four, [None, lk, lk, lk], TRAFFIC)
    peer = predict_peer_step(four, [None, lk, lk, lk], TRAFFIC)
    assert peer < star  # the master's link no longer carries N copies
    # all-gather of layer 0's output: each sends 1/4 of y to 3 others, receives 3/4 of it
    gather = 0.75 * TRAFFIC[0].output_bytes / GBIT
    assert peer > 0.036 + 0.07 + gather


def test_the_peer_plane_lets_the_planner_use_more_machines() -> None:
    workers = [link(GBIT)] * 3
    star = choose_plan(machines(workers), TRAFFIC, "star")
    peer = choose_plan(machines(workers), TRAFFIC, "peer")
    assert len(peer.chosen) >= len(star.chosen)
    assert peer.predicted_step_s <= star.predicted_step_s


def test_never_predicted_worse_than_every_participant_with_the_compute_split() -> None:
    for workers in ([link(GBIT)] * 3, [link(GBIT / 10)] * 3, [link(10 * GBIT)] * 2):
        for plane in ("star", "peer"):
            plan = choose_plan(machines(workers), TRAFFIC, plane)
            assert plan.predicted_step_s <= plan.all_step_s + 1e-12, (plane, plan)
            assert set(plan.chosen) == {f for f, row in zip(
                [p.participant for p in machines(workers)], zip(*plan.counts)) if any(row)}


def test_wire_dtype_auto_takes_float16_only_where_links_matter() -> None:
    from hetconv.master.setup import choose_wire_dtype
    from hetconv.model import ModelConfig, conv_layer_shapes
    shapes = conv_layer_shapes(ModelConfig(conv_kernels=(32, 64), input_shape=(1, 28, 28),
                                           classes=10))
    slow = machines([link(0.3 * GBIT)] * 3)  # 300 Mbit: the bytes decide the step
    chosen, step32, step16 = choose_wire_dtype(slow, shapes, 128, "peer")
    assert chosen == "float16" and step16 < step32
    fast = machines([link(100 * GBIT, rtt_s=1e-5)] * 3)  # compute is everything
    chosen, step32, step16 = choose_wire_dtype(fast, shapes, 128, "peer")
    assert chosen == "float32" and step16 >= step32 * 0.97
