"""The per-repeat table of hetconv bench scale (hetconv/bench/scale_repeats.py)."""
from __future__ import annotations

from hetconv.bench.scale_repeats import format_repeats_table


def test_every_run_shows_each_repeat_its_median_and_spread() -> None:
    lines = format_repeats_table({"baseline-0.45": [0.1882, 0.2474, 0.2553],
                                  "4x[0.45,0.45,0.45,0.45] auto": [0.0842, 0.0968, 0.0959],
                                  "ddp-even 4x[0.45,0.45,0.45,0.45]": [0.1175, 0.1117]})
    header = next(line for line in lines if line.startswith("| run |"))
    assert header == ("| run | repeat 1 ms | repeat 2 ms | repeat 3 ms | median ms | "
                      "spread |")
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| run")]
    assert rows == [
        "| baseline-0.45 | 188.2 | 247.4 | 255.3 | 247.4 | 27% |",
        "| 4x[0.45,0.45,0.45,0.45] auto | 84.2 | 96.8 | 95.9 | 95.9 | 13% |",
        # measured in two repeats only: the third is missing, not invented
        "| ddp-even 4x[0.45,0.45,0.45,0.45] | 117.5 | 111.7 | - | 114.6 | 5% |"]
    assert all(line.count("|") == header.count("|") for line in rows)


def test_no_runs_no_lines() -> None:
    assert format_repeats_table({}) == []
