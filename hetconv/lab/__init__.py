"""A LAN of unequal machines on one host: CPU quotas, capped links, local workers.

Used by the integration and lab tests and by ``hetconv bench split|scale``:

- :mod:`hetconv.lab.quota`: a process at a fraction of a core (cgroup v1);
- :mod:`hetconv.lab.network`: namespaces behind ``tc tbf``-capped veth links, alone
  (:class:`LanHost`) or on one bridge as a switched LAN (:class:`SwitchedLan`);
- :mod:`hetconv.lab.processes`: worker daemons as real subprocesses;
- :mod:`hetconv.lab.ports`: ports for their masters, handed out once per host.

Everything started here is stopped and removed on exit.
"""
from hetconv.lab.network import LanHost, netns_unavailable_reason
from hetconv.lab.ports import free_port
from hetconv.lab.processes import LocalWorker, LocalWorkers, wait_for
from hetconv.lab.quota import (
    CFS_PERIOD_US,
    CGROUP_CPU_ROOT,
    MIN_QUOTA_US,
    CpuQuota,
    cpu_quota_unavailable_reason,
    quota_refusal,
)

__all__ = [
    "CFS_PERIOD_US",
    "MIN_QUOTA_US",
    "quota_refusal",
    "CGROUP_CPU_ROOT",
    "CpuQuota",
    "LanHost",
    "LocalWorker",
    "LocalWorkers",
    "cpu_quota_unavailable_reason",
    "free_port",
    "netns_unavailable_reason",
    "wait_for",
]
