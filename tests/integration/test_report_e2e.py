"""``hetconv report`` on a real distributed run: terminal, JSON and the HTML page.

Two worker subprocesses and a master train a small network; the report's figures
are checked against values recomputed here from ``metrics.jsonl``, and the HTML
page is opened in headless Chromium (skipped when ``/usr/bin/chromium`` is absent)
for a screenshot kept in ``test-artifacts/`` and a check for console errors.
"""
from __future__ import annotations

import base64
import io
import json
import re
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

import pytest
from matplotlib import image as mpimg

from tests.conftest import REPO, SMALL_RUN, run_hetconv

pytestmark = [pytest.mark.integration]

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def pixel_variance(png: bytes) -> float:
    return float(mpimg.imread(io.BytesIO(png), format="png")[..., :3].var())


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          check=False, capture_output=True, text=True, timeout=90)


@pytest.fixture(scope="module")
def distributed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished two-worker run (workers always stopped at the end)."""
    from hetconv.lab import LocalWorkers, free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    base = tmp_path_factory.mktemp("report")
    run_dir = base / "run"
    with LocalWorkers(endpoint, [{"name": "w1"}, {"name": "w2"}], log_dir=base):
        result = run_hetconv("train", "--listen", endpoint, "--min-workers", "2", "--wait", "30",
                             "--rebalance", "off",  # the report must show the calibrated split
                             "--fall-back", "off",  # ... of a run that keeps its workers
                             *SMALL_RUN, "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stderr
    return run_dir


@pytest.mark.timeout(240)
def test_terminal_and_json_figures(distributed_run: Path) -> None:
    records = metrics(distributed_run)
    steps = [r for r in records if r["type"] == "step"]
    used = steps[1:] if len(steps) > 1 else steps
    median_step_ms = statistics.median(s["step_s"] for s in used) * 1e3

    result = run_hetconv("report", str(distributed_run))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert max(len(line) for line in text.splitlines()) <= 100
    assert re.search(rf"median step time\s+{median_step_ms:.1f} ms", text), text
    for calibration in (r for r in records if r["type"] == "calibration"):
        for entry in calibration["participants"]:
            row = rf"^{calibration['layer'] + 1}\s+{re.escape(entry['participant'])}\s+" \
                  rf"{entry.get('samples', entry['kernels'])}\s"
            assert re.search(row, text, re.MULTILINE), (row, text)
    assert (distributed_run / "report.html").is_file()

    result = run_hetconv("report", "--json", "--no-html", str(distributed_run))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["split"]["step_s"] * 1e3 == pytest.approx(median_step_ms)
    assert data["steps_used"] == len(used)
    kernels = {d["id"]: [row["kernels"] for row in d["layers"]] for d in data["devices"]}
    assert {"w1", "w2"} <= set(kernels)
    last = used[-1]
    for layer in last["layers"]:
        for entry in layer["participants"]:
            # work units: kernels, or samples under the sample split
            assert kernels[entry["participant"]][layer["layer"]] == entry.get("samples",
                                                                             entry["kernels"])
    assert 0 < data["balance_efficiency"] <= 1.05


@pytest.mark.timeout(240)
def test_html_report_in_chromium(distributed_run: Path, tmp_path: Path) -> None:
    result = run_hetconv("report", str(distributed_run))
    assert result.returncode == 0, result.stderr
    page_path = distributed_run / "report.html"
    page = page_path.read_text(encoding="utf-8")
    images = re.findall(r'<img src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == page.count("<img") >= 4
    for encoded in images:
        assert pixel_variance(base64.b64decode(encoded, validate=True)) > 0
    assert "http://" not in page and "https://" not in page

    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)")
    url = page_path.resolve().as_uri()
    loaded = chromium("--enable-logging=stderr", "--v=0", "--dump-dom", url,
                      profile=tmp_path / "profile-dom")
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert "<h1>hetconv report: run</h1>" in loaded.stdout
    assert loaded.stdout.count("<img") == len(images)
    console = [line for line in loaded.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console  # the page has no script: any console message is an error

    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "report_e2e.png"
    screenshot.unlink(missing_ok=True)
    shot = chromium(f"--screenshot={screenshot}", "--window-size=1200,3000", url,
                    profile=tmp_path / "profile-shot")
    assert shot.returncode == 0 and screenshot.is_file(), shot.stderr[-2000:]
    assert pixel_variance(screenshot.read_bytes()) > 0
    shutil.copyfile(page_path, ARTIFACTS / "report_e2e.html")
