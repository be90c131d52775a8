"""The chaos bench's report: the summary lines and one markdown table row per fault,
from the result dictionary :func:`hetconv.bench.chaos.run_chaos_bench` returns (and
writes to ``chaos.json``).
"""
from __future__ import annotations

from typing import Any


def _opt(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def _resources_line(result: dict[str, Any]) -> str:
    warm, last = result.get("master_warm"), result.get("master_last")
    if not warm or not last:
        return "- master resources: not sampled (the run was shorter than the warm-up)"
    return (f"- master after warm-up / at the end: RSS {warm['rss_bytes'] / 2**20:.0f} / "
            f"{last['rss_bytes'] / 2**20:.0f} MiB, open files {warm['open_files']} / "
            f"{last['open_files']}, threads {warm['threads']} / {last['threads']}")


def format_table(result: dict[str, Any]) -> list[str]:
    """The summary lines and one table row per fault (markdown)."""
    free, chaos = result["fault_free_accuracy"], result["chaos_accuracy"]
    difference = None if free is None or chaos is None else chaos - free
    settings = result.get("settings") or {}
    lines = ["", f"- mode: {result['mode']}, seed {result['seed']}, {result['epochs']} "
             f"epoch(s) per run, faults for {result['minutes']:g} min or until the run ended",
             "- training settings: " + (", ".join(
                 f"--{key.replace('_', '-')} {value}" for key, value in settings.items())
                 or "the defaults"),
             f"- run completed: {'yes' if result['completed'] else 'NO'}",
             f"- faults injected: {result['faults_injected']} of {result['faults_planned']} "
             f"planned; survived: {result['faults_survived']}",
             f"- final test accuracy: fault-free {_opt(free and 100 * free, '%', 2)}, "
             f"with faults {_opt(chaos and 100 * chaos, '%', 2)} "
             f"(difference {_opt(difference and 100 * difference, ' points', 2)})",
             f"- wall time: fault-free {result['fault_free_wall_s']:.0f} s, with faults "
             f"{result['chaos_wall_s']:.0f} s; fault-free median step "
             f"{result['median_step_s'] * 1e3:.1f} ms",
             _resources_line(result), "",
             "| # | at s | fault | worker | kernels held | effect | detected after s | "
             "recovery s | replayed steps | time lost s | back after s | survived |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for number, fault in enumerate(result["faults"], start=1):
        lines.append(
            f"| {number} | {fault['at_s']:.1f} | {fault['kind']} | {fault['worker']} | "
            f"{'-' if fault.get('kernels') is None else fault['kernels']} | {fault['effect']} | {_opt(fault.get('detected_s'), digits=2)} | "
            f"{fault['recovery_s']:.2f} | {fault['replayed_steps']} | "
            f"{fault['time_lost_s']:.2f} | {_opt(fault['rejoined_s'])} | "
            f"{'yes' if fault['survived'] else 'NO'} |")
    return lines
