"""deploy/slurm/hetconv.sbatch for real: a one-host Slurm cluster (munged, slurmctld and
slurmd from Debian's slurm-wlm, started here and stopped at the end) runs the script end
to end, the master and two CURVE-keyed workers as srun tasks. Root only; skips with the
reason where the packages are missing (deploy/test.sh installs them: slurm-wlm)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hetconv.lab import free_port
from tests.conftest import REPO, child_env

pytestmark = [pytest.mark.lab, pytest.mark.slow, pytest.mark.timeout(240)]

SBATCH_SCRIPT = REPO / "deploy" / "slurm" / "hetconv.sbatch"
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")


def missing_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (starts munged, slurmctld and slurmd on this host)"
    missing = [name for name in PROGRAMS if shutil.which(name) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): "
                "apt-get install slurm-wlm (deploy/test.sh does, as root)")
    return None


def wait_until(predicate: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.2)
    return False


def munge_works() -> bool:
    encoded = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
    if encoded.returncode != 0:
        return False
    return subprocess.run(["unmunge"], input=encoded.stdout, capture_output=True,
                          timeout=10).returncode == 0


def slurm_conf(directory: Path) -> str:
    node = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30,
                          check=True).stdout.splitlines()[0]
    host = node.split()[0].split("=", 1)[1]
    node_line = " ".join(field for field in node.split()
                         if not field.startswith("RealMemory"))  # leave memory unchecked
    return "\n".join([
        "ClusterName=hetconvlab", f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
        f"StateSaveLocation={directory}/state", f"SlurmdSpoolDir={directory}/spool",
        f"SlurmctldPidFile={directory}/slurmctld.pid", f"SlurmdPidFile={directory}/slurmd.pid",
        f"SlurmctldLogFile={directory}/slurmctld.log", f"SlurmdLogFile={directory}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core", "SchedulerType=sched/builtin", "MpiDefault=none",
        "ReturnToService=2", "SlurmdTimeout=30", "InactiveLimit=0", "KillWait=5",
        f"{node_line} NodeAddr=127.0.0.1 State=UNKNOWN",
        f"PartitionName=lab Nodes={host} Default=YES MaxTime=INFINITE State=UP", ""])


@pytest.fixture
def slurm_cluster(tmp_path: Path) -> Iterator[dict[str, str]]:
    """munged (unless one already answers), slurmctld and slurmd in the foreground, as
    children of this test; the environment that points Slurm's commands at them."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    directory = tmp_path / "slurm"
    for sub in ("state", "spool"):
        (directory / sub).mkdir(parents=True)
    conf = directory / "slurm.conf"
    conf.write_text(slurm_conf(directory))
    env = {**child_env(), "SLURM_CONF": str(conf)}
    started: list[subprocess.Popen[bytes]] = []
    try:
        if not MUNGE_SOCKET.exists() or not munge_works():
            MUNGE_SOCKET.parent.mkdir(parents=True, exist_ok=True)
            shutil.chown(MUNGE_SOCKET.parent, "munge", "munge")
            started.append(subprocess.Popen(
                ["runuser", "-u", "munge", "--", "munged", "--foreground", "--force"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            if not wait_until(munge_works, 15):
                pytest.skip("munged does not start here (no MUNGE credentials for Slurm)")
        for daemon in ("slurmctld", "slurmd"):
            started.append(subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env,
                                            stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))

        def node_idle() -> bool:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True,
                                   text=True, env=env, timeout=10)
            return state.stdout.strip() == "idle"

        if not wait_until(node_idle, 60):
            logs = "".join(path.read_text(errors="replace")[-2000:]
                           for path in directory.glob("*.log"))
            pytest.fail(f"the one-host Slurm cluster did not come up:\n{logs}")
        yield env
    finally:
        for process in reversed(started):
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def test_sbatch_script_trains_with_two_curve_workers(slurm_cluster: dict[str, str],
                                                      tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    env = {**slurm_cluster, "HETCONV": f"{sys.executable} -m hetconv",
           "HETCONV_PORT": str(free_port()), "HETCONV_JOB_DIR": str(job_dir),
           "HETCONV_THREADS": "1"}
    result = subprocess.run(
        ["sbatch", "--wait", "--nodes=1", "--ntasks-per-node=2", f"--chdir={tmp_path}",
         f"--output={tmp_path}/job.out", str(SBATCH_SCRIPT),
         "--data", "synthetic", "--limit", "1280", "--test-limit", "128", "--arch", "4:8",
         "--epochs", "1", "--batch", "64", "--wire-dtype", "float32"],
        capture_output=True, text=True, env=env, timeout=200)
    out = (tmp_path / "job.out").read_text(errors="replace") if (tmp_path / "job.out").exists() \
        else ""
    worker_logs = {path.name: path.read_text(errors="replace")
                   for path in sorted((job_dir / "logs").glob("*.log"))}
    assert result.returncode == 0, (result.stdout, result.stderr, out, worker_logs)
    records = [json.loads(line) for line in
               (job_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["type"] == "run_end" and records[-1]["status"] == "completed", out
    devices = next(r for r in records if r["type"] == "devices")["devices"]
    host = socket.gethostname().split(".")[0]
    assert sorted(d["id"] for d in devices) == [f"{host}-0", f"{host}-1"]
    steps = [r for r in records if r["type"] == "step"]
    assert len(steps) == 20 and {entry["participant"] for r in steps for layer in r["layers"]
                                 for entry in layer["participants"]} <= {f"{host}-0", f"{host}-1"}
    assert sorted(worker_logs) == ["worker-0.log", "worker-1.log"]
    for text in worker_logs.values():
        assert "CURVE on" in text, worker_logs
    assert (job_dir / "keys" / "master.key_secret").stat().st_mode & 0o077 == 0
    assert "hetconv: done: test accuracy" in out, out
