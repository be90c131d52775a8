"""One step laid out per participant (``hetconv bench scale``'s step timeline): the
barriers of one step in chain order, seconds since the master began it; the run's
typical step chosen by its median duration; the table."""
from __future__ import annotations

from typing import Any

import pytest

from hetconv.bench.scale_breakdown import format_step_timeline
from hetconv.bench.scale_figures import typical_step_timeline
from hetconv.participant.samples.barrier_trace import TimelineMark, step_timeline


def _share(p: str, t: float, layer: int, phase: str, sync: int = 9, step: int = 4
           ) -> dict[str, Any]:
    return {"e": "share", "t": t, "p": p, "sync": sync, "step": step, "layer": layer,
            "phase": phase}


def _wait(p: str, t: float, end: float, layer: int, phase: str, sync: int = 9
          ) -> dict[str, Any]:
    return {"e": "wait", "t": t, "end": end, "p": p, "sync": sync, "layer": layer,
            "phase": phase}


def _step_events(started: float, sync: int = 9, step: int = 4) -> list[dict[str, Any]]:
    """Two participants, two layers: a's shares come first, b's wait at layer 1's sums
    is not in the trace."""
    events = []
    for offset, (layer, phase) in enumerate([(0, "moments"), (1, "moments"), (1, "sums"),
                                             (0, "sums")]):
        at = started + 0.010 * (offset + 1)
        for p, late in (("a", 0.0), ("b", 0.002)):
            events.append(_share(p, at + late, layer, phase, sync, step))
            if not (p == "b" and (layer, phase) == (1, "sums")):
                events.append(_wait(p, at + late, at + 0.003, layer, phase, sync))
    return events


def test_a_step_is_laid_out_in_chain_order_since_its_start() -> None:
    events = _step_events(100.0) + _step_events(200.0, sync=10, step=5)  # another step
    events.append({"e": "share", "p": "a"})  # malformed: skipped
    timeline = step_timeline(reversed(events), 4, 100.0)
    assert list(timeline) == ["a", "b"]
    a = timeline["a"]
    assert [(m.layer, m.phase) for m in a] == [(0, "moments"), (1, "moments"), (1, "sums"),
                                               (0, "sums")]
    assert a[0] == TimelineMark(0, "moments", pytest.approx(0.010), pytest.approx(0.013))
    b = timeline["b"]
    assert b[2].shared_s == pytest.approx(0.032) and b[2].held_s is None
    assert step_timeline(events, 7, 100.0) == {}


def test_the_typical_step_is_the_median_one_with_each_round_latency() -> None:
    def record(step: int, step_s: float, started: float) -> dict[str, Any]:
        return {"type": "step", "step": step, "step_s": step_s, "time": started + step_s,
                "layers": [{"participants": [{"participant": "a", "forward_latency_s": 0.05},
                                        {"participant": "b", "forward_latency_s": 0.06}]}]}

    steps = [record(3, 0.09, 50.0), record(4, 0.07, 100.0), record(5, 0.08, 200.0),
             record(6, 0.06, 300.0)]
    events = _step_events(100.0) + _step_events(200.0, sync=10, step=5)
    timeline = typical_step_timeline(steps, events)
    assert timeline["step"] == 4 and timeline["step_s"] == 0.07  # lower median of four
    a = timeline["participants"]["a"]
    assert a["result_s"] == 0.05
    assert a["marks"][0][:2] == [0, "moments"]
    assert a["marks"][0][2] == pytest.approx(0.010)
    assert typical_step_timeline(steps[:1], events) == {}  # step 3 left no trace
    assert typical_step_timeline([], events) == {}


def test_the_table_has_a_column_per_barrier_and_the_result() -> None:
    steps = [{"type": "step", "step": 4, "step_s": 0.07, "time": 100.07,
              "layers": [{"participants": [{"participant": "a", "forward_latency_s": 0.05}]}]}]
    row = {"machines": "2x[0.5,0.5] auto",
           "timeline": typical_step_timeline(steps, _step_events(100.0))}
    lines = format_step_timeline([row, {"machines": "kernels", "timeline": {}}])
    assert "2x[0.5,0.5] auto: step 4, 70.0 ms" in lines
    header = next(line for line in lines if line.startswith("| participant |"))
    assert header == ("| participant | layer 1 forward ms | layer 2 forward ms | "
                      "layer 2 backward ms | layer 1 backward ms | "
                      "result at the master ms |")
    assert "| a | 10.0 / 13.0 | 20.0 / 23.0 | 30.0 / 33.0 | 40.0 / 43.0 | 50.0 |" in lines
    assert "| b | 12.0 / 13.0 | 22.0 / 23.0 | 32.0 / - | 42.0 / 43.0 | - |" in lines
    assert format_step_timeline([{"machines": "x"}]) == []
