"""Re-weighting the sample split's slices from measured compute
(master/samples/balance.py). Sans-IO, no sockets."""
from __future__ import annotations

import pytest

from hetconv.master.samples.balance import (
    REBALANCE_WINDOW,
    SETTLED_WINDOW,
    SampleBalance,
    reverses,
)


def test_measured_compute_re_weights_only_for_a_clear_gain() -> None:
    balance = SampleBalance({"master": 1.0, "a": 1.0})
    samples = {"master": 64, "a": 64}
    # a is twice as slow as calibrated: re-weighted after a full window
    step = {"master": 0.064, "a": 0.128}
    for _ in range(REBALANCE_WINDOW - 1):
        assert not balance.observe(step, step, samples)
    assert balance.observe(step, step, samples)
    new = {s.participant: s.samples for s in balance.slices(["master", "a"], 128)}
    assert new == {"master": 85, "a": 43}
    # measured as planned, within noise: nothing changes
    samples = new
    for step in range(2 * REBALANCE_WINDOW):
        compute = {"master": 0.085 * (1.03 if step % 2 else 0.97), "a": 0.086}
        assert not balance.observe(compute, compute, samples)


def test_speeds_that_swing_with_the_slices_meet_halfway_instead_of_flipping() -> None:
    """Two equal quota-throttled machines: the one with the smaller slice idles at the
    barriers and computes in bursts, 25 % faster per sample, so each re-slice makes
    the other look faster (measured: 63/65 -> 71/57 -> 58/70 in 30 steps of the
    VGG-style bench). The re-slice back meets the last estimates halfway."""
    names = ["master", "a"]
    balance = SampleBalance({"master": 0.0050, "a": 0.0050})

    def compute(samples: dict[str, int]) -> dict[str, float]:
        small = min(samples, key=lambda n: samples[n])
        return {n: 0.0050 * samples[n] * (0.75 if n == small else 1.0) for n in names}

    samples = {"master": 63, "a": 65}
    history = [samples]
    for _ in range(6):
        for _ in range(REBALANCE_WINDOW):
            changed = balance.observe(compute(samples), compute(samples), samples)
        if changed:
            samples = {s.participant: s.samples for s in balance.slices(names, 128)}
            history.append(samples)
    assert history[1]["master"] > 68, history  # the first move is made in full
    # then back, but only halfway: never as far as the first move went the other way
    assert all(abs(h["master"] - 64) < abs(history[1]["master"] - 64) for h in history[2:]), \
        history
    assert len(history) <= 4, history  # and it settles


# Compute per sample (ms) of two equal 0.45-core machines, each step of a recorded run
# (`hetconv bench scale --machines 0.45,0.45 ... --arch 32:64`, 2026-11-30 05:51 UTC, the
# master and m1 of docs/figures/scale-alone-trigger-32-64.md's second repeat, its 80 steps
# with both computing): the two swing against each other for about 10 steps at a time.
EQUAL_MASTER_MS = [
    2.39, 1.23, 1.19, 0.94, 0.93, 1.13, 1.12, 1.2, 1.27, 1.58, 1.66, 1.06, 0.83, 0.9, 0.71,
    0.75, 0.79, 0.9, 1.01, 1.7, 1.16, 1.02, 1.4, 1.0, 1.5, 1.44, 1.28, 1.17, 1.07, 0.54, 1.08,
    1.07, 1.26, 1.08, 1.25, 1.31, 1.37, 1.28, 0.96, 0.85, 0.55, 0.49, 0.56, 0.9, 0.63, 0.67,
    0.98, 1.26, 0.89, 0.49, 1.27, 1.45, 1.39, 1.47, 1.38, 1.54, 1.23, 1.19, 1.17, 1.02, 0.88,
    0.8, 0.78, 0.58, 0.7, 0.69, 0.62, 0.69, 0.82, 0.8, 1.1, 1.28, 1.19, 0.97, 1.14, 0.98, 0.98,
    1.02, 0.81, 1.0]
EQUAL_WORKER_MS = [
    1.34, 1.27, 1.14, 1.52, 1.11, 1.01, 1.42, 1.35, 1.02, 1.05, 0.95, 1.2, 1.4, 1.39, 1.52,
    1.42, 1.32, 1.43, 1.21, 1.2, 0.81, 0.81, 0.83, 0.67, 0.98, 0.57, 0.51, 1.32, 1.36, 1.11,
    1.16, 0.83, 0.68, 0.58, 0.68, 0.7, 0.76, 1.08, 1.15, 0.92, 0.96, 1.21, 1.13, 1.02, 1.09,
    1.16, 1.54, 1.62, 1.78, 1.31, 1.27, 0.86, 0.65, 0.92, 0.96, 0.87, 0.91, 1.05, 1.17, 1.26,
    1.12, 1.32, 1.4, 1.56, 1.27, 1.3, 1.29, 1.12, 1.12, 0.97, 0.85, 0.83, 0.86, 0.48, 0.57,
    0.61, 0.57, 0.63, 0.94, 0.5]


def test_two_equal_machines_whose_speeds_swing_keep_an_even_split() -> None:
    """Replayed through the balance at the slices it chooses, the recorded swing moves
    the batch at most once and leaves it within a few samples of even (that run, with
    9-step medians at every check, was re-sliced 78/50 -> 56/72 -> 64/64 -> 81/47)."""
    names = ["master", "m1"]
    balance = SampleBalance({"master": 0.0010, "m1": 0.0010})
    samples = {s.participant: s.samples for s in balance.slices(names, 128)}
    history = [samples]
    for master_ms, worker_ms in zip(EQUAL_MASTER_MS, EQUAL_WORKER_MS):
        compute = {"master": master_ms / 1e3 * samples["master"],
                   "m1": worker_ms / 1e3 * samples["m1"]}
        if balance.observe(compute, compute, samples):
            samples = {s.participant: s.samples for s in balance.slices(names, 128)}
            history.append(samples)
    assert len(history) <= 2, history
    assert all(abs(h["master"] - 64) <= 6 for h in history), history


def test_later_checks_wait_for_a_settled_window_unless_the_gain_is_large() -> None:
    """The first check after a plan comes after REBALANCE_WINDOW steps; later ones take
    the median of SETTLED_WINDOW steps at the current slices (checked every
    REBALANCE_WINDOW steps), and in between the last REBALANCE_WINDOW steps act only
    for a gain of URGENT_GAIN (a machine that turned busy); a joiner or an eviction
    makes the next check a quick one again."""
    names = ["master", "a"]
    balance = SampleBalance({"master": 0.001, "a": 0.001})
    samples = {"master": 64, "a": 64}
    even = {"master": 0.064, "a": 0.064}
    for _ in range(REBALANCE_WINDOW):
        assert not balance.observe(even, even, samples)  # the first check: nothing to gain
    slower = {"master": 0.064, "a": 0.064 * 1.3}  # a 30 % slower: 13 % to gain
    changed_at = next(i for i in range(1, 3 * SETTLED_WINDOW)
                      if balance.observe(slower, slower, samples))
    # the first full settled window (9 even steps, 18 slower ones) has a median slower
    assert changed_at == 2 * REBALANCE_WINDOW == SETTLED_WINDOW - REBALANCE_WINDOW
    samples = {s.participant: s.samples for s in balance.slices(names, 128)}
    assert samples == {"master": 72, "a": 56}
    busy = {"master": 0.001 * 72, "a": 0.0026 * 56}  # a twice as slow again: 36 % to gain
    changed_at = next(i for i in range(1, 3 * SETTLED_WINDOW)
                      if balance.observe(busy, busy, samples))
    assert changed_at == REBALANCE_WINDOW
    balance.add("b", 0.001)  # a join: the next check is a quick one again
    samples = {"master": 50, "a": 28, "b": 50}
    steps = {"master": 0.050, "a": 0.0026 * 28, "b": 0.050 * 1.2}  # b 20 % slower
    changed_at = next(i for i in range(1, 3 * SETTLED_WINDOW)
                      if balance.observe(steps, steps, samples))
    assert changed_at == REBALANCE_WINDOW


def test_reverses_is_a_move_back() -> None:
    assert reverses({"m": 8, "a": -8}, {"m": 71, "a": 57}, {"m": 58, "a": 70})
    assert not reverses({"m": 8, "a": -8}, {"m": 71, "a": 57}, {"m": 75, "a": 53})
    assert not reverses({}, {"m": 71, "a": 57}, {"m": 58, "a": 70})


def test_a_fixed_cost_per_step_moves_samples_to_the_machine_without_it() -> None:
    """A slow machine's rounds cost it 30 ms whatever its slice: fewer samples for it,
    not in proportion to its compute alone."""
    names = ["master", "fast", "slow"]
    balance = SampleBalance(dict.fromkeys(names, 0.001))
    samples = {"master": 43, "fast": 43, "slow": 42}
    compute = {n: 0.001 * samples[n] for n in names}
    # every worker waits 10 ms more than its compute (the master's part), slow 40 ms more
    latency = {"master": compute["master"], "fast": compute["fast"] + 0.010,
               "slow": compute["slow"] + 0.040}
    for _ in range(REBALANCE_WINDOW):
        changed = balance.observe(compute, latency, samples)
    assert changed and balance.overhead["slow"] == pytest.approx(0.030)
    assert balance.overhead["fast"] == balance.overhead["master"] == 0.0
    new = {s.participant: s.samples for s in balance.slices(names, 128)}
    assert new == {"master": 53, "fast": 52, "slow": 23}  # 53 ms = 30 + 23 ms


def test_waiting_for_peers_is_not_a_fixed_cost_so_equal_machines_even_out() -> None:
    """Four equal machines left at 28 and 36 samples by a noisy calibration (measured:
    4 x 0.45 cores, 32:64 over 100 Mbit): under the barriers every round ends with the
    slowest participant's, so the one with 28 samples waits 8 samples' compute. Counted
    as its own fixed cost, that wait justified the split it came from (no re-slice in
    60 steps); left out, the batch evens out."""
    names = ["master", "m1", "m2", "m3"]
    per_sample, tail = 0.0027, 0.004  # seconds; the reply's way back to the master

    def window(balance: SampleBalance, samples: dict[str, int], with_waits: bool) -> bool:
        compute = {n: per_sample * samples[n] for n in names}
        end = max(compute.values())  # every chain ends after the last barrier
        waits = {n: end - compute[n] for n in names}
        latency = {n: end + tail for n in names}
        changed = False
        for _ in range(REBALANCE_WINDOW):
            changed = balance.observe(compute, latency, samples,
                                      waits if with_waits else None)
        return changed

    skewed = {"master": 32, "m1": 32, "m2": 28, "m3": 36}
    blind = SampleBalance(dict.fromkeys(names, per_sample))
    assert not window(blind, skewed, with_waits=False)  # the waits kept it as it was
    balance = SampleBalance(dict.fromkeys(names, per_sample))
    assert window(balance, skewed, with_waits=True)
    assert all(balance.overhead[n] == pytest.approx(0.0, abs=1e-12) for n in names)
    even = {s.participant: s.samples for s in balance.slices(names, 128)}
    assert even == dict.fromkeys(names, 32)
    assert not window(balance, even, with_waits=True)  # and stays so


def test_an_evicted_participant_is_forgotten_and_a_joiner_added() -> None:
    balance = SampleBalance({"master": 1.0, "a": 1.0, "b": 2.0})
    balance.restrict(["master", "b"])
    assert set(balance.seconds) == {"master", "b"}
    balance.add("c", 0.5)
    assert balance.seconds["c"] == 0.5
