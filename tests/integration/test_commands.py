"""The user-facing commands other tests do not cover: calibrate, bench split and bench accuracy."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from hetconv.lab import cpu_quota_unavailable_reason
from tests.conftest import epoch_records, run_hetconv

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(90)
def test_calibrate_prints_every_split_and_leaves_workers_up(endpoint: str, workers: Any) -> None:
    (worker,) = workers("solo")
    result = run_hetconv("calibrate", "--listen", endpoint, "--min-workers", "1", "--wait", "30",
                         "--arch", "4:8", "--batch", "16", "--threads", "1", timeout=80)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "kernel split for --arch 4:8, batch 16, input 1x28x28" in out
    for mode in ("model", "calibrated", "equal"):
        rows = re.findall(rf"^\s*{mode}\s+(\d+)\s+(\d+)\s+[\d.]+$", out, re.MULTILINE)
        assert [sum(map(int, row)) for row in rows] == [4, 8], (mode, out)
    assert worker.process.poll() is None  # still serving, ready for the next run


@pytest.mark.lab
@pytest.mark.serial  # CPU quotas for an emulated fast and slow machine
@pytest.mark.timeout(300)
@pytest.mark.skipif(cpu_quota_unavailable_reason() is not None,
                    reason=f"cgroup CPU quotas unavailable: {cpu_quota_unavailable_reason()}")
def test_bench_split_prints_the_comparison(tmp_path: Path) -> None:
    result = run_hetconv("bench", "split", "--arch", "4:16", "--batch", "32", "--limit", "96",
                         "--work-dir", str(tmp_path), timeout=280)
    assert result.returncode == 0, result.stderr
    for label in ("(a) fast worker alone", "(b) equal split", "(c) calibrated (eq. 1)",
                  "(d) cost-model split", "ideal conv phase for the combined speed"):
        assert label in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "calibrated-0", "equal-0", "model-0", "one-0"]


@pytest.mark.timeout(120)
def test_bench_accuracy_trains_each_seed_and_checks_the_target(tmp_path: Path) -> None:
    figures = tmp_path / "accuracy.md"
    result = run_hetconv("bench", "accuracy", "--seeds", "4,5", "--data", "synthetic",
                         "--limit", "256", "--test-limit", "128", "--arch", "4:8",
                         "--epochs", "2", "--batch", "64", "--workers", "2",
                         "--train-flags=--wire-dtype float32", "--target", "0",
                         "--work-dir", str(tmp_path / "runs"), "--markdown", str(figures),
                         timeout=110)
    assert result.returncode == 0, result.stderr
    assert "every seed reached the target of 0.00% test accuracy" in result.stdout
    text = figures.read_text()
    assert "'--train-flags=--wire-dtype float32'" in text  # the command line re-runs as is
    rows = re.findall(r"^\| (\d) \| ([\d.]+) \| ([\d. /]+) \|", text, re.MULTILINE)
    assert [row[0] for row in rows] == ["4", "5"]
    for seed, final, per_epoch in rows:  # the table holds what each run recorded
        run_dir = tmp_path / "runs" / f"seed-{seed}"
        accuracies = [100 * r["test_accuracy"] for r in epoch_records(run_dir)]
        assert len(accuracies) == 2
        assert float(final) == pytest.approx(accuracies[-1], abs=0.006)
        assert [float(a) for a in per_epoch.split(" / ")] == pytest.approx(accuracies, abs=0.006)
    # an unreachable target fails the command with one line, after the table
    missed = run_hetconv("bench", "accuracy", "--seeds", "4", "--data", "synthetic",
                         "--limit", "128", "--test-limit", "64", "--arch", "4:8", "--epochs", "1",
                         "--batch", "64", "--workers", "1", "--target", "100.0",
                         "--work-dir", str(tmp_path / "missed"), timeout=110)
    assert missed.returncode == 2
    assert "NOT every seed reached" in missed.stdout
    assert missed.stderr.strip().splitlines()[-1].startswith("hetconv: error: not every seed")


# --- bad endpoints, run directories and key files: one line each, exit status 2 ----------------
LOCAL_RUN = ["--data", "synthetic", "--limit", "64", "--test-limit", "64", "--arch", "2:2",
             "--epochs", "1", "--batch", "32", "--no-progress"]


def assert_one_line_error(result: Any, *expected: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("hetconv: error:")]
    assert len(errors) == 1 and result.stderr.strip() == errors[0], result.stderr
    assert all(text in errors[0] for text in expected), errors[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv, expected", [
    (["train", "--listen", "tcp://*:310730"], ["--listen", "port '310730'", "1-65535"]),
    (["train", "--listen", "tcp://*:0"], ["--listen", "port '0'"]),
    (["train", "--listen", "udp://*:5555"], ["--listen", "expected an endpoint like"]),
    (["train", "--listen", "tcp://:5555"], ["--listen", "HOST:PORT"]),
    (["calibrate", "--listen", "tcp://127.0.0.1:65536"], ["--listen", "port '65536'"]),
    (["worker", "--master", "tcp://127.0.0.1:70000"], ["--master", "port '70000'", "1-65535"]),
    (["worker", "--master", "tcp://127.0.0.1:*"], ["--master", "port '*'"]),
    (["worker", "--master", "tcp://*:5555"], ["--master", "name the host"]),
    (["worker", "--master", "ipc://"], ["--master", "names no address"]),
])
def test_a_bad_endpoint_is_one_line(argv: list[str], expected: list[str],
                                    tmp_path: Path) -> None:
    extra = [*LOCAL_RUN, "--run-dir", str(tmp_path / "r"), "--wait", "1"] \
        if argv[0] == "train" else []
    result = run_hetconv(*argv, *extra, timeout=60)
    assert_one_line_error(result, *expected)
    assert not (tmp_path / "r").exists()  # refused before anything was made


@pytest.mark.timeout(120)
def test_a_run_dir_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    regular_file = tmp_path / "file"
    regular_file.write_text("not a directory")
    for run_dir, reason in ((Path("/proc/hetconv-run"), "No such file or directory"),
                            (regular_file / "run", "Not a directory")):
        result = run_hetconv("train", "--local", *LOCAL_RUN, "--run-dir", str(run_dir),
                             timeout=60)
        assert_one_line_error(result, f"--run-dir {run_dir}: cannot create or write it",
                              reason)


@pytest.mark.timeout(60)
def test_a_garbage_allowed_key_file_is_one_line_naming_it(endpoint: str, tmp_path: Path) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    assert run_hetconv("keygen", "--dir", str(keys), "--name", "master").returncode == 0
    allowed.mkdir()
    (allowed / "garbage.key").write_bytes(b"\x00\xffnot a certificate\n")
    result = run_hetconv("train", "--listen", endpoint, *LOCAL_RUN, "--run-dir",
                         str(tmp_path / "r"), "--curve-secret", str(keys / "master.key_secret"),
                         "--curve-allow", str(allowed), timeout=50)
    assert_one_line_error(result, str(allowed / "garbage.key"), "not a public key file")
