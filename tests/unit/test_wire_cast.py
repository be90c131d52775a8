"""The fast float32 -> float16 wire cast equals numpy's astype bit for bit (its slow reference)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetconv.participant.wire_cast import BLOCK, float32_to_float16, to_wire


def reference(x: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numpy warns on overflow to inf
        return x.astype(np.float16)


def assert_same_bits(x: np.ndarray) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fast cast itself warns about nothing
        got = float32_to_float16(x)
    want = reference(x)
    assert got.shape == x.shape and got.dtype == np.float16 and got.flags.c_contiguous
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
    assert (got.view(np.uint16)[nan] & 0x7FFF == 0x7E00).all()  # the quiet NaN, sign kept
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_every_range_ties_and_edges() -> None:
    rng = np.random.default_rng(0)
    scales = (1e-9, 3e-8, 1e-7, 1e-6, 1e-5, 6e-5, 1e-4, 1e-2, 1.0, 100.0, 3e4, 6.5e4, 1e5, 1e37)
    parts = [rng.standard_normal(5000).astype(np.float32) * np.float32(s) for s in scales]
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 65504, 65519.99, 65520,
                      65536, -65520, 2**-14, 2**-14 * (1 - 2**-12), 2**-24, 2**-25,
                      2**-25 * (1 + 2**-20), 1.5 * 2**-24, 2.5 * 2**-24, 1 + 2**-11,
                      1 + 3 * 2**-11, 1 + 2**-11 + 2**-20, 2**-149, 1.17e-38],
                     dtype=np.float32)
    # float16's every value and the midpoints between neighbours (the ties)
    halves = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    mids = (halves[:-1].astype(np.float64) + halves[1:]) / 2
    x = np.concatenate([*parts, edges, halves, -halves, mids.astype(np.float32)])
    assert_same_bits(x)


def test_random_bit_patterns_over_several_blocks() -> None:
    bits = np.random.default_rng(1).integers(0, 2**32, size=3 * BLOCK + 7, dtype=np.uint64)
    assert_same_bits(bits.astype(np.uint32).view(np.float32))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=0,
                max_size=300))
def test_any_float32_values(values: list[float]) -> None:
    assert_same_bits(np.array(values, dtype=np.float32))


def test_shapes_strides_and_to_wire() -> None:
    x = np.random.default_rng(2).standard_normal((4, 6, 5, 5)).astype(np.float32) * 1e-4
    channels = x[:, 2:5]  # a non-contiguous channel slice, as a gradient is split
    assert_same_bits(channels)
    assert_same_bits(np.zeros((0, 3), np.float32))
    np.testing.assert_array_equal(to_wire(channels, "float16"), reference(channels))
    kept = to_wire(channels, np.float32)
    assert kept.dtype == np.float32 and kept.flags.c_contiguous
    np.testing.assert_array_equal(kept, channels)
    with pytest.raises(TypeError):
        float32_to_float16(x.astype(np.float64))
