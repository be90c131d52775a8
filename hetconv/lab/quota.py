"""CPU quotas: a process runs at a fraction of one core (cgroup v1 ``cpu`` controller).

``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` with a short 10 ms period, so a
throttled process is slow at every time scale, as a slower machine is. Needs root
and a cgroup v1 cpu hierarchy at /sys/fs/cgroup/cpu.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

CGROUP_CPU_ROOT = Path("/sys/fs/cgroup/cpu")
CFS_PERIOD_US = 10_000  # short periods: a throttled worker is slow at every scale
MIN_QUOTA_US = 1_000  # the kernel refuses a shorter cpu.cfs_quota_us


def quota_refusal(fraction: float, period_us: int) -> str | None:
    """Why the kernel would refuse ``fraction`` of a core per ``period_us`` (one line), or
    None: the period must be 1 ms to 1 s and the share of it at least ``MIN_QUOTA_US``."""
    if not 0.01 <= fraction <= 64:
        return f"CPU fraction must be within 0.01..64, got {fraction:g}"
    if not 1_000 <= period_us <= 1_000_000 or period_us * fraction < MIN_QUOTA_US:
        return (f"a CFS period of {period_us / 1000:g} ms must be within 1..1000 ms and grant "
                f"{fraction:g} core at least {MIN_QUOTA_US / 1000:g} ms of it (the kernel's "
                "least quota)")
    return None


def cpu_quota_unavailable_reason() -> str | None:
    """Why cgroup v1 CPU quotas cannot be used here, or None when they can."""
    if not (CGROUP_CPU_ROOT / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CGROUP_CPU_ROOT}"
    if not os.access(CGROUP_CPU_ROOT, os.W_OK):
        return f"{CGROUP_CPU_ROOT} is not writable (needs root)"
    return None


class CpuQuota:
    """A cgroup v1 cpu group limited to ``fraction`` of one core, granted per period of
    ``period_us`` microseconds (1 ms to 1 s; default ``CFS_PERIOD_US``): a process that
    used its share of a period waits for the next one."""

    def __init__(self, fraction: float, period_us: int = CFS_PERIOD_US):
        refusal = quota_refusal(fraction, period_us)
        if refusal:
            raise ValueError(refusal)
        reason = cpu_quota_unavailable_reason()
        if reason:
            raise RuntimeError(f"CPU quotas unavailable: {reason}")
        self.path = CGROUP_CPU_ROOT / f"hetconv-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.path.mkdir()
        self.period_us = period_us
        (self.path / "cpu.cfs_period_us").write_text(str(period_us))
        (self.path / "cpu.cfs_quota_us").write_text(str(int(period_us * fraction)))

    def set(self, fraction: float) -> None:
        """Change the group's share of a core (a machine that gets busy or recovers)."""
        refusal = quota_refusal(fraction, self.period_us)
        if refusal:
            raise ValueError(refusal)
        (self.path / "cpu.cfs_quota_us").write_text(str(int(self.period_us * fraction)))

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
