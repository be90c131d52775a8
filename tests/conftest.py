"""Fixtures for integration tests (real worker and master processes on loopback), and the
rule that with ``HETCONV_REQUIRE_TORCH=1`` a PyTorch oracle test fails instead of skipping
when torch is missing (CI sets it; see deploy/test.sh)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from hetconv.lab import LocalWorkers, free_port
from tests.support.faulty_worker import WorkerFaults

REPO = Path(__file__).resolve().parents[1]
TORCH_SKIP_REASON = "could not import 'torch'"  # pytest.importorskip("torch")'s reason
SMALL_RUN = ["--data", "synthetic", "--limit", "6400", "--test-limit", "256", "--arch", "4:8",
             "--epochs", "1", "--batch", "64", "--threads", "1", "--no-progress", "--seed", "3",
             "--wire-dtype", "float32"]  # exactness tests compare with a float32 wire


def hetconv_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "hetconv", *args]


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run_hetconv(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """``hetconv *args`` run to its end; one still running after ``timeout`` seconds is
    killed and fails the test with the last of what it printed (a hang says where)."""
    try:
        return subprocess.run(hetconv_command(*args), capture_output=True, text=True,
                              timeout=timeout, env=child_env(), cwd=REPO)
    except subprocess.TimeoutExpired as error:
        printed = error.stderr or b""
        text = printed.decode(errors="replace") if isinstance(printed, bytes) else printed
        pytest.fail(f"hetconv {args[0] if args else ''} still running after {timeout:.0f} s; "
                    f"the last it printed:\n{text[-4000:]}", pytrace=False)


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
    """A factory that starts local workers; all are stopped at the end of the test.
    ``faults``: they are the tests' faulty worker (tests/support/faulty_worker.py)."""
    started: list[LocalWorkers] = []

    def start(*names: str, faults: WorkerFaults | None = None, **spec: Any) -> Any:
        if faults is not None:
            spec = {**spec, **faults.spec()}
        group = LocalWorkers(endpoint, [{"name": name, **spec} for name in names],
                             log_dir=tmp_path)
        started.append(group)
        return group.__enter__()

    yield start
    for group in started:  # every worker told first: they wind down together
        for worker in group.workers:
            worker.terminate()
    for group in started:
        group.__exit__()


@pytest.fixture(scope="session")
def local_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local run of SMALL_RUN: what every distributed run must reproduce."""
    run_dir = tmp_path_factory.mktemp("local") / "run"
    result = run_hetconv("train", "--local", *SMALL_RUN, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    return run_dir


def torch_required() -> bool:
    return os.environ.get("HETCONV_REQUIRE_TORCH", "0") == "1"


def _fail_torch_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Turn an ``importorskip("torch")`` skip into a failure when torch is required."""
    if not (report.skipped and torch_required()):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if TORCH_SKIP_REASON in reason:
        report.outcome = "failed"
        report.longrepr = (f"HETCONV_REQUIRE_TORCH=1 but the PyTorch test oracle is missing "
                           f"({reason}); install it: pip install torch==2.13.0 --extra-index-url "
                           f"https://download.pytorch.org/whl/cpu")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                               call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    _fail_torch_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    _fail_torch_skip(outcome.get_result())
