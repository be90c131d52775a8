"""The run's state machine (master/run.py): events in, commands out, no sockets, no clock."""
from __future__ import annotations

from hetconv.master.run import (
    EVICT_AFTER_FAULTS,
    FIRST_REQUEST_DEADLINE_S,
    REJOIN_BACKOFF_STEPS,
    REQUEST_DEADLINE_FACTOR,
    REQUEST_DEADLINE_MIN_S,
    Admit,
    Evict,
    FallBackLocal,
    Fault,
    ReplanDone,
    ReplanPoint,
    Resplit,
    RunControl,
    SetAside,
    StepDone,
    Stop,
)


def steps(control: RunControl, count: int, start: float = 0.0, every_s: float = 1.0) -> float:
    now = start
    for _ in range(count):
        now += every_s
        control.handle(StepDone(now))
    return now


def test_a_gone_worker_is_evicted_at_once_and_the_rest_re_planned() -> None:
    control = RunControl(["w1", "w2"])
    commands = control.handle(Fault("w1 died", "w1", gone=True, gone_workers=frozenset({"w1"})))
    assert commands == [Evict("w1", "gone: w1 died", drop=False),
                        Resplit(frozenset({"w2"}), "recovery from: w1 died")]
    assert control.replanning
    assert control.handle(ReplanDone()) == [] and not control.replanning


def test_a_live_worker_is_evicted_after_two_faults_in_a_row_only() -> None:
    control = RunControl(["w1", "w2"])
    first = control.handle(Fault("timeout", "w1"))
    assert first == [Resplit(frozenset({"w1", "w2"}), "recovery from: timeout")]
    control.handle(StepDone(1.0))  # a good step: the fault was transient
    assert not any(isinstance(c, Evict) for c in control.handle(Fault("timeout", "w1")))
    for _ in range(EVICT_AFTER_FAULTS - 2):
        control.handle(Fault("timeout", "w1"))
    commands = control.handle(Fault("timeout", "w1"))
    # alive: told to go, and kept out until its process restarts
    assert commands[0] == Evict("w1", "evicted: timeout", drop=True, misbehaved=True)
    assert commands[1] == Resplit(frozenset({"w2"}), "recovery from: timeout")


def test_wrong_results_evict_and_quarantine_for_the_run() -> None:
    control = RunControl(["w1", "bad"])
    commands = control.handle(Fault("NaN", "bad", evict=True))
    assert commands[0] == Evict("bad", "evicted: NaN", drop=True)
    steps(control, 10 * REJOIN_BACKOFF_STEPS)
    assert not control.may_rejoin("bad")
    assert control.handle(ReplanPoint(("bad",))) == []


def test_a_stale_fault_about_an_evicted_worker_counts_nothing_twice() -> None:
    control = RunControl(["w1", "w2"])
    control.handle(Fault("w1 died", "w1", gone=True, gone_workers=frozenset({"w1"})))
    again = control.handle(Fault("late news of w1", "w1", gone=True,
                                 gone_workers=frozenset({"w1"})))
    assert again == [Resplit(frozenset({"w2"}), "recovery from: late news of w1")]
    assert control.evictions == {"w1": 1}


def test_a_duplicate_fault_report_is_one_more_fault_in_a_row() -> None:
    control = RunControl(["w1", "w2"])
    control.handle(Fault("timeout", "w1"))
    assert Evict("w1", "evicted: timeout", drop=True, misbehaved=True) in control.handle(
        Fault("timeout", "w1"))


def test_a_fault_during_a_re_plan_re_plans_over_the_survivors() -> None:
    control = RunControl(["w1", "w2", "w3"])
    control.handle(Fault("w1 died", "w1", gone=True, gone_workers=frozenset({"w1"})))
    assert control.replanning  # the re-split is being applied when w2 goes too
    commands = control.handle(Fault("w2 lost during the re-split", "w2", gone=True,
                                    gone_workers=frozenset({"w1", "w2"})))
    assert commands == [Evict("w2", "gone: w2 lost during the re-split", drop=False),
                        Resplit(frozenset({"w3"}), "recovery from: w2 lost during the re-split")]
    assert control.evictions == {"w1": 1, "w2": 1}


def test_the_last_worker_leaving_falls_back_to_the_master_or_stops() -> None:
    alone = RunControl(["only"])
    assert alone.handle(Fault("gone", "only", gone=True))[-1] == \
        FallBackLocal("every worker is lost (gone)")
    stop = RunControl(["only"], stop_on_worker_loss=True)
    last = stop.handle(Fault("gone", "only", gone=True))[-1]
    assert isinstance(last, Stop) and "--on-worker-loss stop" in last.reason


def test_a_join_at_a_snapshot_admits_then_re_plans_over_everyone() -> None:
    control = RunControl(["w1"])
    commands = control.handle(ReplanPoint(("w2",)))
    assert commands == [Admit(("w2",)), Resplit(frozenset({"w1", "w2"}), "join of w2", ("w2",))]
    assert control.handle(ReplanPoint(())) == []


def test_a_worker_set_aside_is_re_planned_without_and_may_come_back_at_once() -> None:
    """A trial without a slow worker (master/samples/trial_without.py) is not an eviction: the
    worker is out of the plan, not quarantined nor backed off, and joins again."""
    control = RunControl(["w1", "w2"])
    assert control.handle(SetAside("w2", "trying without w2")) == [
        Resplit(frozenset({"w1"}), "trying without w2")]
    assert control.replanning and "w2" not in control.active
    control.handle(ReplanDone())
    assert control.evictions == {} and control.may_rejoin("w2")
    # a fault now re-plans over w1 alone: w2 stays out
    commands = control.handle(Fault("w1 late", "w1"))
    assert commands == [Resplit(frozenset({"w1"}), "recovery from: w1 late")]
    control.handle(ReplanDone())
    assert control.handle(ReplanPoint(("w2",))) == [
        Admit(("w2",)), Resplit(frozenset({"w1", "w2"}), "join of w2", ("w2",))]
    # never the last worker (the master-alone check decides that), nor one gone already
    control.handle(ReplanDone())
    assert control.handle(SetAside("w3", "not in the run")) == []
    solo = RunControl(["w1"])
    assert solo.handle(SetAside("w1", "the last")) == [] and solo.active == {"w1"}


def test_a_join_that_fails_while_calibrating_is_evicted_and_the_rest_re_planned() -> None:
    control = RunControl(["w1"])
    control.handle(ReplanPoint(("w2",)))
    commands = control.handle(Fault("w2 left while calibrating", "w2", gone=True,
                                    gone_workers=frozenset({"w2"})))
    assert commands[-1] == Resplit(frozenset({"w1"}), "recovery from: w2 left while calibrating")


def test_rejoin_back_off_doubles_with_every_eviction() -> None:
    control = RunControl(["w1", "w2"])
    gone = frozenset({"w1"})
    control.handle(Fault("died", "w1", gone=True, gone_workers=gone))
    assert control.may_rejoin("w1")  # first eviction: back at once (a restart)
    control.handle(ReplanPoint(("w1",)))
    control.handle(Fault("died", "w1", gone=True, gone_workers=gone))
    assert not control.may_rejoin("w1")
    steps(control, REJOIN_BACKOFF_STEPS - 1)
    assert not control.may_rejoin("w1")
    steps(control, 1)
    assert control.may_rejoin("w1")
    control.handle(ReplanPoint(("w1",)))
    control.handle(Fault("died", "w1", gone=True, gone_workers=gone))
    steps(control, REJOIN_BACKOFF_STEPS)
    assert not control.may_rejoin("w1")  # third eviction: twice as long
    steps(control, REJOIN_BACKOFF_STEPS)
    assert control.may_rejoin("w1")


def test_a_worker_evicted_alive_for_faults_blamed_on_it_is_marked_misbehaved() -> None:
    """A silent sender or a hung compute thread (master/blame.py) would say Hello again at
    once after its eviction: the Evict says so, and the stage keeps it out until its
    process restarts (Cluster.misbehaving); a dead worker's eviction does not."""
    control = RunControl(["w1", "w2"])
    for _ in range(EVICT_AFTER_FAULTS):
        out = control.handle(Fault("w2 did not answer: w1's piece never arrived", "w1"))
    assert [c.misbehaved for c in out if isinstance(c, Evict)] == [True]
    out = control.handle(Fault("died", "w2", gone=True, gone_workers=frozenset({"w2"})))
    assert [c.misbehaved for c in out if isinstance(c, Evict)] == [False]


def test_the_request_deadline_follows_the_clean_steps() -> None:
    control = RunControl(["w1"])
    assert control.request_deadline_s() == FIRST_REQUEST_DEADLINE_S
    steps(control, 5, every_s=0.01)  # fast steps: the floor
    assert control.request_deadline_s() == REQUEST_DEADLINE_MIN_S
    now = steps(control, 9, start=100.0, every_s=2.0)
    assert control.request_deadline_s() == REQUEST_DEADLINE_FACTOR * 2.0
    control.handle(Fault("timeout", "w1"))  # a step with a fault in it is not timed
    control.handle(StepDone(now + 500.0))
    assert control.request_deadline_s() == REQUEST_DEADLINE_FACTOR * 2.0


def test_a_fault_naming_nobody_re_plans_without_evicting_the_living() -> None:
    control = RunControl(["w1", "w2"])
    assert control.handle(Fault("the master's share failed")) == \
        [Resplit(frozenset({"w1", "w2"}), "recovery from: the master's share failed")]


def test_a_join_waiting_while_the_snapshot_fails_comes_in_at_the_next_re_plan_point() -> None:
    control = RunControl(["w1", "w2"])
    # the snapshot's audit fails w2 while w3 waits to join: the fault is handled first
    commands = control.handle(Fault("result audit", "w2", evict=True))
    assert commands[-1] == Resplit(frozenset({"w1"}), "recovery from: result audit")
    control.handle(ReplanDone())
    joined = control.handle(ReplanPoint(("w2", "w3")))  # the next snapshot: w3, not w2
    assert joined == [Admit(("w3",)), Resplit(frozenset({"w1", "w3"}), "join of w3", ("w3",))]


def test_the_state_machine_imports_no_sockets_threads_or_clock() -> None:
    import ast
    from pathlib import Path

    import hetconv.master.run as run

    tree = ast.parse(Path(run.__file__).read_text(encoding="utf-8"))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert not imported & {"zmq", "threading", "time", "socket", "asyncio"}, imported
