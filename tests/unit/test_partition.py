"""Kernel partitioning: paper equation (1) and largest-remainder rounding."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetconv.planning.partition import (
    equal_counts,
    ideal_layer_seconds,
    kernel_counts,
    kernel_ranges,
    largest_remainder,
    predicted_layer_seconds,
    workload_fractions,
)


def test_paper_example_two_devices() -> None:
    # Section 4.1.1: device 1 twice as fast as device 2 -> 2/3 and 1/3.
    assert workload_fractions([5.0, 10.0]) == pytest.approx([2 / 3, 1 / 3])
    assert kernel_counts([5.0, 10.0], 300) == [200, 100]


def test_equation_one_matches_formula() -> None:
    times = [1.0, 2.0, 4.0, 8.0]
    slowest = max(times)
    expected = [(slowest / t) / sum(slowest / u for u in times) for t in times]
    assert workload_fractions(times) == pytest.approx(expected)


def test_largest_remainder_known_case() -> None:
    # quotas 3.33, 3.33, 3.33 -> one extra to the first
    assert largest_remainder([1 / 3] * 3, 10) == [4, 3, 3]
    assert largest_remainder([0.5, 0.3, 0.2], 7) == [4, 2, 1]  # 3.5, 2.1, 1.4


def test_slow_device_can_get_zero_kernels() -> None:
    counts = kernel_counts([1.0, 1.0, 1000.0], 10)
    assert counts == [5, 5, 0]
    assert kernel_ranges(counts) == [(0, 5), (5, 10), (10, 10)]


def test_equal_counts() -> None:
    assert equal_counts(3, 8) == [3, 3, 2]


def test_bad_times_rejected() -> None:
    with pytest.raises(ValueError):
        workload_fractions([1.0, 0.0])
    with pytest.raises(ValueError):
        workload_fractions([])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.001, 100.0), min_size=1, max_size=8), st.integers(0, 2000))
def test_counts_sum_and_stay_close(times: list[float], kernels: int) -> None:
    counts = kernel_counts(times, kernels)
    assert sum(counts) == kernels
    assert all(c >= 0 for c in counts)
    for count, fraction in zip(counts, workload_fractions(times)):
        assert abs(count - fraction * kernels) < 1.0 + 1e-9


def test_predicted_and_ideal_seconds() -> None:
    times = [1.0, 3.0]  # seconds for 100 kernels each
    counts = kernel_counts(times, 100)  # 75 / 25
    assert counts == [75, 25]
    assert predicted_layer_seconds(times, 100, counts) == pytest.approx(0.75)
    assert ideal_layer_seconds(times, 100, 100) == pytest.approx(0.75)
    assert predicted_layer_seconds(times, 100, equal_counts(2, 100)) == pytest.approx(1.5)


def test_fit_affine() -> None:
    from hetconv.planning.partition import fit_affine

    assert fit_affine(10, 2.0, 30, 4.0) == pytest.approx((1.0, 0.1))
    assert fit_affine(10, 2.0, 30, 1.0) == pytest.approx((0.0, 1.0 / 30))  # noisy: proportional
    assert fit_affine(10, 0.5, 30, 3.0) == pytest.approx((0.0, 0.1))  # negative intercept


def test_balanced_counts_equalise_finish_times() -> None:
    from hetconv.planning.partition import balanced_counts, predicted_affine_seconds

    # no fixed costs: the same as equation (1)
    assert balanced_counts([(0.0, 1.0), (0.0, 3.0)], 100) == [75, 25]
    # fixed costs shift kernels to the device with the smaller overhead
    counts = balanced_counts([(0.0, 1.0), (20.0, 1.0)], 100)
    assert counts == [60, 40]
    assert predicted_affine_seconds([(0.0, 1.0), (20.0, 1.0)], counts) == pytest.approx(60.0)
    # a device whose overhead alone is slower than doing everything elsewhere gets nothing
    assert balanced_counts([(0.0, 1.0), (500.0, 1.0)], 100) == [100, 0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 10.0), st.floats(0.01, 5.0)), min_size=1, max_size=6),
       st.integers(0, 500))
def test_balanced_counts_are_optimal_to_one_kernel(costs: list[tuple[float, float]],
                                                   kernels: int) -> None:
    from hetconv.planning.partition import balanced_counts, predicted_affine_seconds

    counts = balanced_counts(costs, kernels)
    assert sum(counts) == kernels and min(counts) >= 0
    best = predicted_affine_seconds(costs, counts)
    # the continuous optimum is a lower bound; whole kernels lose at most one kernel's cost
    assert best <= min(a + b * kernels for a, b in costs) + 1e-9
    low, high = 0.0, best
    for _ in range(60):
        mid = (low + high) / 2
        if sum(max(0.0, (mid - a) / b) for a, b in costs) < kernels:
            low = mid
        else:
            high = mid
    assert best <= high + max(b for _, b in costs) + 1e-6
