"""Kernel partitioning: how many of a layer's kernels each device gets.

Pure functions over plain numbers, tested without sockets. The paper's equation
(1) gives device i with calibration time t_i the fraction
``w_i = (max t / t_i) / sum_j (max t / t_j)``, i.e. proportional to its speed
1/t_i. Whole kernels are handed out by largest remainder so that the counts add up
exactly; a device may get none.
"""
from __future__ import annotations

import math
from typing import Sequence


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
