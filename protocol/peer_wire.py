"""A :class:`PeerPiece` packed for the peer data plane: one fixed binary head instead of
the generic codec's msgpack header (docs/protocol.md §12, "Packed pieces").

Every step of the sample split sends each participant some 50 pieces and receives as
many (the batch-norm barriers' (2, K) moments and sums, the weight reduction's pieces).
Between two of them the participant computes convolutions that evict the interpreter's
code and data from the caches, so each piece pays its Python cold: a (2, 64) piece sent
and received costs about a quarter less CPU packed than through the generic codec
(encode, a multi-frame send, RCVTIMEO set for every read, decode; 257 against 193 us
in docs/figures/ab/peer-wire-cold.log). That is milliseconds a step on a 0.45-core
machine.

Frames: ``[head + data]`` where the data is under :data:`ZERO_COPY_BYTES`, else
``[head, data]`` (the data sent without copying). The head, little-endian::

    magic b"HCPP", u16 protocol version, u8 dtype code (index in ARRAY_DTYPES),
    u8 ndim, u16 phase bytes, u16 sender bytes,
    i64 pass_id, step, layer, attempt, kernel_start, kernel_stop, batch_start,
        batch_stop, batch_size,
    u64 x ndim dims, phase (UTF-8), sender (UTF-8), zero padding to a multiple of 8

then the array's bytes in C order. :func:`unpack_piece` checks what the generic
codec checks (version, dtype, ndim, dims, element count, byte count, UTF-8 strings and
their length, the frame count) and raises ``ProtocolError`` for anything else; the
array it returns is a read-only view of the frame. A first frame that does not start
with the magic is a generic message (:func:`decode_frames` hands it to ``decode``).
"""
from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import limits
from .codec import ARRAY_DTYPES, DTYPE_NAMES, byte_view, decode
from .errors import ERR_BAD_MESSAGE, ProtocolError
from .message_base import Message
from .peer_messages import PeerPiece
from .version import PROTOCOL_VERSION

MAGIC = b"HCPP"
ZERO_COPY_BYTES = 64 * 1024
"""Data of at least this many bytes goes as a second frame, without copying (pyzmq
copies smaller frames anyway)."""
_HEAD = struct.Struct("<4sHBBHH9q")
_INTS = ("pass_id", "step", "layer", "attempt", "kernel_start", "kernel_stop",
         "batch_start", "batch_stop", "batch_size")
_DTYPES = tuple(ARRAY_DTYPES.values())
_CODES: dict[np.dtype[Any], tuple[int, bool]] = {
    dtype: (list(ARRAY_DTYPES).index(name), swap)
    for dtype, (name, swap) in DTYPE_NAMES.items()}
"""Either byte order of an allowed dtype → (its code, needs a byte swap)."""
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _fail(message: str) -> ProtocolError:
    return ProtocolError(ERR_BAD_MESSAGE, f"packed peer piece: {message}")


def _text(value: object, name: str) -> bytes:
    if type(value) is not str:
        raise _fail(f"{name} must be a str, got {type(value).__name__}")
    try:
        data = value.encode("utf-8")
    except UnicodeEncodeError:
        raise _fail(f"{name} is not encodable as UTF-8") from None
    if len(data) > limits.MAX_STR_LEN:
        raise _fail(f"{name} is a string of {len(data)} bytes, limit {limits.MAX_STR_LEN}")
    return data


def _padded(size: int) -> int:
    return -(-size // 8) * 8


def pack_piece(piece: PeerPiece) -> list[bytes | memoryview]:
    """The frames of ``piece`` (the data not copied when it goes as its own frame: do not
    change it until sent). ``ProtocolError`` where ``unpack_piece`` would refuse it."""
    ints = []
    for name in _INTS:
        value = getattr(piece, name)
        if type(value) is not int:
            if not isinstance(value, np.integer):
                raise _fail(f"field {name!r} must be an int, got {type(value).__name__}")
            value = int(value)
        if not _INT64[0] <= value <= _INT64[1]:
            raise _fail(f"field {name!r} is outside int64: {value}")
        ints.append(value)
    phase, sender = _text(piece.phase, "phase"), _text(piece.sender, "sender")
    data = piece.data
    if not isinstance(data, np.ndarray):
        raise _fail(f"data must be a numpy array, got {type(data).__name__}")
    found = _CODES.get(data.dtype)
    if found is None:
        raise _fail(f"data has dtype {data.dtype}, allowed: {', '.join(ARRAY_DTYPES)}")
    code, swap = found
    if data.ndim > limits.MAX_NDIM:
        raise _fail(f"data has {data.ndim} dims, at most {limits.MAX_NDIM}")
    if max(data.shape, default=0) > limits.MAX_DIM or math.prod(
            d or 1 for d in data.shape) > limits.MAX_ELEMENTS:
        raise _fail(f"data shape {data.shape} has a dim over MAX_DIM or MAX_ELEMENTS")
    if swap:
        data = data.astype(_DTYPES[code])
    if not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    if data.nbytes > limits.MAX_FRAME_BYTES:
        raise _fail(f"data has {data.nbytes} bytes, limit {limits.MAX_FRAME_BYTES}")
    used = _HEAD.size + 8 * data.ndim + len(phase) + len(sender)
    head = b"".join((_HEAD.pack(MAGIC, PROTOCOL_VERSION, code, data.ndim, len(phase),
                                len(sender), *ints),
                     struct.pack(f"<{data.ndim}Q", *data.shape), phase, sender,
                     bytes(_padded(used) - used)))
    body = data.data.cast("B") if data.nbytes else b""
    if data.nbytes >= ZERO_COPY_BYTES:
        return [head, body]
    return [head + bytes(body)]


def is_packed(frame: object) -> bool:
    """Whether a first frame holds a packed piece (it starts with the magic)."""
    return byte_view(frame, 0)[:len(MAGIC)] == MAGIC


def unpack_piece(frames: Sequence[object]) -> PeerPiece:
    """The piece in ``frames`` (one or two frames: :func:`pack_piece`), its data a
    read-only view of the last frame; ``ProtocolError`` for anything else."""
    if not 1 <= len(frames) <= 2:
        raise _fail(f"1 or 2 frames, got {len(frames)}")
    head = byte_view(frames[0], 0)
    if head.nbytes < _HEAD.size:
        raise _fail(f"a head of {head.nbytes} bytes, at least {_HEAD.size}")
    magic, version, code, ndim, phase_len, sender_len, *ints = _HEAD.unpack_from(head)
    if magic != MAGIC:
        raise _fail("no magic")
    if version != PROTOCOL_VERSION:
        raise _fail(f"protocol version {version}, this side speaks {PROTOCOL_VERSION}")
    if code >= len(_DTYPES) or ndim > limits.MAX_NDIM:
        raise _fail(f"dtype code {code} or {ndim} dims not allowed")
    used = _HEAD.size + 8 * ndim + phase_len + sender_len
    if phase_len > limits.MAX_STR_LEN or sender_len > limits.MAX_STR_LEN or \
            head.nbytes < _padded(used):
        raise _fail(f"a head of {head.nbytes} bytes, {_padded(used)} described")
    shape = struct.unpack_from(f"<{ndim}Q", head, _HEAD.size)
    if max(shape, default=0) > limits.MAX_DIM or math.prod(
            d or 1 for d in shape) > limits.MAX_ELEMENTS:
        raise _fail(f"shape {shape} has a dim over MAX_DIM or MAX_ELEMENTS")
    at = _HEAD.size + 8 * ndim
    try:
        phase, sender = _name(head[at:at + phase_len]), _name(head[at + phase_len:used])
    except UnicodeDecodeError:
        raise _fail("phase or sender is not UTF-8") from None
    dtype = _DTYPES[code]
    nbytes = math.prod(shape) * dtype.itemsize
    if len(frames) == 2:
        if head.nbytes != _padded(used):
            raise _fail(f"a head frame of {head.nbytes} bytes, {_padded(used)} described")
        body = byte_view(frames[1], 1)
    else:
        body = head[_padded(used):]
    if body.nbytes != nbytes:
        raise _fail(f"{body.nbytes} data bytes, shape {shape} of {dtype} needs {nbytes}")
    data = np.ndarray(shape, dtype, body) if nbytes else np.empty(shape, dtype)
    data.flags.writeable = False
    pass_id, step, layer, attempt, kernel_start, kernel_stop, start, stop, size = ints
    return PeerPiece(pass_id=pass_id, step=step, layer=layer, phase=phase, attempt=attempt,
                     sender=sender, kernel_start=kernel_start, kernel_stop=kernel_stop,
                     batch_start=start, batch_stop=stop, batch_size=size, data=data)


_NAMES: dict[bytes, str] = {}
"""Phase and sender names decoded before (a run has a few dozen): bounded by
``_NAMES_KEPT`` entries of at most ``_NAME_KEPT_BYTES`` bytes, whatever peers send."""
_NAMES_KEPT = 256
_NAME_KEPT_BYTES = 64


def _name(raw: memoryview) -> str:
    """UTF-8 bytes as a str (``UnicodeDecodeError`` if they are not UTF-8)."""
    key = bytes(raw)
    found = _NAMES.get(key)
    if found is None:
        found = key.decode("utf-8")
        if len(key) <= _NAME_KEPT_BYTES and len(_NAMES) < _NAMES_KEPT:
            _NAMES[key] = found
    return found


def decode_frames(frames: Sequence[object]) -> Message:
    """A packed piece, or any generic message (``decode``): what a data endpoint reads."""
    if frames and is_packed(frames[0]):
        return unpack_piece(frames)
    return decode(frames)
