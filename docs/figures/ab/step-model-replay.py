"""Replay recorded runs' steps through the step model calibrated in place, two versions.

The step model (master/samples/step_model.py) fits its terms on a run's first steps and checks
its prediction on the next ones (``model`` records). This feeds each recorded run's
steps (recorded_runs.py: the step, its conv part as the rounds' wall time, one round a
step as under the step chain, each participant's compute and samples) to the model of
``--old REV`` and to this working tree's, and prints each run's check errors ((predicted
- measured) / measured) as the run recorded them, as the old version replays them (how
faithful the replay is) and as the new one does; then, per machine configuration and
for every run, the median absolute error of the first and of the last check, how many
last checks are within 10 %, and the mean signed error of the last check.

    python docs/figures/ab/step-model-replay.py --old REV [--runs FILE]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
import recorded_runs  # noqa: E402

from hetconv.master.samples import step_model as new_model  # noqa: E402


def checks(model: Any, run: recorded_runs.Run) -> list[float]:
    """The check errors of one version over one run's steps (the master's steps only:
    a run always has the master)."""
    in_place, errors = model.InPlaceModel(), []
    for step_s, conv_s, compute, samples in recorded_runs.step_figures(run):
        if "master" not in samples:
            continue
        check = in_place.observe(model.StepSample(step_s, conv_s, 1, compute, samples))
        if check is not None:
            errors.append(check.error)
    return errors


def summary(rows: list[list[float]]) -> str:
    rows = [r for r in rows if r]
    if not rows:
        return "| | | | |"
    first = statistics.median(abs(r[0]) for r in rows)
    last = [r[-1] for r in rows]
    within = sum(abs(e) <= 0.10 for e in last)
    return (f"{first:.1%} | {statistics.median(abs(e) for e in last):.1%} | {within}/{len(last)} "
            f"| {statistics.mean(last):+.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True)
    parser.add_argument("--runs", type=Path,
                        default=Path(__file__).with_name("recorded-runs.json"))
    args = parser.parse_args()
    runs = recorded_runs.load(args.runs)
    old = recorded_runs.module_at(args.old, "master/samples/step_model.py", ROOT)
    percent = lambda errors: " ".join(f"{e:+.0%}" for e in errors) or "-"  # noqa: E731
    print(f"| run | recorded checks | {args.old} replayed | new replayed |")
    print("|---|---|---|---|")
    groups: dict[str, list[tuple[list[float], list[float], list[float]]]] = {}
    for name, run in sorted(runs.items()):
        recorded, before, after = run["model_errors"], checks(old, run), checks(new_model, run)
        if not before and not after:
            continue
        print(f"| {name} | {percent(recorded)} | {percent(before)} | {percent(after)} |")
        groups.setdefault(name.split("/")[1].split("]")[0] + "]", []).append(
            (recorded, before, after))
    print()
    print("| machines | runs | version | first check, median abs. error | last check, median "
          "abs. error | last checks within 10 % | last check, mean error |")
    print("|---|---|---|---|---|---|---|")
    every = [r for rows in groups.values() for r in rows]
    for machines, rows in sorted(groups.items()) + [("every run", every)]:
        for index, version in enumerate(("recorded", f"{args.old} replayed", "new replayed")):
            print(f"| {machines} | {len(rows)} | {version} | {summary([r[index] for r in rows])} |")


if __name__ == "__main__":
    main()
