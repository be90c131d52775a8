"""Prometheus /metrics of a real run: a master with two workers on loopback, scraped over
HTTP while it trains, parsed with prometheus_client's text parser; every number equals
what metrics.jsonl says (docs/metrics.md, "Prometheus")."""
from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from hetconv.commands.status import fetch_metrics, from_metrics_text, render
from hetconv.lab import free_port
from hetconv.master.rehearsal_steps import REHEARSAL_WARMUP
from tests.conftest import SMALL_RUN, child_env, hetconv_command, run_hetconv

parser = pytest.importorskip("prometheus_client.parser",
                             reason="prometheus_client is missing: pip install 'hetconv[metrics]'")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            return str(reply.read().decode())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, through prometheus_client's parser."""
    found = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return found


def value(found: dict[Any, float], metric: str, /, **labels: str) -> float:
    return found[(metric, tuple(sorted(labels.items())))]


def expected_from_jsonl(records: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """What /metrics must say once ``steps`` step records were written, computed here
    from the file (not with hetconv.prometheus) ."""
    step_records = [r for r in records if r["type"] == "step"][:steps]
    per: dict[str, dict[str, float]] = {}
    for record in step_records:
        for layer in record["layers"]:
            for entry in layer["participants"]:
                totals = per.setdefault(entry["participant"], {})
                for key, amount in (("compute", entry["forward_s"] + entry["backward_s"]),
                                    ("wait", entry["wait_s"]),
                                    ("sent", entry["bytes_sent"]),
                                    ("received", entry["bytes_received"])):
                    totals[key] = totals.get(key, 0.0) + amount
    last = step_records[-1]
    kernels: dict[str, int] = {}
    for layer in last["layers"]:
        for entry in layer["participants"]:
            kernels[entry["participant"]] = kernels.get(entry["participant"], 0) + entry["kernels"]
    return {"images": sum(r["images"] for r in step_records),
            "step_seconds": sum(r["step_s"] for r in step_records),
            "last": last, "per": per, "kernels": kernels}


def rehearsed_backwards(records: list[dict[str, Any]], name: str) -> int:
    """The backward requests worker ``name`` served in set-up's rehearsal of the kernel
    plan (master/kernels/rehearsal.py): one per step (the warm-up's too) and per layer
    it holds kernels of in the first plan (the calibration records')."""
    rehearsals = [r for r in records if r["type"] == "rehearsal"]
    if not rehearsals:
        return 0
    layers = sum(1 for r in records if r["type"] == "calibration"
                 for entry in r["participants"]
                 if entry["participant"] == name and entry["kernels"] > 0)
    return int(REHEARSAL_WARMUP + rehearsals[0]["steps"]) * layers


def test_scraped_metrics_equal_metrics_jsonl(workers: Any, endpoint: str, tmp_path: Path) -> None:
    worker_ports = {"prom-a": free_port(), "prom-b": free_port()}
    started = []
    for name, port in worker_ports.items():
        started += workers(name, extra_args=("--metrics-port", str(port)))
    train_port = free_port()
    run_dir = tmp_path / "run"
    master = subprocess.Popen(
        hetconv_command("train", "--listen", endpoint, "--split-by", "kernels", "--min-workers", "2", "--wait", "60",
                        "--no-local", *SMALL_RUN, "--run-dir", str(run_dir),
                        "--metrics-port", str(train_port)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env())
    last_text, mid_run_scrapes, status_line = None, 0, None
    try:
        while master.poll() is None:
            text = scrape(train_port)
            if text and "hetconv_steps_total" in text:
                found = samples(text)
                if value(found, "hetconv_steps_total") > 0:
                    last_text = text
                    mid_run_scrapes += 1
                    if status_line is None:  # what hetconv status URL prints of it
                        status_line = render(from_metrics_text(
                            fetch_metrics(f"http://127.0.0.1:{train_port}")), time.time())
            time.sleep(0.05)
        output = master.communicate(timeout=30)[0]
    finally:
        if master.poll() is None:
            master.kill()
            master.communicate()
    assert master.returncode == 0, output
    assert mid_run_scrapes > 0 and last_text is not None, "never scraped the run mid-way"
    assert scrape(train_port) is None, "the /metrics server outlived the run"

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    found = samples(last_text)
    steps = int(value(found, "hetconv_steps_total"))
    expected = expected_from_jsonl(records, steps)
    last = expected["last"]
    assert value(found, "hetconv_step") == last["step"]
    assert value(found, "hetconv_loss") == last["loss"]
    assert value(found, "hetconv_accuracy") == last["accuracy"]
    assert value(found, "hetconv_last_step_seconds") == last["step_s"]
    assert value(found, "hetconv_last_comm_seconds") == last["comm_s"]
    assert value(found, "hetconv_images_total") == expected["images"]
    assert value(found, "hetconv_step_seconds_total") == pytest.approx(expected["step_seconds"],
                                                                        rel=1e-12)
    assert value(found, "hetconv_images_per_second") == pytest.approx(
        last["images"] / last["step_s"], rel=1e-12)
    all_step_records = sum(1 for r in records if r["type"] == "step")
    # the last scrape may come after run_end, before the endpoint closes
    assert value(found, "hetconv_run_running") == 1 or steps == all_step_records
    assert value(found, "hetconv_recoveries_total") == 0
    devices = next(r for r in records if r["type"] == "devices")["devices"]
    assert {d["id"] for d in devices} == set(worker_ports)
    for device in devices:
        assert value(found, "hetconv_participant_info", participant=device["id"],
                     device=device["device"], kind=device["kind"], name=device["name"],
                     hostname=device["hostname"]) == 1
    for calibration in (r for r in records if r["type"] == "calibration"):
        for entry in calibration["participants"]:
            assert value(found, "hetconv_participant_calibrated_seconds",
                         participant=entry["participant"],
                         layer=str(calibration["layer"])) == entry["seconds"]
    # the planner may leave a worker without kernels on a busy machine: then it is in no step
    assert expected["per"] and set(expected["per"]) <= set(worker_ports)
    for name, totals in expected["per"].items():
        assert value(found, "hetconv_participant_compute_seconds_total",
                     participant=name) == pytest.approx(totals["compute"], rel=1e-12)
        assert value(found, "hetconv_participant_wait_seconds_total",
                     participant=name) == pytest.approx(totals["wait"], rel=1e-12)
        assert value(found, "hetconv_participant_bytes_sent_total",
                     participant=name) == totals["sent"]
        assert value(found, "hetconv_participant_bytes_received_total",
                     participant=name) == totals["received"]
        assert value(found, "hetconv_participant_kernels",
                     participant=name) == expected["kernels"].get(name, 0)

    # the workers stay up after the run: their counters cover the whole run
    all_steps = [r for r in records if r["type"] == "step"]
    for name, port in worker_ports.items():
        text = scrape(port)
        assert text is not None, f"worker {name} serves no /metrics"
        worker = samples(text)
        backward = sum(1 for r in all_steps for layer in r["layers"]
                       for entry in layer["participants"] if entry["participant"] == name)
        backward += rehearsed_backwards(records, name)  # set-up's, before any step
        served = sum(worker.get(("hetconv_worker_requests_total", (("type", kind),)), 0.0)
                     for kind in ("backward_request", "peer_backward_request"))
        assert served == backward  # the star or the peer data plane, whichever is on
        backward_s = sum(entry["backward_s"] for r in all_steps for layer in r["layers"]
                         for entry in layer["participants"] if entry["participant"] == name)
        assert value(worker, "hetconv_worker_compute_seconds_total") >= backward_s
        sent = sum(entry["bytes_received"] for r in all_steps for layer in r["layers"]
                   for entry in layer["participants"] if entry["participant"] == name)
        assert value(worker, "hetconv_worker_bytes_sent_total") >= sent
        assert value(worker, "hetconv_worker_runs_joined_total") == 1
        assert value(worker, "hetconv_worker_evictions_seen_total") == 0
    assert status_line is not None
    check_status_table(status_line, set(worker_ports), running=None)  # None: mid-run or just after
    from_dir = run_hetconv("status", str(run_dir), timeout=30)
    assert from_dir.returncode == 0, from_dir.stderr
    check_status_table(from_dir.stdout, set(worker_ports), running=False)
    logs = "".join(worker.output() for worker in started)
    assert f"serving master {endpoint}" in logs and "CURVE off" in logs, logs


def check_status_table(text: str, names: set[str], running: bool | None) -> None:
    """``hetconv status``: a run line, a header, one row per worker with its kernels."""
    lines = text.splitlines()
    starts = {True: ("run: running; step ",), False: ("run: not running",),
              None: ("run: running; step ", "run: not running")}[running]
    assert lines[0].startswith(starts), text
    assert lines[1].split()[:4] == ["participant", "device", "calibrated", "s/layer"], text
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == names, text
    for row in rows.values():  # calibrated seconds of the two layers, then kernels held
        assert row[1] == "cpu" and int(row[4]) >= 0, text
    assert any(int(row[4]) > 0 and "ago" in row for row in rows.values()), text


def test_status_errors_are_one_line(tmp_path: Path) -> None:
    for target, expected in (
            (str(tmp_path), "no metrics.jsonl there"),
            (f"http://127.0.0.1:{free_port()}", "is the master running with --metrics-port"),
            ("tcp://127.0.0.1:5555", "not its ZeroMQ port")):
        result = run_hetconv("status", target, timeout=30)
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
        assert expected in result.stderr, result.stderr


def test_a_taken_metrics_port_is_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            hetconv_command("train", "--local", *SMALL_RUN, "--run-dir", str(tmp_path / "r"),
                            "--metrics-port", str(port)),
            capture_output=True, text=True, env=child_env(), timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"hetconv: error: --metrics-port {port}: cannot serve /metrics there: Address already "
        "in use; choose another port"], result.stderr
