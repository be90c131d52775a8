"""A performance model of one training step: compute and link costs -> step seconds.

Pure functions over measured numbers, used by ``hetconv bench scale`` to print a
prediction beside every measurement, and meant for the planner that decides which
machines to use. The model of today's star data plane (every worker exchanges
everything with the master, nothing overlaps):

    step = dense + sum over layers of max over participants (fixed + per_kernel * kernels)
           + master_link_bytes / link_rate

``fixed`` and ``per_kernel`` are the calibration fit of a participant's layer
forward + backward time (seconds, seconds per kernel); ``master_link_bytes`` is
what the master's link carries per step (both directions share the serialised
sends of one socket loop, so they add); ``link_rate`` is in bytes per second.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ParticipantCost:
    """One participant's calibrated cost for one layer (seconds) and its kernels there."""

    fixed_s: float
    per_kernel_s: float
    kernels: int

    def seconds(self) -> float:
        return 0.0 if self.kernels == 0 else self.fixed_s + self.per_kernel_s * self.kernels


def compute_seconds(layers: Sequence[Sequence[ParticipantCost]]) -> float:
    """Conv compute of one step: per layer the slowest participant, summed over layers."""
    return sum(max((p.seconds() for p in layer), default=0.0) for layer in layers)


def star_step_seconds(layers: Sequence[Sequence[ParticipantCost]], dense_s: float,
                      master_link_bytes: float, link_bytes_per_s: float) -> float:
    """Predicted step seconds of the star data plane (no overlap; see the module doc)."""
    if link_bytes_per_s <= 0:
        raise ValueError("link_bytes_per_s must be positive")
    return dense_s + compute_seconds(layers) + master_link_bytes / link_bytes_per_s


def ideal_speedup(machine_speeds: Sequence[float]) -> float:
    """Sum of the machines' speeds over the fastest one's: the most N machines can give."""
    if not machine_speeds or min(machine_speeds) <= 0:
        raise ValueError("machine speeds must be positive")
    return sum(machine_speeds) / max(machine_speeds)
