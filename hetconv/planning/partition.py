"""Kernel partitioning: how many of a layer's kernels each participant gets.

Pure functions over plain numbers, tested without sockets. A "device" below is a
participant of the split (the master's own device or one worker), in participant
order; ``hetconv.master.plan`` turns the counts into shards. The paper's equation
(1) gives device i with calibration time t_i the fraction
``w_i = (max t / t_i) / sum_j (max t / t_j)``, i.e. proportional to its speed
1/t_i. Whole kernels are handed out by largest remainder so that the counts add up
exactly; a device may get none.
"""
from __future__ import annotations

import math
from collections.abc import Sequence


def workload_fractions(calibration_seconds: Sequence[float]) -> list[float]:
    """Paper equation (1): fraction of the kernels per device (sums to 1)."""
    if not calibration_seconds:
        raise ValueError("no devices to split over")
    for seconds in calibration_seconds:
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"calibration times must be positive and finite, got {seconds}")
    slowest = max(calibration_seconds)
    speeds = [slowest / seconds for seconds in calibration_seconds]
    total = sum(speeds)
    return [speed / total for speed in speeds]


def largest_remainder(fractions: Sequence[float], total: int) -> list[int]:
    """Whole counts summing to ``total`` closest to ``fractions * total``.

    Each device first gets the floor of its quota; the leftover units go to the
    largest remainders (ties to the lower index, so the result is deterministic).
    """
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    quotas = [fraction * total for fraction in fractions]
    counts = [math.floor(quota) for quota in quotas]
    leftover = total - sum(counts)
    order = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for index in order[:leftover]:
        counts[index] += 1
    return counts


def kernel_counts(calibration_seconds: Sequence[float], kernels: int) -> list[int]:
    """Kernels per device for a layer of ``kernels`` kernels (calibrated split)."""
    return largest_remainder(workload_fractions(calibration_seconds), kernels)


def equal_counts(devices: int, kernels: int) -> list[int]:
    """Kernels per device when every device gets the same share."""
    return largest_remainder([1.0 / devices] * devices, kernels)


def kernel_ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive [start, stop) kernel ranges, in device order, from counts."""
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def predicted_layer_seconds(calibration_seconds: Sequence[float], calibrated_kernels: int,
                            counts: Sequence[int]) -> float:
    """Predicted conv time of a split: the slowest device, linear in its kernels."""
    return max((seconds * count / calibrated_kernels
                for seconds, count in zip(calibration_seconds, counts)), default=0.0)


def ideal_layer_seconds(calibration_seconds: Sequence[float], calibrated_kernels: int,
                        kernels: int) -> float:
    """Conv time if the kernels could be split into fractions (combined speed)."""
    speed = sum(calibrated_kernels / seconds for seconds in calibration_seconds)
    return kernels / speed


# --- an affine cost model: fixed overhead + per-kernel cost -----------------------------
#
# Equation (1) assumes a device's time is proportional to its kernel count. It is not:
# unfolding the input (im2col) and folding the input gradient back cost the same
# whatever the share, so a slow device with a small share is slower than (1) predicts.
# Timing each device at two kernel counts gives t_i(k) = a_i + b_i * k; the split below
# makes every device finish at the same time T, and a device whose fixed cost alone
# exceeds T gets no kernels at all. The fit is of compute time only: calibration runs
# the layer on each device's own memory and moves nothing over the network, so the
# (also share-independent) cost of sending x to a worker and dx back is not in a_i.


def fit_affine(kernels_small: int, seconds_small: float, kernels_large: int,
               seconds_large: float) -> tuple[float, float]:
    """(fixed seconds a >= 0, seconds per kernel b > 0) through two timings."""
    if kernels_large <= kernels_small:
        return 0.0, seconds_large / max(1, kernels_large)
    slope = (seconds_large - seconds_small) / (kernels_large - kernels_small)
    if slope <= 0:  # timing noise: fall back to proportional
        return 0.0, seconds_large / kernels_large
    fixed = seconds_large - slope * kernels_large
    if fixed < 0:  # noise again: keep the line through the larger timing
        return 0.0, seconds_large / kernels_large
    return fixed, slope


def balanced_counts(costs: Sequence[tuple[float, float]], kernels: int) -> list[int]:
    """Whole kernels per device minimising the slowest device's a + b*k.

    Continuous solution by bisection on the finish time T (each device gets
    max(0, (T - a)/b)), largest-remainder rounding, then single-kernel moves from the
    slowest device while they shorten the step.
    """
    if not costs:
        raise ValueError("no devices to split over")
    if kernels == 0:
        return [0] * len(costs)
    for fixed, per_kernel in costs:
        if not (fixed >= 0 and per_kernel > 0 and math.isfinite(fixed + per_kernel)):
            raise ValueError(f"bad cost model a={fixed}, b={per_kernel}")

    def assigned(finish: float) -> float:
        return sum(max(0.0, (finish - a) / b) for a, b in costs)

    low, high = 0.0, min(a + b * kernels for a, b in costs)
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if assigned(mid) < kernels else (low, mid)
    fractions = [max(0.0, (high - a) / b) for a, b in costs]
    total = sum(fractions)
    counts = largest_remainder([f / total for f in fractions], kernels)

    def time_of(i: int, count: int) -> float:
        return costs[i][0] + costs[i][1] * count if count else 0.0

    for _ in range(kernels):
        slowest = max(range(len(costs)), key=lambda i: time_of(i, counts[i]))
        current = time_of(slowest, counts[slowest])
        target = min((i for i in range(len(costs)) if i != slowest),
                     key=lambda i: time_of(i, counts[i] + 1), default=None)
        if target is None or counts[slowest] == 0:
            break
        if max(time_of(target, counts[target] + 1),
               time_of(slowest, counts[slowest] - 1)) >= current:
            break
        counts[slowest] -= 1
        counts[target] += 1
    return counts


def predicted_affine_seconds(costs: Sequence[tuple[float, float]], counts: Sequence[int]) -> float:
    """The slowest device's a + b*k (devices without kernels cost nothing)."""
    return max((a + b * k for (a, b), k in zip(costs, counts) if k), default=0.0)
