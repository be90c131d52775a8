"""``hetconv plan`` for a run split by samples, from the run's step model fitted in place
(hetconv/analysis/whatif_samples.py, hetconv/commands/plan.py): pure, over hand-made runs
and run directories written in tmp_path."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

from hetconv.analysis import whatif
from hetconv.analysis.whatif_samples import (
    CALIBRATION_MODEL,
    fitted_terms,
    predict_sample_scenarios,
    read_sample_plan,
    read_step_model,
)
from hetconv.commands.plan import run_plan
from hetconv.master.samples.plan import conv_weights, predict_sample_step, sample_slices
from hetconv.master.samples.step_model import ModelCheck, StepTerms
from hetconv.model import conv_layer_shapes
from hetconv.planning.perf_model import Link
from tests.unit.test_whatif import FAST, MASTER, MODEL, SLOW, measured
from tests.unit.test_whatif_samples import PER_SAMPLE

STEPS = ({"master": 0.001, "fast": 0.0005, "slow": 0.002},
         {"master": 0.0012, "fast": 0.0005, "slow": 0.0018},
         {"master": 0.001, "fast": 0.0007, "slow": 0.002})
TERMS = StepTerms({"master": 0.001, "fast": 0.0005, "slow": 0.002}, round_s=0.0015,
                  serial_s=0.004, rounds=6, steps_s=STEPS)
# slices by speed of 128 samples (1000 : 2000 : 500 samples a second): 36.6, 73.1, 18.3
SLICES = {"master": 37, "fast": 73, "slow": 18}
# compute: per fitted step its slowest participant at SLICES: 37.0, 44.4, 51.1 ms; median
COMPUTE = 0.0444
NAMES = ["master", "fast", "slow"]


def model_record(terms: StepTerms = TERMS, **extra: Any) -> dict[str, Any]:
    check = ModelCheck(terms, SLICES, terms.predict(SLICES), 0.06, None, 9, 9)
    return {"type": "model", "split_by": "samples", "step": 19, **check.as_record(), **extra}


def plan_record(**extra: Any) -> dict[str, Any]:
    return {"type": "plan", "split_by": "samples", "seconds_per_sample": PER_SAMPLE, **extra}


def write(directory: Path, records: list[dict[str, Any]], raw: str = "") -> Path:
    directory.mkdir(exist_ok=True)
    (directory / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records) + raw, encoding="utf-8")
    return directory


def wire(run: whatif.MeasuredRun, per_sample: dict[str, float], link: Link) -> float:
    """The link model's transfers and round trips (predict_sample_step less its compute)
    at SLICES, both workers on ``link``."""
    shapes = conv_layer_shapes(MODEL)
    slices = sample_slices(NAMES, [per_sample[n] for n in NAMES], run.batch)
    links = {"master": None, "fast": link, "slow": link}
    compute = max(per_sample[s.participant] * s.samples for s in slices)
    return predict_sample_step(slices, per_sample, links, shapes, conv_weights(shapes), 4,
                               "peer") - compute


def test_the_measured_configuration_is_the_fitted_models_own_prediction(tmp_path: Path) -> None:
    fitted = read_step_model(write(tmp_path, [plan_record(), model_record()]))
    assert fitted is not None and fitted.terms == TERMS and fitted.fitted_steps == 9
    run = measured((MASTER, FAST, SLOW))
    slices = sample_slices(NAMES, [TERMS.per_sample_s[n] for n in NAMES], run.batch)
    samples = {s.participant: s.samples for s in slices}
    assert samples == SLICES
    (prediction,) = predict_sample_scenarios(run, PER_SAMPLE, [whatif.measured_scenario(run)],
                                             fitted)
    assert prediction.step_s == TERMS.predict(samples)  # exactly: one model
    assert prediction.step_s == pytest.approx(COMPUTE + 6 * 0.0015 + 0.004)  # 57.4 ms
    # no dense part added: the fitted compute holds it (step chain) or serial does
    assert prediction.single_step_s == pytest.approx(0.0005 * 128 + 0.004)
    assert prediction.measured_step_s == run.measured_step_s and prediction.chosen == 3


def test_a_faster_link_takes_only_the_link_models_wire_difference_off_the_rounds(
        tmp_path: Path) -> None:
    fitted = read_step_model(write(tmp_path, [plan_record(), model_record()]))
    assert fitted is not None
    run = measured((MASTER, FAST, SLOW))
    scenario = whatif.Scenario(3, 1e10, run.batch, run.arch, rate_label="10gbit")
    assert FAST.link is not None and FAST.link == SLOW.link
    measured_wire = wire(run, dict(TERMS.per_sample_s), FAST.link)
    fast_wire = wire(run, dict(TERMS.per_sample_s), Link(1.25e9, 1.25e9, 2e-4))
    assert measured_wire - fast_wire > 0.004  # 1 Gbit -> 10 Gbit: ms less on the wire
    cluster, terms = fitted_terms(run, PER_SAMPLE, fitted, scenario)
    assert cluster.samples == SLICES and terms.serial_s == 0.004 and terms.rounds == 6
    assert terms.round_s == pytest.approx(0.0015 - (measured_wire - fast_wire) / 6, rel=1e-12)
    (prediction,) = predict_sample_scenarios(run, PER_SAMPLE, [scenario], fitted)
    assert prediction.step_s == pytest.approx(COMPUTE + 6 * 0.0015 + 0.004
                                              - (measured_wire - fast_wire), rel=1e-12)
    assert prediction.measured_step_s is None
    # a fitted round cost below the wire saved: the round costs nothing, not less
    cheap = read_step_model(write(tmp_path, [plan_record(), model_record(
        StepTerms(TERMS.per_sample_s, 0.0001, 0.004, 6, STEPS))]))
    assert cheap is not None
    (clamped,) = predict_sample_scenarios(run, PER_SAMPLE, [scenario], cheap)
    assert clamped.step_s == pytest.approx(COMPUTE + 0.004)


def test_without_a_model_record_the_calibration_model_is_unchanged(tmp_path: Path) -> None:
    run_dir = write(tmp_path, [plan_record(), {**model_record(), "split_by": "kernels"}])
    assert read_step_model(run_dir) is None  # a kernel split's record is not the sample model
    per_sample = read_sample_plan(run_dir)
    assert per_sample == PER_SAMPLE
    run = measured((MASTER, FAST, SLOW))
    (prediction,) = predict_sample_scenarios(run, per_sample, [whatif.measured_scenario(run)])
    shapes = conv_layer_shapes(MODEL)
    slices = sample_slices(NAMES, [PER_SAMPLE[n] for n in NAMES], run.batch)
    assert [s.samples for s in slices] == [41, 66, 21]  # 1250 : 2000 : 625 samples a second
    expected = predict_sample_step(slices, PER_SAMPLE, {"master": None, "fast": FAST.link,
                                                        "slow": SLOW.link},
                                   shapes, conv_weights(shapes), 4, "peer") + run.dense_s
    assert prediction.step_s == expected
    assert prediction.single_step_s == pytest.approx(0.0005 * 128 + 0.002)


def test_a_participant_ten_times_slower_in_the_fit_gets_fewer_samples(tmp_path: Path) -> None:
    slow = StepTerms({"master": 0.001, "fast": 0.0005, "slow": 0.02}, 0.0015, 0.004, 6)
    fitted = read_step_model(write(tmp_path, [plan_record(), model_record(slow)]))
    assert fitted is not None
    run = measured((MASTER, FAST, SLOW))
    cluster, terms = fitted_terms(run, PER_SAMPLE, fitted, whatif.measured_scenario(run))
    # 1000 : 2000 : 50 samples a second: 41.97, 83.93, 2.10 (calibrated: 41, 66, 21)
    assert cluster.samples == {"master": 42, "fast": 84, "slow": 2}
    (prediction,) = predict_sample_scenarios(run, PER_SAMPLE, [whatif.measured_scenario(run)],
                                             fitted)
    assert prediction.step_s == pytest.approx(max(0.042, 0.042, 0.04) + 6 * 0.0015 + 0.004)
    six = fitted_terms(run, PER_SAMPLE, fitted, whatif.Scenario(6, None, 128, run.arch))[0]
    assert six.samples["slow"] < six.samples["master"] < six.samples["fast"]
    assert six.samples["slow-1"] == six.samples["slow"] <= 2


def test_a_participant_without_a_fitted_figure_takes_its_calibrated_one(tmp_path: Path) -> None:
    partial = StepTerms({"master": 0.001, "fast": 0.0005}, 0.0015, 0.004, 6)
    fitted = read_step_model(write(tmp_path, [plan_record(), model_record(partial)]))
    assert fitted is not None
    run = measured((MASTER, FAST, SLOW))
    assert fitted.calibrated(run) == ("slow",)
    _, terms = fitted_terms(run, PER_SAMPLE, fitted, whatif.measured_scenario(run))
    assert terms.per_sample_s == {"master": 0.001, "fast": 0.0005, "slow": 0.0016}


@pytest.mark.parametrize("raw", [
    '{"type": "model", "split_by": "samples"}',
    '{"type": "model", "split_by": "samples", "per_sample_s": "fast", "round_s": 0.001, '
    '"serial_s": 0.004, "rounds": 6}',
    '{"type": "model", "split_by": "samples", "per_sample_s": {"fast": 0.001}, '
    '"round_s": "abc", "serial_s": 0.004, "rounds": 6}',
    '{"type": "model", "split_by": "samples", "per_sample_s": {"fast": 0.001}, '
    '"round_s": 0.001, "serial_s": 0.004, "rounds": 1e400}',
    '{"type": "model", "split_by": "samples", "per_sample_s": {"fast": -1}, '
    '"round_s": 0.001, "serial_s": 0.004, "rounds": 6}',
    '{"type": "model", "split_by": "samples", "per_sample_s": {}, '
    '"round_s": 0.001, "serial_s": 0.004, "rounds": 6}',
    '{"type": "model", "split_by": "samples", "per_sample_s": {"fast": 0.001}, '
    '"round_s": NaN, "serial_s": 0.004, "rounds": 6}',
    '{"type": "model", "split_by": "samples", "per_sample_s": {"fast": 0.001}, '
    '"round_s": 0.001, "serial_s": 0.004, "rounds": 0}',
    '{"type": "model", "split_by": "samples", "per_sample_s": {"fast": null}, '
    '"round_s": 0.001, "serial_s": 0.004, "rounds": 6}',
    '{"type": "model", "split_by": "samples", "per_sample_s": {"fast": 0.001}, '
    '"round_s": 0.001, "serial_s": 0.004, "rounds": 6, "steps_per_sample_s": "oops"}',
    '{"type": "model", "split_by": "samples", "per_sample_s": {"fast": 0.001}, '
    '"round_s": 0.001, "serial_s": 0.004, "rounds": 6, "steps_per_sample_s": [{"fast": '
    'Infinity}]}',
], ids=["no-terms", "string-figures", "string-round", "huge-rounds", "negative", "empty",
        "nan", "no-rounds", "null", "string-steps", "infinite-step"])
def test_a_garbled_model_record_falls_back_to_the_calibration_model(tmp_path: Path,
                                                                    raw: str) -> None:
    # the last record counts: a good one before it is not taken instead
    run_dir = write(tmp_path, [plan_record(), model_record()], raw + "\n")
    assert read_step_model(run_dir) is None
    run = measured((MASTER, FAST, SLOW))
    calibrated = predict_sample_scenarios(run, PER_SAMPLE, [whatif.measured_scenario(run)])
    assert calibrated[0].step_s > 0 and math.isfinite(calibrated[0].step_s)


# --- the command, on a whole run directory --------------------------------------------------
CONFIG = {"mode": "distributed", "arch": [32, 64], "batch": 128, "input_shape": [1, 28, 28],
          "kernel_size": 5, "padding": 0, "classes": 10, "wire_dtype": "float32",
          "data_plane": "peer"}
LINKS = [{"participant": name, "down_bytes_per_s": 1.25e8, "up_bytes_per_s": 1.25e8,
          "rtt_s": 2e-4} for name in ("fast", "slow")]


def calibration(layer: int, kernels: int) -> dict[str, object]:
    return {"type": "calibration", "layer": layer, "split": "model", "kernels": kernels,
            "calibrated_kernels": kernels // 2, "small_kernels": kernels // 8,
            "participants": [{"participant": d, "seconds": 0.01, "small_seconds": 0.005,
                              "fixed_s": 0.002, "per_kernel_s": 0.0003, "kernels": kernels,
                              "kernel_start": 0, "kernel_stop": kernels, "share": 1 / 3}
                             for d in NAMES]}


def run_directory(directory: Path, *extra: dict[str, Any]) -> Path:
    step = {"type": "step", "epoch": 0, "loss": 2.0, "accuracy": 0.1, "images": 128,
            "conv_s": 0.05, "comm_s": 0.005, "data_s": 0.0, "layers": [], "dense_s": 0.002}
    return write(directory, [
        {"type": "run_start", "config": CONFIG}, calibration(0, 32), calibration(1, 64),
        plan_record(chosen=NAMES, predicted_step_s=0.04, links=LINKS),
        *({**step, "step": i, "step_s": 0.058} for i in range(20)), *extra,
        {"type": "run_end", "status": "completed", "error": None}])


def plan(run_dir: Path, tmp_path: Path) -> tuple[list[str], dict[str, Any]]:
    lines: list[str] = []
    data = tmp_path / "plan.json"
    args = argparse.Namespace(run_dir=str(run_dir), machines="1,3,8", rate="measured,10gbit",
                              batch=None, arch=None, like=None, json=str(data),
                              markdown=str(tmp_path / "plan.md"))
    assert run_plan(args, lines.append) == 0
    return lines, json.loads(data.read_text())


def test_the_plan_command_says_which_model_and_predicts_from_the_fit(tmp_path: Path) -> None:
    run_dir = run_directory(tmp_path / "run", model_record())
    lines, document = plan(run_dir, tmp_path)
    text = " ".join(lines)  # the note is wrapped
    assert "step model fitted in place: compute + rounds x round + serial, from 9 steps" in text
    assert "skew" in text and "calibration model" not in text
    assert ("  model estimate   57.4 ms per step = compute 44.4 + 6 rounds x 1.5 + serial 4.0 "
            "(the run's step model fitted in place: compute + rounds x round + serial, from 9 "
            "steps, at the slices by speed)" in lines), lines
    assert any(line.startswith("  measured median  58.0 ms per step") for line in lines)
    assert any(line.startswith("  in-place model   57.4 ms per step") for line in lines)
    assert document["estimate"].startswith("the run's step model fitted in place")
    assert document["measured_configuration"]["predicted_step_s"] == TERMS.predict(SLICES)
    # one machine, the master alone: its fitted compute for the batch and the serial part
    single = [row for row in document["rows"] if row["machines"] == 1]
    assert [row["predicted_step_s"] for row in single] == pytest.approx([0.001 * 128 + 0.004] * 2)
    assert all(row["speedup"] == pytest.approx(1.0) for row in single)
    assert "fitted in place" in (tmp_path / "plan.md").read_text()


@pytest.mark.parametrize("extra", [(), ({"type": "model", "split_by": "samples",
                                          "predicted_step_s": 0.05, "measured_step_s": 0.06,
                                          "compute_s": 0.04, "rounds": 6, "round_s": 0.001,
                                          "serial_s": 0.004, "checked_steps": 9},)],
                         ids=["no-record", "older-record"])
def test_the_plan_command_without_a_usable_fit_names_the_calibration_model(
        tmp_path: Path, extra: tuple[dict[str, Any], ...]) -> None:
    lines, document = plan(run_directory(tmp_path / "run", *extra), tmp_path)
    text = " ".join(lines)  # the note is wrapped
    assert "calibration model" in text and "no usable step model fitted in place" in text
    assert "(the calibration model)" in text
    assert document["estimate"] == CALIBRATION_MODEL


def test_a_run_too_short_for_a_fit_in_place_takes_set_ups_rehearsal(tmp_path: Path) -> None:
    """No ``model`` record (fewer than 19 steps): the ``rehearsal`` record's terms, the
    same model fitted at set-up; a later ``model`` record wins over it."""
    rehearsal = {**model_record(), "type": "rehearsal", "steps": 6}
    del rehearsal["split_by"], rehearsal["fitted_steps"]
    fitted = read_step_model(write(tmp_path / "short", [plan_record(), rehearsal]))
    assert fitted is not None and fitted.terms == TERMS and fitted.fitted_steps == 6
    assert fitted.source == "rehearsal" and "set-up on the plan's rehearsal" in fitted.describe()
    later = read_step_model(write(tmp_path / "long", [plan_record(), rehearsal,
                                                      model_record(fitted_steps=9)]))
    # one model over both windows: the rehearsal's 6 steps and the fit's 9
    assert later is not None and later.source == "model" and later.fitted_steps == 15
    assert later.windows == 2 and later.terms.steps_s == TERMS.steps_s * 2


def step_record(step: int, samples: dict[str, int]) -> dict[str, Any]:
    entries = [{"participant": n, "samples": c, "forward_s": 0.01, "backward_s": 0.02}
               for n, c in samples.items()]
    return {"type": "step", "step": step, "step_s": 0.06, "comm_s": 0.002,
            "layers": [{"layer": 0, "participants": entries}]}


def test_the_measured_configuration_is_predicted_at_the_runs_own_slices(
        tmp_path: Path) -> None:
    """The rebalancer follows speeds that swing a window late, so the run's steps were
    not at the slices by speed: the measured configuration is the median over the
    run's steps (the first and those of the master alone left out) of the model at each
    step's slices."""
    own = [{"master": 30, "fast": 60, "slow": 38}, {"master": 30, "fast": 60, "slow": 38},
           {"master": 40, "fast": 70, "slow": 18}]
    steps = [step_record(0, {"master": 1, "fast": 1, "slow": 126}),  # the first: left out
             *[step_record(i + 1, s) for i, s in enumerate(own)],
             step_record(4, {"master": 128})]  # the master alone: left out
    fitted = read_step_model(write(tmp_path, [plan_record(), *steps, model_record()]))
    assert fitted is not None and [dict(s) for s in fitted.run_slices] == own
    run = measured((MASTER, FAST, SLOW))
    (prediction,) = predict_sample_scenarios(run, PER_SAMPLE, [whatif.measured_scenario(run)],
                                             fitted)
    expected = sorted(TERMS.predict(s) for s in own)[1]
    assert prediction.step_s == pytest.approx(expected)
    # slow's 38 samples at 1.8-2 ms: 76 ms of compute, not the 44.4 at the slices by speed
    assert prediction.step_s == pytest.approx(0.076 + 6 * 0.0015 + 0.004)
