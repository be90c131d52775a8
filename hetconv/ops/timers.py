"""Optional per-op wall-clock timers, for ``hetconv bench step``'s breakdown.

Off by default: ``timed(name)`` then returns one shared do-nothing context manager, a
few hundred nanoseconds per op. ``collect()`` switches them on for the calling thread
and yields the totals: ``{op name: seconds}`` summed over every ``timed`` block entered
on that thread inside it (an op that fans out to the host-thread pool is timed once,
by the thread that waits for it). Names are the breakdown's rows, e.g.
``conv forward``, ``BN+ReLU+pool backward``, ``dense``, ``SGD update``.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

_local = threading.local()


class _Timer:
    __slots__ = ("name", "totals", "start")

    def __init__(self, name: str, totals: dict[str, float]):
        self.name, self.totals, self.start = name, totals, 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.totals[self.name] = (self.totals.get(self.name, 0.0)
                                  + time.perf_counter() - self.start)


_OFF = contextlib.nullcontext()


def timed(name: str) -> Any:
    """A context manager that adds its block's seconds to ``name`` while ``collect`` runs
    on this thread, else does nothing."""
    totals: dict[str, float] | None = getattr(_local, "totals", None)
    return _OFF if totals is None else _Timer(name, totals)


@contextlib.contextmanager
def collect() -> Iterator[dict[str, float]]:
    """Time every ``timed`` block of the calling thread inside the ``with``; the dict it
    yields holds the totals (seconds by op name), filled as the ops run."""
    previous = getattr(_local, "totals", None)
    totals: dict[str, float] = {}
    _local.totals = totals
    try:
        yield totals
    finally:
        _local.totals = previous
