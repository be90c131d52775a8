"""The peer's figures beside hetconv's in ``hetconv bench scale --peer ddp`` (pure: rows
in, rows or Markdown lines out; the runs themselves are :mod:`hetconv.bench.scale`'s).

A row is one hetconv configuration's summary (``step_s``, ``speedup``, ``machines``, its
per-participant ``breakdown``); :func:`add_peer_figures` adds PyTorch DDP's medians for
the same machines (``ddp_even_step_s``, ``ddp_speed_step_s``, ``torch_alone_step_s``,
the ratios, and each rank's compute-only step ``ddp_even_compute_s``), keyed by
:func:`ddp_label`. Times are seconds; the tables print milliseconds.

The ratios are of the medians over the repeats; beside them the tables give the
lowest and highest ratio of one repeat's figures (``..._repeats``: hetconv's step in
repeat k over the peer's in repeat k, the runs closest in time, since the repeats
interleave them), so a reader sees how far the host's drift moves the comparison.
"""
from __future__ import annotations

import statistics
from typing import Any

from hetconv.bench.scale_cpu import merge_cpu_repeats

SPLITS_MEASURED = ("even", "speed")
"""The peer's batch splits (the by-speed run only where the machines differ)."""


def ddp_label(fractions: tuple[float, ...], split: str) -> str:
    """``ddp-even 4x[0.45,...]``: the peer's run of a machine set with a batch split."""
    return f"ddp-{split} {len(fractions)}x[{','.join(f'{f:g}' for f in fractions)}]"



def add_peer_figures(rows: list[dict[str, Any]],
                     configurations: list[tuple[tuple[float, ...], str]],
                     peer_results: dict[str, list[float]],
                     peer_compute: dict[str, list[list[float]]] | None = None,
                     peer_cpu: dict[str, list[dict[str, dict[str, float]]]] | None = None
                     ) -> None:
    """Add the peer's medians to every row: DDP with the even and the by-speed batch
    split (the same run where the machines are equal), PyTorch alone on the fastest
    machine, and hetconv's step over each; with ``peer_compute`` (per repeat, each rank's
    compute-only step of the even split) also ``ddp_even_compute_s``, each rank's median
    over the repeats; with ``peer_cpu`` (per repeat, each rank's CPU figures:
    :func:`hetconv.bench.scale_cpu.machine_cpu`) ``ddp_even_cpu`` and, where the
    machines differ, ``ddp_speed_cpu``, their medians over the repeats, and PyTorch
    alone's, ``torch_alone_cpu``."""
    for row, (fractions, _) in zip(rows, configurations):
        for split in SPLITS_MEASURED:
            cpu = [r for r in (peer_cpu or {}).get(ddp_label(fractions, split), []) if r]
            if cpu:
                row[f"ddp_{split}_cpu"] = merge_cpu_repeats(cpu)
        alone_cpu = [r for r in (peer_cpu or {}).get(ddp_label((max(fractions),), "even"), [])
                     if r]
        if alone_cpu:
            row["torch_alone_cpu"] = merge_cpu_repeats(alone_cpu)
        repeats = [r for r in (peer_compute or {}).get(ddp_label(fractions, "even"), []) if r]
        if repeats:
            row["ddp_even_compute_s"] = [statistics.median(r[rank] for r in repeats)
                                         for rank in range(min(map(len, repeats)))]
        even = statistics.median(peer_results[ddp_label(fractions, "even")])
        speed_runs = peer_results.get(ddp_label(fractions, "speed"))
        speed = statistics.median(speed_runs) if speed_runs else even
        alone = statistics.median(peer_results[ddp_label((max(fractions),), "even")])
        row.update({"ddp_even_step_s": even, "ddp_speed_step_s": speed,
                    "torch_alone_step_s": alone,
                    "hetconv_over_ddp_even": row["step_s"] / even,
                    "hetconv_over_ddp_speed": row["step_s"] / speed})
        ours = row.get("repeat_steps_s", [])
        for split, runs in (("even", peer_results[ddp_label(fractions, "even")]),
                            ("speed", speed_runs or peer_results[ddp_label(fractions, "even")])):
            row[f"hetconv_over_ddp_{split}_repeats"] = repeat_ratios(ours, runs)


def repeat_ratios(ours: list[float], theirs: list[float]) -> list[float]:
    """Repeat k's step over the peer's repeat k, for every repeat both measured (the
    lists are in repeat order); none where their lengths differ (a run missing from a
    repeat would pair figures of different repeats)."""
    if len(ours) != len(theirs):
        return []
    return [a / b for a, b in zip(ours, theirs) if b > 0]


def ratio_cell(row: dict[str, Any], key: str) -> str:
    """``1.09`` or, with two or more repeats, ``1.09 (1.02-1.21)``: the median ratio and
    the lowest and highest ratio of one repeat."""
    repeats = row.get(f"{key}_repeats") or []
    if len(repeats) < 2:
        return f"{row[key]:.2f}"
    return f"{row[key]:.2f} ({min(repeats):.2f}-{max(repeats):.2f})"


def format_peer_table(rows: list[dict[str, Any]], rate: str) -> list[str]:
    """hetconv against PyTorch DDP on the same machines (ratio < 1: hetconv is faster);
    the ratios of the medians, and in brackets the lowest and highest of one repeat's."""
    lines = ["", "| machines (core each) | link | hetconv ms (x over hetconv alone) | "
             "DDP even split ms (x over torch alone) | DDP split by speed ms | "
             "hetconv / DDP even (repeats' range) | hetconv / DDP by speed (repeats' range) |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['machines']} | {row.get('rate', rate)} | {row['step_s'] * 1e3:.1f} "
            f"({row['speedup']:.2f}x) | {row['ddp_even_step_s'] * 1e3:.1f} "
            f"({row['torch_alone_step_s'] / row['ddp_even_step_s']:.2f}x) | "
            f"{row['ddp_speed_step_s'] * 1e3:.1f} | {ratio_cell(row, 'hetconv_over_ddp_even')} | "
            f"{ratio_cell(row, 'hetconv_over_ddp_speed')} |")
    return lines


def format_peer_breakdown(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: where DDP's step (even split) and hetconv's go, side by side.
    DDP's compute is each rank's step under ``no_sync()`` (forward, backward and update,
    no all-reduce; all ranks at once, in their quotas); the rest of its step, over the
    slowest rank's compute, is what its gradients' all-reduce costs, CPU and waiting.
    hetconv's compute is each participant's conv layers' forward and backward timed in
    the real step (its exchanges' I/O thread shares the quota), its peer wait the time
    it waited for peers' pieces (the breakdown table below)."""
    with_ranks = [row for row in rows if row.get("ddp_even_compute_s")]
    if not with_ranks:
        return []
    lines = ["", "Where each step goes, medians (then over the repeats), lowest-highest rank "
             "or participant: DDP's compute is a rank's step under `no_sync()` (forward, "
             "backward, update, with no all-reduce running: neither its CPU nor its waits), "
             "the rest of DDP's step over its slowest rank's compute is what the all-reduce "
             "costs, CPU and waiting; hetconv's compute is a participant's conv layers, "
             "timed in the real step (its exchanges' I/O thread shares the machine's "
             "quota), its peer wait the waiting for peers' pieces.", "",
             "| machines (core each) | DDP step ms | DDP rank compute ms | DDP step beyond "
             "the slowest rank's compute ms | hetconv step ms | hetconv participant compute "
             "ms | hetconv peer wait ms |",
             "|---|---|---|---|---|---|---|"]

    def span(values: list[float]) -> str:
        low, high = min(values) * 1e3, max(values) * 1e3
        return f"{low:.1f}" if abs(high - low) < 0.05 else f"{low:.1f}-{high:.1f}"

    for row in with_ranks:
        ranks = row["ddp_even_compute_s"]
        people = list(row.get("breakdown", {}).values())
        compute = span([p["compute_s"] for p in people]) if people else "-"
        waits = span([p["peer_wait_s"] for p in people]) if people else "-"
        lines.append(f"| {row['machines']} | {row['ddp_even_step_s'] * 1e3:.1f} | "
                     f"{span(ranks)} | {(row['ddp_even_step_s'] - max(ranks)) * 1e3:.1f} | "
                     f"{row['step_s'] * 1e3:.1f} | {compute} | {waits} |")
    return lines
