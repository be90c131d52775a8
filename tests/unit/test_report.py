"""The report (``hetconv report``): hand-written metrics files with known answers."""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest

from hetconv.analysis.report.analysis import summarize
from hetconv.analysis.report.json_out import render_json
from hetconv.analysis.report.records import parse_run
from hetconv.analysis.report.render_text import WIDTH, render_comparison, render_run
from hetconv.commands.report import run_report
from hetconv.errors import UserError
from hetconv.master.samples.fall_back import STAY_ALONE_REASON

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def timing(name: str, kernels: int, forward_s: float, backward_s: float, wait_s: float = 0.0,
           sent: int = 0, received: int = 0) -> dict[str, Any]:
    return {"participant": name, "kernels": kernels, "forward_s": forward_s,
            "backward_s": backward_s, "wait_s": wait_s, "forward_latency_s": forward_s + wait_s,
            "backward_latency_s": backward_s, "bytes_sent": sent, "bytes_received": received}


def step(number: int, step_s: float, conv_s: float, comm_s: float, dense_s: float,
         layers: list[list[dict[str, Any]]], epoch: int = 0) -> dict[str, Any]:
    return {"type": "step", "time": 1000.0 + number, "epoch": epoch, "step": number,
            "loss": 2.0 / (number + 1), "accuracy": min(1.0, 0.1 * (number + 1)), "images": 64,
            "learning_rate": 0.05, "step_s": step_s, "conv_s": conv_s, "dense_s": dense_s,
            "comm_s": comm_s, "data_s": 0.001,
            "layers": [{"layer": i, "participants": devices} for i, devices in enumerate(layers)]}


def run_start(mode: str = "distributed", arch: tuple[int, ...] = (4, 8)) -> dict[str, Any]:
    return {"type": "run_start", "time": 999.0, "pid": 1,
            "config": {"mode": mode, "arch": list(arch), "batch": 64, "epochs": 1},
            "layers": [{"index": i, "kernels": k, "in_channels": 1, "height": 28, "width": 28,
                        "kernel_size": 5} for i, k in enumerate(arch)]}


def devices_record(*ids_kinds: tuple[str, str]) -> dict[str, Any]:
    return {"type": "devices", "time": 999.1,
            "devices": [{"id": i, "kind": k, "name": f"{k.upper()} model", "device": k,
                         "hostname": "h", "pid": 1, "cores": 4, "threads": None,
                         "memory_bytes": 1} for i, k in ids_kinds]}


def calibration(layer: int, kernels: int, calibrated: int,
                timings: list[tuple[str, float, int]]) -> dict[str, Any]:
    start, entries = 0, []
    for name, seconds, count in timings:
        entries.append({"participant": name, "seconds": seconds, "kernels": count,
                        "kernel_start": start, "kernel_stop": start + count,
                        "share": count / kernels})
        start += count
    return {"type": "calibration", "time": 999.2, "layer": layer, "split": "calibrated",
            "kernels": kernels, "calibrated_kernels": calibrated, "participants": entries}


def epoch_record(epoch: int = 0, test_accuracy: float = 0.75) -> dict[str, Any]:
    return {"type": "epoch", "time": 2000.0, "epoch": epoch, "train_loss": 0.9,
            "train_accuracy": 0.6, "test_loss": 0.8, "test_accuracy": test_accuracy,
            "train_s": 1.0, "epoch_s": 1.2, "images_per_s": 256.0}


def write_run(directory: Path, records: list[dict[str, Any]], tail: str = "") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (directory / "metrics.jsonl").write_text(text, encoding="utf-8")
    return directory


def two_device_layers(w1_layer1_forward_s: float) -> list[list[dict[str, Any]]]:
    """Layer 0 (4 kernels): master 1, w1 3; layer 1 (8 kernels): master 2, w1 6."""
    return [[timing("master", 1, 0.005, 0.010),
             timing("w1", 3, 0.005, 0.005, wait_s=0.002, sent=1000, received=500)],
            [timing("master", 2, 0.010, 0.020),
             timing("w1", 6, w1_layer1_forward_s, 0.015, wait_s=0.003, sent=2000, received=700)]]


def two_device_records(with_end: bool = True) -> list[dict[str, Any]]:
    records = [run_start(), devices_record(("master", "cpu"), ("w1", "gpu")),
               calibration(0, 4, 2, [("master", 0.02, 1), ("w1", 0.01, 3)]),
               calibration(1, 8, 4, [("master", 0.04, 2), ("w1", 0.02, 6)]),
               # step 0: warm-up, absurd numbers that must not count
               step(0, 1.0, 0.9, 0.5, 0.1, two_device_layers(0.5)),
               step(1, 0.100, 0.080, 0.010, 0.020, two_device_layers(0.015)),
               step(2, 0.110, 0.085, 0.010, 0.025, two_device_layers(0.015)),
               step(3, 0.150, 0.120, 0.020, 0.030, two_device_layers(0.030))]
    if with_end:
        records += [epoch_record(), {"type": "run_end", "time": 2001.0, "status": "completed",
                                     "error": None}]
    return records


def test_two_devices_exact_figures(tmp_path: Path) -> None:
    summary = summarize(parse_run(write_run(tmp_path / "run", two_device_records())))
    assert (summary.steps_total, summary.steps_used, summary.status) == (4, 3, "completed")
    split = summary.split
    assert split is not None
    assert split.step_s == pytest.approx(0.110)
    assert split.comm_s == pytest.approx(0.010)
    assert split.conv_s == pytest.approx(0.075)  # median of 0.070, 0.075, 0.100
    assert split.dense_s == pytest.approx(0.025)
    assert split.other_s == pytest.approx(0.0)
    # conv_s minus the latest device's latency summed over layer-phases (0.055 or 0.070)
    assert split.after_results_s == pytest.approx(0.030)
    assert split.comm_fraction == pytest.approx(0.010 / 0.110)
    assert split.conv_fraction == pytest.approx(0.075 / 0.110)
    assert split.dense_fraction == pytest.approx(0.025 / 0.110)

    # balance: per step sum over layer-phases of K / sum(k / t); slowest sum of max t
    ideal_steps_1_2 = 4 / (1 / 0.005 + 3 / 0.005) + 4 / (1 / 0.010 + 3 / 0.005) \
        + 8 / (2 / 0.010 + 6 / 0.015) + 8 / (2 / 0.020 + 6 / 0.015)
    assert summary.conv_ideal_s == pytest.approx(ideal_steps_1_2)
    assert summary.conv_slowest_s == pytest.approx(0.005 + 0.010 + 0.015 + 0.020)
    assert summary.balance_efficiency == pytest.approx(ideal_steps_1_2 / 0.050)
    layer0, layer1 = summary.layers
    assert layer0.efficiency == pytest.approx((4 / 800 + 4 / 700) / 0.015)
    # imbalance: layer 0 is 0.015 vs 0.010 every step -> 1.2; layer 1 median is 1.0
    assert layer0.imbalance == pytest.approx(1.2)
    assert layer1.imbalance == pytest.approx(1.0)
    assert summary.imbalance == pytest.approx(1.2) and summary.imbalance_layer == 0

    master, w1 = summary.devices
    assert (master.id, master.kind, w1.id, w1.kind) == ("master", "cpu", "w1", "gpu")
    assert master.compute_s == pytest.approx(0.045)
    assert w1.compute_s == pytest.approx(0.040)  # median of 0.040, 0.040, 0.055
    assert w1.wait_s == pytest.approx(0.005)
    assert (w1.bytes_sent, w1.bytes_received) == (3000, 1200)
    assert [row.kernels for row in w1.layers] == [3, 6]
    assert w1.layers[0].kernel_share == pytest.approx(0.75)
    assert master.layers[0].calibrated_speed == pytest.approx(0.5)
    assert w1.layers[0].calibrated_speed == pytest.approx(1.0)
    assert master.layers[0].throughput_share == pytest.approx((1 / 0.015) / (1 / 0.015 + 300))
    # measured kernels/s over calibrated kernels/s: (1 / 0.015) / (2 / 0.02)
    assert master.layers[0].speed_vs_calibration == pytest.approx((1 / 0.015) / 100)
    assert w1.layers[1].speed_vs_calibration == pytest.approx((6 / 0.030) / (4 / 0.02))

    # alone: w1 needs 4 * 0.010 / 3 + 8 * 0.030 / 6; the master 0.060 + 0.120
    w1_alone = 4 * 0.010 / 3 + 8 * 0.030 / 6
    assert w1.single_device_conv_s == pytest.approx(w1_alone)
    assert master.single_device_conv_s == pytest.approx(0.180)
    assert summary.fastest_device == "w1"
    assert summary.speedup == pytest.approx((w1_alone + 0.025) / 0.110)
    assert summary.amdahl_bound == pytest.approx((w1_alone + 0.025) / 0.025)

    what_if = summary.what_if
    assert what_if is not None and what_if.extra_device == "w1"
    old = 4 / 800 + 4 / 700 + 8 / 600 + 8 / 500  # medians: w1 forward 0.015 in layer 1
    new = 4 / 1400 + 4 / 1300 + 8 / 1000 + 8 / 900
    expected = 0.110 - 0.075 - 0.010 + 0.075 * new / old + 0.010 * 2
    assert what_if.extra_device_step_s == pytest.approx(expected)
    assert what_if.fast_network_step_s == pytest.approx(0.105)
    assert what_if.fast_network_speedup == pytest.approx(0.110 / 0.105)
    assert summary.final_test_accuracy == pytest.approx(0.75)


def test_text_report_fits_and_shows_figures(tmp_path: Path) -> None:
    first = summarize(parse_run(write_run(tmp_path / "a", two_device_records())))
    second = summarize(parse_run(write_run(tmp_path / "b", two_device_records(False))))
    text = render_run(first) + "\n" + render_comparison([first, second])
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    assert "110.0 ms" in text and "9.1%" in text and "1.20x" in text
    comparison = render_comparison([first, second])
    assert "completed" in comparison and "in progress" in comparison


def test_in_progress_run_without_steps_or_epochs(tmp_path: Path) -> None:
    records = two_device_records(with_end=False)[:4]  # started, calibrated, no step yet
    summary = summarize(parse_run(write_run(tmp_path / "run", records)))
    assert summary.status == "in progress" and summary.steps_total == 0
    assert summary.split is None and summary.speedup is None and summary.what_if is None
    assert [row.kernels for row in summary.devices[1].layers] == [3, 6]  # from calibration
    assert any("no step records" in w for w in summary.warnings)
    assert "in progress" in render_run(summary)
    run_report([str(tmp_path / "run")], json_output=False, out=lambda _: None)
    assert (tmp_path / "run" / "report.html").exists()


def test_in_progress_run_with_steps(tmp_path: Path) -> None:
    summary = summarize(parse_run(write_run(tmp_path / "run", two_device_records(False))))
    assert summary.status == "in progress" and summary.steps_used == 3
    assert summary.epochs == () and summary.final_test_accuracy is None
    assert summary.split is not None and summary.split.step_s == pytest.approx(0.110)
    assert any("no run_end" in w for w in summary.warnings)


def test_truncated_last_line_is_skipped_with_a_visible_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    records = two_device_records(with_end=False)
    run_dir = write_run(tmp_path / "run", records, tail='{"type": "step", "time": 10')
    summary = summarize(parse_run(run_dir))
    assert summary.steps_total == 4
    assert any("cut off" in w for w in summary.warnings)
    assert any("cut off" in r.getMessage() for r in caplog.records)
    assert any(line.startswith("warning:") and "cut off" in line
               for line in render_run(summary).splitlines())


def test_device_with_zero_kernels_in_a_layer(tmp_path: Path) -> None:
    layers = [[timing("master", 1, 0.005, 0.010), timing("w1", 3, 0.005, 0.005)],
              [timing("w1", 8, 0.020, 0.020)]]  # the master got none of layer 1
    records = [run_start(), devices_record(("master", "cpu"), ("w1", "gpu")),
               calibration(0, 4, 2, [("master", 0.02, 1), ("w1", 0.01, 3)]),
               calibration(1, 8, 4, [("master", 0.2, 0), ("w1", 0.02, 8)]),
               *[step(n, 0.1, 0.08, 0.01, 0.02, layers) for n in range(3)]]
    summary = summarize(parse_run(write_run(tmp_path / "run", records)))
    master, w1 = summary.devices
    assert master.layers[1].kernels == 0 and master.layers[1].compute_s is None
    assert master.layers[1].throughput_share is None
    assert master.layers[1].calibrated_speed == pytest.approx(0.1)
    assert master.single_device_conv_s is None  # not in every layer
    assert summary.fastest_device == "w1"
    assert w1.layers[1].throughput_share == pytest.approx(1.0)
    assert summary.layers[1].efficiency == pytest.approx(1.0)
    assert summary.layers[1].imbalance == pytest.approx(1.0)
    assert "layer" in render_run(summary)
    run_report([str(tmp_path / "run")], json_output=False, out=lambda _: None)
    assert (tmp_path / "run" / "report.html").exists()


def test_local_run(tmp_path: Path) -> None:
    layers = [[timing("master", 4, 0.004, 0.006)], [timing("master", 8, 0.010, 0.010)]]
    records = [run_start("local"), devices_record(("master", "cpu")),
               *[step(n, 0.035, 0.030, 0.0, 0.005, layers) for n in range(3)], epoch_record(),
               {"type": "run_end", "time": 2001.0, "status": "completed", "error": None}]
    summary = summarize(parse_run(write_run(tmp_path / "run", records)))
    assert summary.mode == "local" and len(summary.devices) == 1
    assert summary.balance_efficiency == pytest.approx(1.0)
    assert summary.imbalance == pytest.approx(1.0)
    assert summary.devices[0].layers[0].calibration_s is None
    assert summary.fastest_device == "master"
    assert summary.speedup == pytest.approx((0.030 + 0.005) / 0.035)
    assert summary.amdahl_bound == pytest.approx(0.035 / 0.005)
    assert summary.what_if is not None and summary.what_if.notes
    assert summary.what_if.extra_device_step_s == pytest.approx(0.035 - 0.015)


def test_json_output_has_the_same_figures(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", two_device_records())
    lines: list[str] = []
    run_report([str(run_dir)], json_output=True, html=False, out=lines.append)
    data = json.loads("\n".join(lines))
    summary = summarize(parse_run(run_dir))
    assert data["split"]["step_s"] == pytest.approx(summary.split.step_s if summary.split else 0)
    assert data["balance_efficiency"] == pytest.approx(summary.balance_efficiency)
    assert [d["id"] for d in data["devices"]] == ["master", "w1"]
    both = json.loads(render_json([summary, summary]))
    assert isinstance(both, list) and len(both) == 2


@pytest.mark.parametrize("setup, message", [
    ("missing", "no such run directory"),
    ("no-metrics", "no metrics.jsonl"),
    ("empty", "no metrics records yet"),
])
def test_clear_errors(tmp_path: Path, setup: str, message: str) -> None:
    run_dir = tmp_path / "run"
    if setup != "missing":
        run_dir.mkdir()
    if setup == "empty":
        (run_dir / "metrics.jsonl").write_text("\n")
    with pytest.raises(UserError, match=message) as caught:
        run_report([str(run_dir)], json_output=False, out=lambda _: None)
    assert "\n" not in str(caught.value)


def test_html_report_is_self_contained(tmp_path: Path) -> None:
    records = two_device_records()
    records[1]["devices"][1]["name"] = "<script>alert(1)</script> & GPU"
    first = write_run(tmp_path / "a", records)
    second = write_run(tmp_path / "b", two_device_records(with_end=False))
    printed: list[str] = []
    run_report([str(first), str(second)], json_output=False, out=printed.append)
    assert any("Comparison" in text for text in printed)
    for path in (first / "report.html", second / "report.html", tmp_path / "comparison.html"):
        page = path.read_text(encoding="utf-8")
        assert "<script" not in page
        if path.parent != second:
            assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; GPU" in page
        assert "http://" not in page and "https://" not in page
        assert not re.search(r"""(src|href)\s*=\s*["'](?!data:)""", page)
        images = re.findall(r'<img src="data:image/png;base64,([^"]+)"', page)
        assert len(images) >= 4
        for encoded in images:
            assert base64.b64decode(encoded, validate=True).startswith(PNG_MAGIC)


def sample_timing(name: str, samples: int, forward_s: float,
                  backward_s: float) -> dict[str, Any]:
    return {**timing(name, 4, forward_s, backward_s), "split_by": "samples",
            "samples": samples}


def sample_split_records() -> list[dict[str, Any]]:
    """Two workers under the sample split (70 and 58 samples of 128), whose last step
    is an epoch's short batch (53 and 43 of 96); the plan's calibration per sample."""
    def layers(a: int, b: int) -> list[list[dict[str, Any]]]:
        return [[sample_timing("a", a, 0.010, 0.015), sample_timing("b", b, 0.009, 0.013)],
                [sample_timing("a", a, 0.020, 0.028), sample_timing("b", b, 0.018, 0.025)]]

    return [run_start(arch=(32, 64)), devices_record(("a", "cpu"), ("b", "cpu")),
            calibration(0, 32, 16, [("a", 0.028, 16), ("b", 0.032, 16)]),
            calibration(1, 64, 32, [("a", 0.060, 32), ("b", 0.067, 32)]),
            {"type": "plan", "time": 999.5, "split_by": "samples", "chosen": ["a", "b"],
             "predicted_step_s": 0.08, "dense_part": "replicas",
             "samples": [{"participant": "a", "samples": 70},
                         {"participant": "b", "samples": 58}],
             "seconds_per_sample": {"a": 0.0010, "b": 0.00125}},
            *[step(n, 0.085, 0.075, 0.007, 0.001, layers(70, 58)) for n in range(5)],
            step(5, 0.070, 0.060, 0.007, 0.001, layers(53, 43)),
            epoch_record(), {"type": "run_end", "time": 2001.0, "status": "completed",
                             "error": None}]


def test_sample_split_layers_show_the_usual_batch_and_the_chain_calibration(
        tmp_path: Path) -> None:
    """Under the sample split the per-layer table counts the samples of the run's usual
    step (not an epoch's short last batch), and compares the participants' speeds with
    the sample calibration (whole chain, relative) rather than the kernel calibration's
    kernels/s (another unit)."""
    summary = summarize(parse_run(write_run(tmp_path / "run", sample_split_records())))
    rows = {(d.id, row.layer): row for d in summary.devices for row in d.layers}
    assert rows[("a", 0)].kernels == 70 and rows[("b", 1)].kernels == 58
    assert rows[("a", 0)].kernel_share == pytest.approx(70 / 128)
    assert [layer.kernels for layer in summary.layers] == [128, 128]
    assert rows[("a", 0)].calibrated_speed == pytest.approx(1.0)
    assert rows[("b", 0)].calibrated_speed == pytest.approx(0.8)
    assert all(row.calibration_s is None and row.speed_vs_calibration is None
               for row in rows.values())
    text = render_run(summary)
    table = text[text.index("Samples per layer and participant"):].split("\n\n")[0]
    assert "calib. speed" in table and "(whole chain)" in table
    assert "measured" not in table and "calib.\n" not in table
    assert re.search(r"^1\s+b\s+58\s+45\.3%\s+0\.80\s", table, re.M), table


def test_overview_labels_wrap_instead_of_being_clipped(tmp_path: Path) -> None:
    summary = summarize(parse_run(write_run(tmp_path / "run", sample_split_records())))
    text = render_run(summary)
    overview = text[text.index("Overview"):].split("\n\n")[0]
    assert "~" not in overview, overview
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    column = len(overview.splitlines()[2].split("  ")[0])  # the rule under the header
    words = " ".join(line[:column].strip() for line in overview.splitlines())
    assert "speedup over fastest participant alone (est., per sample)" in words, overview
    # a wrapped label goes on indented below its first line
    lines = overview.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("speedup over"))
    assert lines[first + 1].startswith("  ") and not lines[first + 1].startswith("   ")


def test_under_the_sample_split_the_fastest_alone_scales_each_step_by_its_samples(
        tmp_path: Path) -> None:
    """The participant alone under the sample split: its measured seconds scaled by the
    batch over its samples, step by step (an epoch's short last batch scaled by its own
    samples), never by the kernel calibration's per-kernel fit (another unit: it made the
    slower worker 'the fastest' in a demo, and the speed-up 1.98x for a measured 1.58x)."""
    summary = summarize(parse_run(write_run(tmp_path / "run", sample_split_records())))
    alone = {d.id: d.single_device_conv_s for d in summary.devices}
    assert alone["a"] == pytest.approx((0.025 + 0.048) * 128 / 70)
    assert alone["b"] == pytest.approx((0.022 + 0.043) * 128 / 58)
    assert summary.fastest_device == "a"
    assert summary.split is not None
    assert summary.single_device_step_s == pytest.approx(alone["a"] + summary.split.dense_s)
    assert "(est., per sample)" in " ".join(render_run(summary).split())


def test_the_html_report_of_a_sample_split_speaks_of_samples(tmp_path: Path) -> None:
    """The share chart of a sample-split run compares sample shares (the layer's batch,
    not its kernels: a demo's page said 'Kernel split' and 'layer 1 (128 kernels)')."""
    sample_run = write_run(tmp_path / "samples", sample_split_records())
    kernel_run = write_run(tmp_path / "kernels", two_device_records())
    run_report([str(sample_run)], json_output=False, out=lambda _: None)
    run_report([str(kernel_run)], json_output=False, out=lambda _: None)
    page = (sample_run / "report.html").read_text(encoding="utf-8")
    assert "Sample split against measured throughput" in page
    assert "Kernel split" not in page and "kernel share" not in page
    assert "Kernel split against measured throughput" in (
        kernel_run / "report.html").read_text(encoding="utf-8")


def test_a_cpu_participant_names_numpys_blas_kernels(tmp_path: Path) -> None:
    """The same CPU model can run twice as fast with other BLAS kernels: the report's
    participants table says which each CPU ran (a devices record from before the field
    existed shows the model alone)."""
    from hetconv.device_info import describe_device

    records = sample_split_records()
    records[1]["devices"][0]["blas"] = "openblas SkylakeX"
    summary = summarize(parse_run(write_run(tmp_path / "run", records)))
    table = render_run(summary)
    table = table[table.index("Participants (medians"):].split("\n\n")[0]
    assert re.search(r"^a\s+cpu\s+CPU model \(openblas\s", table, re.M), table
    assert "SkylakeX)" in table and "~" not in table, table
    assert re.search(r"^b\s+cpu\s+CPU model\s+\d", table, re.M), table
    described = describe_device("cpu")
    assert described["kind"] == "cpu" and isinstance(described["blas"], str)
    assert described["blas"] == "" or len(described["blas"].split()) == 2, described


@pytest.mark.parametrize("links,expected", [
    (None, "float32"),  # a run from before the choice link by link: the plan's wire_dtype
    ({"a": "float32", "b": "float32"}, "float32 on every link"),
    ({"a": "float32", "b": "float16"}, "float16 on the link of b, float32 on the others"),
    ({"a": "float16", "b": "float16"}, "float16 on every link"),
], ids=["before", "float32", "b-slow", "float16"])
def test_the_overview_names_the_wire_dtype_of_every_link(
        tmp_path: Path, links: dict[str, str] | None, expected: str) -> None:
    """Which links carried float16 (the sample split chooses it link by link): one row
    of the overview, from the plan record."""
    records = sample_split_records()
    plan = next(r for r in records if r["type"] == "plan")
    plan["wire_dtype"] = "float32"
    if links is not None:
        plan["link_wire_dtypes"] = links
    text = render_run(summarize(parse_run(write_run(tmp_path / "run", records))))
    assert re.search(rf"^wire dtype\s+{re.escape(expected)}", text, re.M), text[:3000]


def test_a_local_run_has_no_wire_row(tmp_path: Path) -> None:
    records = [r for r in sample_split_records() if r["type"] != "plan"]
    text = render_run(summarize(parse_run(write_run(tmp_path / "run", records))))
    assert "wire dtype" not in text


def test_the_overview_names_the_participants_the_plan_left_out(tmp_path: Path) -> None:
    """A worker the plan did not use (the sample split leaves out one whose link would
    lengthen the step) is named in the overview, not only shown empty in the tables."""
    records = sample_split_records()
    plan = next(r for r in records if r["type"] == "plan")
    plan["chosen"], plan["not_used"] = ["a"], ["b"]
    text = render_run(summarize(parse_run(write_run(tmp_path / "run", records))))
    assert re.search(r"^not used\s+b\s+left out by the plan", text, re.M), text[:3000]
    plan["chosen"] = ["a", "b"]
    text = render_run(summarize(parse_run(write_run(tmp_path / "every", records))))
    assert "not used" not in text


def test_the_overview_says_how_the_plan_split_the_layers_and_why(tmp_path: Path) -> None:
    """The plan record's split and its reason (``split_by_why``, the console's) make one
    overview row; a record without them (older runs, --split equal) makes none."""
    records = sample_split_records()
    plan = next(r for r in records if r["type"] == "plan")
    why = ("predicted 118.0 ms per step split by samples, 243.0 ms by kernels; the byte "
           "rule alone would take kernels: layer 2 moves fewer bytes split by kernels")
    plan["split_by_why"] = why
    text = render_run(summarize(parse_run(write_run(tmp_path / "run", records))))
    assert re.search(r"^split by \(the plan's\)\s+samples\s+predicted 118\.0 ms per step",
                     text, re.M), text[:3000]
    plan["split_by_why"] = 3  # hostile or garbled: no row, no crash
    text = render_run(summarize(parse_run(write_run(tmp_path / "garbled", records))))
    assert "split by (the plan's)" not in text
    del plan["split_by_why"]
    text = render_run(summarize(parse_run(write_run(tmp_path / "older", records))))
    assert "split by (the plan's)" not in text


def test_the_overview_says_when_the_alone_check_left_the_master_alone(tmp_path: Path) -> None:
    """A run whose master-alone check kept the master alone (master/samples/fall_back.py) says so
    in the overview, from which step and why; a trial that went back to the workers
    says nothing there (its re-plans are in the events table)."""
    records = sample_split_records()
    at = next(i for i, r in enumerate(records) if r["type"] == "step" and r["step"] == 3)
    trial = {"type": "replan", "time": 1500.0, "reason": "trying the master alone: ...",
             "counts": []}
    stay = {"type": "replan", "time": 1501.0, "counts": [],
            "reason": STAY_ALONE_REASON + ": the conv part took 100.9 ms per step with "
            "the workers, 98.1 ms alone (medians of 9 steps)"}
    records[at:at] = [trial, stay]
    text = render_run(summarize(parse_run(write_run(tmp_path / "run", records))))
    assert re.search(r"^trained alone\s+from step 3\s+slower than the master alone", text,
                     re.M), text[:3000]
    stay["reason"] = "the master alone was slower: 120.0 ms per step alone, 90.0 ms with ..."
    text = render_run(summarize(parse_run(write_run(tmp_path / "back", records))))
    assert "trained alone" not in text

