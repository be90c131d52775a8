"""Metrics files written before the renames (schema version 1: a participant id under
``device``, not ``participant``; versions 1 and 2: the lists of per-participant entries
under ``devices``, not ``participants``) still read the same: the report, the Prometheus totals,
``hetconv status``, the what-if links and the benches' readers see no difference."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from hetconv.analysis.report.analysis import summarize
from hetconv.analysis.report.events import JOIN, LOSS, RESPLIT
from hetconv.analysis.report.json_out import summary_to_dict
from hetconv.analysis.report.records import RunRecords, parse_run
from hetconv.analysis.report.render_text import render_run
from hetconv.analysis.whatif import read_plan_links
from hetconv.bench.chaos_plan import kernels_held
from hetconv.bench.scale_breakdown import step_breakdown
from hetconv.commands.status import from_run_dir
from hetconv.master.kernels.rebalance import measured_compute
from hetconv.metrics import participant_of, read_metrics
from hetconv.planning.perf_model import Link
from hetconv.prometheus import TrainingTotals
from tests.unit.test_report import write_run
from tests.unit.test_report_events import faulty_run

PLAN = {"type": "plan", "time": 999.3, "chosen": ["master", "w1", "w2"],
        "predicted_step_s": 0.06, "best_single": "master", "best_single_step_s": 0.09,
        "all_step_s": 0.06, "wire_dtype": "float32",
        "links": [{"participant": "w1", "down_bytes_per_s": 1e8, "up_bytes_per_s": 2e8,
                   "rtt_s": 1e-4},
                  {"participant": "w2", "down_bytes_per_s": 5e7, "up_bytes_per_s": 5e7,
                   "rtt_s": 2e-4}]}


def current_run() -> list[dict[str, Any]]:
    """A run with every record type that names participants, as written today."""
    records = faulty_run()
    records.insert(4, copy.deepcopy(PLAN))  # after run_start, devices, two calibrations
    return records


def entries(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-participant entries of one record (docs/metrics.md)."""
    kind = record["type"]
    if kind == "calibration":
        return list(record["participants"])
    if kind == "plan":
        return [*record.get("links", []), *record.get("samples", [])]
    if kind == "step":
        return [entry for layer in record["layers"] for entry in layer["participants"]]
    if kind in ("rebalance", "replan"):
        return [entry for layer in record.get("counts", []) for entry in layer["participants"]]
    return []


def legacy(records: list[dict[str, Any]], schema: int = 1) -> list[dict[str, Any]]:
    """The same records as schema version ``schema`` (1 or 2) wrote them: the lists of
    per-participant entries under ``devices``, and in version 1 ``device`` for the
    participant id in every entry (a recovery's own ``participant`` field stays)."""
    old = copy.deepcopy(records)
    for record in old:
        if schema == 1:
            for entry in entries(record):
                entry["device"] = entry.pop("participant")
        lists = ([record] if record["type"] == "calibration" else
                 record.get("layers", []) if record["type"] == "step" else
                 record.get("counts", []) if record["type"] in ("rebalance", "replan") else [])
        for holder in lists:
            holder["devices"] = holder.pop("participants")
    return old


def legacy_entries(record: dict[str, Any]) -> list[dict[str, Any]]:
    """:func:`entries` of a record as schema version 1 or 2 wrote it."""
    kind = record["type"]
    if kind == "calibration":
        return list(record["devices"])
    if kind == "step":
        return [entry for layer in record["layers"] for entry in layer["devices"]]
    if kind in ("rebalance", "replan"):
        return [entry for layer in record.get("counts", []) for entry in layer["devices"]]
    return entries(record)


@pytest.fixture(params=[1, 2], ids=["schema-1", "schema-2"])
def runs(tmp_path: Path, request: pytest.FixtureRequest) -> tuple[Path, Path]:
    new = write_run(tmp_path / "new", current_run())
    old = write_run(tmp_path / "old", legacy(current_run(), request.param))
    written = read_metrics(old / "metrics.jsonl")
    key = "device" if request.param == 1 else "participant"
    assert all(key in e for r in written for e in legacy_entries(r))
    assert not any("participants" in holder for r in written
                   for holder in [r, *r.get("layers", []), *r.get("counts", [])])
    assert sum(len(legacy_entries(r)) for r in written) > 50  # every kind of entry is there
    return new, old


def test_participant_of_prefers_the_new_key_and_reads_the_old() -> None:
    assert participant_of({"participant": "w1", "kernels": 3}) == "w1"
    assert participant_of({"device": "w1", "kernels": 3}) == "w1"
    assert participant_of({"participant": "w2", "device": "w1"}) == "w2"
    with pytest.raises(KeyError):
        participant_of({"kernels": 3})


def same_dir(records: RunRecords, like: RunRecords) -> RunRecords:
    return dataclasses.replace(records, run_dir=like.run_dir)


def test_an_old_metrics_file_reports_the_same(runs: tuple[Path, Path]) -> None:
    new_dir, old_dir = runs
    new, old = parse_run(new_dir), same_dir(parse_run(old_dir), parse_run(new_dir))
    assert old == new and not new.warnings
    assert {t.participant for s in new.steps for layer in s.layers for t in layer.devices} \
        == {"master", "w1", "w2", "w3"}
    assert [d.participant for d in new.calibration[0].devices] == ["master", "w1", "w2"]
    kinds = [e.kind for e in new.events]
    assert LOSS in kinds and JOIN in kinds and RESPLIT in kinds
    assert next(e for e in new.events if e.kind == RESPLIT).split == \
        "layer 1: master 3, w1 1; layer 2: master 5, w1 3"
    summary = summarize(new)
    assert summarize(old) == summary
    assert summary_to_dict(summarize(old)) == summary_to_dict(summary)
    assert render_run(summarize(old)) == render_run(summary)
    assert [d.id for d in summary.devices] == ["master", "w1", "w2", "w3"]


def test_old_files_fold_into_the_same_totals_and_status(runs: tuple[Path, Path]) -> None:
    new_dir, old_dir = runs
    totals = []
    for run_dir in runs:
        folded = TrainingTotals()
        for record in read_metrics(run_dir / "metrics.jsonl"):
            folded.observe(record)
        totals.append(folded)
    assert totals[0] == totals[1]
    assert totals[0].participants["w1"].calibrated_s == {0: 0.02, 1: 0.04}
    assert totals[0].participants["w3"].kernels == 6  # layers("master", "w1", "w3", "w3")
    assert from_run_dir(old_dir) == from_run_dir(new_dir)


def test_old_plan_links_and_bench_readers_read_the_same(runs: tuple[Path, Path]) -> None:
    new_dir, old_dir = runs
    links = read_plan_links(new_dir)
    assert links == {"w1": Link(1e8, 2e8, 1e-4), "w2": Link(5e7, 5e7, 2e-4)}
    assert read_plan_links(old_dir) == links
    new, old = (read_metrics(d / "metrics.jsonl") for d in runs)
    steps = [[r for r in records if r["type"] == "step"] for records in (new, old)]
    assert step_breakdown(steps[1]) == step_breakdown(steps[0])
    assert set(step_breakdown(steps[0])) == {"master", "w1", "w2", "w3"}
    assert kernels_held(old) == kernels_held(new) == {"master": 3, "w1": 3, "w3": 6}
    assert measured_compute(steps[1][-1]) == measured_compute(steps[0][-1])
