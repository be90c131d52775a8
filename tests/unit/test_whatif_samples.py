"""The sample split's what-if (hetconv/analysis/whatif_samples.py): pure, over hand-made runs;
the measured configuration reproduces the run's own prediction."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetconv.analysis import whatif
from hetconv.analysis.whatif_samples import predict_sample_scenarios, read_sample_plan
from hetconv.errors import UserError
from hetconv.master.samples.plan import predict_sample_step, sample_slices
from hetconv.model import conv_layer_shapes
from tests.unit.test_whatif import FAST, MASTER, MODEL, SLOW, measured

PER_SAMPLE = {"master": 0.0008, "fast": 0.0005, "slow": 0.0016}  # seconds per sample


def test_the_measured_configuration_is_the_runs_own_prediction() -> None:
    run = measured((MASTER, FAST, SLOW))
    (prediction,) = predict_sample_scenarios(run, PER_SAMPLE, [whatif.measured_scenario(run)])
    shapes = conv_layer_shapes(MODEL)
    names = ["master", "fast", "slow"]
    slices = sample_slices(names, [PER_SAMPLE[n] for n in names], run.batch)
    weights = sum(s.kernels * s.in_channels * s.kernel_size ** 2 for s in shapes)
    expected = predict_sample_step(slices, PER_SAMPLE, {"master": None, "fast": FAST.link,
                                                        "slow": SLOW.link},
                                   shapes, weights, 4, "peer")
    assert prediction.step_s == pytest.approx(expected + run.dense_s)
    assert prediction.single_step_s == pytest.approx(0.0005 * run.batch + run.dense_s)
    assert prediction.chosen == 3 and prediction.measured_step_s == run.measured_step_s
    assert prediction.ideal_speedup == pytest.approx((1 / 0.0008 + 1 / 0.0005 + 1 / 0.0016)
                                                     * 0.0005)


def test_copies_of_a_fast_machine_scale_until_the_rounds_and_the_link_dominate() -> None:
    run = measured((MASTER, FAST))
    steps = [p.step_s for p in predict_sample_scenarios(
        run, PER_SAMPLE, [whatif.Scenario(n, 1e9, run.batch, run.arch, "fast")
                          for n in (1, 2, 4, 8, 128)])]
    assert steps[0] > steps[1] > steps[2] > steps[3]  # more machines, shorter steps
    alone = PER_SAMPLE["fast"] * run.batch
    assert steps[-1] > alone / 128  # never the ideal: rounds and bytes cost
    slow = predict_sample_scenarios(run, PER_SAMPLE, [whatif.Scenario(4, 1e6, run.batch,
                                                                      run.arch, "fast")])[0]
    assert slow.step_s > steps[2]  # a 1 Mbit link costs more than 1 Gbit
    assert slow.master_link_bytes > 0


def test_arch_and_batch_scale_the_compute() -> None:
    run = measured((MASTER,), dense_s=0.0)
    base, double_batch, wider = predict_sample_scenarios(run, PER_SAMPLE, [
        whatif.Scenario(1, None, 128, (32, 64)), whatif.Scenario(1, None, 256, (32, 64)),
        whatif.Scenario(1, None, 128, (32, 128))])
    assert double_batch.step_s == pytest.approx(2 * base.step_s)
    assert wider.step_s > base.step_s


def test_a_participant_without_seconds_is_refused() -> None:
    with pytest.raises(UserError, match="no seconds per sample for slow"):
        predict_sample_scenarios(measured((MASTER, FAST, SLOW)), {"master": 1e-3, "fast": 1e-3},
                                 [whatif.Scenario(3, None, 128, (32, 64))])


def test_the_plan_record_says_whether_the_run_was_split_by_samples(tmp_path: Path) -> None:
    lines = [{"type": "plan", "chosen": ["master"], "predicted_step_s": 0.01},
             {"type": "plan", "split_by": "samples", "seconds_per_sample": PER_SAMPLE}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert read_sample_plan(tmp_path) == PER_SAMPLE
    (tmp_path / "metrics.jsonl").write_text(json.dumps(lines[0]) + "\n")
    assert read_sample_plan(tmp_path) is None
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"type": "plan", "split_by": "samples"})
                                            + "\n")
    with pytest.raises(UserError, match="seconds_per_sample"):
        read_sample_plan(tmp_path)


def test_workers_the_plan_left_out_are_read_from_its_record(tmp_path: Path) -> None:
    """The sample split's plan record names the workers it left out (``not_used``);
    the model of the run leaves them out as the run did (``measured_run``)."""
    lines = [{"type": "plan", "split_by": "samples", "seconds_per_sample": PER_SAMPLE,
              "chosen": ["master", "fast"], "not_used": ["slow"]}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert whatif.run_left_out(tmp_path) == ("slow",)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"type": "plan", "chosen": []}) + "\n")
    assert whatif.run_left_out(tmp_path) == ()
