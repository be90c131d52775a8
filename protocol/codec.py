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
building anything, and builds arrays over the received frames: no copy, and the
arrays are **read-only** (``.copy()`` to get a writable one). Any failure, for any
input whatsoever, is a ``ProtocolError``.

Both directions run once per message right after megabytes went through the CPU
caches, so the success paths are kept short: per-class field specs are compiled
once at import, and each check is a plain loop (no generators, no per-call dicts).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np

from . import limits
from .errors import ERR_BAD_MESSAGE, ProtocolError, VersionMismatch
from .messages import HANDSHAKE_TYPES, SCHEMAS, Message
from .version import PROTOCOL_VERSION

ARRAY_DTYPES: dict[str, np.dtype[Any]] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("|u1"),
}
"""Array dtypes any message may carry (not a run's wire dtypes): name → little-endian dtype."""

DTYPE_NAMES: dict[np.dtype[Any], tuple[str, bool]] = {
    dtype.newbyteorder(order): (name, order == ">" and dtype.itemsize > 1)
    for name, dtype in ARRAY_DTYPES.items()
    for order in ("<", ">")
}
"""Either byte order of an allowed dtype → (wire name, needs a byte swap)."""

HEADER_KEYS = frozenset({"v", "type", "fields", "arrays"})
ARRAY_KEYS = frozenset({"name", "dtype", "shape", "nbytes"})
_KIND_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (float, int), "bool": (bool,),
    "str": (str,), "dict": (dict,), "list": (list,),
}

Frame = bytes | memoryview


@dataclass(frozen=True)
class _Spec:
    """One message class compiled for the codec's loops."""

    cls: type[Message]
    tag: str
    header: tuple[tuple[str, str, tuple[type, ...]], ...]  # (name, kind, accepted types)
    names: frozenset[str]
    arrays: tuple[tuple[str, bool], ...]  # (name, may be None)
    handshake: bool


_SPECS: dict[str, _Spec] = {
    tag: _Spec(schema.cls, tag,
               tuple((name, kind, _KIND_TYPES[kind]) for name, kind in schema.header_fields),
               frozenset(name for name, _ in schema.header_fields),
               schema.array_fields, tag in HANDSHAKE_TYPES)
    for tag, schema in SCHEMAS.items()
}
_SPECS_BY_CLASS: dict[type, _Spec] = {spec.cls: spec for spec in _SPECS.values()}


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


def _wrong_type(name: str, kind: str, value: object) -> ProtocolError:
    return _fail(f"field {name!r} must be {kind}, got {type(value).__name__}")


# --- encode -----------------------------------------------------------------------------
def _encode_fields(spec: _Spec, msg: Message) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for name, kind, types in spec.header:
        value = getattr(msg, name)
        if type(value) not in types:
            if not isinstance(value, np.generic):
                raise _wrong_type(name, kind, value)
            value = value.item()  # numpy scalar → Python scalar, then check again
            if type(value) not in types:
                raise _wrong_type(name, kind, value)
        if kind == "float":
            value = float(value)
        elif kind == "str":
            _check_str(value, f"field {name!r}")
        elif kind != "int" and kind != "bool":
            _check_native(value, f"field {name!r}", 0)
        fields[name] = value
    return fields


def _encode_array(name: str, value: object) -> tuple[dict[str, Any], Frame]:
    """The array's description and its frame (a view of its memory when possible)."""
    if not isinstance(value, np.ndarray):
        raise _fail(f"array field {name!r} must be a numpy array, got {type(value).__name__}")
    found = DTYPE_NAMES.get(value.dtype)
    if found is None:
        raise _fail(f"array field {name!r} has dtype {value.dtype}, allowed: "
                    f"{', '.join(ARRAY_DTYPES)}")
    dtype_name, needs_swap = found
    shape = value.shape
    if len(shape) > limits.MAX_NDIM:
        raise _fail(f"array field {name!r} has {len(shape)} dims, at most {limits.MAX_NDIM}")
    extent = math.prod(dim or 1 for dim in shape)  # a zero dim counted as 1
    if max(shape, default=0) > limits.MAX_DIM or extent > limits.MAX_ELEMENTS:
        raise _fail(f"array field {name!r}: shape {shape} has a dim over MAX_DIM or MAX_ELEMENTS")
    if needs_swap:
        value = value.astype(ARRAY_DTYPES[dtype_name])
    if not value.flags.c_contiguous:
        value = value.copy(order="C")
    nbytes = value.nbytes
    if nbytes > limits.MAX_FRAME_BYTES:
        raise _fail(f"array {name!r} has {nbytes} bytes, limit {limits.MAX_FRAME_BYTES}")
    description = {"name": name, "dtype": dtype_name, "shape": list(shape), "nbytes": nbytes}
    return description, (value.data.cast("B") if nbytes else b"")


def encode(msg: Message) -> list[Frame]:
    """Encode a message to ``[header, array frames...]`` without copying arrays.

    Raises ``ProtocolError`` (code ``bad_message``) when the message would not pass
    ``decode``: wrong field types, disallowed dtype, too many dims, over a limit.
    numpy scalars in header fields are converted to Python scalars.
    """
    spec = _SPECS_BY_CLASS.get(type(msg))
    if spec is None:
        raise _fail(f"cannot encode {type(msg).__name__}: not a protocol message class")
    fields = _encode_fields(spec, msg)
    descriptions: list[dict[str, Any] | None] = []
    frames: list[Frame] = [b""]
    total = 0
    for name, optional in spec.arrays:
        value = getattr(msg, name)
        if value is None and optional:
            descriptions.append(None)
            continue
        description, frame = _encode_array(name, value)
        descriptions.append(description)
        frames.append(frame)
        total += description["nbytes"]
    header = {"v": PROTOCOL_VERSION, "type": spec.tag, "fields": fields,
              "arrays": descriptions}
    try:
        frames[0] = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:  # defensive: checked above
        raise _fail(f"cannot pack header: {type(exc).__name__}: {_short(str(exc))}") from None
    if len(frames[0]) > limits.MAX_HEADER_BYTES:
        raise _fail(f"header has {len(frames[0])} bytes, limit {limits.MAX_HEADER_BYTES}")
    if len(frames[0]) + total > limits.MAX_TOTAL_BYTES:
        raise _fail(f"message exceeds {limits.MAX_TOTAL_BYTES} bytes in total")
    return frames


# --- decode -----------------------------------------------------------------------------
def byte_view(frame: object, index: int) -> memoryview:
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
    dtype = ARRAY_DTYPES.get(entry["dtype"]) if type(entry["dtype"]) is str else None
    if dtype is None:
        raise _fail(f"array {name!r}: dtype {_short(entry['dtype'])} not in "
                    f"{', '.join(ARRAY_DTYPES)}")
    shape = entry["shape"]
    if type(shape) is not list or len(shape) > limits.MAX_NDIM:
        raise _fail(f"array {name!r}: shape must be a list of at most {limits.MAX_NDIM} ints")
    expected, extent = dtype.itemsize, 1  # extent: prod(dims), a zero dim counted as 1
    for dim in shape:
        if (type(dim) is not int or not 0 <= dim <= limits.MAX_DIM
                or (extent := extent * (dim or 1)) > limits.MAX_ELEMENTS):
            raise _fail(f"array {name!r}: shape {_short(shape)} has a dim not in [0, "
                        f"{limits.MAX_DIM}] or over {limits.MAX_ELEMENTS} elements in all")
        expected *= dim
    nbytes = entry["nbytes"]
    if type(nbytes) is not int or nbytes != expected:
        raise _fail(f"array {name!r}: nbytes {_short(nbytes)} != prod{tuple(shape)} * "
                    f"{dtype.itemsize} = {expected}")
    return dtype, tuple(shape), nbytes


def _decode_fields(spec: _Spec, fields: object, version: int) -> dict[str, Any]:
    if type(fields) is not dict:
        raise _fail(f"'fields' must be a map, got {type(fields).__name__}")
    if fields.keys() != spec.names:
        missing, extra = spec.names - fields.keys(), fields.keys() - spec.names
        raise _fail(f"{spec.tag}: fields missing {sorted(missing)}, "
                    f"unexpected {sorted(map(str, extra))[:5]}")
    values: dict[str, Any] = {}
    for name, kind, types in spec.header:
        value = fields[name]
        if type(value) not in types:  # exact types: a bool is not an int
            raise _wrong_type(name, kind, value)
        if kind == "float":
            value = float(value)
        elif kind == "dict" or kind == "list":  # msgpack already bounded str fields
            _check_native(value, f"field {name!r}", 0)
        values[name] = value
    if spec.handshake and values["protocol_version"] != version:
        raise _fail(f"protocol_version {values['protocol_version']} != header v {version}")
    return values


def _decode_body(header: dict[str, Any], spec: _Spec, views: list[memoryview]) -> Message:
    values = _decode_fields(spec, header["fields"], header["v"])
    descriptions = header["arrays"]
    if type(descriptions) is not list or len(descriptions) != len(spec.arrays):
        raise _fail(f"{spec.tag}: 'arrays' must be a list of {len(spec.arrays)} descriptions")
    checked = []
    present = 0
    for entry, (name, optional) in zip(descriptions, spec.arrays, strict=True):
        item = _check_description(entry, name, optional)
        checked.append(item)
        present += item is not None
    if present != len(views) - 1:
        raise _fail(f"{spec.tag}: {present} arrays described but "
                    f"{len(views) - 1} array frames received")
    index = 1
    for (name, _), item in zip(spec.arrays, checked, strict=True):
        if item is None:
            values[name] = None
            continue
        dtype, shape, nbytes = item
        view = views[index]
        index += 1
        if view.nbytes != nbytes:
            raise _fail(f"array {name!r}: frame has {view.nbytes} bytes, described {nbytes}")
        array = np.ndarray(shape, dtype, view) if nbytes else np.empty(shape, dtype)
        array.flags.writeable = False  # the shape was bounded: MAX_ELEMENTS
        values[name] = array
    return spec.cls(**values)


def decode(frames: Sequence[object]) -> Message:
    """Validate ``[header, array frames...]`` and build the message (zero copy).

    Frames may be bytes, bytearray, memoryview or ``zmq.Frame``. Raises
    ``VersionMismatch`` for a non-handshake message of another protocol version
    (handshake types decode at any version; the caller compares
    ``protocol_version``), and ``ProtocolError`` for everything else (nothing else).
    """
    if not isinstance(frames, (list, tuple)) or not 1 <= len(frames) <= limits.MAX_FRAMES:
        count = len(frames) if isinstance(frames, (list, tuple)) else type(frames).__name__
        raise _fail(f"a message has 1 to {limits.MAX_FRAMES} frames, got {count}")
    views: list[memoryview] = []
    total = 0
    for index, frame in enumerate(frames):
        view = byte_view(frame, index)
        if index == 0 and view.nbytes > limits.MAX_HEADER_BYTES:
            raise _fail(f"header has {view.nbytes} bytes, limit {limits.MAX_HEADER_BYTES}")
        if index and view.nbytes > limits.MAX_FRAME_BYTES:
            raise _fail(f"frame {index} has {view.nbytes} bytes, limit {limits.MAX_FRAME_BYTES}")
        total += view.nbytes
        views.append(view)
    if total > limits.MAX_TOTAL_BYTES:
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
        spec = _SPECS.get(message_type) if message_type is not None else None
        if spec is None:
            raise _fail(f"unknown message type {_short(tag)}")
        try:
            return _decode_body(header, spec, views)
        except ProtocolError as error:
            if version == PROTOCOL_VERSION:
                raise
            # A handshake message we cannot read from a peer of another version:
            # report the version, which is what the user has to fix.
            raise VersionMismatch(
                PROTOCOL_VERSION, version, message_type=message_type
            ) from error
        except Exception as exc:  # noqa: BLE001 - a gap in the checks is still a bad message
            raise _fail(f"undecodable: {type(exc).__name__}: {_short(str(exc))}") from None
    except ProtocolError as error:
        error.request_id, error.message_type = request_id, message_type
        raise
