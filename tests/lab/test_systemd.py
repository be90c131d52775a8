"""deploy/hetconv-worker.service: checked with ``systemd-analyze verify`` (its ExecStart
pointed at this environment's hetconv), and every HETCONV_* variable it sets or
documents is one ``hetconv worker`` reads. No unit is started: the test machines run
no systemd as PID 1."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hetconv.commands.cli import build_parser
from tests.conftest import REPO

UNIT = REPO / "deploy" / "hetconv-worker.service"
pytestmark = [pytest.mark.lab, pytest.mark.timeout(60)]


def test_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is missing: apt-get install systemd "
                    "(deploy/test.sh does, as root)")
    hetconv = Path(sys.executable).parent / "hetconv"
    if not hetconv.exists():
        pytest.skip(f"{hetconv} is missing: pip install -e . in this environment")
    text = UNIT.read_text()
    assert "ExecStart=/opt/hetconv/venv/bin/hetconv worker" in text
    unit = tmp_path / UNIT.name
    unit.write_text(text.replace("/opt/hetconv/venv/bin/hetconv", str(hetconv)))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                            timeout=30)
    findings = [line for line in (result.stdout + result.stderr).splitlines()
                if UNIT.name in line]
    assert result.returncode == 0 and not findings, result.stdout + result.stderr


def test_unit_variables_are_worker_settings(capsys: pytest.CaptureFixture[str]) -> None:
    text = UNIT.read_text()
    variables = set(re.findall(r"\b(HETCONV_[A-Z_]+)\b", text))
    assert {"HETCONV_MASTER", "HETCONV_METRICS_PORT", "HETCONV_LOG_FORMAT"} <= variables
    source = "\n".join(path.read_text() for path in (REPO / "hetconv").rglob("*.py"))
    for variable in variables:
        name = variable.removeprefix("HETCONV_")
        assert re.search(rf'env(?:_int|_float|_positive_int)?\("{name}"|"{variable}"',
                         source), f"{variable} is read nowhere in hetconv/"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--help"])
    assert "--metrics-port" in capsys.readouterr().out
