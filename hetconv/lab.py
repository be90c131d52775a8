"""A LAN of unequal machines on one host: local worker processes, CPU quotas, links.

Used by the integration tests and by ``hetconv bench split``. Worker daemons run
as real subprocesses (``python -m hetconv worker``), optionally inside a
cgroup v1 CPU quota (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) so one of them
runs at, say, 30% of a core, and optionally inside a network namespace joined to
the host by a veth pair with a ``tc tbf`` bandwidth cap (:class:`LanHost`), so
their traffic crosses a real, slower link. Everything started here is stopped and
removed on exit.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import IO, Any

CGROUP_CPU_ROOT = Path("/sys/fs/cgroup/cpu")
CFS_PERIOD_US = 10_000  # short periods: a throttled worker is slow at every scale


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_quota_unavailable_reason() -> str | None:
    """Why cgroup v1 CPU quotas cannot be used here, or None when they can."""
    if not (CGROUP_CPU_ROOT / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CGROUP_CPU_ROOT}"
    if not os.access(CGROUP_CPU_ROOT, os.W_OK):
        return f"{CGROUP_CPU_ROOT} is not writable (needs root)"
    return None


class CpuQuota:
    """A cgroup v1 cpu group limited to ``fraction`` of one core."""

    def __init__(self, fraction: float):
        if not 0.01 <= fraction <= 64:
            raise ValueError(f"CPU fraction must be within 0.01..64, got {fraction}")
        reason = cpu_quota_unavailable_reason()
        if reason:
            raise RuntimeError(f"CPU quotas unavailable: {reason}")
        self.path = CGROUP_CPU_ROOT / f"hetconv-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.path.mkdir()
        (self.path / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        (self.path / "cpu.cfs_quota_us").write_text(str(int(CFS_PERIOD_US * fraction)))

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        if not self.path.exists():
            return
        procs = (self.path / "cgroup.procs").read_text().split()
        for pid in procs:  # move survivors back to the root group
            try:
                (CGROUP_CPU_ROOT / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        try:
            self.path.rmdir()
        except OSError:
            pass


def netns_unavailable_reason() -> str | None:
    """Why network namespaces with veth links cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"hcprobe{os.getpid() % 100000}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                            check=False)
    if result.returncode != 0:
        return f"ip netns add failed: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


class LanHost:
    """A network namespace reached from the host over a veth pair at ``rate``.

    The host side gets ``10.77.<index>.1``, the namespace ``10.77.<index>.2``; both
    directions are capped with ``tc tbf`` when ``rate`` (e.g. ``"200mbit"``) is given.
    """

    def __init__(self, index: int, rate: str | None = None):
        if not 1 <= index <= 250:
            raise ValueError("index must be within 1..250")
        tag = f"{os.getpid() % 10000}x{index}"
        self.netns, self.host_if, self.peer_if = f"hc{tag}", f"hch{tag}", f"hcp{tag}"
        self.host_address, self.address = f"10.77.{index}.1", f"10.77.{index}.2"
        commands = [
            ["ip", "netns", "add", self.netns],
            ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.peer_if],
            ["ip", "link", "set", self.peer_if, "netns", self.netns],
            ["ip", "addr", "add", f"{self.host_address}/24", "dev", self.host_if],
            ["ip", "link", "set", self.host_if, "up"],
            ["ip", "netns", "exec", self.netns, "ip", "addr", "add", f"{self.address}/24",
             "dev", self.peer_if],
            ["ip", "netns", "exec", self.netns, "ip", "link", "set", self.peer_if, "up"],
            ["ip", "netns", "exec", self.netns, "ip", "link", "set", "lo", "up"],
        ]
        if rate:
            tbf = ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]
            commands += [["tc", "qdisc", "add", "dev", self.host_if, *tbf],
                         ["ip", "netns", "exec", self.netns, "tc", "qdisc", "add", "dev",
                          self.peer_if, *tbf]]
        try:
            for command in commands:
                subprocess.run(command, capture_output=True, text=True, check=True)
        except subprocess.CalledProcessError as error:
            self.remove()
            raise RuntimeError(f"{' '.join(error.cmd)}: {error.stderr.strip()}") from None

    def remove(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)


class LocalWorker:
    """One ``hetconv worker`` subprocess; ``stop()`` always ends it."""

    def __init__(self, master: str, name: str, threads: int = 1, cpu_fraction: float | None = None,
                 log_path: Path | None = None, extra_args: tuple[str, ...] = (),
                 netns: str | None = None):
        self.name = name
        self.quota = CpuQuota(cpu_fraction) if cpu_fraction is not None else None
        self.log_path = log_path
        self._log: IO[bytes] | int = open(log_path, "wb") if log_path else subprocess.DEVNULL
        command = [sys.executable, "-m", "hetconv", "worker", "--master", master,
                   "--threads", str(threads), "--name", name, *extra_args]
        if netns is not None:  # run it on the emulated LAN host
            command = ["ip", "netns", "exec", netns, *command]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env)
        if self.quota is not None:
            try:
                self.quota.add(self.process.pid)
            except BaseException:
                self.stop()
                raise

    def stop(self, timeout_s: float = 3.0) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)
        if self.quota is not None:
            self.quota.remove()
        if not isinstance(self._log, int):
            self._log.close()
        return self.process.returncode

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""


class LocalWorkers:
    """Several local workers as a context manager: ``with LocalWorkers(...) as ws:``."""

    def __init__(self, master: str, specs: list[dict[str, Any]], log_dir: Path | None = None):
        self.master, self.specs, self.log_dir = master, specs, log_dir
        self.workers: list[LocalWorker] = []

    def __enter__(self) -> list[LocalWorker]:
        try:
            for spec in self.specs:
                log_path = self.log_dir / f"{spec['name']}.log" if self.log_dir else None
                self.workers.append(LocalWorker(self.master, log_path=log_path, **spec))
        except BaseException:
            self.__exit__()
            raise
        return self.workers

    def __exit__(self, *exc: object) -> None:
        for worker in self.workers:
            worker.stop()


def wait_for(predicate: Any, timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())
