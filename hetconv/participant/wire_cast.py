"""Arrays onto the wire: float32 as is, float16 by a fast cast that equals numpy's.

numpy casts float32 to float16 one element at a time and, for every value that
underflows the float16 normal range (|x| < 2**-14, most of a layer's gradients),
raises the floating-point underflow flag through ``feraiseexcept``: profiled on a
VGG-style training over float16 links, that call alone took a third of every
worker's CPU (about 34 ns per number against 0.3 ns for a float32 copy).
:func:`float32_to_float16` does the same round-to-nearest-even conversion with
branch-free integer operations on cache-sized blocks (F. Giesen's
``float_to_half_fast3_rtne``); ``ndarray.astype(np.float16)`` is its slow reference
in the tests, bit for bit (NaN payloads aside: every NaN becomes the quiet NaN
0x7e00 with its sign).
"""
from __future__ import annotations

import numpy as np

BLOCK = 16384  # numbers per block: the block's temporaries stay in the L2 cache

_F32_INFINITY = np.uint32(255 << 23)
_F16_OVERFLOW = np.uint32((127 + 16) << 23)  # |x| >= 2**16 rounds to infinity (or is NaN)
_F16_SMALLEST_NORMAL = np.int32(113 << 23)  # |x| < 2**-14: a float16 subnormal or zero
_DENORM_MAGIC = np.uint32(((127 - 15) + (23 - 10) + 1) << 23)  # the float 0.5
_REBIAS = np.uint32((((15 - 127) << 23) + 0xFFF) & 0xFFFFFFFF)  # exponent 127 -> 15, round
_SIGN = np.uint32(0x80000000)
_QUIET_NAN, _INFINITY = np.uint32(0x7E00), np.uint32(0x7C00)


def float32_to_float16(x: np.ndarray) -> np.ndarray:
    """x (any shape, float32, any strides) -> a new C-contiguous float16 array of the
    same shape, rounded to nearest even like ``x.astype(np.float16)`` (overflow to
    +-inf, float16 subnormals kept)."""
    if x.dtype != np.float32:
        raise TypeError(f"float32_to_float16 takes float32, not {x.dtype}")
    flat = np.ascontiguousarray(x).reshape(-1).view(np.uint32)
    result = np.empty(flat.size, np.uint16)
    size = min(BLOCK, flat.size)
    sign, magnitude, out = (np.empty(size, np.uint32) for _ in range(3))
    tiny, small = np.empty(size, np.float32), np.empty(size, np.int32)
    with np.errstate(all="ignore"):  # x + 0.5 on NaN/inf inputs: replaced below anyway
        for start in range(0, flat.size, BLOCK):
            bits = flat[start:start + BLOCK]
            n = bits.size
            s, m, o, t, k = sign[:n], magnitude[:n], out[:n], tiny[:n], small[:n]
            np.bitwise_and(bits, _SIGN, out=s)
            np.bitwise_xor(bits, s, out=m)
            # a normal float16: rebias the exponent, round the 13 dropped bits (ties to even)
            np.right_shift(m, np.uint32(13), out=o)
            np.bitwise_and(o, np.uint32(1), out=o)
            np.add(o, m, out=o)
            np.add(o, _REBIAS, out=o)
            np.right_shift(o, np.uint32(13), out=o)
            # a subnormal (or zero): adding 0.5 in float32 rounds the mantissa into place
            np.add(m.view(np.float32), np.float32(0.5), out=t)
            t_bits = t.view(np.uint32)
            np.subtract(t_bits, _DENORM_MAGIC, out=t_bits)
            np.subtract(m.view(np.int32), _F16_SMALLEST_NORMAL, out=k)
            np.right_shift(k, np.int32(31), out=k)  # all ones where |x| < 2**-14
            np.bitwise_xor(t_bits, o, out=t_bits)
            np.bitwise_and(t_bits, k.view(np.uint32), out=t_bits)
            np.bitwise_xor(o, t_bits, out=o)  # the subnormal where small, else unchanged
            huge = m >= _F16_OVERFLOW
            if huge.any():  # infinity, or the quiet NaN
                o[huge] = np.where(m[huge] > _F32_INFINITY, _QUIET_NAN, _INFINITY)
            np.right_shift(s, np.uint32(16), out=s)
            np.bitwise_or(o, s, out=o)
            result[start:start + n] = o
    return result.view(np.float16).reshape(x.shape)


def to_wire(array: np.ndarray, dtype: np.dtype | str | type) -> np.ndarray:
    """``array`` as a C-contiguous array of the wire dtype (float32 or float16)."""
    wire = np.dtype(dtype)
    if wire == np.float16 and array.dtype == np.float32:
        return float32_to_float16(array)
    return np.ascontiguousarray(array, dtype=wire)
