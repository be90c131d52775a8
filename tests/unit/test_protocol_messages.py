"""Unit tests of protocol.messages and the package's rules (no pickle, module sizes)."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from hetconv import protocol
from hetconv.protocol.errors import ERROR_CODES, ProtocolError, VersionMismatch
from hetconv.protocol.messages import (
    HANDSHAKE_TYPES,
    MESSAGE_TYPES,
    SCHEMAS,
    BackwardReply,
    ForwardReply,
    Heartbeat,
    Hello,
    message_equal,
)

PROTOCOL_DIR = Path(protocol.__file__).parent


def test_every_message_is_a_frozen_dataclass_with_a_unique_tag() -> None:
    assert len(MESSAGE_TYPES) == len({cls.TYPE for cls in MESSAGE_TYPES.values()}) == 36
    for tag, cls in MESSAGE_TYPES.items():
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
        assert tag == cls.TYPE and tag.isidentifier() and tag == tag.lower()
        assert "TYPE" not in {field.name for field in dataclasses.fields(cls)}
        assert cls.__doc__


def test_schemas_split_header_fields_from_arrays() -> None:
    assert SCHEMAS["backward_reply"].array_fields == (("dx", True),)
    assert SCHEMAS["forward_request"].array_fields == (("x", False),)
    assert dict(SCHEMAS["forward_request"].header_fields)["train"] == "bool"
    assert dict(SCHEMAS["hello"].header_fields)["device"] == "dict"
    assert len(SCHEMAS["assign_shard"].array_fields) == 8
    assert 1 + len(SCHEMAS["snapshot_reply"].array_fields) <= protocol.limits.MAX_FRAMES
    for tag in HANDSHAKE_TYPES:
        assert "protocol_version" in dict(SCHEMAS[tag].header_fields)
    for tag, schema in SCHEMAS.items():
        if tag.endswith(("_request", "_reply")) or tag in {"ack", "end_run", "assign_shard"}:
            assert schema.header_fields[0] == ("request_id", "int"), tag


def test_step_messages_carry_step_layer_attempt() -> None:
    for tag in ("forward_request", "forward_reply", "backward_request", "backward_reply"):
        names = [name for name, _ in SCHEMAS[tag].header_fields]
        assert names[:4] == ["request_id", "step", "layer", "attempt"]


def test_messages_are_immutable() -> None:
    beat = Heartbeat(1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        beat.sent_at = 2.0  # type: ignore[misc]


def test_message_equal_compares_arrays_by_dtype_shape_and_value() -> None:
    y = np.array([[1.0, np.nan]], np.float32)
    reply = ForwardReply(1, 2, 3, 0, 0.1, y)
    assert message_equal(reply, ForwardReply(1, 2, 3, 0, 0.1, y.copy()))
    assert not message_equal(reply, ForwardReply(1, 2, 3, 0, 0.1, y.astype(np.float64)))
    assert not message_equal(reply, ForwardReply(1, 2, 3, 0, 0.1, y.reshape(2, 1)))
    assert not message_equal(reply, ForwardReply(1, 2, 3, 1, 0.1, y))
    assert message_equal(BackwardReply(1, 1, 1, 0, 0.0, None), BackwardReply(1, 1, 1, 0, 0.0, None))
    assert not message_equal(BackwardReply(1, 1, 1, 0, 0.0, None),
                             BackwardReply(1, 1, 1, 0, 0.0, np.zeros(1, np.float32)))
    assert not message_equal(Hello("a", {}, 1), Hello("a", {"x": 1}, 1))


def test_errors_are_one_line_and_carry_context() -> None:
    error = ProtocolError("bad_message", "two\nlines", request_id=3, identity=b"w")
    assert str(error) == "bad_message: two lines" and error.request_id == 3
    mismatch = VersionMismatch(1, 2, message_type="hello")
    assert isinstance(mismatch, ProtocolError) and mismatch.code in ERROR_CODES
    assert "version 2" in str(mismatch) and "\n" not in str(mismatch)


def test_public_names_are_exported() -> None:
    for name in protocol.__all__:
        assert hasattr(protocol, name), name
    for cls in MESSAGE_TYPES.values():
        assert cls.__name__ in protocol.__all__


def _top(module: str) -> str:
    """The top package, or ``hetconv.protocol`` for the protocol package's own modules."""
    return "hetconv.protocol" if module.startswith("hetconv.protocol") else module.split(".")[0]


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(_top(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(_top(node.module))
    return names


# That the protocol imports only the standard library, numpy, msgpack and zmq (and nothing
# else of hetconv) is checked with the rest of the import direction, relative and
# function-level imports included, in tests/unit/test_import_direction.py.


@pytest.mark.parametrize("path", sorted(PROTOCOL_DIR.glob("*.py")), ids=lambda p: p.name)
def test_no_pickle_in_protocol(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    assert not {"pickle", "cPickle", "dill", "marshal"} & _imported_modules(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            assert node.attr not in {"send_pyobj", "recv_pyobj", "loads", "load"}, node.attr
        if isinstance(node, ast.keyword):
            assert node.arg != "allow_pickle"


def test_module_sizes_and_docstrings() -> None:
    for path in PROTOCOL_DIR.glob("*.py"):
        lines = path.read_text(encoding="utf-8").count("\n")
        assert lines <= 400, path.name
        assert ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))), path.name
