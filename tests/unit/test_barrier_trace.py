"""The batch-norm barriers' trace (hetconv/participant/samples/barrier_trace.py) and its table in ``hetconv
bench scale`` (hetconv/bench/scale_breakdown.py): a wait splits into skew (until the
last peer shared) and delivery (the rest), the trace is off unless asked for, and what
a killed process half wrote is skipped."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetconv.bench.scale_breakdown import (
    barrier_figures,
    format_barrier_breakdown,
    merge_barrier_repeats,
)
from hetconv.participant.samples.barrier_trace import BarrierTrace, barrier_breakdown, read_trace


def _share(p: str, t: float, sync: int = 5, step: int = 3, layer: int = 1,
           phase: str = "moments") -> dict[str, Any]:
    return {"e": "share", "t": t, "p": p, "sync": sync, "step": step, "layer": layer,
            "phase": phase}


def _wait(p: str, t: float, end: float, sync: int = 5, layer: int = 1,
          phase: str = "moments") -> dict[str, Any]:
    return {"e": "wait", "t": t, "end": end, "p": p, "sync": sync, "layer": layer,
            "phase": phase}


def test_a_wait_is_the_skew_until_the_last_peer_shared_then_the_delivery() -> None:
    events = [_share("a", 1.000), _share("b", 1.002), _share("c", 1.005),
              _wait("a", 1.000, 1.006), _wait("b", 1.002, 1.0065), _wait("c", 1.005, 1.0055)]
    [row] = barrier_breakdown(events)
    assert row.to_read_s is None  # no reads in this trace
    # a: last peer (c) at 1.005: skew 5 ms, delivery 1 ms; b: skew 3 ms, delivery 1.5 ms;
    # c: its peers shared before it arrived: no skew, delivery 0.5 ms
    assert (row.layer, row.phase, row.waits, row.per_step) == (1, "moments", 3, 3.0)
    assert row.skew_s == pytest.approx((0.005 + 0.003 + 0.0) / 3)
    assert row.delivery_s == pytest.approx((0.001 + 0.0015 + 0.0005) / 3)
    assert row.wait_s == pytest.approx((0.006 + 0.0045 + 0.0005) / 3)
    assert row.skew_s + row.delivery_s == pytest.approx(row.wait_s)


def test_earlier_steps_waits_without_peers_and_malformed_events_are_left_out() -> None:
    events = [
        _share("a", 1.0, sync=4, step=0), _share("b", 1.1, sync=4, step=0),
        _wait("a", 1.0, 1.2, sync=4),  # step 0: before the measured steps
        _share("a", 2.0, sync=6, step=1), _share("b", 2.001, sync=6, step=1),
        _wait("a", 2.0, 2.002, sync=6), _wait("b", 2.001, 2.003, sync=6),
        _wait("c", 2.0, 2.5, sync=9),  # no share of that barrier in the trace
        {"e": "wait", "t": "soon"}, {"e": "share"}, {"nothing": 1},
    ]
    [row] = barrier_breakdown(events, first_step=1)
    assert row.waits == 2 and row.per_step == 2.0
    assert row.skew_s == pytest.approx(0.001 / 2)
    assert row.delivery_s == pytest.approx((0.001 + 0.002) / 2)
    assert barrier_breakdown(events, first_step=2) == []


def test_rows_come_in_layer_then_phase_order_with_waits_per_step() -> None:
    events = []
    for step, sync in ((1, 10), (2, 11)):
        for layer in (1, 0):
            for phase in ("sums", "moments"):
                events += [_share(p, 1.0, sync, step, layer, phase) for p in ("a", "b")]
                events += [_wait(p, 1.0, 1.001, sync, layer, phase) for p in ("a", "b")]
    rows = barrier_breakdown(events)
    assert [(r.layer, r.phase) for r in rows] == [(0, "moments"), (0, "sums"),
                                                  (1, "moments"), (1, "sums")]
    assert all(r.waits == 4 and r.per_step == 2.0 for r in rows)


def test_the_trace_records_nothing_unless_a_directory_is_given(tmp_path: Path) -> None:
    off = BarrierTrace(None)
    off.share("a", 1, 1, 0, "moments")
    off.wait("a", 1, 0, "moments", 1.0, 2.0)
    off.flush()
    assert not off.enabled and not list(tmp_path.iterdir())


def test_the_trace_is_written_in_batches_and_read_back(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import hetconv.participant.samples.barrier_trace

    monkeypatch.setattr(hetconv.participant.samples.barrier_trace, "FLUSH_EVERY", 3)
    trace = BarrierTrace(str(tmp_path / "trace"))
    trace.share("a", 5, 3, 1, "moments")
    trace.share("b", 5, 3, 1, "moments")
    assert not (tmp_path / "trace").exists()  # kept in memory until FLUSH_EVERY events
    trace.wait("a", 5, 1, "moments", 1.0, 1.5)  # the third: written
    trace.wait("b", 5, 1, "moments", 1.2, 1.5)
    trace.flush()
    [path] = list((tmp_path / "trace").iterdir())
    with open(path, "a", encoding="utf-8") as out:
        out.write('{"e": "wait", "t": 1.0, "en')  # a process killed while writing
    events = read_trace(tmp_path / "trace")
    assert [e["e"] for e in events] == ["share", "share", "wait", "wait"]
    assert read_trace(tmp_path / "absent") == []
    [row] = barrier_breakdown(events)
    assert row.waits == 2


def test_a_gradient_exchange_traces_its_barriers(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real GradientExchange over the in-memory port of test_weight_reduce:
    each share and each wait of a batch-norm barrier is one event."""
    import hetconv.participant.samples.weight_reduce
    from hetconv.participant.samples.reduction_plan import reduce_plan
    from hetconv.participant.samples.weight_reduce import PHASE_MOMENTS, GradientExchange
    from tests.unit.test_weight_reduce import Network

    trace = BarrierTrace(str(tmp_path))
    monkeypatch.setattr(hetconv.participant.samples.weight_reduce, "TRACE", trace)
    network = Network()
    everyone = ["master", "w1"]
    plan = reduce_plan([4], everyone, everyone)
    exchanges = {n: GradientExchange(n, plan, network.port(n), 0.2) for n in everyone}
    for exchange in exchanges.values():
        exchange.share(9, 4, 0, PHASE_MOMENTS, np.ones((2, 4), np.float32))
    for exchange in exchanges.values():
        exchange.collect(9, 0, PHASE_MOMENTS, everyone)
    trace.flush()
    events = read_trace(tmp_path)
    assert sorted((e["e"], e["p"], e.get("from")) for e in events) == [
        ("share", "master", None), ("share", "w1", None), ("take", "master", "w1"),
        ("take", "w1", "master"), ("wait", "master", None), ("wait", "w1", None)]
    assert all(e["sync"] == 9 and e["layer"] == 0 and e["phase"] == PHASE_MOMENTS
               for e in events)
    [row] = barrier_breakdown(events, first_step=4)
    assert row.waits == 2 and row.to_read_s is not None
    assert 0 <= row.to_read_s <= row.delivery_s


def test_the_bench_table_merges_repeats_and_sums_a_participants_step() -> None:
    first = barrier_figures(barrier_breakdown(
        [_share("a", 1.0), _share("b", 1.004), _wait("a", 1.0, 1.005), _wait("b", 1.004, 1.005),
         _share("a", 1.0, phase="sums"), _share("b", 1.0, phase="sums"),
         _wait("a", 1.0, 1.002, phase="sums"), _wait("b", 1.0, 1.002, phase="sums")]))
    second = {key: {**values, "wait_s": values["wait_s"] * 3} for key, values in first.items()}
    merged = merge_barrier_repeats([first, second, first])
    assert list(merged) == ["1:moments", "1:sums"]
    assert merged["1:moments"]["wait_s"] == first["1:moments"]["wait_s"]  # the median
    lines = format_barrier_breakdown([{"machines": "2x[0.45,0.45] auto", "barriers": merged},
                                      {"machines": "kernels", "barriers": {}}])
    assert lines[-4].startswith("|---")
    assert lines[-3].startswith("| 2x[0.45,0.45] auto | 2 | forward (moments) | 2.0 | 3.00 |")
    assert lines[-2] == "|  | 2 | backward (sums) | 2.0 | 2.00 | 0.00 | 2.00 | - |"
    # per participant and step: (2 x 3 ms + 2 x 2 ms) over 2 participants; no reads traced
    assert lines[-1] == "|  | per participant and step | all | | 5.0 | 2.0 | 3.0 | - |"
    assert format_barrier_breakdown([{"machines": "kernels", "barriers": {}}]) == []


def test_the_delivery_until_the_last_peers_piece_is_read() -> None:
    """a shares first; b shares 2 ms later; a's thread reads b's piece 3 ms after b
    shared and holds everything 1 ms later: delivery 4 ms, 3 of them to the read. b
    read a's piece before it even waited: nothing of its delivery was to the read."""
    events = [_share("a", 1.000), _share("b", 1.002), _wait("a", 1.000, 1.006),
              {"e": "take", "t": 1.005, "p": "a", "sync": 5, "layer": 1,
               "phase": "moments", "from": "b"},
              {"e": "take", "t": 1.001, "p": "b", "sync": 5, "layer": 1,
               "phase": "moments", "from": "a"},
              _wait("b", 1.002, 1.0025)]
    [row] = barrier_breakdown(events)
    assert row.delivery_s == pytest.approx((0.004 + 0.0005) / 2)
    assert row.to_read_s == pytest.approx((0.003 + 0.0) / 2)
    lines = format_barrier_breakdown([{"machines": "2x", "barriers": barrier_figures([row])}])
    assert lines[-2].endswith("| 2.25 | 1.50 |") and lines[-1].endswith("| 2.2 | 1.5 |")
