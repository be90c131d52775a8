"""The trial without a worker (master/samples/trial_without.py): when a worker with a small
slice is tried without, and how a trial ends. Sans-IO: seconds in, verdicts out."""
from __future__ import annotations

import pytest

from hetconv.master.samples.trial_without import (
    SMALL_SHARE,
    WITHOUT_GAIN,
    WITHOUT_WINDOW,
    KeepWithout,
    TakeBack,
    TryWithout,
    WithoutCheck,
    smallest_slice,
)


def fill(check: WithoutCheck, seconds: float, count: int = WITHOUT_WINDOW) -> None:
    for _ in range(count):
        check.step(seconds)


SLOW_W3 = {"master": 42, "w1": 42, "w2": 42, "w3": 2}  # w3: 2 of an even 32


def test_the_smallest_slice_under_half_an_even_share_is_the_candidate() -> None:
    assert smallest_slice(SLOW_W3, set()) == "w3"
    assert smallest_slice(SLOW_W3, {"w3"}) is None  # tried once: never again
    assert smallest_slice({"master": 32, "w1": 32, "w2": 32, "w3": 32}, set()) is None
    # the 0.2-core workers of 0.6/0.4/0.2/0.2 (13-15 of 128): no trial
    assert smallest_slice({"master": 58, "w1": 45, "w2": 13, "w3": 12}, set()) is None
    # just under the threshold, and an empty slice, both count; the smaller first
    even = 128 / 4
    small = int(SMALL_SHARE * even) - 1
    assert smallest_slice({"master": 64 - small, "w1": 64, "w2": small, "w3": 0},
                          set()) == "w3"
    # the master is never a candidate; with one worker left it is the alone check's
    assert smallest_slice({"master": 2, "w1": 60, "w2": 66}, set()) is None
    assert smallest_slice({"master": 120, "w1": 8}, set()) is None
    assert smallest_slice({"w1": 120, "w2": 8}, set()) == "w2"  # --no-local


def test_no_verdict_before_a_full_window_of_steps() -> None:
    check = WithoutCheck()
    fill(check, 0.08, WITHOUT_WINDOW - 1)
    assert check.at_snapshot(SLOW_W3) is None and check.trial is None


def test_a_trial_that_measures_shorter_keeps_the_worker_out() -> None:
    check = WithoutCheck()
    fill(check, 0.085)
    verdict = check.at_snapshot(SLOW_W3)
    assert verdict == TryWithout("w3", 2, 128, pytest.approx(0.085))
    assert check.trial == verdict and "w3" in check.tried
    # the next snapshot comes before a full window without it: the trial goes on
    fill(check, 0.070, WITHOUT_WINDOW - 1)
    assert check.at_snapshot({"master": 43, "w1": 43, "w2": 42}) is None
    check.step(0.070)
    verdict = check.at_snapshot({"master": 43, "w1": 43, "w2": 42})
    assert verdict == KeepWithout("w3", pytest.approx(0.085), pytest.approx(0.070))
    assert check.trial is None
    fill(check, 0.070)
    assert check.at_snapshot({"master": 43, "w1": 43, "w2": 42}) is None


@pytest.mark.parametrize("without_s", [0.085, 0.09, 0.085 * (1 - WITHOUT_GAIN / 2)],
                         ids=["same", "slower", "within-the-margin"])
def test_a_trial_not_clearly_shorter_takes_the_worker_back_for_good(without_s: float) -> None:
    check = WithoutCheck()
    fill(check, 0.085)
    assert isinstance(check.at_snapshot(SLOW_W3), TryWithout)
    fill(check, without_s)
    verdict = check.at_snapshot({"master": 43, "w1": 43, "w2": 42})
    assert verdict == TakeBack("w3", pytest.approx(0.085), pytest.approx(without_s))
    fill(check, 0.085)
    assert check.at_snapshot(SLOW_W3) is None  # w3 was tried: not again


def test_a_fault_or_a_join_ends_a_trial_without_a_verdict() -> None:
    check = WithoutCheck()
    fill(check, 0.085)
    assert isinstance(check.at_snapshot(SLOW_W3), TryWithout)
    fill(check, 0.07, 3)
    check.reset()
    assert check.trial is None and not check.steps
    fill(check, 0.07)
    assert check.at_snapshot({"master": 43, "w1": 43, "w2": 42}) is None


def test_the_decision_imports_no_sockets_threads_or_clock() -> None:
    import ast
    from pathlib import Path

    import hetconv.master.samples.trial_without as module
    tree = ast.parse(Path(module.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {str(node.module).split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert not imported & {"zmq", "socket", "threading", "time", "asyncio"}, imported
