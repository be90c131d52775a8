"""The master's own share of a phase or a round, computed in a helper thread (both splits).

While the helper thread computes, the main thread gathers the workers' replies, so each
reply is stamped when it arrives (a measure the sample split's re-slicing relies on:
stamped after the master's own compute, every worker would look as slow as the master
and the master would draw the work onto itself). The helper wakes the gather loop
through an inproc socket the cluster polls (``Cluster.extra_sockets``) the moment it is
done. Jobs run one at a time, in the order submitted (a step sent ahead queues behind the
step before it); :meth:`OwnShare.wait` always returns only once the job has finished,
so nothing else touches the master's replicas meanwhile.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from hetconv.master.cluster import Cluster


class JobCancelled(Exception):
    """The job was cancelled before it started (its step was abandoned)."""


class OwnJob:
    """One job's outcome: ``result`` or ``error``, how long it ran (``seconds``, s) and
    when it finished (monotonic s). ``cancelled`` set before the job starts makes it end
    at once with JobCancelled."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.cancelled = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.finished_at = 0.0


class OwnShare:
    """A one-thread executor that wakes the cluster's gather loop when a job ends."""

    def __init__(self, cluster: Cluster, thread_name: str = "hetconv-own"):
        self.cluster = cluster
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._endpoint = f"inproc://own-share-{uuid.uuid4().hex}"
        wake = cluster.ctx.socket(zmq.PAIR)
        wake.bind(self._endpoint)
        cluster.extra_sockets.append(wake)
        self._sender: Any = None  # created in, and only used by, the helper thread

    def submit(self, work: Callable[[], Any]) -> OwnJob:
        job = OwnJob()

        def run() -> None:
            start = time.perf_counter()
            try:
                if job.cancelled.is_set():
                    raise JobCancelled("cancelled before it started")
                job.result = work()
            except BaseException as error:  # re-raised by the main thread
                job.error = error
            finally:
                job.seconds = time.perf_counter() - start
                job.finished_at = time.monotonic()
                job.done.set()
                if self._sender is None:
                    self._sender = self.cluster.ctx.socket(zmq.PAIR)
                    self._sender.setsockopt(zmq.LINGER, 0)
                    self._sender.connect(self._endpoint)
                self._sender.send(b"")

        self._executor.submit(run)
        return job

    @staticmethod
    def wait(job: OwnJob) -> Any:
        """The job's result once it has finished (its error raised)."""
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def wait_idle(self) -> None:
        """Return once every job submitted so far has finished (the helper thread idle)."""
        self._executor.submit(lambda: None).result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        if self._sender is not None:  # the helper thread is gone: safe to close here
            self._sender.close(linger=0)
            self._sender = None
