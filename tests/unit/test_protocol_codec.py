"""Unit tests of protocol.codec: round trips, zero copy, and every validation rule."""
from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np
import pytest

from hetconv.protocol import limits
from hetconv.protocol.codec import ARRAY_DTYPES, decode, encode
from hetconv.protocol.errors import (
    ERR_BAD_MESSAGE,
    ERR_VERSION_MISMATCH,
    ProtocolError,
    VersionMismatch,
)
from hetconv.protocol.messages import (
    MESSAGE_TYPES,
    SCHEMAS,
    AssignShard,
    BackwardReply,
    ErrorReply,
    ForwardRequest,
    Heartbeat,
    Hello,
    Message,
    Refuse,
    message_equal,
)
from hetconv.protocol.version import PROTOCOL_VERSION


def sample_message(cls: type[Message], rng: np.random.Generator, *, empty: bool = False,
                   none_arrays: bool = False) -> Message:
    """A message of ``cls`` with random field values and random float32 arrays."""
    values: dict[str, Any] = {}
    schema = SCHEMAS[cls.TYPE]
    for name, kind in schema.header_fields:
        values[name] = {
            "int": lambda: int(rng.integers(-(2**40), 2**40)),
            "float": lambda: float(rng.standard_normal()),
            "bool": lambda: bool(rng.integers(2)),
            "str": lambda: "ünïcode-" + str(rng.integers(1000)),
            "dict": lambda: {"kind": "cpu", "cores": 2, "memory_bytes": 2**34,
                             "gpus": [{"name": "none", "mem": 0.5}], "pid": None},
            "list": lambda: [1, "two", 3.0],
        }[kind]()
    if "protocol_version" in values:
        values["protocol_version"] = PROTOCOL_VERSION
    for name, optional in schema.array_fields:
        if optional and none_arrays:
            values[name] = None
            continue
        shape = (0, 3, 5, 5) if empty else tuple(int(d) for d in rng.integers(1, 6, size=4))
        values[name] = rng.standard_normal(shape).astype(np.float32)
    return cls(**values)


def header_of(msg: Message) -> tuple[dict[str, Any], list[Any]]:
    frames = encode(msg)
    return msgpack.unpackb(frames[0], raw=False), frames[1:]


def repacked(header: dict[str, Any], arrays: list[Any]) -> list[Any]:
    return [msgpack.packb(header, use_bin_type=True), *arrays]


def forward(x: np.ndarray | None = None) -> ForwardRequest:
    return ForwardRequest(7, 3, 1, 0, True, np.ones((2, 3), np.float32) if x is None else x)


def assert_rejected(frames: Any, fragment: str = "", code: str = ERR_BAD_MESSAGE) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.code == code
    assert fragment in str(info.value), str(info.value)
    assert "\n" not in str(info.value)
    return info.value


# --- round trips -------------------------------------------------------------------------
@pytest.mark.parametrize("tag", sorted(MESSAGE_TYPES))
@pytest.mark.parametrize("variant", ["random", "empty", "none"])
def test_round_trip_every_type(tag: str, variant: str) -> None:
    rng = np.random.default_rng(abs(hash((tag, variant))) % 2**32)
    msg = sample_message(MESSAGE_TYPES[tag], rng, empty=variant == "empty",
                         none_arrays=variant == "none")
    decoded = decode(encode(msg))
    assert type(decoded) is type(msg)
    assert message_equal(decoded, msg)


@pytest.mark.parametrize("dtype_name", sorted(ARRAY_DTYPES))
def test_round_trip_every_dtype_and_layout(dtype_name: str) -> None:
    base = (np.arange(60) % 17).astype(dtype_name).reshape(3, 4, 5)
    big_endian = base.astype(base.dtype.newbyteorder(">"))
    for x in (base, base.transpose(2, 0, 1), base[:, ::2], big_endian,
              base[:1, 0, 0].reshape(()), np.zeros((0, 2**30), dtype_name)):
        y = decode(encode(forward(x))).x  # type: ignore[attr-defined]
        assert y.dtype == ARRAY_DTYPES[dtype_name] and y.shape == x.shape
        assert np.array_equal(y, x)


def test_float_field_accepts_int_and_numpy_scalars_are_coerced() -> None:
    header, arrays = header_of(Heartbeat(1.5))
    header["fields"]["sent_at"] = 3
    decoded = decode(repacked(header, arrays))
    assert decoded == Heartbeat(3.0) and type(decoded.sent_at) is float  # type: ignore[attr-defined]
    msg = ForwardRequest(np.int64(5), np.int32(1), 0, 0, np.bool_(True),  # type: ignore[arg-type]
                         np.ones(2, np.float32))
    decoded_forward = decode(encode(msg))
    assert decoded_forward.request_id == 5 and decoded_forward.train is True  # type: ignore[attr-defined]


def test_handshake_messages_compare_by_value() -> None:
    hello = Hello("w", {"kind": "gpu", "threads": 4}, PROTOCOL_VERSION)
    assert decode(encode(hello)) == hello
    assert not message_equal(hello, Refuse("x", 1))


# --- zero copy -----------------------------------------------------------------------------
def test_encode_does_not_copy_contiguous_arrays() -> None:
    x = np.arange(4096, dtype=np.float32).reshape(64, 64)
    frames = encode(forward(x))
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), x)


def test_decoded_array_shares_memory_with_frame_and_is_read_only() -> None:
    frames = encode(forward(np.arange(4096, dtype=np.float32)))
    received = bytearray(frames[1])  # stands for a zmq frame buffer
    decoded = decode([frames[0], memoryview(received)])
    assert np.shares_memory(decoded.x, np.frombuffer(received, np.uint8))  # type: ignore[attr-defined]
    assert not decoded.x.flags.writeable  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        decoded.x[0] = 1.0  # type: ignore[attr-defined]


# --- framing and sizes -----------------------------------------------------------------
def test_rejects_bad_frame_lists() -> None:
    assert_rejected([], "1 to 16 frames")
    assert_rejected("not a list", "frames")
    assert_rejected([b""] * (limits.MAX_FRAMES + 1), "frames")
    assert_rejected([12345], "not a contiguous byte buffer")
    assert_rejected([np.ones((4, 4))[:, ::2]], "not a contiguous byte buffer")


def test_rejects_oversized_header_frame_and_total(monkeypatch: pytest.MonkeyPatch) -> None:
    assert_rejected([b"\x80" + b" " * limits.MAX_HEADER_BYTES], "header has")
    frames = encode(forward(np.zeros(1024, np.float32)))
    monkeypatch.setattr(limits, "MAX_FRAME_BYTES", 1000)
    assert_rejected(frames, "frame 1 has 4096 bytes")
    monkeypatch.setattr(limits, "MAX_FRAME_BYTES", 2**30)
    monkeypatch.setattr(limits, "MAX_TOTAL_BYTES", 4096)
    assert_rejected(frames, "in total")


@pytest.mark.parametrize("raw", [
    b"", b"\xc1", b"\x81\xa1v", b"\x93\x01\x02", b"\x81\x01\x02", b"\xc4\x03abc",
    msgpack.packb(msgpack.ExtType(3, b"")), msgpack.packb({"v": msgpack.ExtType(1, b"xy")}),
    msgpack.packb({"v": msgpack.Timestamp(1)}), msgpack.packb({"v": 1}) + b"\x00",
    msgpack.packb([0] * (limits.MAX_ARRAY_LEN + 1)), msgpack.packb("s" * (limits.MAX_STR_LEN + 1)),
    msgpack.packb({str(i): i for i in range(limits.MAX_MAP_LEN + 1)}),
    msgpack.packb({"v": 1, "type": "ack", "fields": {}, "arrays": [], "x": 0}),
])
def test_rejects_bad_headers(raw: bytes) -> None:
    assert_rejected([raw])


# --- header content ---------------------------------------------------------------------
def mutate(msg: Message, change: Any) -> list[Any]:
    header, arrays = header_of(msg)
    change(header)
    return repacked(header, arrays)


@pytest.mark.parametrize(("change", "fragment"), [
    (lambda h: h.update(v=True), "'v' must be an int"),
    (lambda h: h.update(v="1"), "'v' must be an int"),
    (lambda h: h.update(type="forward"), "unknown message type"),
    (lambda h: h.update(type=7), "unknown message type"),
    (lambda h: h.update(fields=[1]), "'fields' must be a map"),
    (lambda h: h["fields"].pop("step"), "missing ['step']"),
    (lambda h: h["fields"].update(extra=1), "unexpected ['extra']"),
    (lambda h: h["fields"].update(step=True), "field 'step' must be int"),
    (lambda h: h["fields"].update(step=1.0), "field 'step' must be int"),
    (lambda h: h["fields"].update(train=1), "field 'train' must be bool"),
    (lambda h: h["fields"].update(attempt=None), "field 'attempt' must be int"),
    (lambda h: h.update(arrays={}), "'arrays' must be a list"),
    (lambda h: h["arrays"].append(None), "'arrays' must be a list of 1"),
    (lambda h: h.update(arrays=[None]), "required but described as None"),
    (lambda h: h["arrays"][0].update(extra=1), "description must be a map"),
    (lambda h: h["arrays"][0].pop("nbytes"), "description must be a map"),
    (lambda h: h["arrays"][0].update(name="y"), "description names 'y'"),
    (lambda h: h["arrays"][0].update(dtype="float128"), "dtype 'float128' not in"),
    (lambda h: h["arrays"][0].update(dtype="<f4"), "not in"),
    (lambda h: h["arrays"][0].update(dtype="object"), "not in"),
    (lambda h: h["arrays"][0].update(dtype=4), "not in"),
    (lambda h: h["arrays"][0].update(shape=(2, 3).__repr__()), "shape must be a list"),
    (lambda h: h["arrays"][0].update(shape=[1] * 9), "shape must be a list of at most 8"),
    (lambda h: h["arrays"][0].update(shape=[-2, -3]), "has a dim"),
    (lambda h: h["arrays"][0].update(shape=[True, 6]), "has a dim"),
    (lambda h: h["arrays"][0].update(shape=[2.0, 3]), "has a dim"),
    (lambda h: h["arrays"][0].update(shape=[0, 2**62]), "has a dim"),
    (lambda h: h["arrays"][0].update(shape=[3, 3]), "nbytes 24 != prod(3, 3) * 4 = 36"),
    (lambda h: h["arrays"][0].update(nbytes=25), "nbytes 25"),
    (lambda h: h["arrays"][0].update(nbytes=24.0), "nbytes 24.0"),
    (lambda h: h["arrays"][0].update(shape=[3, 2]), None),  # transposed shape is fine
])
def test_rejects_each_bad_header_content(change: Any, fragment: str | None) -> None:
    frames = mutate(forward(), change)
    if fragment is None:
        assert decode(frames).x.shape == (3, 2)  # type: ignore[attr-defined]
        return
    error = assert_rejected(frames, fragment)
    if isinstance(error.request_id, int):
        assert error.request_id == 7


def test_rejects_bad_dict_field_values() -> None:
    hello = Hello("w", {"kind": "cpu"}, PROTOCOL_VERSION)
    deep: Any = 1
    for _ in range(limits.MAX_NESTING_DEPTH + 1):
        deep = [deep]
    for device, fragment in [({"k": b""}, "type bytes"), ({"k": deep}, "nests deeper"),
                             ({"s": "ß" * (limits.MAX_STR_LEN // 2 + 1)}, "max_str_len")]:
        header, _ = header_of(hello)
        header["fields"]["device"] = device
        assert_rejected([msgpack.packb(header, use_bin_type=True)], fragment)
    header, _ = header_of(hello)
    raw = msgpack.packb(header).replace(b"\xa4kind", b"\xc4\x04kind")  # bin-typed map key
    assert_rejected([raw], "msgpack")


def test_rejects_frame_count_and_length_mismatch() -> None:
    frames = encode(forward())
    assert_rejected(frames[:1], "1 arrays described but 0 array frames")
    assert_rejected([*frames, b""], "1 arrays described but 2 array frames")
    assert_rejected([frames[0], bytes(frames[1])[:-1]], "frame has 23 bytes, described 24")
    reply = BackwardReply(1, 2, 3, 0, 0.5, None)
    assert_rejected([*encode(reply), b""], "0 arrays described but 1")


def test_error_carries_request_id_and_type() -> None:
    error = assert_rejected(mutate(forward(), lambda h: h["arrays"][0].update(dtype="int8")))
    assert error.request_id == 7 and error.message_type == "forward_request"
    error = assert_rejected(mutate(forward(), lambda h: h["fields"].update(request_id=True)))
    assert error.request_id is None


# --- versions ---------------------------------------------------------------------------
def test_version_mismatch_on_ordinary_message() -> None:
    frames = mutate(forward(), lambda h: h.update(v=PROTOCOL_VERSION + 1, type="brand_new"))
    with pytest.raises(VersionMismatch) as info:
        decode(frames)
    assert issubclass(type(info.value), ProtocolError)  # one class catches every failure
    error = info.value
    assert error.code == ERR_VERSION_MISMATCH
    assert (error.local_version, error.remote_version) == (PROTOCOL_VERSION, PROTOCOL_VERSION + 1)
    assert error.request_id == 7 and error.message_type == "brand_new"
    assert f"version {PROTOCOL_VERSION + 1}" in str(error)


def test_handshake_of_another_version_decodes_for_a_reply() -> None:
    other = PROTOCOL_VERSION + 1

    def bump(header: dict[str, Any]) -> None:
        header["v"] = header["fields"]["protocol_version"] = other

    hello = decode(mutate(Hello("w", {"kind": "cpu"}, PROTOCOL_VERSION), bump))
    assert isinstance(hello, Hello) and hello.protocol_version == other
    refuse = decode(mutate(Refuse("old master", PROTOCOL_VERSION), bump))
    assert isinstance(refuse, Refuse) and refuse.reason == "old master"
    # a future Hello we cannot read still reports the version, not a schema error
    def bump_and_extend(header: dict[str, Any]) -> None:
        bump(header)
        header["fields"]["extra"] = 1

    with pytest.raises(VersionMismatch):
        decode(mutate(Hello("w", {}, 1), bump_and_extend))
    # at our own version, header and field must agree
    assert_rejected(mutate(Hello("w", {}, PROTOCOL_VERSION + 5), lambda h: None), "!= header v")


# --- encode-side checks -----------------------------------------------------------------
@pytest.mark.parametrize(("msg", "fragment"), [
    (forward(np.ones(3, np.complex64)), "dtype complex64"),
    (forward(np.ones(3, np.int8)), "dtype int8"),
    (forward(np.array(["a"], dtype=object)), "dtype object"),
    (forward(np.ones((1,) * 9, np.float32)), "9 dims"),
    (forward(np.zeros((0, 2**31), np.float32)), "a dim over"),
    (forward([1.0, 2.0]), "must be a numpy array"),  # type: ignore[arg-type]
    (ForwardRequest(True, 1, 1, 1, True, np.ones(1, np.float32)), "must be int"),
    (ForwardRequest(1, 1, 1, 1, 1, np.ones(1, np.float32)), "must be bool"),  # type: ignore[arg-type]
    (BackwardReply(1, 1, 1, 1, "0.5", None), "must be float"),  # type: ignore[arg-type]
    (ErrorReply(1, "internal", "x" * (limits.MAX_STR_LEN + 1)), "limit"),
    (ErrorReply(1, "internal", "\ud800"), "UTF-8"),
    (ErrorReply(1, "internal", "ß" * (limits.MAX_STR_LEN // 2 + 1)), "bytes, limit"),
    (Hello("w", {"big": 2**64}, 1), "64-bit"),
    (Hello("w", {1: "x"}, 1), "not a str"),  # type: ignore[dict-item]
    (Hello("w", {"t": (1, 2)}, 1), "type tuple"),
    (dataclasses.replace(sample_message(AssignShard, np.random.default_rng(0)),  # type: ignore[type-var]
                         gamma=None),
     "must be a numpy array"),
])
def test_encode_rejects_invalid_messages(msg: Message, fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment.replace("(", r"\(")):
        encode(msg)


def test_encode_rejects_non_messages_and_huge_headers() -> None:
    with pytest.raises(ProtocolError, match="not a protocol message"):
        encode("hello")  # type: ignore[arg-type]
    device = {f"k{i}": "v" * 1000 for i in range(100)}
    with pytest.raises(ProtocolError, match="header has"):
        encode(Hello("w", device, PROTOCOL_VERSION))
