"""The chaos bench's fault schedule (pure): the fault kinds and how long each lasts,
the ``--faults`` list parsed, the seeded times and kinds of the faults
(:func:`plan_faults`), and which worker each strikes (:func:`pick_worker`, preferring
one that holds kernels at the last recorded step, :func:`kernels_held`). Used by
:mod:`hetconv.bench.chaos_cluster`, which injects them, and :mod:`hetconv.bench.chaos`.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hetconv.errors import UserError
from hetconv.metrics import participant_entries, participant_of

SIGKILL, SIGSTOP, RESTART, CPU_QUOTA, LINK_DOWN_SHORT, LINK_DOWN_LONG = (
    "sigkill", "sigstop", "restart", "cpu-quota", "link-down-2s", "link-down-20s")
FAULT_KINDS = (SIGKILL, SIGSTOP, RESTART, CPU_QUOTA, LINK_DOWN_SHORT, LINK_DOWN_LONG)
LOOPBACK_FAULTS = (SIGKILL, SIGSTOP, RESTART)
"""The faults that need no root (the others need ``--lab``)."""
RESTART_AFTER_S = 5.0  # a SIGKILLed worker is started again after this
STOPPED_FOR_S = 10.0  # SIGSTOP .. SIGCONT
QUOTA_FRACTION = 0.2  # a cpu-quota fault's core fraction
QUOTA_FOR_S = 60.0  # ... for this long
LINK_DOWN_S = {LINK_DOWN_SHORT: 2.0, LINK_DOWN_LONG: 20.0}


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
        for entry in participant_entries(layer):
            name = participant_of(entry)
            held[name] = held.get(name, 0) + int(entry.get("kernels", 0))
    return held

