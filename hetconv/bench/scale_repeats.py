"""The per-repeat table of ``hetconv bench scale``: every run's median step in each
interleaved repeat, so that a figure file shows the spread behind its medians (the
baselines', hetconv's and the peer's), not only the medians.

Pure: step seconds in, markdown lines out (``tests/unit/test_scale_repeats.py``).
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence


def format_repeats_table(runs: Mapping[str, Sequence[float]]) -> list[str]:
    """Markdown lines: one row per run name (in ``runs``' order) with its median step
    (ms) in repeat 1..N, the median over them and the spread, (max − min) / median.
    ``runs``: name -> step seconds per repeat, in repeat order (a run measured in fewer
    repeats than the others shows ``-`` for the missing ones). No runs: no lines."""
    if not runs:
        return []
    repeats = max(len(steps) for steps in runs.values())
    lines = ["", "Each run's median step in every repeat (the repeats interleave the runs: "
             "repeat 1 of every run, then repeat 2, ...), their median and their spread "
             "((highest − lowest) / median).", "",
             "| run | " + " | ".join(f"repeat {k + 1} ms" for k in range(repeats))
             + " | median ms | spread |",
             "|---|" + "---|" * (repeats + 2)]
    for name, steps in runs.items():
        if not steps:
            continue
        cells = [f"{s * 1e3:.1f}" for s in steps] + ["-"] * (repeats - len(steps))
        median = statistics.median(steps)
        spread = (max(steps) - min(steps)) / median if median > 0 else 0.0
        lines.append(f"| {name} | " + " | ".join(cells)
                     + f" | {median * 1e3:.1f} | {100 * spread:.0f}% |")
    return lines
