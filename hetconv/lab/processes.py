"""Local processes of the lab: worker daemons as real subprocesses, always stopped.

A :class:`LocalWorker` is one ``python -m hetconv worker`` subprocess (or another
module that takes the same arguments: the tests' faulty worker), optionally in
a CPU quota (:mod:`hetconv.lab.quota`) and a network namespace
(:mod:`hetconv.lab.network`). Everything started here is stopped on exit.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from hetconv.lab.quota import CFS_PERIOD_US, CpuQuota


class LocalWorker:
    """One ``hetconv worker`` subprocess; ``stop()`` always ends it. ``launcher``: what
    follows ``python`` before ``worker`` (default ``-m hetconv``)."""

    def __init__(self, master: str, name: str, threads: int = 1, cpu_fraction: float | None = None,
                 log_path: Path | None = None, extra_args: tuple[str, ...] = (),
                 netns: str | None = None, env: dict[str, str] | None = None,
                 launcher: Sequence[str] = ("-m", "hetconv"), cpu_period_us: int = CFS_PERIOD_US):
        self.name = name
        self.quota = CpuQuota(cpu_fraction, cpu_period_us) if cpu_fraction is not None else None
        self.log_path = log_path
        self._log: IO[bytes] | int = open(log_path, "wb") if log_path else subprocess.DEVNULL
        command = [sys.executable, *launcher, "worker", "--master", master,
                   "--threads", str(threads), "--name", name, *extra_args]
        if netns is not None:  # run it on the emulated LAN host
            command = ["ip", "netns", "exec", netns, *command]
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads),
                       **(env or {})}
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=environment)
        self._terminated = False
        if self.quota is not None:
            try:
                self.quota.add(self.process.pid)
            except BaseException:
                self.stop()
                raise

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM) without waiting; ``stop()`` then waits for it. Several
        workers told first wind down at the same time instead of one after another."""
        if self.process.poll() is None and not self._terminated:
            self.process.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout_s: float = 3.0) -> int | None:
        if self.process.poll() is None:
            self.terminate()
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
            worker.terminate()
        for worker in self.workers:
            worker.stop()


def wait_for(predicate: Any, timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())
