"""Whether a network can fit across a distributed run's participants, before calibration.

Each participant holds what its share of a step needs (hetconv/planning/memory.py):

- split by samples, a slice of ``s`` samples: every layer whole for those samples
  (``step_need(shapes, s)``);
- split by kernels, a share ``f`` of every layer's kernels: every layer's whole input for
  the whole batch and its kernels' outputs (``layer_bytes(shape, batch, ceil(f K))``).

Each participant's capacity is the largest slice (or kernel share) whose estimate fits in
``USABLE`` of its memory. The run cannot fit when the capacities together fall short of
the batch (or of every kernel) under every split the run may use. Like the local check it
is one-sided: the estimate is a lower bound within its stated band, memory is a
worker's total (its Hello), the master's available, so a refused run would not have fit.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hetconv.model import ConvLayerShape
from hetconv.planning.memory import USABLE, gib, layer_bytes, step_need, workspace_bytes

SHARE_STEPS = 1000
"""The kernel share's resolution (a share is found in 1/1000 of every layer's kernels)."""


def _largest(fits: Callable[[int], bool], most: int) -> int:
    """The largest n in [0, most] with fits(n) (fits is monotone, fits(0) assumed)."""
    low, high = 0, most
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def sample_capacity(shapes: Sequence[ConvLayerShape], batch: int, dense_values: int,
                    memory: int) -> int:
    """The most samples of a step (at most ``batch``) whose slice fits in ``memory``."""
    return _largest(lambda s: step_need(shapes, s, dense_values).total <= USABLE * memory,
                    batch)


def kernel_need(shapes: Sequence[ConvLayerShape], batch: int, share: float) -> int:
    """Bytes a participant holding ``share`` of every layer's kernels needs."""
    counts = [math.ceil(share * shape.kernels) for shape in shapes]
    kept = sum(layer_bytes(shape, batch, k) for shape, k in zip(shapes, counts))
    return kept + max(workspace_bytes(shape, batch, k) for shape, k in zip(shapes, counts))


def kernel_capacity(shapes: Sequence[ConvLayerShape], batch: int, memory: int) -> float:
    """The largest share of every layer's kernels (0..1) that fits in ``memory``."""
    steps = _largest(lambda n: n == 0 or kernel_need(shapes, batch, n / SHARE_STEPS)
                     <= USABLE * memory, SHARE_STEPS)
    return steps / SHARE_STEPS


def machine_memory(participants: Sequence[tuple[str, bool, Mapping[str, Any]]],
                   own_available: int) -> dict[str, int] | None:
    """Memory by machine, named by its participants (``"a+b"``), from (participant, is the
    master's own device, device description) and the master machine's available bytes;
    None when a description says no memory. CPU participants with the same hostname and
    boot time share one machine's memory (the workers of one host, the lab's namespaces);
    a GPU has its own. A machine's memory is the least available any of its participants
    reported (its total where none said), the master's machine ``own_available``."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    memory: dict[tuple[Any, ...], int] = {}
    for name, own, info in participants:
        total = info.get("memory_bytes")
        if not isinstance(total, int) or total <= 0:
            return None
        available = info.get("memory_available_bytes")
        have = available if isinstance(available, int) and available > 0 else total
        machine: tuple[Any, ...] = (info.get("hostname"), info.get("boot_time"),
                                    info.get("device") if info.get("kind") == "gpu" else "cpu")
        if machine[1] is None:  # an older worker: a machine of its own
            machine = (name,)
        if own and machine[2] == "cpu":
            have = own_available
        groups.setdefault(machine, []).append(name)
        memory[machine] = min(memory.get(machine, have), have)
    return {"+".join(names): memory[machine] for machine, names in groups.items()}


def spread_refusal(shapes: Sequence[ConvLayerShape], batch: int, dense_values: int,
                   memory: Mapping[str, int], splits: Sequence[str]) -> str | None:
    """One line saying why the network cannot fit on the machines with ``memory``
    (:func:`machine_memory`) under any of ``splits`` ("samples", "kernels"), or None.
    A machine with several participants counts as one (its fixed costs once: lenient)."""
    if not memory or not shapes:
        return None
    samples = kernels = None
    if "samples" in splits:
        samples = sum(sample_capacity(shapes, batch, dense_values, m) for m in memory.values())
        if samples >= batch:
            return None
    if "kernels" in splits:
        kernels = sum(kernel_capacity(shapes, batch, m) for m in memory.values())
        if kernels >= 1.0:
            return None
    if samples is None and kernels is None:  # no split named: nothing to conclude
        return None
    need = step_need(shapes, batch, dense_values)
    held = []
    if samples is not None:
        held.append(f"{samples} of the batch's {batch} samples split by samples")
    if kernels is not None:
        held.append(f"{kernels:.0%} of the kernels split by kernels")
    machines = ", ".join(f"{name} {gib(m)}" for name, m in memory.items())
    return (f"the network cannot fit at batch {batch} on the {len(memory)} machine(s) of "
            f"this run: a whole training step needs about {gib(need.total)} (conv layer "
            f"{need.largest_layer + 1} alone {gib(need.largest)}), and together they hold at "
            f"most {' or '.join(held)} (memory: {machines}): use a smaller --batch, fewer "
            "kernels, or more workers")
