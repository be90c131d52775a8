"""`hetconv train` writing to a pipe (as under systemd, Slurm or a container): progress
lines instead of bar redraws, and with --log-format json nothing but JSON lines."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import SMALL_RUN, run_hetconv

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
RUN = [flag for flag in SMALL_RUN if flag != "--no-progress"]  # 100 steps of 64 images


def test_json_logs_off_a_terminal_are_json_lines_with_progress(tmp_path: Path) -> None:
    result = run_hetconv("train", "--local", *RUN, "--run-dir", str(tmp_path / "run"),
                         "--log-format", "json", "--progress-every", "40")
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stdout + result.stderr
    lines = [json.loads(line) for line in
             (result.stdout + result.stderr).splitlines()]  # every line is one object
    progress = [line for line in lines if line.get("event") == "progress"]
    assert [line["done"] for line in progress] == [40, 80, 100]
    assert all(line["total"] == 100 and 0 < line["loss"] < 10 for line in progress)
    assert lines[-1]["message"].startswith("hetconv: done: test accuracy")


def test_text_logs_off_a_terminal_are_lines(tmp_path: Path) -> None:
    result = run_hetconv("train", "--local", *RUN, "--run-dir", str(tmp_path / "run"),
                         "--progress-every", "50")
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stdout + result.stderr and result.stderr == ""
    progress = [line for line in result.stdout.splitlines() if "batches" in line]
    assert [line.split(":")[1].split()[0] for line in progress] == ["50/100", "100/100"]
