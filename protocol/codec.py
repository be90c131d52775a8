"""Encode messages to ZeroMQ frames and decode (and validate) frames to messages.

A message is ``[header, array frame, array frame, ...]``. The header is a msgpack
map ``{"v": version, "type": tag, "fields": {...}, "arrays": [...]}`` where
``fields`` holds exactly the message's non-array fields and ``arrays`` has one entry
per array field in declaration order: ``{"name", "dtype", "shape", "nbytes"}``, or
``None`` for an optional array that is absent (an absent array has no frame). Array
frames are raw little-endian C-order bytes.

``encode`` does not copy arrays that are already C-contiguous little-endian: the
frame is a byte ``memoryview`` of the caller's array, so the caller must not mutate
that array until the message has been sent. ``decode`` validates everything (sizes,
msgpack limits, type tag, version, field names and types, array descriptions) before
building anything, and rebuilds arrays with ``np.frombuffer`` over the received
frames: no copy, and the arrays are **read-only** (``.copy()`` to get a writable
one). Any failure, for any input whatsoever, is a ``ProtocolError``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np

from protocol import limits
from protocol.errors import ERR_BAD_MESSAGE, ProtocolError, VersionMismatch
from protocol.messages import HANDSHAKE_TYPES, SCHEMAS, Message, MessageSchema
from protocol.version import PROTOCOL_VERSION

WIRE_DTYPES: dict[str, np.dtype[Any]] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("|u1"),
}
"""Allow-list of array dtypes on the wire: name in the header → little-endian dtype."""

_DTYPE_NAMES: dict[np.dtype[Any], str] = {
    dtype.newbyteorder(order): name
    for name, dtype in WIRE_DTYPES.items()
    for order in ("<", ">")
}
"""Either byte order of an allowed dtype → its wire name (a dict lookup is much
faster than ``dtype.name``)."""

_FIELD_NAMES = {
    tag: frozenset(name for name, _ in schema.header_fields) for tag, schema in SCHEMAS.items()
}
HEADER_KEYS = frozenset({"v", "type", "fields", "arrays"})
ARRAY_KEYS = frozenset({"name", "dtype", "shape", "nbytes"})

Frame = bytes | memoryview


def _fail(message: str) -> ProtocolError:
    return ProtocolError(ERR_BAD_MESSAGE, message)


def _short(value: object, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


# --- values of header fields (shared by encode and decode) ------------------------------
def _check_str(value: str, where: str) -> None:
    """A str must be valid UTF-8 of at most MAX_STR_LEN bytes (msgpack's unit)."""
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise _fail(f"{where} is not encodable as UTF-8") from None
    if size > limits.MAX_STR_LEN:
        raise _fail(f"{where} is a string of {size} bytes, limit {limits.MAX_STR_LEN}")


def _check_native(value: object, where: str, depth: int) -> None:
    """Check a value inside a dict/list field: msgpack-native, str keys, bounded."""
    if depth > limits.MAX_NESTING_DEPTH:
        raise _fail(f"{where} nests deeper than {limits.MAX_NESTING_DEPTH}")
    if value is None or type(value) in (bool, float):
        return
    if type(value) is int:
        if not -(2**63) <= value < 2**64:
            raise _fail(f"{where} is an int outside the 64-bit range")
        return
    if type(value) is str:
        _check_str(value, where)
        return
    if type(value) is list:
        if len(value) > limits.MAX_ARRAY_LEN:
            raise _fail(f"{where} is a list longer than {limits.MAX_ARRAY_LEN}")
        for index, item in enumerate(value):
            _check_native(item, f"{where}[{index}]", depth + 1)
        return
    if type(value) is dict:
        if len(value) > limits.MAX_MAP_LEN:
            raise _fail(f"{where} is a map with more than {limits.MAX_MAP_LEN} entries")
        for key, item in value.items():
            if type(key) is not str:
                raise _fail(f"{where} has a key that is not a str: {_short(key)}")
            _check_str(key, f"{where} key")
            _check_native(item, f"{where}[{key!r}]", depth + 1)
        return
    raise _fail(f"{where} has a value of type {type(value).__name__}, not msgpack-native")


_KIND_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (float, int), "bool": (bool,),
    "str": (str,), "dict": (dict,), "list": (list,),
}
_DEEP_KINDS = frozenset({"str", "dict", "list"})


def _check_field(name: str, kind: str, value: object, *, coerce_numpy: bool) -> object:
    """Return the field value if it has the kind's type (float accepts int)."""
    if coerce_numpy and isinstance(value, np.generic):
        value = value.item()
    if type(value) not in _KIND_TYPES[kind]:  # exact types: a bool is not an int
        raise _fail(f"field {name!r} must be {kind}, got {type(value).__name__}")
    if kind == "float":
        return float(value)  # type: ignore[arg-type]
    if kind in _DEEP_KINDS:
        _check_native(value, f"field {name!r}", 0)
    return value


# --- encode -----------------------------------------------------------------------------
def _wire_array(name: str, value: object) -> tuple[np.ndarray, str]:
    """The array as it goes on the wire (allowed dtype, little-endian, C-contiguous)
    and its dtype's wire name."""
    if not isinstance(value, np.ndarray):
        raise _fail(f"array field {name!r} must be a numpy array, got {type(value).__name__}")
    dtype_name = _DTYPE_NAMES.get(value.dtype)
    if dtype_name is None:
        raise _fail(f"array field {name!r} has dtype {value.dtype}, allowed: "
                    f"{', '.join(WIRE_DTYPES)}")
    if value.ndim > limits.MAX_NDIM:
        raise _fail(f"array field {name!r} has {value.ndim} dims, at most {limits.MAX_NDIM}")
    if any(dim > limits.MAX_DIM for dim in value.shape):
        raise _fail(f"array field {name!r} has a dim over {limits.MAX_DIM}: {value.shape}")
    wire_dtype = WIRE_DTYPES[dtype_name]
    if value.dtype != wire_dtype:
        value = value.astype(wire_dtype)
    return (value if value.flags.c_contiguous else value.copy(order="C")), dtype_name


def encode(msg: Message) -> list[Frame]:
    """Encode a message to ``[header, array frames...]`` without copying arrays.

    Raises ``ProtocolError`` (code ``bad_message``) when the message would not pass
    ``decode``: wrong field types, disallowed dtype, too many dims, over a limit.
    numpy scalars in header fields are converted to Python scalars.
    """
    schema = SCHEMAS.get(getattr(type(msg), "TYPE", ""))
    if schema is None or type(msg) is not schema.cls:
        raise _fail(f"cannot encode {type(msg).__name__}: not a protocol message class")
    fields = {
        name: _check_field(name, kind, getattr(msg, name), coerce_numpy=True)
        for name, kind in schema.header_fields
    }
    descriptions: list[dict[str, Any] | None] = []
    frames: list[memoryview] = []
    for name, optional in schema.array_fields:
        value = getattr(msg, name)
        if value is None and optional:
            descriptions.append(None)
            continue
        array, dtype_name = _wire_array(name, value)
        if array.nbytes > limits.MAX_FRAME_BYTES:
            raise _fail(f"array {name!r} has {array.nbytes} bytes, "
                        f"limit {limits.MAX_FRAME_BYTES}")
        descriptions.append({"name": name, "dtype": dtype_name,
                             "shape": list(array.shape), "nbytes": array.nbytes})
        frames.append(array.reshape(-1).view(np.uint8).data)
    try:
        header = msgpack.packb(
            {"v": PROTOCOL_VERSION, "type": schema.cls.TYPE, "fields": fields,
             "arrays": descriptions},
            use_bin_type=True,
        )
    except (TypeError, ValueError, OverflowError) as exc:  # defensive: checked above
        raise _fail(f"cannot pack header: {type(exc).__name__}: {_short(str(exc))}") from None
    if len(header) > limits.MAX_HEADER_BYTES:
        raise _fail(f"header has {len(header)} bytes, limit {limits.MAX_HEADER_BYTES}")
    if len(header) + sum(frame.nbytes for frame in frames) > limits.MAX_TOTAL_BYTES:
        raise _fail(f"message exceeds {limits.MAX_TOTAL_BYTES} bytes in total")
    return [header, *frames]


# --- decode -----------------------------------------------------------------------------
def _byte_view(frame: object, index: int) -> memoryview:
    """A flat byte view of a frame: bytes, bytearray, memoryview or zmq.Frame."""
    try:
        buffer: Any = getattr(frame, "buffer", frame)  # zmq.Frame has .buffer
        view = memoryview(buffer)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
    # Deliberately broad: an arbitrary object may raise anything from its buffer or
    # attribute hooks, and decode promises ProtocolError for every input.
    except Exception as exc:  # noqa: BLE001
        raise _fail(
            f"frame {index} is not a contiguous byte buffer ({type(exc).__name__})"
        ) from None
    return view


def _reject_ext(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def _unpack_header(view: memoryview) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(
            view, raw=False, strict_map_key=True, use_list=True, timestamp=0,
            ext_hook=_reject_ext, max_str_len=limits.MAX_STR_LEN, max_bin_len=0,
            max_array_len=limits.MAX_ARRAY_LEN, max_map_len=limits.MAX_MAP_LEN,
            max_ext_len=0,
        )
    # Deliberately broad: msgpack raises several unrelated types (ValueError,
    # OutOfData, FormatError, StackError, ...); all of them mean "bad bytes".
    except Exception as exc:  # noqa: BLE001
        raise _fail(
            f"header is not valid msgpack: {type(exc).__name__}: {_short(str(exc))}"
        ) from None
    if type(header) is not dict or header.keys() != HEADER_KEYS:
        keys = sorted(map(str, header)) if type(header) is dict else type(header).__name__
        raise _fail(f"header must be a map with keys {sorted(HEADER_KEYS)}, got {keys}")
    return header


def _check_description(
    entry: object, name: str, optional: bool
) -> tuple[np.dtype[Any], tuple[int, ...], int] | None:
    """Validate one entry of ``arrays``; return (dtype, shape, nbytes) or None."""
    if entry is None:
        if optional:
            return None
        raise _fail(f"array {name!r} is required but described as None")
    if type(entry) is not dict or entry.keys() != ARRAY_KEYS:
        raise _fail(f"array {name!r}: description must be a map with keys {sorted(ARRAY_KEYS)}")
    if entry["name"] != name:
        raise _fail(f"array {name!r}: description names {_short(entry['name'])}")
    dtype = WIRE_DTYPES.get(entry["dtype"]) if type(entry["dtype"]) is str else None
    if dtype is None:
        raise _fail(f"array {name!r}: dtype {_short(entry['dtype'])} not in "
                    f"{', '.join(WIRE_DTYPES)}")
    shape = entry["shape"]
    if type(shape) is not list or len(shape) > limits.MAX_NDIM:
        raise _fail(f"array {name!r}: shape must be a list of at most {limits.MAX_NDIM} ints")
    if not all(type(dim) is int and 0 <= dim <= limits.MAX_DIM for dim in shape):
        raise _fail(f"array {name!r}: shape {_short(shape)} has a dim that is not an int "
                    f"in [0, {limits.MAX_DIM}]")
    nbytes = entry["nbytes"]
    expected = math.prod(shape) * dtype.itemsize
    if type(nbytes) is not int or nbytes != expected:
        raise _fail(f"array {name!r}: nbytes {_short(nbytes)} != prod{tuple(shape)} * "
                    f"{dtype.itemsize} = {expected}")
    return dtype, tuple(shape), nbytes


def _decode_body(
    header: dict[str, Any], schema: MessageSchema, views: list[memoryview]
) -> Message:
    fields = header["fields"]
    if type(fields) is not dict:
        raise _fail(f"'fields' must be a map, got {type(fields).__name__}")
    expected = _FIELD_NAMES[schema.cls.TYPE]
    if fields.keys() != expected:
        missing, extra = expected - fields.keys(), fields.keys() - expected
        raise _fail(f"{schema.cls.TYPE}: fields missing {sorted(missing)}, "
                    f"unexpected {sorted(map(str, extra))[:5]}")
    values: dict[str, Any] = {
        name: _check_field(name, kind, fields[name], coerce_numpy=False)
        for name, kind in schema.header_fields
    }
    if schema.cls.TYPE in HANDSHAKE_TYPES and values["protocol_version"] != header["v"]:
        raise _fail(f"protocol_version {values['protocol_version']} != header v {header['v']}")
    descriptions = header["arrays"]
    if type(descriptions) is not list or len(descriptions) != len(schema.array_fields):
        raise _fail(f"{schema.cls.TYPE}: 'arrays' must be a list of "
                    f"{len(schema.array_fields)} descriptions")
    checked = [
        _check_description(entry, name, optional)
        for entry, (name, optional) in zip(descriptions, schema.array_fields, strict=True)
    ]
    present = [item for item in checked if item is not None]
    if len(present) != len(views) - 1:
        raise _fail(f"{schema.cls.TYPE}: {len(present)} arrays described but "
                    f"{len(views) - 1} array frames received")
    frame_views = iter(views[1:])
    for (name, _), item in zip(schema.array_fields, checked, strict=True):
        if item is None:
            values[name] = None
            continue
        dtype, shape, nbytes = item
        view = next(frame_views)
        if view.nbytes != nbytes:
            raise _fail(f"array {name!r}: frame has {view.nbytes} bytes, described {nbytes}")
        array = np.empty(shape, dtype) if nbytes == 0 else np.frombuffer(view, dtype)
        array = array.reshape(shape)
        array.flags.writeable = False
        values[name] = array
    return schema.cls(**values)


def decode(frames: Sequence[object]) -> Message:
    """Validate ``[header, array frames...]`` and build the message (zero copy).

    Frames may be bytes, bytearray, memoryview or ``zmq.Frame``. Raises
    ``VersionMismatch`` for a non-handshake message of another protocol version
    (handshake types decode at any version; the caller compares
    ``protocol_version``), and ``ProtocolError`` for everything else that is wrong.
    """
    if not isinstance(frames, (list, tuple)) or not 1 <= len(frames) <= limits.MAX_FRAMES:
        count = len(frames) if isinstance(frames, (list, tuple)) else type(frames).__name__
        raise _fail(f"a message has 1 to {limits.MAX_FRAMES} frames, got {count}")
    views = [_byte_view(frame, index) for index, frame in enumerate(frames)]
    if views[0].nbytes > limits.MAX_HEADER_BYTES:
        raise _fail(f"header has {views[0].nbytes} bytes, limit {limits.MAX_HEADER_BYTES}")
    for index, view in enumerate(views[1:], start=1):
        if view.nbytes > limits.MAX_FRAME_BYTES:
            raise _fail(f"frame {index} has {view.nbytes} bytes, limit {limits.MAX_FRAME_BYTES}")
    if sum(view.nbytes for view in views) > limits.MAX_TOTAL_BYTES:
        raise _fail(f"message exceeds {limits.MAX_TOTAL_BYTES} bytes in total")
    header = _unpack_header(views[0])
    tag, version, fields = header["type"], header["v"], header["fields"]
    message_type = tag if type(tag) is str else None
    request_id = fields.get("request_id") if type(fields) is dict else None
    request_id = request_id if type(request_id) is int else None
    try:
        if type(version) is not int:
            raise _fail(f"header 'v' must be an int, got {type(version).__name__}")
        if version != PROTOCOL_VERSION and message_type not in HANDSHAKE_TYPES:
            raise VersionMismatch(PROTOCOL_VERSION, version, message_type=message_type)
        schema = SCHEMAS.get(message_type) if message_type is not None else None
        if schema is None:
            raise _fail(f"unknown message type {_short(tag)}")
        try:
            return _decode_body(header, schema, views)
        except ProtocolError as error:
            if version == PROTOCOL_VERSION:
                raise
            # A handshake message we cannot read from a peer of another version:
            # report the version, which is what the user has to fix.
            raise VersionMismatch(
                PROTOCOL_VERSION, version, message_type=message_type
            ) from error
    except ProtocolError as error:
        error.request_id, error.message_type = request_id, message_type
        raise
