"""Property tests: ``decode`` raises nothing but ``ProtocolError``, whatever it is fed.

Four families of input: arbitrary frame lists, arbitrary msgpack values as a header,
structurally plausible headers with wrong contents (the dangerous middle ground),
valid messages that were truncated or had bytes flipped, and valid headers with one
entry changed, deleted or added. ``HETCONV_FUZZ_EXAMPLES=20000`` makes a long soak.
"""
from __future__ import annotations

import os
from typing import Any

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetconv.protocol.codec import ARRAY_DTYPES, decode, encode
from hetconv.protocol.errors import ProtocolError
from hetconv.protocol.messages import (
    MESSAGE_TYPES,
    SCHEMAS,
    AssignShard,
    ForwardRequest,
    Hello,
    Message,
)

EXAMPLES = int(os.environ.get("HETCONV_FUZZ_EXAMPLES", "400"))  # raise it for a long soak
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def decodes_or_protocol_error(frames: Any) -> None:
    try:
        message = decode(frames)
    except ProtocolError as error:
        assert error.code and "\n" not in str(error)
    else:
        assert isinstance(message, Message)


msgpack_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=20),
)
msgpack_values = st.recursive(
    msgpack_leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(st.one_of(st.text(max_size=10), st.integers(-(2**63), 2**63 - 1)),
                        children, max_size=5),
    ),
    max_leaves=30,
)


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=20))
def test_random_frame_lists(frames: list[bytes]) -> None:
    decodes_or_protocol_error(frames)


@FUZZ
@given(msgpack_values, st.lists(st.binary(max_size=64), max_size=3))
def test_random_msgpack_headers(header: Any, arrays: list[bytes]) -> None:
    decodes_or_protocol_error([msgpack.packb(header, use_bin_type=True), *arrays])


field_names = st.sampled_from(sorted({n for s in SCHEMAS.values() for n, _ in s.header_fields}))
descriptions = st.one_of(
    st.none(),
    st.fixed_dictionaries({
        "name": st.one_of(st.sampled_from(["x", "y", "dx", "dy", "weight"]), msgpack_values),
        "dtype": st.one_of(st.sampled_from([*sorted(ARRAY_DTYPES), "float128", "|O"]),
                           msgpack_values),
        "shape": st.one_of(st.lists(st.integers(-3, 2**40), max_size=10), msgpack_values),
        "nbytes": st.one_of(st.integers(-1, 1 << 12), msgpack_values),
    }),
    msgpack_values,
)
plausible_headers = st.fixed_dictionaries({
    "v": st.one_of(st.just(1), st.integers(-2, 3), msgpack_values),
    "type": st.one_of(st.sampled_from(sorted(MESSAGE_TYPES)), msgpack_values),
    "fields": st.one_of(st.dictionaries(field_names, msgpack_values, max_size=12), msgpack_values),
    "arrays": st.one_of(st.lists(descriptions, max_size=9), msgpack_values),
})


@settings(FUZZ, max_examples=max(1, EXAMPLES * 3 // 8))
@given(plausible_headers, st.lists(st.binary(max_size=256), max_size=9))
def test_plausible_headers_with_wrong_contents(header: dict[str, Any], arrays: list[bytes]) -> None:
    decodes_or_protocol_error([msgpack.packb(header, use_bin_type=True), *arrays])


def valid_frames() -> list[list[bytes]]:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4, 3, 5, 5)).astype(np.float32)
    vector = np.ones(4, np.float32)
    messages: list[Message] = [
        ForwardRequest(1, 2, 3, 0, True, rng.standard_normal((2, 3, 4, 4)).astype(np.float32)),
        Hello("worker-1", {"kind": "cpu", "cores": 2, "gpus": []}, 1),
        AssignShard(5, 0, 0, 4, 1, 2, False, 0.1, 1e-5, 0.9, 5e-4, weight, vector, vector,
                    vector, vector, weight, vector, vector),
    ]
    return [[bytes(frame) for frame in encode(message)] for message in messages]


VALID = valid_frames()


@FUZZ
@given(st.sampled_from(range(len(VALID))), st.data())
def test_truncated_frames(which: int, data: st.DataObject) -> None:
    frames = list(VALID[which])
    index = data.draw(st.integers(0, len(frames) - 1))
    cut = data.draw(st.integers(0, max(0, len(frames[index]) - 1)))
    frames[index] = frames[index][:cut]
    drop_tail = data.draw(st.integers(0, len(frames) - 1))
    decodes_or_protocol_error(frames[: len(frames) - drop_tail] if drop_tail else frames)


@FUZZ
@given(st.sampled_from(range(len(VALID))), st.data())
def test_flipped_header_bytes(which: int, data: st.DataObject) -> None:
    frames = list(VALID[which])
    header = bytearray(frames[0])
    for _ in range(data.draw(st.integers(1, 4))):
        header[data.draw(st.integers(0, len(header) - 1))] = data.draw(st.integers(0, 255))
    decodes_or_protocol_error([bytes(header), *frames[1:]])


def _containers(value: Any, found: list[Any]) -> list[Any]:
    """Every dict and list inside ``value``, ``value`` included."""
    if isinstance(value, (dict, list)):
        found.append(value)
        for child in value.values() if isinstance(value, dict) else value:
            _containers(child, found)
    return found


@FUZZ
@given(st.sampled_from(range(len(VALID))), st.data())
def test_single_mutations_of_valid_headers(which: int, data: st.DataObject) -> None:
    """Change, delete or add one entry anywhere in a valid header."""
    frames = list(VALID[which])
    header = msgpack.unpackb(frames[0], raw=False)
    container = data.draw(st.sampled_from(_containers(header, [])))
    action = data.draw(st.sampled_from(["replace", "delete", "add"]))
    if isinstance(container, dict):
        key = data.draw(st.sampled_from(sorted(container))) if container else "k"
        if action == "delete":
            container.pop(key, None)
        else:
            key = key if action == "replace" else data.draw(st.text(max_size=8))
            container[key] = data.draw(msgpack_values)
    elif container:
        index = data.draw(st.integers(0, len(container) - 1))
        if action == "delete":
            del container[index]
        elif action == "replace":
            container[index] = data.draw(msgpack_values)
        else:
            container.insert(index, data.draw(msgpack_values))
    decodes_or_protocol_error([msgpack.packb(header, use_bin_type=True), *frames[1:]])
