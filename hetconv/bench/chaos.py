"""``hetconv bench chaos``: a master and 4 workers under a seeded random fault every
20-40 s, against a fault-free run of the same seed (docs/resilience.md).

Both runs train the same network with the same flags and seed; the fault-free one
runs first. They run the settings a user gets by default (``--split model``,
``--wire-dtype auto``, the peer data plane, rebalancing on) unless ``split``,
``wire_dtype`` or ``data_plane`` say otherwise; only ``--threads 1`` is pinned (five
processes share the machine). With ``--epochs auto`` (the default) a one-epoch
probe run first measures an epoch's wall time, and the runs get enough epochs to
outlast ``--minutes`` by a quarter. In the second, once the first training step is
recorded, a fault is injected every ``--interval-min``..``--interval-max`` seconds
(seeded) for ``--minutes`` or until the run ends, into a worker that is not busy
with an earlier fault, one that held kernels at the last recorded step where there
is one (the planner may leave a slow worker idle; a fault there would test nothing):

* ``sigkill``: SIGKILL, then the worker is started again under the same name after
  5 s;
* ``sigstop``: SIGSTOP for 10 s, then SIGCONT;
* ``restart``: SIGTERM (the worker leaves cleanly) and started again at once;
* ``cpu-quota`` (``--lab`` only): its CPU quota dropped from 1 to 0.2 core for 60 s;
* ``link-down-2s``, ``link-down-20s`` (``--lab`` only): its namespace's link set down
  (``ip link set IF down`` inside the namespace) and up again after 2 or 20 s.

On loopback (the default, no root needed) every process runs on this machine; with
``--lab`` (root) every machine is a network namespace on one bridge with ``tc``-capped
links (:class:`hetconv.lab.network.SwitchedLan`) and every worker runs in a CPU quota
of one core. Everything is stopped and removed on exit, also on Ctrl-C or SIGTERM.

Then it prints every fault injected and its effect, read from the chaos run's
``metrics.jsonl``: the kernels the worker held when it struck; the ``recovery``
records written within ``--recovery-window`` seconds of it (and before the next
fault), or none (nothing needed: a short stall retried); the time it cost (each
recovery's own seconds plus its replayed steps times the fault-free run's median
step time); when a worker that was out (killed, restarted or evicted) was back (the
``join`` re-plan that took it in again: naming it, giving it kernels, or naming no
faulted worker); whether the run
completed (a fault is survived when the run completed); the master's RSS, open
files and threads after warm-up and at the end; and the final test accuracy of
both runs. The fault schedule is in :mod:`hetconv.bench.chaos_plan` and the
assessment in :mod:`hetconv.bench.chaos_assess` (both pure), the processes in
:mod:`hetconv.bench.chaos_cluster`, the table in :mod:`hetconv.bench.chaos_table`; this
module runs the bench and re-exports their names.
"""
from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hetconv.bench.chaos_assess import (
    AUTO_MARGIN,
    FaultOutcome,
    InjectedFault,
    assess,
    auto_epochs,
    epoch_wall_s,
    final_accuracy,
    median_step_s,
    run_completed,
)
from hetconv.bench.chaos_cluster import (
    WORKERS,
    ChaosCluster,
    Injector,
    Resources,
    RunResult,
    run_once,
)
from hetconv.bench.chaos_plan import (
    CPU_QUOTA,
    FAULT_KINDS,
    LINK_DOWN_LONG,
    LINK_DOWN_SHORT,
    LOOPBACK_FAULTS,
    RESTART,
    SIGKILL,
    SIGSTOP,
    PlannedFault,
    kernels_held,
    parse_faults,
    pick_worker,
    plan_faults,
)
from hetconv.bench.chaos_table import format_table
from hetconv.bench.signals import terminate_as_interrupt
from hetconv.config import DATA_PLANES, SPLIT_MODES, WIRE_DTYPE_AUTO
from hetconv.errors import UserError
from hetconv.lab import cpu_quota_unavailable_reason
from hetconv.lab.network import SwitchedLan, netns_unavailable_reason

__all__ = [
    "AUTO_MARGIN", "CPU_QUOTA", "FAULT_KINDS", "LINK_DOWN_LONG", "LINK_DOWN_SHORT",
    "LOOPBACK_FAULTS", "RESTART", "SIGKILL", "SIGSTOP", "WORKERS", "ChaosCluster",
    "FaultOutcome", "InjectedFault", "Injector", "PlannedFault", "Resources", "RunResult",
    "assess", "auto_epochs", "epoch_wall_s", "final_accuracy", "format_table", "kernels_held",
    "median_step_s", "parse_faults", "pick_worker", "plan_faults", "run_chaos_bench",
    "run_completed", "run_once"]


def run_chaos_bench(minutes: float = 10.0, interval_min_s: float = 20.0,
                    interval_max_s: float = 40.0, faults: str | None = None, lab: bool = False,
                    rate: str = "1gbit", arch: str = "32:64", batch: int = 64,
                    epochs: int | None = None,
                    limit: int | None = None, test_limit: int | None = None, seed: int = 1,
                    checkpoint_every: int = 20, split: str = SPLIT_MODES[0],
                    data_plane: str = DATA_PLANES[0], wire_dtype: str = WIRE_DTYPE_AUTO,
                    recovery_window_s: float = 30.0, work_dir: str | None = None,
                    out: Callable[[str], None] = print) -> dict[str, Any]:
    """The fault-free run, then the chaos run; the result rows and the table.
    ``epochs`` None: enough to outlast ``minutes`` (a one-epoch probe run first).
    ``split``, ``data_plane`` and ``wire_dtype`` default to ``hetconv train``'s defaults."""
    kinds = parse_faults(faults, lab) if faults else (FAULT_KINDS if lab else LOOPBACK_FAULTS)
    if minutes <= 0 or recovery_window_s <= 0:
        raise UserError("--minutes and --recovery-window must be positive")
    if lab:
        for reason in (netns_unavailable_reason(), cpu_quota_unavailable_reason()):
            if reason:
                raise UserError(f"hetconv bench chaos --lab needs root features: {reason}")
    planned = plan_faults(seed, minutes, interval_min_s, interval_max_s, kinds)
    root = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="hetconv-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    common = ["--data", "synthetic", "--arch", arch, "--batch", str(batch), "--threads", "1",
              "--no-progress", "--seed", str(seed), "--checkpoint-every",
              str(checkpoint_every), "--split", split, "--data-plane", data_plane,
              "--wire-dtype", wire_dtype]
    common += ["--limit", str(limit)] if limit else []
    common += ["--test-limit", str(test_limit)] if test_limit else []
    with terminate_as_interrupt(), ExitStack() as stack:
        lan = stack.enter_context(SwitchedLan(WORKERS + 1, rate)) if lab else None
        if epochs is None:
            probe = run_once("probe", root, [*common, "--epochs", "1"], lan, [], seed, out)
            if not run_completed(probe.records):
                raise UserError(f"the probe run failed; see {probe.run_dir.parent / 'master.log'}")
            epochs = auto_epochs(minutes, epoch_wall_s(probe.records))
            out(f"hetconv bench chaos: --epochs auto: {epochs} epoch(s)")
        flags = [*common, "--epochs", str(epochs)]
        reference = run_once("fault-free", root, flags, lan, [], seed, out)
        if not run_completed(reference.records):
            raise UserError(f"the fault-free run failed (status {reference.returncode}); see "
                            f"{reference.run_dir.parent / 'master.log'}")
        chaos = run_once("chaos", root, flags, lan, planned, seed, out)
    completed = chaos.returncode == 0 and run_completed(chaos.records)
    step_s = median_step_s(reference.records)
    outcomes = assess(chaos.injected, chaos.records, completed, step_s, recovery_window_s)
    result: dict[str, Any] = {
        "mode": "lab" if lab else "loopback", "minutes": minutes, "seed": seed,
        "epochs": epochs, "settings": {"split": split, "data_plane": data_plane,
                                       "wire_dtype": wire_dtype},
        "completed": completed, "faults_planned": len(planned),
        "faults_injected": len(outcomes),
        "faults_survived": sum(1 for o in outcomes if o.survived),
        "fault_free_accuracy": final_accuracy(reference.records),
        "chaos_accuracy": final_accuracy(chaos.records),
        "fault_free_wall_s": reference.wall_s, "chaos_wall_s": chaos.wall_s,
        "median_step_s": step_s, "faults": [asdict(o) for o in outcomes],
        "master_warm": None if chaos.warm is None else asdict(chaos.warm),
        "master_last": None if chaos.last is None else asdict(chaos.last),
        "work_dir": str(root)}
    table = format_table(result)
    for line in table:
        out(line)
    (root / "chaos.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    result["table"] = table
    return result
