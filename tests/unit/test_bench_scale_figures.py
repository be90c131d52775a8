"""Which steps `hetconv bench scale` takes its figures from (pure)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hetconv.bench.scale_figures import SETTLED_STEPS, run_figures, settled_split
from hetconv.master.samples.fall_back import STAY_ALONE_REASON


def records(steps: int, resplits: list[int]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"type": "step", "step": s} for s in range(steps)]
    out += [{"type": "rebalance", "step": s, "new_predicted_step_s": s / 1000}
            for s in resplits]
    return out


def test_no_resplit_means_no_settled_split() -> None:
    assert settled_split(records(40, [])) is None


def test_the_last_resplit_with_enough_steps_after_it_wins() -> None:
    last = 40 - SETTLED_STEPS - 2  # exactly SETTLED_STEPS steps after it (one skipped)
    assert settled_split(records(40, [7, last])) == {
        "type": "rebalance", "step": last, "new_predicted_step_s": last / 1000}
    # a re-split too close to the end is not the steady state: the one before it is
    assert settled_split(records(40, [7, last + 1]))["step"] == 7  # type: ignore[index]
    assert settled_split(records(12, [7])) is None


def _step(step: int, time: float, step_s: float) -> dict[str, Any]:
    return {"type": "step", "step": step, "time": time, "step_s": step_s, "conv_s": step_s,
            "dense_s": 0.002, "comm_s": 0.0, "layers": []}


def test_a_run_the_check_left_alone_is_figured_from_its_steps_alone(tmp_path: Path) -> None:
    """After the master-alone check's trial kept the master alone, the run's figures
    are its steps alone, and the plan in force is the master alone: its prediction is
    what the trial measured of it (plus the dense part), not the step model's
    prediction of the workers' plan it left."""
    lines = [{"type": "plan", "split_by": "samples", "predicted_step_s": 0.05},
             *[_step(s, 100.0 + s, 0.100) for s in range(20)],
             {"type": "model", "step": 18, "predicted_step_s": 0.070},
             {"type": "rebalance", "step": 17, "new_predicted_step_s": 0.07},
             {"type": "replan", "time": 120.5, "reason": "trying the master alone: ...",
              "measured_step_s": 0.100, "alone_step_s": 0.085},
             *[_step(s, 100.0 + s, 0.090) for s in range(20, 30)],
             {"type": "replan", "time": 130.5, "reason": STAY_ALONE_REASON + ": the ...",
              "measured_step_s": 0.100, "alone_step_s": 0.088},
             *[_step(s, 100.0 + s, 0.087) for s in range(31, 60)]]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    figures = run_figures(tmp_path, None)
    assert figures.step_s == pytest.approx(0.087)
    assert figures.predicted_step_s == pytest.approx(0.088 + 0.002)
    # a trial that went back leaves the figures to the workers' plan
    lines[-30]["reason"] = "the master alone was slower: ..."
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert run_figures(tmp_path, None).predicted_step_s == pytest.approx(0.070)


def _sliced_step(step: int, step_s: float, slices: dict[str, int]) -> dict[str, Any]:
    devices = [{"participant": name, "samples": count, "kernels": 32, "split_by": "samples",
                "forward_s": 0.01, "backward_s": 0.01, "wait_s": 0.0, "peer_wait_s": 0.0,
                "forward_latency_s": step_s, "backward_latency_s": 0.0, "bytes_sent": 0,
                "bytes_received": 0, "peer_bytes_sent": 0, "peer_bytes_received": 0}
               for name, count in slices.items()]
    return {**_step(step, 100.0 + step, step_s), "layers": [{"layer": 0, "participants": devices}]}


def test_the_prediction_is_the_step_models_at_the_slices_the_figures_were_measured_on(
        tmp_path: Path) -> None:
    """The step model checked its fit on 77/51 and the rebalancer re-sliced to 62/66
    after the check: the figures are the steps at 62/66, so the prediction beside them
    is the recorded terms' at 62/66 (each fitted step's slowest participant there), not
    the check's prediction for 77/51."""
    fitted = [{"master": 0.0010, "m1": 0.0012}, {"master": 0.0012, "m1": 0.0010},
              {"master": 0.0011, "m1": 0.0011}]
    model = {"type": "model", "step": 27, "predicted_step_s": 0.0935,
             "samples": {"master": 77, "m1": 51}, "round_s": 0.005, "serial_s": 0.001,
             "rounds": 1, "per_sample_s": {"master": 0.0011, "m1": 0.0011},
             "steps_per_sample_s": fitted}
    lines = [{"type": "plan", "split_by": "samples", "predicted_step_s": 0.05},
             *[_sliced_step(s, 0.090, {"master": 77, "m1": 51}) for s in range(30)],
             model,
             {"type": "rebalance", "step": 30, "new_predicted_step_s": 0.08},
             *[_sliced_step(s, 0.080, {"master": 62, "m1": 66}) for s in range(31, 60)]]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    figures = run_figures(tmp_path, None)
    assert figures.step_s == pytest.approx(0.080)
    # per fitted step, the slowest at 62/66: 79.2, 74.4, 72.6 ms; their median + 5 + 1
    assert figures.predicted_step_s == pytest.approx(0.0744 + 0.005 + 0.001)
    # measured on the checked slices: the check's own prediction
    lines = lines[:32] + [_sliced_step(s, 0.090, {"master": 77, "m1": 51}) for s in range(31, 60)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert run_figures(tmp_path, None).predicted_step_s == pytest.approx(0.0935)
    # a record without the fitted steps (an older version): the medians at 62/66
    del model["steps_per_sample_s"]
    lines = [*lines[:31], model, {"type": "rebalance", "step": 30, "new_predicted_step_s": 0.08},
             *[_sliced_step(s, 0.080, {"master": 62, "m1": 66}) for s in range(31, 60)]]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert run_figures(tmp_path, None).predicted_step_s == pytest.approx(
        0.0011 * 66 + 0.005 + 0.001)
