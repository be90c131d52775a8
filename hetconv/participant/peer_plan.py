"""The peer data plane's plan: every layer's kernel ranges and the routes they imply.

Pure data (no sockets, no arrays): which participant holds which kernels of every
conv layer, who relays layer 0's input, who sends which piece to whom in each phase,
(when the master knows them) every layer's input H and W, so a piece of another
size is bad data, and the sample split's *bucket*: the first layers whose weight
gradients are reduced together (:mod:`hetconv.participant.samples.weight_reduce`). It travels in ``AssignPeers.plan`` (:meth:`PeerPlan.to_wire`).
:mod:`hetconv.participant.kernels.exchange` moves the pieces the plan describes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hetconv.config import MASTER_PARTICIPANT

PHASE_INPUT = "input"
PHASE_FORWARD = "forward"
PHASE_BACKWARD = "backward"
PHASES = (PHASE_INPUT, PHASE_FORWARD, PHASE_BACKWARD)
MAX_BUCKET_ELEMENTS = 1 << 26
"""No layer of a bucket has more weight-gradient elements than this (a hostile plan
cannot make a participant wait for a huge piece)."""


@dataclass(frozen=True)
class KernelRange:
    """Kernels [start, stop) of one layer held by ``participant`` (may be empty)."""

    participant: str
    start: int
    stop: int

    @property
    def kernels(self) -> int:
        return self.stop - self.start


class PeerPlan:
    """Every layer's kernel ranges, one per participant in kernel order, and the routes
    that follow from them. ``layers[l]`` lists ranges that tile [0, K_l)."""

    def __init__(self, layers: Sequence[Sequence[KernelRange]],
                 input_sizes: Sequence[tuple[int, int]] = (), bucket: Sequence[int] = ()):
        self.layers = [list(ranges) for ranges in layers]
        # (H, W) of every layer's input, when known: a piece of another size is bad data
        self.input_sizes = [tuple(size) for size in input_sizes]
        if self.input_sizes and len(self.input_sizes) != len(self.layers):
            raise ValueError("plan: input sizes must give one (H, W) per layer")
        # elements of the weight gradients of layers 0..len(bucket)-1, reduced together
        self.bucket = [int(size) for size in bucket]
        if len(self.bucket) > len(self.layers) or any(
                size <= 0 or size > MAX_BUCKET_ELEMENTS for size in self.bucket):
            raise ValueError(f"plan: the bucket must give 1 to {MAX_BUCKET_ELEMENTS} elements "
                             f"for at most every layer of the plan")
        for index, ranges in enumerate(self.layers):
            position = 0
            for kernel_range in ranges:
                if kernel_range.start != position or kernel_range.stop < kernel_range.start:
                    raise ValueError(f"layer {index}: ranges do not tile the kernels in order")
                position = kernel_range.stop
            if position == 0:
                raise ValueError(f"layer {index}: no kernels")

    # --- wire form (AssignPeers.plan) --------------------------------------------------
    @classmethod
    def from_wire(cls, plan: list[Any]) -> PeerPlan:
        """From ``[[[participant, start, stop], ...] per layer]``, optionally followed by
        ``{"input_sizes": [[H, W], ...], "bucket": [elements, ...]}`` (either key may be
        absent); ValueError if malformed."""
        layers: list[list[KernelRange]] = []
        sizes: list[tuple[int, int]] = []
        bucket: list[int] = []
        if plan and isinstance(plan[-1], dict):
            extra, plan = plan[-1], plan[:-1]
            raw = extra.get("input_sizes", [])
            if not (isinstance(raw, list) and all(
                    isinstance(hw, list) and len(hw) == 2
                    and all(type(v) is int and 0 < v <= 1 << 16 for v in hw) for hw in raw)):
                raise ValueError("plan: input_sizes must be [[H, W], ...] of positive ints")
            sizes = [(hw[0], hw[1]) for hw in raw]
            bucket = extra.get("bucket", [])
            if not (isinstance(bucket, list) and all(type(v) is int for v in bucket)):
                raise ValueError("plan: bucket must be a list of ints")
        for ranges in plan:
            if not isinstance(ranges, list):
                raise ValueError("plan: every layer must be a list of ranges")
            layer = []
            for item in ranges:
                if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                        and all(type(v) is int for v in item[1:])):
                    raise ValueError("plan: a range must be [participant, start, stop]")
                layer.append(KernelRange(item[0], item[1], item[2]))
            layers.append(layer)
        return cls(layers, sizes, bucket)

    def to_wire(self) -> list[Any]:
        ranges: list[Any] = [[[r.participant, r.start, r.stop] for r in layer]
                             for layer in self.layers]
        extra: dict[str, Any] = {}
        if self.input_sizes:
            extra["input_sizes"] = [list(size) for size in self.input_sizes]
        if self.bucket:
            extra["bucket"] = list(self.bucket)
        if extra:
            ranges.append(extra)
        return ranges

    def in_bucket(self, layer: int) -> bool:
        """Whether ``layer``'s weight gradient is reduced in the bucket."""
        return 0 <= layer < len(self.bucket)

    def input_size(self, layer: int) -> tuple[int, ...] | None:
        """(H, W) of ``layer``'s input, if known (None past the last layer)."""
        return self.input_sizes[layer] if 0 <= layer < len(self.input_sizes) else None

    # --- queries -------------------------------------------------------------------------
    @property
    def last_layer(self) -> int:
        return len(self.layers) - 1

    def holders(self, layer: int) -> list[KernelRange]:
        """The non-empty ranges of ``layer``, in kernel order."""
        return [r for r in self.layers[layer] if r.kernels > 0]

    def range_of(self, layer: int, participant: str) -> KernelRange | None:
        """``participant``'s non-empty range of ``layer``, or None."""
        return next((r for r in self.holders(layer) if r.participant == participant), None)

    def holds(self, layer: int, participant: str) -> bool:
        return self.range_of(layer, participant) is not None

    # --- routes (``me`` included where it sends to or receives from itself) -------------
    def input_relay(self) -> str | None:
        """The worker that gets layer 0's input from the master and passes it on."""
        return next((r.participant for r in self.holders(0)
                     if r.participant != MASTER_PARTICIPANT), None)

    def input_targets(self, me: str) -> list[str]:
        """Who gets layer 0's input from ``me`` (the relay: the other workers of layer 0)."""
        if me != self.input_relay():
            return []
        return [r.participant for r in self.holders(0)
                if r.participant not in (me, MASTER_PARTICIPANT)]

    def forward_sources(self, layer: int, me: str) -> list[KernelRange]:
        """Output pieces of layer-1 that ``me`` assembles into layer's input."""
        if layer == 0 or not self.holds(layer, me):
            return []
        return self.holders(layer - 1)

    def forward_targets(self, layer: int, me: str) -> list[str]:
        """Who gets ``me``'s output piece of ``layer`` (the holders of layer+1)."""
        if layer == self.last_layer or not self.holds(layer, me):
            return []
        return [r.participant for r in self.holders(layer + 1)]

    def backward_sources(self, layer: int, me: str) -> list[KernelRange]:
        """Whose partial gradients ``me`` sums into its output gradient of ``layer``
        (the holders of layer+1, in kernel order)."""
        if layer == self.last_layer or not self.holds(layer, me):
            return []
        return self.holders(layer + 1)

    def backward_targets(self, layer: int, me: str) -> list[KernelRange]:
        """Slices of ``me``'s partial input gradient of ``layer`` and who gets each
        (the holders of layer-1 and their ranges)."""
        if layer == 0 or not self.holds(layer, me):
            return []
        return self.holders(layer - 1)

    def expected_range(self, layer: int, phase: str, sender: str,
                       receiver: str) -> KernelRange | None:
        """The channels a ``phase`` piece of ``layer`` from ``sender`` to ``receiver`` must
        carry, or None when no such piece belongs in the plan."""
        if not 0 <= layer <= self.last_layer or layer == self.last_layer:
            return None
        if phase == PHASE_FORWARD:
            if self.holds(layer + 1, receiver):
                return self.range_of(layer, sender)
        elif phase == PHASE_BACKWARD:
            if self.holds(layer + 1, sender):
                return self.range_of(layer, receiver)
        return None
