"""CURVE: encrypted, authenticated traffic with an allow-list of worker keys."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SMALL_RUN, run_hetconv

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(120)
def test_only_allowed_workers_join(endpoint: str, workers: Any, tmp_path: Path) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    for name in ("master", "good", "bad"):
        result = run_hetconv("keygen", "--dir", str(keys), "--name", name)
        assert result.returncode == 0, result.stderr
    assert (keys / "good.key_secret").stat().st_mode & 0o777 == 0o600
    again = run_hetconv("keygen", "--dir", str(keys), "--name", "good")
    assert again.returncode == 2 and "never overwritten" in again.stderr
    allowed.mkdir()
    (allowed / "good.key").write_bytes((keys / "good.key").read_bytes())
    master_args = ["--curve-secret", str(keys / "master.key_secret"),
                   "--curve-allow", str(allowed)]
    # a worker whose key is not allowed is refused: the master sees nobody
    workers("bad", extra_args=("--curve-secret", str(keys / "bad.key_secret"),
                               "--master-key", str(keys / "master.key")))
    refused = run_hetconv("train", "--listen", endpoint, "--min-workers", "1", "--wait", "3",
                          *SMALL_RUN, "--run-dir", str(tmp_path / "r0"), *master_args)
    assert refused.returncode == 2 and "only 0 of 1 worker" in refused.stderr
    # the allowed worker joins and trains
    workers("good", extra_args=("--curve-secret", str(keys / "good.key_secret"),
                                "--master-key", str(keys / "master.key")))
    args = [a for a in SMALL_RUN]
    args[args.index("--limit") + 1] = "256"
    result = run_hetconv("train", "--listen", endpoint, "--min-workers", "1", "--wait", "30",
                         "--no-local", *args, "--run-dir", str(tmp_path / "r1"), *master_args)
    assert result.returncode == 0, result.stderr
    assert "good" in result.stdout and "bad" not in result.stdout


@pytest.mark.timeout(30)
def test_half_configured_curve_is_a_clear_error(endpoint: str, tmp_path: Path) -> None:
    result = run_hetconv("worker", "--master", endpoint, "--curve-secret", "x.key_secret")
    assert result.returncode == 2
    assert result.stderr.strip() == ("hetconv: error: CURVE needs both --curve-secret (this "
                                     "worker's NAME.key_secret) and --master-key (the master's "
                                     "NAME.key)")
    start = time.monotonic()
    result = run_hetconv("train", "--listen", endpoint, "--curve-secret", str(tmp_path / "nope"),
                         "--curve-allow", str(tmp_path), *SMALL_RUN,
                         "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 2 and "cannot read CURVE key file" in result.stderr
    assert time.monotonic() - start < 20
