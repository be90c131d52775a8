"""Fixtures for integration tests: real worker and master processes on loopback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hetconv.lab import LocalWorkers, free_port

REPO = Path(__file__).resolve().parents[1]
SMALL_RUN = ["--data", "synthetic", "--limit", "6400", "--test-limit", "256", "--arch", "4:8",
             "--epochs", "1", "--batch", "64", "--threads", "1", "--no-progress", "--seed", "3"]


def hetconv_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "hetconv", *args]


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run_hetconv(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(hetconv_command(*args), capture_output=True, text=True,
                          timeout=timeout, env=child_env(), cwd=REPO)


def step_losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["type"] == "step"]


def epoch_records(run_dir: Path) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["type"] == "epoch"]


@pytest.fixture
def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture
def workers(endpoint: str, tmp_path: Path) -> Iterator[Any]:
    """A factory that starts local workers; all are stopped at the end of the test."""
    started: list[LocalWorkers] = []

    def start(*names: str, **spec: Any) -> Any:
        group = LocalWorkers(endpoint, [{"name": name, **spec} for name in names],
                             log_dir=tmp_path)
        started.append(group)
        return group.__enter__()

    yield start
    for group in started:
        group.__exit__()


@pytest.fixture(scope="session")
def local_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local run of SMALL_RUN: what every distributed run must reproduce."""
    run_dir = tmp_path_factory.mktemp("local") / "run"
    result = run_hetconv("train", "--local", *SMALL_RUN, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    return run_dir
