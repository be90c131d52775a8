"""Replay recorded compute per sample through the sample split's re-slicing, two versions.

The re-slicing (``SampleBalance``, master/samples/balance.py) decides from each
participant's measured compute per sample. This replays recorded runs' series of it
(per step and participant, from ``hetconv bench scale`` work directories' metrics) at
the slices each version chooses: a participant's compute in a step is its recorded
compute per sample that step times the samples the version gave it (the recording's
per-sample figure is taken as independent of the slice: true of the equal machines,
rough for a machine with a large fixed cost per step and a tiny slice). For each run
and version it prints how often the batch was re-sliced and the cost: the sum over the
steps of the slowest participant's compute, over the same sum for the one split that
is best on average (slices by each participant's mean compute per sample): 1.000 is as
good as knowing the average in advance.

    python docs/figures/ab/rebalance-replay.py --old REV [--runs FILE] [--extract FILE] [RUN_DIR/metrics.jsonl ...]

``--old REV``: the other version, ``SampleBalance`` at that git revision (master/samples/balance.py,
or master/samples/plan.py where it lived before 2026-11-30; the
working tree's is the new one). Metrics files given: their runs are read (and, with
``--extract FILE``, written to FILE as JSON: recorded_runs.py); without them the runs
come from ``--runs FILE`` (default: recorded-runs.json beside this script, the bench
runs on this lab that the figures of 2026-11-29/30 came from). Runs with fewer than 40
steps of every participant computing are left out.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
import recorded_runs  # noqa: E402

from hetconv.master.samples import balance as new_plan  # noqa: E402
from hetconv.master.samples.plan import sample_slices  # noqa: E402

Series = list[dict[str, float]]  # per step: participant -> seconds per sample


def series_of(run: recorded_runs.Run) -> Series:
    """The steps where every participant of the run's most common set computed."""
    steps: Series = [{n: compute[n] / samples[n] for n in samples}
                     for _, _, compute, samples in recorded_runs.step_figures(run)
                     if len(samples) >= 2 and all(c > 0 for c in samples.values())]
    if not steps:
        return steps
    common = Counter(tuple(sorted(s)) for s in steps).most_common(1)[0][0]
    return [s for s in steps if tuple(sorted(s)) == common]


def replay(plan: Any, series: Series, calibration: dict[str, float], batch: int = 128
           ) -> tuple[int, float]:
    """(re-slices, cost) of one version over one run's series; the balance starts from
    the run's calibration (seconds per sample) where it has every participant, else
    from the median of the first three steps."""
    names = list(series[0])
    start = calibration if set(names) <= set(calibration) else {
        n: statistics.median(s[n] for s in series[:3]) for n in names}
    balance = plan.SampleBalance({n: start[n] for n in names})
    slices = {s.participant: s.samples for s in balance.slices(names, batch)}
    mean = {n: statistics.mean(s[n] for s in series) for n in names}
    best = {s.participant: s.samples for s in sample_slices(names, [mean[n] for n in names], batch)}
    moves, total, best_total = 0, 0.0, 0.0
    for step in series:
        compute = {n: step[n] * slices[n] for n in names}
        total += max(compute.values())
        best_total += max(step[n] * best[n] for n in names)
        if balance.observe(compute, compute, dict(slices)):
            slices = {s.participant: s.samples for s in balance.slices(names, batch)}
            moves += 1
    return moves, total / best_total


def window_gains(series: Series, batch: int = 128, window: int = 9) -> list[float]:
    """The gain a re-slice from each (non-overlapping) ``window``-step median of a run
    of equal machines would predict against the even split: 1 - (the slowest compute
    at the slices by those medians) / (the slowest at the even split). From the steps
    as recorded (not replayed): how large a gain the noise alone predicts."""
    names = list(series[0])
    even = {s.participant: s.samples for s in
            sample_slices(names, [1.0] * len(names), batch)}
    gains = []
    for start in range(0, len(series) - window + 1, window):
        medians = {n: statistics.median(step[n] for step in series[start:start + window])
                   for n in names}
        now = max(medians[n] * even[n] for n in names)
        best = sample_slices(names, [medians[n] for n in names], batch)
        gains.append(1 - max(medians[s.participant] * s.samples for s in best if s.samples)
                     / now)
    return gains


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True)
    parser.add_argument("--runs", type=Path,
                        default=Path(__file__).with_name("recorded-runs.json"))
    parser.add_argument("--extract", type=Path)
    parser.add_argument("--gains", action="store_true",
                        help="also the predicted gains of 9-step windows on equal machines")
    parser.add_argument("metrics", nargs="*", type=Path)
    args = parser.parse_args()
    if args.metrics:
        recorded = {recorded_runs.run_name(p): recorded_runs.extract(p) for p in args.metrics}
        if args.extract:
            recorded_runs.write(recorded, args.extract)
    else:
        recorded = recorded_runs.load(args.runs)
    runs = {name: (series, {n: ms / 1e3 for n, ms in run.get("calibration_ms", {}).items()})
            for name, series, run in ((name, series_of(run), run) for name, run in recorded.items())
            if len(series) >= 40}
    try:
        old = recorded_runs.module_at(args.old, "master/samples/balance.py", ROOT)
    except subprocess.CalledProcessError:  # before 2026-11-30 it lived in sample_plan.py
        old = recorded_runs.module_at(args.old, "master/samples/plan.py", ROOT)
    print(f"| run | steps | re-slices, {args.old} | cost, {args.old} | re-slices, new | cost, new |")
    print("|---|---|---|---|---|---|")
    groups: dict[str, list[tuple[int, float, int, float]]] = {}
    for name, (series, calibration) in sorted(runs.items()):
        (om, oc), (nm, nc) = replay(old, series, calibration), replay(new_plan, series, calibration)
        print(f"| {name} | {len(series)} | {om} | {oc:.3f} | {nm} | {nc:.3f} |")
        groups.setdefault(machines_of(name), []).append((om, oc, nm, nc))
    print()
    print(f"| machines | runs | re-slices, {args.old} | cost, {args.old} | re-slices, new | "
          "cost, new |")
    print("|---|---|---|---|---|---|")
    every = [r for group in groups.values() for r in group]
    for machines, rows in sorted(groups.items()) + [("every run", every)]:
        means = [statistics.mean(r[i] for r in rows) for i in range(4)]
        print(f"| {machines} | {len(rows)} | {means[0]:.2f} | {means[1]:.3f} | "
              f"{means[2]:.2f} | {means[3]:.3f} |")
    if args.gains:
        print_gains({name: series for name, (series, _) in runs.items()})


def print_gains(runs: dict[str, Series]) -> None:
    """Per configuration of equal machines: the distribution of :func:`window_gains`."""
    print()
    print("| equal machines | 9-step windows | median predicted gain | 90th percentile | "
          "largest | share >= 30 % |")
    print("|---|---|---|---|---|---|")
    by_machines: dict[str, list[float]] = {}
    for name, series in runs.items():
        machines = machines_of(name)
        if len(set(machines.split("[")[1].rstrip("]").split(","))) == 1:
            by_machines.setdefault(machines, []).extend(window_gains(series))
    for machines, gains in sorted(by_machines.items()):
        gains.sort()
        print(f"| {machines} | {len(gains)} | {statistics.median(gains):.1%} | "
              f"{gains[int(0.9 * len(gains))]:.1%} | {gains[-1]:.1%} | "
              f"{sum(g >= 0.3 for g in gains) / len(gains):.0%} |")


def machines_of(run: str) -> str:
    """``4x[0.45,0.45,0.45,0.45]`` of ``abc/4x[0.45,0.45,0.45,0.45]-auto/repeat1``."""
    return run.split("/")[1].split("]")[0] + "]"


if __name__ == "__main__":
    main()
