"""Scales far out of line (hetconv/participant/samples/outliers.py): the check behind
catching a wrong training-mode forward that passed the audit."""
from __future__ import annotations

import numpy as np

from hetconv.participant.samples.outliers import (
    OUTLIER_FACTOR,
    check_scales,
    moments_scale,
    outlier,
)


def test_a_sender_a_thousand_times_the_others_is_named_an_honest_spread_is_not() -> None:
    assert outlier({"master": 1.0, "a": 2.5, "b": 0.4}, "a") is None
    assert outlier({"master": 1.0, "a": 1.2, "b": 1000.0}, "a") == "b"
    assert outlier({"master": 1.0, "a": 1.2, "b": 1000.0}, "b") == "b"  # itself, too
    assert outlier({"master": 1.0, "b": float("nan"), "a": 1.1}, "a") == "b"


def test_with_two_senders_each_judges_the_other_by_its_own() -> None:
    assert outlier({"master": 1.0, "b": 1000.0}, "master") == "b"
    assert outlier({"master": 1.0, "b": 1000.0}, "b") is None  # b trusts itself: master judges
    assert outlier({"a": 1.0, "b": 1000.0}, "master") is None  # not one of them: no call


def test_empty_or_constant_slices_are_never_a_reference() -> None:
    assert outlier({"master": 0.0, "a": 0.0, "b": 3.0}, "a") is None
    assert outlier({"master": 0.0, "b": 3.0}, "master") is None


def test_the_scale_of_moments() -> None:
    rng = np.random.default_rng(0)
    y = rng.standard_normal((16, 8, 5, 5)).astype(np.float32) * 3.0
    values = y.transpose(1, 0, 2, 3).reshape(8, -1)
    mean = values.mean(axis=1)
    moments = np.stack([values.sum(axis=1), ((values - mean[:, None]) ** 2).sum(axis=1)])
    assert abs(moments_scale(moments, values.shape[1]) - 3.0) < 0.3
    assert moments_scale(moments * np.array([[1000.0], [1e6]]), values.shape[1]) > 2000
    line = check_scales({"master": 1.0, "a": 1.0, "b": 1000.0}, "a", "batch-norm spread")
    assert line is not None and line[0] == "b" and f"{OUTLIER_FACTOR:.0f} times" in line[1]
