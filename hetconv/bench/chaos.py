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
both runs. The decision logic (:func:`plan_faults`, :func:`assess`) is pure; the
processes are in :class:`ChaosCluster`.
"""
from __future__ import annotations

import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from hetconv.bench.signals import terminate_as_interrupt
from hetconv.config import DATA_PLANES, SPLIT_MODES, WIRE_DTYPE_AUTO
from hetconv.errors import UserError
from hetconv.lab import LocalWorker, cpu_quota_unavailable_reason, free_port
from hetconv.lab.network import SwitchedLan, netns_unavailable_reason
from hetconv.lab.quota import CFS_PERIOD_US
from hetconv.metrics import read_metrics

SIGKILL, SIGSTOP, RESTART, CPU_QUOTA, LINK_DOWN_SHORT, LINK_DOWN_LONG = (
    "sigkill", "sigstop", "restart", "cpu-quota", "link-down-2s", "link-down-20s")
FAULT_KINDS = (SIGKILL, SIGSTOP, RESTART, CPU_QUOTA, LINK_DOWN_SHORT, LINK_DOWN_LONG)
LOOPBACK_FAULTS = (SIGKILL, SIGSTOP, RESTART)
"""The faults that need no root (the others need ``--lab``)."""
WORKERS = 4
RESTART_AFTER_S = 5.0  # a SIGKILLed worker is started again after this
STOPPED_FOR_S = 10.0  # SIGSTOP .. SIGCONT
QUOTA_FRACTION = 0.2  # a cpu-quota fault's core fraction
QUOTA_FOR_S = 60.0  # ... for this long
LINK_DOWN_S = {LINK_DOWN_SHORT: 2.0, LINK_DOWN_LONG: 20.0}
AUTO_MARGIN = 1.25  # --epochs auto: the runs last this many times --minutes
WARM_UP_S = 30.0  # master resources are compared from this long after the first step on
SAMPLE_EVERY_S = 5.0
START_TIMEOUT_S = 180.0  # for the first step of a run (workers joining, calibration)
RUN_TIMEOUT_S = 3600.0


def parse_faults(text: str, lab: bool) -> tuple[str, ...]:
    """``"sigkill,sigstop"`` -> the fault kinds; the lab-only ones refused without
    ``--lab``."""
    kinds = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if not kinds or unknown:
        raise UserError(f"--faults {text!r}: expected a comma-separated list of "
                        f"{', '.join(FAULT_KINDS)}")
    if not lab:
        needs_lab = [k for k in kinds if k not in LOOPBACK_FAULTS]
        if needs_lab:
            raise UserError(f"--faults {', '.join(needs_lab)}: needs --lab (root: network "
                            "namespaces and CPU quotas)")
    return kinds


# --- the schedule (pure) --------------------------------------------------------------------
@dataclass(frozen=True)
class PlannedFault:
    """A fault to inject ``at_s`` seconds after the first training step."""

    at_s: float
    kind: str


def plan_faults(seed: int, minutes: float, interval_min_s: float, interval_max_s: float,
                kinds: Sequence[str]) -> list[PlannedFault]:
    """Faults at seeded random intervals in [interval_min_s, interval_max_s] until
    ``minutes`` have passed, each of a seeded random kind of ``kinds``."""
    if not 0 < interval_min_s <= interval_max_s:
        raise UserError("--interval-min must be positive and at most --interval-max")
    if not kinds:
        raise UserError("no fault kinds to inject")
    rng = random.Random(seed)
    planned: list[PlannedFault] = []
    at = 0.0
    while True:
        at += rng.uniform(interval_min_s, interval_max_s)
        if at > minutes * 60:
            return planned
        planned.append(PlannedFault(round(at, 3), rng.choice(list(kinds))))


def pick_worker(rng: random.Random, names: Sequence[str], busy: set[str],
                holding: Sequence[str] = ()) -> str | None:
    """A seeded random worker that no earlier fault still holds, or None; among those,
    one of ``holding`` (the workers holding kernels now) where there is one."""
    free = [name for name in names if name not in busy]
    preferred = [name for name in free if name in holding]
    return rng.choice(preferred or free) if free else None


def kernels_held(records: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Kernels per worker (all layers) in the last ``step`` record of ``records``."""
    last = next((r for r in reversed(records) if r.get("type") == "step"), None)
    held: dict[str, int] = {}
    for layer in (last or {}).get("layers", []):
        for device in layer.get("devices", []):
            name = str(device["device"])
            held[name] = held.get(name, 0) + int(device.get("kernels", 0))
    return held


def _takes_in(join: dict[str, Any], name: str, workers: set[str]) -> bool:
    """Whether a ``join`` re-plan takes worker ``name`` back: it names it, gives it
    kernels, or names none of ``workers`` ("join of a returning worker": one that came
    back and got no kernels)."""
    named = set(str(join.get("reason", "")).replace(",", " ").split())
    gives = any(d.get("device") == name and int(d.get("kernels", 0)) > 0
                for layer in join.get("counts", []) for d in layer.get("devices", []))
    return name in named or gives or not named & workers


# --- the assessment (pure) ------------------------------------------------------------------
@dataclass
class InjectedFault:
    """A fault as injected: Unix times of its start and of its end (the worker back,
    the link up, the quota restored; None if the run ended first)."""

    kind: str
    worker: str
    at_s: float  # seconds after the first training step
    time: float
    ended: float | None = None
    kernels: int | None = None  # the worker's kernels at the last step before it (None: unknown)


@dataclass(frozen=True)
class FaultOutcome:
    """What one fault did to the run (seconds)."""

    kind: str
    worker: str
    at_s: float
    effect: str  # "recovery" (a snapshot restored) or "none needed"
    kernels: int | None  # the worker's kernels (all layers) when the fault struck
    recoveries: int
    recovery_s: float  # the recoveries' own seconds
    detected_s: float | None  # from the fault to the start of its first recovery
    replayed_steps: int
    time_lost_s: float  # recovery_s + replayed_steps * the fault-free median step
    rejoined_s: float | None  # from the fault's end to the re-plan that took the worker in
    survived: bool


def assess(faults: Sequence[InjectedFault], records: Sequence[dict[str, Any]],
           completed: bool, median_step_s: float, window_s: float) -> list[FaultOutcome]:
    """Each fault's effect from the chaos run's metrics records: the ``recovery``
    records in [its time, its time + window_s) and before the next fault; for a worker
    that was out (killed, restarted, or named by one of those recoveries), the first
    ``join`` re-plan after the fault's end that takes it back (:func:`_takes_in`)."""
    recoveries = [r for r in records if r.get("type") == "recovery"]
    joins = [r for r in records if r.get("type") == "replan"
             and str(r.get("reason", "")).startswith("join")]
    workers = {fault.worker for fault in faults}
    outcomes = []
    for index, fault in enumerate(faults):
        until = fault.time + window_s
        if index + 1 < len(faults):
            until = min(until, faults[index + 1].time)
        mine = [r for r in recoveries if fault.time <= float(r["time"]) < until]
        seconds = sum(float(r.get("seconds") or 0.0) for r in mine)
        replayed = sum(max(0, int(r["failed_step"]) - int(r["resumed_step"])) for r in mine)
        detected = None
        if mine:  # a recovery record is written when it ends, after ``seconds`` of work
            first = min(mine, key=lambda r: float(r["time"]))
            detected = max(0.0, float(first["time"]) - float(first.get("seconds") or 0.0)
                           - fault.time)
        rejoined = None
        out = fault.kind in (SIGKILL, RESTART) or any(
            r.get("participant") == fault.worker for r in mine)  # it has to come back
        if out and fault.ended is not None:
            back = next((r for r in joins if float(r["time"]) >= fault.ended
                         and _takes_in(r, fault.worker, workers)), None)
            rejoined = None if back is None else float(back["time"]) - fault.ended
        outcomes.append(FaultOutcome(
            kind=fault.kind, worker=fault.worker, at_s=fault.at_s,
            effect="recovery" if mine else "none needed", kernels=fault.kernels,
            recoveries=len(mine),
            recovery_s=seconds, detected_s=detected, replayed_steps=replayed,
            time_lost_s=seconds + replayed * median_step_s, rejoined_s=rejoined,
            survived=completed))
    return outcomes


def final_accuracy(records: Sequence[dict[str, Any]]) -> float | None:
    """The test accuracy of the last epoch (the last record of it counts)."""
    epochs = {int(r["epoch"]): r for r in records if r.get("type") == "epoch"}
    if not epochs:
        return None
    value = epochs[max(epochs)].get("test_accuracy")
    return None if value is None else float(value)


def median_step_s(records: Sequence[dict[str, Any]]) -> float:
    """The median step time, the last record of each step counting, the first step
    (warm-up) left out when there are others."""
    by_step = {int(r["step"]): float(r["step_s"]) for r in records if r.get("type") == "step"}
    times = [by_step[s] for s in sorted(by_step)]
    times = times[1:] if len(times) > 1 else times
    return statistics.median(times) if times else 0.0


def auto_epochs(minutes: float, epoch_s: float) -> int:
    """Epochs whose wall time outlasts ``minutes`` by AUTO_MARGIN, given one epoch's."""
    return max(1, math.ceil(minutes * 60 * AUTO_MARGIN / max(epoch_s, 1e-3)))


def epoch_wall_s(records: Sequence[dict[str, Any]]) -> float:
    """The first epoch's wall time, training and evaluation (seconds)."""
    epochs = [r for r in records if r.get("type") == "epoch"]
    if not epochs:
        raise UserError("the probe run recorded no epoch")
    return float(epochs[0].get("epoch_s") or epochs[0]["train_s"])


def run_completed(records: Sequence[dict[str, Any]]) -> bool:
    ends = [r for r in records if r.get("type") == "run_end"]
    return bool(ends) and ends[-1].get("status") == "completed"


# --- the processes --------------------------------------------------------------------------
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


# --- the table ------------------------------------------------------------------------------
def _opt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def _resources_line(result: dict[str, Any]) -> str:
    warm, last = result.get("master_warm"), result.get("master_last")
    if not warm or not last:
        return "- master resources: not sampled (the run was shorter than the warm-up)"
    return (f"- master after warm-up / at the end: RSS {warm['rss_bytes'] / 2**20:.0f} / "
            f"{last['rss_bytes'] / 2**20:.0f} MiB, open files {warm['open_files']} / "
            f"{last['open_files']}, threads {warm['threads']} / {last['threads']}")


def format_table(result: dict[str, Any]) -> list[str]:
    """The summary lines and one table row per fault (markdown)."""
    free, chaos = result["fault_free_accuracy"], result["chaos_accuracy"]
    difference = None if free is None or chaos is None else chaos - free
    settings = result.get("settings") or {}
    lines = ["", f"- mode: {result['mode']}, seed {result['seed']}, {result['epochs']} "
             f"epoch(s) per run, faults for {result['minutes']:g} min or until the run ended",
             "- training settings: " + (", ".join(
                 f"--{key.replace('_', '-')} {value}" for key, value in settings.items())
                 or "the defaults"),
             f"- run completed: {'yes' if result['completed'] else 'NO'}",
             f"- faults injected: {result['faults_injected']} of {result['faults_planned']} "
             f"planned; survived: {result['faults_survived']}",
             f"- final test accuracy: fault-free {_opt(free and 100 * free, '%', 2)}, "
             f"with faults {_opt(chaos and 100 * chaos, '%', 2)} "
             f"(difference {_opt(difference and 100 * difference, ' points', 2)})",
             f"- wall time: fault-free {result['fault_free_wall_s']:.0f} s, with faults "
             f"{result['chaos_wall_s']:.0f} s; fault-free median step "
             f"{result['median_step_s'] * 1e3:.1f} ms",
             _resources_line(result), "",
             "| # | at s | fault | worker | kernels held | effect | detected after s | "
             "recovery s | replayed steps | time lost s | back after s | survived |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for number, fault in enumerate(result["faults"], start=1):
        lines.append(
            f"| {number} | {fault['at_s']:.1f} | {fault['kind']} | {fault['worker']} | "
            f"{'-' if fault.get('kernels') is None else fault['kernels']} | {fault['effect']} | {_opt(fault.get('detected_s'), digits=2)} | "
            f"{fault['recovery_s']:.2f} | {fault['replayed_steps']} | "
            f"{fault['time_lost_s']:.2f} | {_opt(fault['rejoined_s'])} | "
            f"{'yes' if fault['survived'] else 'NO'} |")
    return lines
