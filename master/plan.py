"""The kernel plan: which participant holds which shard of every conv layer.

Vocabulary (used everywhere in ``hetconv.master``):

- a *participant* is the master's own device (id ``"master"``) or one worker
  (id: the worker's name); a *device* is what a participant computes on
  (``cpu``, ``gpu:N``);
- a *shard* is kernels ``[start, stop)`` of one conv layer held by one participant;
  its *share* is the fraction ``(stop - start) / kernels`` of the layer.

Everything here is pure: kernel counts in, shards out (the counts come from the split
rule, :mod:`hetconv.master.kernels.split`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hetconv.model import ConvLayerShape
from hetconv.planning.partition import kernel_ranges

if TYPE_CHECKING:
    from hetconv.master.cluster import WorkerHandle


@dataclass(frozen=True)
class Participant:
    """The master's own device (``worker`` None) or one worker."""

    participant: str  # "master" or the worker id
    worker: WorkerHandle | None
    description: dict[str, Any]  # the device description (hetconv.device_info)


@dataclass(frozen=True)
class Shard:
    """Kernels [start, stop) of one conv layer on one participant (worker None = master)."""

    participant: str
    worker: WorkerHandle | None
    start: int
    stop: int

    @property
    def kernels(self) -> int:
        return self.stop - self.start


def format_split(plan: list[list[Shard]], shapes: list[ConvLayerShape]) -> list[str]:
    """Human-readable lines: the kernels each participant got per layer."""
    lines = []
    for shape, shards in zip(shapes, plan):
        cells = ", ".join(f"{s.participant} {s.kernels} ({100 * s.kernels / shape.kernels:.0f}%)"
                          for s in shards)
        lines.append(f"hetconv: layer {shape.index + 1} split of {shape.kernels} kernels: {cells}")
    return lines


def shards_from_counts(participants: list[Participant],
                       counts: Sequence[Sequence[int]]) -> list[list[Shard]]:
    """Shards per layer from kernel counts per layer per participant (kernel order)."""
    return [[Shard(p.participant, p.worker, start, stop)
             for p, (start, stop) in zip(participants, kernel_ranges(list(row)))]
            for row in counts]


def reshard(shards: Sequence[Sequence[Shard]],
            counts: Sequence[Sequence[int]]) -> list[list[Shard]]:
    """The same participants (each layer's shards in participant order) with new kernel
    counts per layer per participant; the counts of a layer must sum to its kernels."""
    if len(counts) != len(shards):
        raise ValueError(f"counts for {len(counts)} layers, the plan has {len(shards)}")
    out = []
    for layer, (row, layer_counts) in enumerate(zip(shards, counts)):
        kernels = row[-1].stop if row else 0
        if len(layer_counts) != len(row) or sum(layer_counts) != kernels \
                or min(layer_counts, default=0) < 0:
            raise ValueError(f"layer {layer}: counts {list(layer_counts)} do not split its "
                             f"{kernels} kernels over {len(row)} participants")
        out.append([Shard(s.participant, s.worker, start, stop)
                    for s, (start, stop) in zip(row, kernel_ranges(list(layer_counts)))])
    return out
