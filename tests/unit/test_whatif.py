"""The what-if predictions (hetconv/analysis/whatif.py): pure, over hand-made measured runs."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hetconv.analysis import whatif
from hetconv.analysis.report.records import parse_run
from hetconv.errors import UserError
from hetconv.master.kernels.planner import ParticipantProfile, choose_plan
from hetconv.model import ModelConfig, conv_layer_shapes
from hetconv.planning.perf_model import LayerTraffic, Link

GBIT = 1e9
LINK = Link(GBIT / 8, GBIT / 8, 2e-4)
MODEL = ModelConfig(conv_kernels=(32, 64), input_shape=(1, 28, 28))


def measured(profiles: tuple[ParticipantProfile, ...], data_plane: str = "peer",
             dense_s: float = 0.002, batch: int = 128) -> whatif.MeasuredRun:
    return whatif.MeasuredRun(run_dir="run", profiles=profiles, model=MODEL, batch=batch,
                              wire_itemsize=4, data_plane=data_plane, dense_s=dense_s,
                              measured_step_s=0.05, steps_used=10, plan_predicted_step_s=None)


MASTER = ParticipantProfile("master", ((0.004, 0.0012), (0.005, 0.0009)), None)
FAST = ParticipantProfile("fast", ((0.003, 0.0008), (0.004, 0.0006)), LINK)
SLOW = ParticipantProfile("slow", ((0.006, 0.0020), (0.007, 0.0015)), LINK)
RUN = measured((MASTER, FAST, SLOW))


def flat(costs: tuple[tuple[float, float], ...]) -> list[float]:
    return [value for pair in costs for value in pair]


def scenarios(run: whatif.MeasuredRun, machines: tuple[int, ...], rate: float | None = None,
              like: str | None = None) -> list[whatif.Scenario]:
    return [whatif.Scenario(n, rate, run.batch, run.arch, like) for n in machines]


@pytest.mark.parametrize("data_plane", ["peer", "star"])
@pytest.mark.parametrize("machines", [1, 2, 3, 5, 7])
def test_the_symmetric_search_finds_what_choose_plan_finds(data_plane: str, machines: int) -> None:
    run = measured((MASTER, FAST, SLOW), data_plane)
    scenario = whatif.Scenario(machines, None, run.batch, run.arch)
    cluster = whatif.cluster(run, scenario)
    traffic = whatif.layer_traffic(conv_layer_shapes(MODEL), run.batch, 4)
    plan = choose_plan(cluster, traffic, data_plane)
    prediction = whatif.predict_scenarios(run, [scenario])[0]
    assert prediction.step_s == pytest.approx(plan.predicted_step_s + run.dense_s, rel=1e-9)
    assert prediction.single_step_s == pytest.approx(plan.best_single_step_s + run.dense_s,
                                                     rel=1e-9)
    assert prediction.chosen == len(plan.chosen)


def test_the_measured_configuration_is_the_measured_profiles() -> None:
    scenario = whatif.measured_scenario(RUN)
    assert whatif.is_measured(RUN, scenario)
    assert whatif.cluster(RUN, scenario) == list(RUN.profiles)
    prediction = whatif.predict_scenarios(RUN, [scenario])[0]
    assert prediction.measured_step_s == RUN.measured_step_s
    other = whatif.predict_scenarios(RUN, scenarios(RUN, (2,)))[0]
    assert other.measured_step_s is None


@pytest.mark.parametrize("rate", [None, 1e7, 1e8, GBIT, 1e10])
@pytest.mark.parametrize("like", [None, "fast", "master"])
def test_more_machines_never_predict_a_slower_step(rate: float | None, like: str | None) -> None:
    machines = (1, 2, 3, 4, 6, 8, 16, 32)
    predictions = whatif.predict_scenarios(RUN, scenarios(RUN, machines, rate, like))
    steps = [p.step_s for p in predictions]
    assert all(later <= earlier * (1 + 1e-12) for earlier, later in zip(steps, steps[1:])), steps
    assert predictions[0].speedup == pytest.approx(1.0)
    assert all(1 <= p.chosen <= p.scenario.machines for p in predictions)


def test_a_very_slow_link_keeps_the_master_alone() -> None:
    predictions = whatif.predict_scenarios(RUN, scenarios(RUN, (1, 2, 8, 64), rate=1e5,
                                                          like="fast"))
    for prediction in predictions:
        assert prediction.chosen == 1
        assert prediction.speedup == pytest.approx(1.0)
        assert prediction.master_link_bytes == 0.0
    assert predictions[-1].ideal_speedup == pytest.approx(64)
    assert predictions[-1].share_of_ideal == pytest.approx(1 / 64)


def test_a_fast_link_and_identical_machines_scale() -> None:
    predictions = whatif.predict_scenarios(RUN, scenarios(RUN, (1, 2, 4), rate=1e11,
                                                          like="fast"))
    assert [p.ideal_speedup for p in predictions] == pytest.approx([1, 2, 4])
    assert 1.5 < predictions[1].speedup <= 2.0
    assert predictions[2].speedup > predictions[1].speedup
    assert all(0 < p.share_of_ideal <= 1.0 for p in predictions)


def test_batch_scales_costs_traffic_and_dense_linearly() -> None:
    doubled = whatif.scaled_costs(RUN, FAST, RUN.arch, 2 * RUN.batch)
    assert flat(doubled) == pytest.approx([2 * c for c in flat(FAST.costs)])
    assert whatif.scaled_dense_s(RUN, RUN.arch, 64) == pytest.approx(RUN.dense_s / 2)
    shapes = conv_layer_shapes(MODEL)
    small, large = (whatif.layer_traffic(shapes, b, 4) for b in (64, 128))
    assert [2 * t.input_bytes for t in small] == [t.input_bytes for t in large]
    one, two = whatif.predict_scenarios(RUN, [whatif.Scenario(1, None, b, RUN.arch, "master")
                                              for b in (128, 256)])
    assert two.step_s == pytest.approx(2 * one.step_s)  # one machine: compute and dense only


def test_arch_scales_the_cost_per_kernel_by_flop_per_kernel() -> None:
    assert whatif.scaled_costs(RUN, FAST, (32, 64), RUN.batch) == FAST.costs
    wider = whatif.scaled_costs(RUN, FAST, (32, 256), RUN.batch)
    assert flat(wider) == pytest.approx(flat(FAST.costs))  # same input: the same per kernel
    deeper_input = whatif.scaled_costs(RUN, FAST, (64, 64), RUN.batch)
    (fixed0, per0), (fixed1, per1) = deeper_input
    assert (fixed0, per0) == pytest.approx(FAST.costs[0])
    assert per1 == pytest.approx(2 * FAST.costs[1][1])  # twice the input channels
    assert fixed1 == pytest.approx(2 * FAST.costs[1][0])  # twice the input elements
    assert whatif.scaled_costs(RUN, FAST, (32,), RUN.batch) == FAST.costs[:1]
    with pytest.raises(UserError, match="too small"):  # the model's own check of the shapes
        whatif.scaled_costs(RUN, FAST, (32, 64, 64), RUN.batch)
    assert whatif.scaled_dense_s(RUN, (32, 128), RUN.batch) == pytest.approx(2 * RUN.dense_s)
    one, wide = whatif.predict_scenarios(RUN, [whatif.Scenario(1, None, RUN.batch, a, "master")
                                               for a in ((32, 64), (32, 256))])
    assert wide.step_s > one.step_s


@pytest.mark.serial  # times itself
def test_128_machines_are_fast() -> None:
    started = time.perf_counter()  # the paper's setting: identical machines
    predictions = whatif.predict_scenarios(RUN, scenarios(RUN, whatif.DEFAULT_MACHINES,
                                                          like="fast"))
    assert time.perf_counter() - started < 2.0
    assert predictions[-1].scenario.machines == 128
    assert predictions[-1].step_s <= predictions[0].step_s
    started = time.perf_counter()  # three kinds of machine: about three times the work
    repeated = whatif.predict_scenarios(RUN, scenarios(RUN, (128,)))[0]
    assert time.perf_counter() - started < 10.0
    assert 1 <= repeated.chosen <= 128


@pytest.mark.parametrize("machines", [0, 129])
def test_machine_counts_outside_1_to_128_are_refused(machines: int) -> None:
    with pytest.raises(UserError, match="give 1 to 128"):
        whatif.predict_scenarios(RUN, scenarios(RUN, (machines,)))


def test_an_unknown_participant_to_copy_is_refused() -> None:
    with pytest.raises(UserError, match="no such participant"):
        whatif.cluster(RUN, whatif.Scenario(2, None, RUN.batch, RUN.arch, "nobody"))


def test_copies_of_the_master_get_the_median_link_and_a_rate_replaces_links() -> None:
    machines = whatif.cluster(RUN, whatif.Scenario(4, None, RUN.batch, RUN.arch))
    assert [m.participant for m in machines] == ["master", "fast", "slow", "master-1"]
    assert machines[0].link is None and machines[3].link == LINK
    capped = whatif.cluster(RUN, whatif.Scenario(3, 8e6, RUN.batch, RUN.arch))
    assert capped[0].link is None
    assert capped[1].link == Link(1e6, 1e6, LINK.rtt_s)
    no_links = measured((MASTER, ParticipantProfile("w", FAST.costs, None)))
    assert not no_links.links_measured
    with pytest.raises(UserError, match="no measured link"):
        whatif.cluster(no_links, whatif.Scenario(2, None, RUN.batch, RUN.arch))
    assert whatif.cluster(no_links, whatif.Scenario(2, GBIT, RUN.batch, RUN.arch))[1].link


def test_master_link_bytes_star_and_peer() -> None:
    traffic = [LayerTraffic(100, 40, 4, False), LayerTraffic(40, 16, 8, True)]
    counts = ((2, 2), (4, 4))  # master's own device, one worker
    star = whatif.master_link_bytes(counts, [False, True], traffic, "star")
    # layer 0: x down, half the output up and its gradient down; layer 1: x, dx, half out x2
    assert star == (100 + 2 * 20) + (40 + 40 + 2 * 8)
    peer = whatif.master_link_bytes(counts, [False, True], traffic, "peer")
    # input once; all-gather and reduce-scatter of layer 0's output: half each way x2;
    # the worker's half of the last output and its gradient
    assert peer == 100 + 2 * 40 * (0.5 + 0.5) + 2 * 8
    workers_only = whatif.master_link_bytes(((1, 1, 2), (2, 2, 4)), [True] * 3, traffic, "peer")
    more = whatif.master_link_bytes(((1, 1, 1, 1), (2, 2, 2, 2)), [True] * 4, traffic, "peer")
    assert workers_only == more == 100 + 2 * 16  # the master's link: the same bytes


def write_run(directory: Path, records: list[dict[str, object]]) -> Path:
    directory.mkdir()
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def calibration(layer: int, kernels: int) -> dict[str, object]:
    return {"type": "calibration", "layer": layer, "split": "model", "kernels": kernels,
            "calibrated_kernels": kernels // 2, "small_kernels": kernels // 8,
            "participants": [{"participant": d, "seconds": 0.01, "small_seconds": 0.005,
                         "fixed_s": 0.002, "per_kernel_s": 0.0003, "kernels": kernels // 2,
                         "kernel_start": 0, "kernel_stop": kernels // 2, "share": 0.5}
                        for d in ("master", "w1")]}


CONFIG = {"mode": "distributed", "arch": [32, 64], "batch": 64, "input_shape": [1, 28, 28],
          "kernel_size": 5, "padding": 0, "classes": 10, "wire_dtype": "float16",
          "data_plane": "star"}
STEP = {"type": "step", "epoch": 0, "loss": 2.0, "accuracy": 0.1, "images": 64,
        "conv_s": 0.02, "comm_s": 0.005, "data_s": 0.0, "layers": []}


def test_a_run_directory_becomes_the_model_s_inputs(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", [
        {"type": "run_start", "config": CONFIG},
        calibration(0, 32), calibration(1, 64),
        {"type": "plan", "chosen": ["master", "w1"], "predicted_step_s": 0.02,
         "best_single": "master", "best_single_step_s": 0.03, "all_step_s": 0.02,
         "links": [{"participant": "w1", "down_bytes_per_s": 1e8, "up_bytes_per_s": 2e8,
                    "rtt_s": 1e-4}]},
        *({**STEP, "step": i, "step_s": 0.03 + i * 0.001, "dense_s": 0.004} for i in range(5)),
        {"type": "run_end", "status": "completed", "error": None}])
    run = whatif.measured_run(parse_run(run_dir), whatif.read_plan_links(run_dir))
    assert [p.participant for p in run.profiles] == ["master", "w1"]
    assert run.profiles[0].link is None and run.profiles[1].link == Link(1e8, 2e8, 1e-4)
    assert run.profiles[1].costs == ((0.002, 0.0003), (0.002, 0.0003))
    assert (run.batch, run.arch, run.wire_itemsize, run.data_plane) == (64, (32, 64), 2, "star")
    assert run.measured_step_s == pytest.approx(0.0325)  # the first step skipped
    assert run.dense_s == pytest.approx(0.004) and run.links_measured


def test_a_local_run_has_no_profiles(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "local", [
        {"type": "run_start", "config": {**CONFIG, "mode": "local"}},
        {**STEP, "step": 0, "step_s": 0.03, "dense_s": 0.004}])
    with pytest.raises(UserError, match="no calibration records"):
        whatif.measured_run(parse_run(run_dir), whatif.read_plan_links(run_dir))


def test_the_wire_dtype_of_an_auto_run_is_the_planners_choice(tmp_path: Path) -> None:
    from hetconv.analysis.whatif import run_wire_dtype
    (tmp_path / "metrics.jsonl").write_text(
        '{"type":"plan","time":1,"wire_dtype":"float16"}\n', encoding="utf-8")
    assert run_wire_dtype(tmp_path, {"wire_dtype": "auto"}) == "float16"
    assert run_wire_dtype(tmp_path, {"wire_dtype": "float32"}) == "float32"
    (tmp_path / "metrics.jsonl").write_text('{"type":"step","time":1}\n', encoding="utf-8")
    assert run_wire_dtype(tmp_path, {"wire_dtype": "auto"}) == "float32"
