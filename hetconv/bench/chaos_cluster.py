"""The chaos bench's processes: one run's master and workers (:func:`run_once`), the
workers started again under the same name after a fault (:class:`ChaosCluster`), the
faults injected and undone as time passes (:class:`Injector`), and the master's
resources sampled while it runs. ``close()`` and the run's exit stack stop everything
and undo every fault, whatever happens.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from hetconv.bench.chaos_assess import InjectedFault
from hetconv.bench.chaos_plan import (
    CPU_QUOTA,
    LINK_DOWN_S,
    QUOTA_FOR_S,
    QUOTA_FRACTION,
    RESTART,
    RESTART_AFTER_S,
    SIGKILL,
    SIGSTOP,
    STOPPED_FOR_S,
    PlannedFault,
    kernels_held,
    pick_worker,
)
from hetconv.errors import UserError
from hetconv.lab import LocalWorker, free_port
from hetconv.lab.network import SwitchedLan
from hetconv.lab.quota import CFS_PERIOD_US
from hetconv.metrics import read_metrics

WORKERS = 4
WARM_UP_S = 30.0  # master resources are compared from this long after the first step on
SAMPLE_EVERY_S = 5.0
START_TIMEOUT_S = 180.0  # for the first step of a run (workers joining, calibration)
RUN_TIMEOUT_S = 3600.0


class ChaosCluster:
    """The workers of one run, started again under the same name after a fault, and
    the faults themselves; ``close()`` stops everything and undoes every fault."""

    def __init__(self, endpoint: str, log_dir: Path, lan: SwitchedLan | None) -> None:
        self.endpoint, self.log_dir, self.lan = endpoint, log_dir, lan
        self.names = [f"w{index}" for index in range(1, WORKERS + 1)]
        self.workers: dict[str, LocalWorker] = {}
        self.generation: dict[str, int] = {}
        self.stopped: set[str] = set()
        self.links_down: set[str] = set()
        for name in self.names:
            self.start(name)

    def _netns(self, name: str) -> str | None:
        return None if self.lan is None else self.lan.machines[self.names.index(name) + 1].netns

    def start(self, name: str) -> None:
        generation = self.generation.get(name, 0) + 1
        self.generation[name] = generation
        self.workers[name] = LocalWorker(
            self.endpoint, name, threads=1, cpu_fraction=1.0 if self.lan else None,
            log_path=self.log_dir / f"{name}-{generation}.log", netns=self._netns(name))

    def kill(self, name: str) -> None:
        os.kill(self.workers[name].process.pid, signal.SIGKILL)
        self.workers[name].stop()

    def freeze(self, name: str) -> None:
        os.kill(self.workers[name].process.pid, signal.SIGSTOP)
        self.stopped.add(name)

    def thaw(self, name: str) -> None:
        if name in self.stopped and self.workers[name].process.poll() is None:
            os.kill(self.workers[name].process.pid, signal.SIGCONT)
        self.stopped.discard(name)

    def restart(self, name: str) -> None:
        self.workers[name].stop()
        self.start(name)

    def set_quota(self, name: str, fraction: float) -> None:
        quota = self.workers[name].quota
        if quota is None:
            raise UserError("cpu-quota faults need --lab")
        (quota.path / "cpu.cfs_quota_us").write_text(str(int(CFS_PERIOD_US * fraction)))

    def _interface(self, netns: str) -> str:
        listing = subprocess.run(["ip", "netns", "exec", netns, "ip", "-o", "link", "show"],
                                 capture_output=True, text=True, check=True).stdout
        names = [line.split(":")[1].strip().split("@")[0] for line in listing.splitlines()
                 if ":" in line]
        return next(name for name in names if name != "lo")

    def link(self, name: str, up: bool) -> None:
        netns = self._netns(name)
        if netns is None:
            raise UserError("link faults need --lab")
        subprocess.run(["ip", "netns", "exec", netns, "ip", "link", "set",
                        self._interface(netns), "up" if up else "down"],
                       capture_output=True, check=True)
        (self.links_down.discard if up else self.links_down.add)(name)

    def close(self) -> None:
        for name in list(self.stopped):
            self.thaw(name)
        for name in list(self.links_down):
            try:
                self.link(name, True)
            except (subprocess.CalledProcessError, StopIteration):
                pass
        for worker in self.workers.values():  # all told first: they wind down together
            worker.terminate()
        for worker in self.workers.values():
            worker.stop()


@dataclass
class Injector:
    """Injects the planned faults into a :class:`ChaosCluster` as time passes, with the
    follow-up actions (restart, SIGCONT, link up, quota back) at their due times."""

    cluster: ChaosCluster
    planned: list[PlannedFault]
    seed: int
    out: Callable[[str], None]
    held: Callable[[], dict[str, int]] = dict  # kernels per worker now
    injected: list[InjectedFault] = field(default_factory=list)
    pending: list[tuple[float, str, Callable[[], None]]] = field(default_factory=list)
    busy: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed + 1)
        self.queue = list(self.planned)

    def _later(self, due: float, name: str, action: Callable[[], None],
               fault: InjectedFault) -> None:
        def finish() -> None:
            action()
            fault.ended = time.time()
            self.busy.discard(name)
        self.pending.append((due, name, finish))

    def tick(self, elapsed_s: float) -> None:
        """Run every follow-up that is due, then inject every planned fault that is
        due (``elapsed_s``: seconds since the first training step)."""
        now = time.monotonic()
        for entry in [e for e in self.pending if e[0] <= now]:
            self.pending.remove(entry)
            entry[2]()
        while self.queue and self.queue[0].at_s <= elapsed_s:
            held = self.held()
            name = pick_worker(self.rng, self.cluster.names, self.busy,
                               [n for n, kernels in held.items() if kernels > 0])
            if name is None:
                return  # every worker still holds a fault: try again at the next tick
            self._inject(self.queue.pop(0), name, elapsed_s, now,
                         held.get(name, 0) if held else None)  # not in the plan: none

    def _inject(self, planned: PlannedFault, name: str, elapsed_s: float, now: float,
                kernels: int | None = None) -> None:
        fault = InjectedFault(planned.kind, name, round(elapsed_s, 1), time.time(),
                              kernels=kernels)
        cluster, kind = self.cluster, planned.kind
        self.busy.add(name)
        if kind == SIGKILL:
            cluster.kill(name)
            self._later(now + RESTART_AFTER_S, name, lambda: cluster.start(name), fault)
        elif kind == SIGSTOP:
            cluster.freeze(name)
            self._later(now + STOPPED_FOR_S, name, lambda: cluster.thaw(name), fault)
        elif kind == RESTART:
            cluster.restart(name)
            fault.ended = time.time()
            self.busy.discard(name)
        elif kind == CPU_QUOTA:
            cluster.set_quota(name, QUOTA_FRACTION)
            self._later(now + QUOTA_FOR_S, name, lambda: cluster.set_quota(name, 1.0), fault)
        else:
            cluster.link(name, False)
            self._later(now + LINK_DOWN_S[kind], name, lambda: cluster.link(name, True), fault)
        self.injected.append(fault)
        self.out(f"  +{elapsed_s:.1f} s: {kind} on {name} ({'?' if kernels is None else kernels}"
                 " kernels)")

    def finish_pending(self) -> None:
        """Run every follow-up now (the run is over): nothing stays stopped or down."""
        for _, _, action in sorted(self.pending, key=lambda e: e[0]):
            action()
        self.pending.clear()


@dataclass(frozen=True)
class Resources:
    """The master's RSS (bytes), open files and threads at one moment."""

    rss_bytes: int
    open_files: int
    threads: int


def _sample(pid: int) -> Resources | None:
    import psutil

    try:
        process = psutil.Process(pid)
        with process.oneshot():
            return Resources(process.memory_info().rss, process.num_fds(),
                             process.num_threads())
    except (psutil.Error, OSError):
        return None


def _steps_recorded(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    return path.read_text(encoding="utf-8", errors="replace").count('"type":"step"')


def _last_step(run_dir: Path) -> list[dict[str, Any]]:
    """The last complete ``step`` record of a running run's metrics (a list of at most
    one), read while the master may be writing the next line."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    for line in reversed(path.read_text(encoding="utf-8", errors="replace").splitlines()):
        if '"type":"step"' in line:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # cut off: being written
            return [record] if isinstance(record, dict) else []
    return []


@dataclass
class RunResult:
    run_dir: Path
    returncode: int
    wall_s: float
    records: list[dict[str, Any]]
    injected: list[InjectedFault]
    warm: Resources | None
    last: Resources | None


def run_once(name: str, root: Path, train_flags: list[str], lan: SwitchedLan | None,
             planned: list[PlannedFault], seed: int,
             out: Callable[[str], None]) -> RunResult:
    """One run of a master and WORKERS workers, with the planned faults injected (none
    for the fault-free run). The workers are stopped at the end, whatever happens."""
    run_dir = root / name
    run_dir.mkdir(parents=True, exist_ok=True)
    host = "127.0.0.1" if lan is None else lan.machines[0].address
    port = free_port()
    endpoint = f"tcp://{host}:{port}"
    command = [sys.executable, "-m", "hetconv", "train", "--listen", endpoint,
               "--min-workers", str(WORKERS), "--wait", "60", *train_flags,
               # faults must hit workers: never drop them for being slower than alone
               "--fall-back", "off", "--run-dir", str(run_dir / "run"), "--overwrite"]
    if lan is not None:
        command = lan.machines[0].command(command)
    log_path = run_dir / "master.log"
    out(f"hetconv bench chaos: {name} run ({len(planned)} fault(s) planned), logs in {run_dir}")
    with ExitStack() as stack:
        log: IO[bytes] = stack.enter_context(open(log_path, "wb"))
        cluster = ChaosCluster(endpoint, run_dir, lan)
        stack.callback(cluster.close)
        started = time.monotonic()
        master = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})

        def end_master() -> None:
            if master.poll() is None:
                master.send_signal(signal.SIGTERM)
                try:
                    master.wait(10)
                except subprocess.TimeoutExpired:
                    master.kill()
                    master.wait()
        stack.callback(end_master)
        injector = Injector(cluster, planned, seed, out,
                            lambda: kernels_held(_last_step(run_dir / "run")))
        stack.callback(injector.finish_pending)
        while _steps_recorded(run_dir / "run") == 0:
            if master.poll() is not None or time.monotonic() - started > START_TIMEOUT_S:
                raise UserError(f"the {name} run did not start training; see {log_path}")
            time.sleep(0.1)
        first_step = time.monotonic()
        warm = last = None
        next_sample = first_step
        while master.poll() is None:
            now = time.monotonic()
            if now - started > RUN_TIMEOUT_S:
                raise UserError(f"the {name} run took more than {RUN_TIMEOUT_S:.0f} s; see "
                                f"{log_path}")
            injector.tick(now - first_step)
            if now >= next_sample:
                sample = _sample(master.pid)
                last = sample or last
                if warm is None and now - first_step >= WARM_UP_S:
                    warm = sample
                next_sample = now + SAMPLE_EVERY_S
            time.sleep(0.05)
        wall_s = time.monotonic() - started
    records = read_metrics(run_dir / "run" / "metrics.jsonl")
    return RunResult(run_dir / "run", master.returncode, wall_s, records, injector.injected,
                     warm, last)
