"""The report with faults, re-plans and resumes: hand-written metrics files whose
membership events, replayed steps and snapshot costs are known."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hetconv.analysis.report.analysis import summarize
from hetconv.analysis.report.events import (
    JOIN,
    LOSS,
    RECOVERY,
    REPLAN,
    RESPLIT,
    RESUME,
    membership_events,
    split_text,
)
from hetconv.analysis.report.json_out import render_json
from hetconv.analysis.report.plots import event_marks
from hetconv.analysis.report.records import parse_run
from hetconv.analysis.report.render_text import WIDTH, render_run
from hetconv.commands.report import run_report
from tests.unit.test_report import (
    calibration,
    devices_record,
    epoch_record,
    run_start,
    step,
    timing,
    write_run,
)


def layers(*holders: str) -> list[list[dict[str, Any]]]:
    """Layer 0 (4 kernels) and layer 1 (8 kernels) split equally over ``holders``."""
    return [[timing(name, 4 // len(holders), 0.004, 0.006) for name in holders],
            [timing(name, 8 // len(holders), 0.008, 0.012) for name in holders]]


def timed(record: dict[str, Any], time: float) -> dict[str, Any]:
    return {**record, "time": time}


def checkpoint(number: int, time: float, seconds: float = 0.010) -> dict[str, Any]:
    return {"type": "checkpoint", "time": time, "step": number, "epoch": 0,
            "position": number, "state_bytes": 4000, "file_bytes": 5000, "seconds": seconds}


def counts(split: dict[str, tuple[int, int]]) -> list[dict[str, Any]]:
    return [{"layer": layer, "participants": [{"participant": name, "kernels": kernels[layer]}
                                         for name, kernels in split.items()]}
            for layer in (0, 1)]


def faulty_run() -> list[dict[str, Any]]:
    """Steps 0..9 with: w2 lost in step 7 (snapshot of step 5 restored, steps 5 and 6
    replayed), a re-split after step 7, the master killed after step 9 and resumed from
    the snapshot of step 8, and w3 joining at that resume's first re-plan point."""
    three = ("master", "w1", "w2")
    records = [run_start(), devices_record(("master", "cpu"), ("w1", "cpu"), ("w2", "cpu")),
               calibration(0, 4, 2, [("master", 0.02, 2), ("w1", 0.02, 1), ("w2", 0.02, 1)]),
               calibration(1, 8, 4, [("master", 0.04, 4), ("w1", 0.04, 2), ("w2", 0.04, 2)]),
               checkpoint(0, 1000.0)]
    records += [step(n, 0.100, 0.080, 0.010, 0.020, layers(*three)) for n in range(5)]
    records += [checkpoint(5, 1005.5)]
    records += [step(n, 0.100, 0.080, 0.010, 0.020, layers(*three)) for n in (5, 6)]
    # the master writes a recovery's re-plan first (the stage re-plans inside recover())
    records += [{"type": "replan", "time": 1008.0,
                 "reason": "recovery from: w2 is gone (peer_lost)",
                 "counts": counts({"master": (2, 4), "w1": (2, 4), "w2": (0, 0)})},
                {"type": "recovery", "time": 1008.1, "failed_step": 7, "resumed_step": 5,
                 "participant": "w2", "gone": True, "reason": "w2 is gone (peer_lost)",
                 "seconds": 0.25}]
    replayed = [timed(step(n, 0.120, 0.090, 0.010, 0.020, layers("master", "w1")),
                      1008.2 + n) for n in (5, 6, 7)]
    replayed[0]["loss"] = 0.123  # the replayed record of step 5 is the one that counts
    records += replayed
    records += [{"type": "rebalance", "time": 1016.0, "step": 7,
                 "reason": "w1 measured 0.8 of calibrated; step 120 -> 100 ms",
                 "old_predicted_step_s": 0.12, "new_predicted_step_s": 0.10,
                 "counts": [{"layer": layer, "participants": [
                     {"participant": "master", "kernels": k[0], "scale": 1.0},
                     {"participant": "w1", "kernels": k[1], "scale": 0.8},
                     {"participant": "w2", "kernels": 0, "scale": 1.0}]}
                     for layer, k in ((0, (3, 1)), (1, (5, 3)))],
                 "apply_s": 0.03},
                checkpoint(8, 1017.5, seconds=0.020),
                timed(step(8, 0.100, 0.080, 0.010, 0.020, layers("master", "w1")), 1017.6),
                timed(step(9, 0.100, 0.080, 0.010, 0.020, layers("master", "w1")), 1018.0),
                # the master is killed; --resume goes on from the snapshot of step 8
                {**run_start(), "time": 1100.0, "resumed_from": 8},
                {"type": "replan", "time": 1101.0, "reason": "join of w3",
                 "counts": counts({"master": (2, 4), "w1": (1, 2), "w2": (0, 0),
                                   "w3": (1, 2)})},
                checkpoint(8, 1101.5),
                timed(step(8, 0.090, 0.070, 0.010, 0.020,
                           layers("master", "w1", "w3", "w3")), 1102.0),
                timed(step(9, 0.090, 0.070, 0.010, 0.020,
                           layers("master", "w1", "w3", "w3")), 1102.1),
                checkpoint(10, 1102.5),
                timed(epoch_record(), 1103.0),
                {"type": "run_end", "time": 1104.0, "status": "completed", "error": None}]
    return records


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run", faulty_run())


def test_the_last_record_of_a_replayed_step_counts(run_dir: Path) -> None:
    records = parse_run(run_dir)
    assert [s.step for s in records.steps] == list(range(10))
    assert records.steps[5].loss == pytest.approx(0.123)  # the replay, not the first record
    assert records.steps[9].step_s == pytest.approx(0.090)  # after the resume
    assert records.replayed_steps == 2 + 2  # 5, 6 after the recovery; 8, 9 after the resume
    summary = summarize(records)
    assert summary.steps_total == 10
    assert summary.status == "completed"
    # per-step figures over the used steps 1..9 (one record each): 120 ms only 5, 6, 7
    assert summary.split is not None and summary.split.step_s == pytest.approx(0.100)


def test_membership_events_in_time_order(run_dir: Path) -> None:
    events = parse_run(run_dir).events
    assert [(e.kind, e.step, e.participant) for e in events] == [
        (LOSS, 7, "w2"), (RECOVERY, 7, "w2"), (REPLAN, 5, None), (RESPLIT, 8, None),
        (RESUME, 8, None), (JOIN, 8, "w3"), (REPLAN, 8, None)]
    recovery = events[1]
    assert (recovery.failed_step, recovery.resumed_step) == (7, 5)
    assert recovery.seconds == pytest.approx(0.25)
    assert "w2 left the split" in events[2].reason
    assert events[2].split == "layer 1: master 2, w1 2; layer 2: master 4, w1 4"
    assert events[3].reason.startswith("w1 measured") and events[3].seconds == pytest.approx(0.03)
    assert events[4].resumed_step == 8


def test_snapshot_cost_and_fault_cost(run_dir: Path) -> None:
    resilience = summarize(parse_run(run_dir)).resilience
    assert resilience is not None
    cost = resilience.snapshots
    assert cost is not None
    assert cost.count == 5
    assert cost.total_s == pytest.approx(0.060)
    assert cost.median_s == pytest.approx(0.010)
    assert (cost.state_bytes, cost.file_bytes, cost.steps) == (20000, 25000, 10)
    assert cost.per_step_s == pytest.approx(0.006)
    assert cost.per_step_state_bytes == pytest.approx(2000)
    assert cost.per_step_file_bytes == pytest.approx(2500)
    assert cost.step_fraction == pytest.approx(0.06)
    assert (resilience.recoveries, resilience.replayed_steps) == (1, 4)
    assert resilience.recovery_s == pytest.approx(0.25)


def test_text_report_lists_every_event(run_dir: Path) -> None:
    text = render_run(summarize(parse_run(run_dir)))
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    section = text.split("Membership and re-plans", 1)[1]
    kinds = [line.split()[2] for line in section.split("Resilience:")[0].splitlines()[4:]
             if line[:5].strip()]  # rows (not wrapped detail lines): at, step, event, ...
    assert kinds == ["loss", "recovery", "re-plan", "re-split", "resume", "join", "re-plan"]
    section = " ".join(section.split())  # the detail column wraps
    assert "step 7 failed; restored the snapshot of step 5, replaying 2 step(s)" in section
    assert "w2 is gone (peer_lost)" in section
    assert "w1 measured 0.8 of calibrated" in section  # a re-split shows its reason
    assert "snapshots taken" in section and "6.0 ms" in section  # per step trained
    assert "6.0% of the median step" in section
    assert "+100.0" not in section and "101.0" in section  # seconds since the first record


def test_html_report_has_the_section_and_marks_the_events(run_dir: Path) -> None:
    run_report([str(run_dir)], json_output=False, out=lambda _: None)
    html = (run_dir / "report.html").read_text(encoding="utf-8")
    assert "<h2>Membership and re-plans</h2>" in html
    assert "w2 is gone (peer_lost)" in html and "join" in html
    assert "membership events" in html and "data:image/png;base64," in html
    marks = event_marks(parse_run(run_dir))
    assert [(x, kind) for x, kind, _ in marks] == [
        (7.0, LOSS), (7.0, RECOVERY), (4.5, REPLAN), (7.5, RESPLIT), (7.5, RESUME),
        (7.5, JOIN), (7.5, REPLAN)]


def test_json_report_carries_the_events(run_dir: Path) -> None:
    data = json.loads(render_json([summarize(parse_run(run_dir))]))
    kinds = [event["kind"] for event in data["resilience"]["events"]]
    assert kinds == [LOSS, RECOVERY, REPLAN, RESPLIT, RESUME, JOIN, REPLAN]
    assert data["resilience"]["snapshots"]["count"] == 5


def test_a_run_without_faults_shows_the_snapshot_cost_and_no_events(tmp_path: Path) -> None:
    records = [run_start(), devices_record(("master", "cpu")), checkpoint(0, 999.5)]
    records += [step(n, 0.050, 0.030, 0.0, 0.020, [[timing("master", 4, 0.01, 0.01)],
                                                    [timing("master", 8, 0.005, 0.005)]])
                for n in range(4)]
    summary = summarize(parse_run(write_run(tmp_path / "run", records)))
    assert summary.resilience is not None and summary.resilience.events == ()
    assert summary.resilience.replayed_steps == 0
    text = render_run(summary)
    assert "Membership and re-plans" in text and "(none yet)" in text


def test_a_malformed_recovery_record_is_a_warning_not_a_crash(tmp_path: Path) -> None:
    records = faulty_run()
    broken = next(r for r in records if r["type"] == "recovery")
    del broken["failed_step"]
    summary = summarize(parse_run(write_run(tmp_path / "run", records)))
    assert any("(recovery) is malformed" in w for w in summary.warnings)
    assert summary.resilience is not None
    assert RECOVERY not in [e.kind for e in summary.resilience.events]
    render_run(summary)


def test_a_recovery_re_plan_without_its_recovery_record_is_still_listed(
        tmp_path: Path) -> None:
    records = faulty_run()
    end = next(i for i, r in enumerate(records) if r["type"] == "replan") + 3
    records = [r for r in records[:end] if r["type"] != "recovery"]
    events = parse_run(write_run(tmp_path / "run", records)).events
    assert [(e.kind, e.step) for e in events] == [(REPLAN, 7)]  # the next step at that point


def test_a_resumed_run_in_progress_is_not_ended_by_the_killed_runs_run_end(
        tmp_path: Path) -> None:
    records = [run_start(), {"type": "run_end", "time": 1000.5, "status": "interrupted",
                             "error": None}, {**run_start(), "time": 1001.0, "resumed_from": 0}]
    summary = summarize(parse_run(write_run(tmp_path / "run", records)))
    assert summary.status == "in progress"


def test_a_sample_split_re_slice_names_the_samples_not_the_kernels() -> None:
    """A sample split's records list every layer whole (all its kernels) on every
    participant; what changed is the slices, and that is what the event says."""
    rebalance = {"type": "rebalance", "time": 1002.0, "split_by": "samples", "step": 3,
                 "reason": "measured compute per sample",
                 "counts": [{"layer": layer, "participants": [
                     {"participant": "worker-a", "kernels": kernels, "samples": 71},
                     {"participant": "worker-b", "kernels": kernels, "samples": 57},
                     {"participant": "worker-c", "kernels": kernels, "samples": 0}]}
                     for layer, kernels in ((0, 32), (1, 64))]}
    events, _ = membership_events([step(n, 0.1, 0.08, 0.01, 0.02, layers("w1"))
                                   for n in range(4)] + [rebalance])
    (event,) = events
    assert event.kind == RESPLIT and event.step == 4
    assert event.split == "samples of every batch: worker-a 71, worker-b 57"
    kernel_split = [{"layer": 0, "participants": [{"participant": "w1", "kernels": 3},
                                             {"participant": "w2", "kernels": 0}]}]
    assert split_text(kernel_split) == "layer 1: w1 3"
