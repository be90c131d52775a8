"""Packed peer pieces (protocol/peer_wire.py): they carry what the generic codec carries,
bit for bit, and a reader refuses every malformed packing with one ProtocolError."""
from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetconv.protocol import PeerPiece, ProtocolError, decode, encode, limits, peer_wire
from hetconv.protocol.version import PROTOCOL_VERSION


def _piece(data: np.ndarray, **fields: Any) -> PeerPiece:
    values: dict[str, Any] = dict(pass_id=7, step=12, layer=2, phase="sums", attempt=1,
                                  sender="w1", kernel_start=0, kernel_stop=64, batch_start=0,
                                  batch_stop=1, batch_size=1)
    values.update(fields)
    return PeerPiece(**values, data=data)


def _same(a: PeerPiece, b: PeerPiece) -> None:
    for name in peer_wire._INTS + ("phase", "sender"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
    assert a.data.tobytes() == b.data.tobytes()


def _frames(frames: list[bytes | memoryview]) -> list[bytes]:
    return [bytes(frame) for frame in frames]


@pytest.mark.parametrize("data", [
    np.arange(128, dtype=np.float32).reshape(2, 64),  # a barrier's moments or sums
    np.linspace(-3, 3, 9 * 32 * 33, dtype=np.float16).reshape(9, 32, 33),  # float16 wire
    np.full((3, 5), np.pi, dtype=np.float64),
    np.arange(-5, 5, dtype=np.int64),
    np.zeros((0, 4), dtype=np.float32),  # no data
    np.ones((), dtype=np.float32),  # no dims
    np.random.default_rng(0).standard_normal((64, 32, 3, 3)).astype(np.float32),  # 73 KB
])
def test_a_packed_piece_carries_what_the_generic_codec_carries(data: np.ndarray) -> None:
    piece = _piece(data, phase="gather", sender="ÿ-worker", pass_id=-(1 << 63),
                   step=(1 << 63) - 1)
    frames = peer_wire.pack_piece(piece)
    assert len(frames) == (2 if data.nbytes >= peer_wire.ZERO_COPY_BYTES else 1)
    got = peer_wire.unpack_piece(_frames(frames))
    _same(got, piece)
    _same(got, decode(encode(piece)))  # = what the generic codec carries
    assert not got.data.flags.writeable
    assert peer_wire.is_packed(frames[0]) and isinstance(
        peer_wire.decode_frames(_frames(frames)), PeerPiece)


def test_other_byte_orders_and_layouts_are_packed_as_their_values() -> None:
    values = np.arange(24, dtype=np.float32).reshape(4, 6)
    for data in (values.astype(">f4"), values.T, values[:, ::2]):
        got = peer_wire.unpack_piece(_frames(peer_wire.pack_piece(_piece(data))))
        assert np.array_equal(got.data, data) and got.data.dtype == np.dtype("<f4")


def test_the_data_is_aligned_for_its_dtype() -> None:
    for sender in ("a", "abc", "worker-17"):
        frame = _frames(peer_wire.pack_piece(_piece(np.ones((2, 8)), sender=sender)))[0]
        got = peer_wire.unpack_piece([frame])
        assert (len(frame) - got.data.nbytes) % 8 == 0


def test_a_generic_message_on_the_data_endpoint_still_decodes() -> None:
    piece = _piece(np.ones((2, 4), dtype=np.float32))
    assert not peer_wire.is_packed(encode(piece)[0])
    _same(peer_wire.decode_frames(encode(piece)), piece)  # type: ignore[arg-type]


@pytest.mark.parametrize("change, error", [
    (dict(step=True), "must be an int"),
    (dict(step=1.0), "must be an int"),
    (dict(step=1 << 63), "outside int64"),
    (dict(phase=5), "phase must be a str"),
    (dict(sender="x" * (limits.MAX_STR_LEN + 1)), "limit"),
    (dict(data=[1.0, 2.0]), "numpy array"),
    (dict(data=np.ones(3, dtype=np.complex64)), "dtype"),
    (dict(data=np.ones((1,) * (limits.MAX_NDIM + 1), dtype=np.float32)), "dims"),
])
def test_a_piece_that_cannot_be_packed_is_one_protocol_error(change: dict[str, Any],
                                                             error: str) -> None:
    piece = _piece(np.ones((2, 4), dtype=np.float32))
    for name, value in change.items():
        object.__setattr__(piece, name, value)
    with pytest.raises(ProtocolError, match=error):
        peer_wire.pack_piece(piece)


def _packed(data: np.ndarray | None = None) -> bytes:
    return _frames(peer_wire.pack_piece(_piece(
        np.ones((2, 4), dtype=np.float32) if data is None else data)))[0]


def _with_head(frame: bytes, **fields: int) -> bytes:
    """``frame`` with fields of its fixed head replaced (by name)."""
    names = ("magic", "version", "code", "ndim", "phase_len", "sender_len")
    values = list(peer_wire._HEAD.unpack_from(frame))
    for name, value in fields.items():
        values[names.index(name)] = value
    return peer_wire._HEAD.pack(*values) + frame[peer_wire._HEAD.size:]


@pytest.mark.parametrize("frames, error", [
    ([b"HCPP"], "a head of 4 bytes"),
    ([_with_head(_packed(), version=PROTOCOL_VERSION - 1)], "protocol version"),
    ([_with_head(_packed(), code=200)], "dtype code"),
    ([_with_head(_packed(), ndim=limits.MAX_NDIM + 1)], "dims not allowed"),
    ([_with_head(_packed(), sender_len=60000)], "described"),
    ([_packed()[:-1]], "data bytes"),
    ([_packed() + b"\0\0\0\0"], "data bytes"),
    ([_packed(), b"\0" * 32], "a head frame"),
    ([_packed(), b"", b""], "1 or 2 frames"),
    ([], "1 or 2 frames"),
])
def test_a_malformed_packing_is_one_protocol_error(frames: list[bytes], error: str) -> None:
    with pytest.raises(ProtocolError, match=error):
        peer_wire.unpack_piece(frames)


def test_a_shape_over_the_limits_or_a_bad_name_is_refused_before_any_allocation() -> None:
    frame = _packed(np.ones((2, 4), dtype=np.float32))
    dims_at = peer_wire._HEAD.size
    huge = frame[:dims_at] + struct.pack("<2Q", 1 << 40, 1 << 40) + frame[dims_at + 16:]
    with pytest.raises(ProtocolError, match="MAX_DIM or MAX_ELEMENTS"):
        peer_wire.unpack_piece([huge])
    names_at = dims_at + 16  # phase "sums" then sender "w1"
    bad = frame[:names_at] + b"\xff\xfe\xfd\xfc" + frame[names_at + 4:]
    with pytest.raises(ProtocolError, match="not UTF-8"):
        peer_wire.unpack_piece([bad])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 399), st.booleans())
def test_any_bytes_after_the_magic_give_a_piece_or_one_protocol_error(
        tail: bytes, cut: int, two_frames: bool) -> None:
    """Mangled packings (a valid one cut and spliced with random bytes, or random bytes
    after the magic): a piece whose data matches its shape, or ProtocolError."""
    valid = _packed()
    frames = [valid[:cut] + tail] if cut % 2 else [peer_wire.MAGIC + tail]
    if two_frames:
        frames.append(tail[: cut % 64])
    try:
        got = peer_wire.decode_frames(frames)
    except ProtocolError:
        return
    assert isinstance(got, PeerPiece)
    assert got.data.nbytes == got.data.size * got.data.dtype.itemsize
