"""Unit tests of the bounds on what a peer can make us do: the codec's shape bounds
(``MAX_ELEMENTS``, checked before any allocation), ``decode``'s promise that nothing but
``ProtocolError`` leaves it, the per-sender budgets and the CURVE key binding."""
from __future__ import annotations

import logging
from typing import Any

import msgpack
import numpy as np
import pytest

from hetconv.master.membership import Log, Membership, MessageReceived, Send
from hetconv.protocol import (
    PROTOCOL_VERSION,
    ForwardReply,
    Heartbeat,
    Hello,
    ProtocolError,
    decode,
    encode,
    limits,
)
from hetconv.protocol.admission import SenderBudget
from hetconv.protocol.codec import _SPECS


def reply_header(shape: list[Any], nbytes: int = 0) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": "forward_reply",
            "fields": {"request_id": 1, "step": 0, "layer": 0, "attempt": 0, "compute_s": 0.1},
            "arrays": [{"name": "y", "dtype": "float32", "shape": shape, "nbytes": nbytes}]}


@pytest.mark.parametrize("shape", [[0, 2**30, 2**30, 2**30], [2**30, 2**30, 0],
                                   [0] + [2**20] * 7, [2**15, 2**15, 2, 0]])
def test_huge_dims_of_an_empty_array_are_refused(shape: list[int]) -> None:
    frames = [msgpack.packb(reply_header(shape)), b""]
    assert len(frames[0]) < 200  # a small message (the was 80 bytes)
    with pytest.raises(ProtocolError, match="elements in all"):
        decode(frames)


def test_element_bound_is_inclusive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "MAX_ELEMENTS", 12)
    message = decode([msgpack.packb(reply_header([0, 3, 4])), b""])
    assert isinstance(message, ForwardReply) and message.y.shape == (0, 3, 4)
    with pytest.raises(ProtocolError, match="elements"):
        decode([msgpack.packb(reply_header([0, 13])), b""])
    with pytest.raises(ProtocolError, match="elements"):  # non-empty, too: before the bytes
        decode([msgpack.packb(reply_header([13], 52)), b"\0" * 52])


def test_encode_refuses_what_decode_would(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "MAX_ELEMENTS", 12)
    ok = ForwardReply(request_id=1, step=0, layer=0, attempt=0, compute_s=0.0,
                      y=np.zeros((0, 3, 4), np.float32))
    assert decode(encode(ok)).y.shape == (0, 3, 4)  # type: ignore[attr-defined]
    with pytest.raises(ProtocolError, match="MAX_ELEMENTS"):
        encode(ForwardReply(request_id=1, step=0, layer=0, attempt=0, compute_s=0.0,
                            y=np.zeros((0, 13), np.float32)))


def test_any_exception_while_building_is_a_protocol_error() -> None:
    """A gap in the checks (here: a message class that raises) is still a bad message."""
    spec = _SPECS["heartbeat"]

    class Exploding:
        def __init__(self, **_: Any) -> None:
            raise MemoryError("boom")

    object.__setattr__(spec, "cls", Exploding)  # a frozen dataclass
    try:
        with pytest.raises(ProtocolError, match="MemoryError"):
            decode(encode(Heartbeat(sent_at=1.0)))
    finally:
        object.__setattr__(spec, "cls", Heartbeat)
    assert isinstance(decode(encode(Heartbeat(sent_at=1.0))), Heartbeat)


# --- per-sender budgets ----------------------------------------------------------------
def test_budget_drops_past_the_limit_and_counts() -> None:
    budget = SenderBudget(window_s=1.0, max_messages=3, max_errors=1, max_stranger_messages=1,
                          max_joiner_messages=2)
    assert [budget.admit(b"a", 0.0) for _ in range(5)] == [True, True, True, False, False]
    assert [budget.admit(b"s", 0.0, known=False) for _ in range(3)] == [True, False, False]
    assert [budget.admit(b"j", 0.0, joiner=True) for _ in range(3)] == [True, True, False]
    assert budget.admit(b"b", 0.5)  # other senders have their own budget
    assert budget.admit(b"a", 1.0)  # a new window
    assert budget.may_complain(b"a", 1.0) and not budget.may_complain(b"a", 1.1)
    assert budget.take_counts(b"a") == (2, 1)
    assert budget.take_counts(b"a") == (0, 0)
    assert budget.take_counts(b"nobody") == (0, 0)


def test_budget_table_stays_bounded() -> None:
    budget = SenderBudget()
    for index in range(10_000):
        budget.admit(index.to_bytes(4, "big"), 0.0, known=False)
    assert len(budget._windows) <= 4096


# --- a CURVE key is bound to the identity that said Hello with it ----------------------------
def hello(name: str) -> Hello:
    return Hello(worker_id=name, device={"device": "cpu"}, protocol_version=PROTOCOL_VERSION)


def test_a_message_under_a_workers_identity_with_another_key_is_dropped() -> None:
    membership = Membership("run")
    membership.handle(MessageReceived(b"id-b", hello("b"), 0.0, "KEY-B"))
    worker = membership.workers[b"id-b"]
    assert worker.curve_key == "KEY-B"
    assert membership.handle(MessageReceived(b"id-b", Heartbeat(sent_at=0.0), 1.0, "KEY-B")) == []
    assert worker.last_seen == 1.0
    first = membership.handle(MessageReceived(b"id-b", Heartbeat(sent_at=0.0), 2.0, "KEY-A"))
    assert len(first) == 1 and isinstance(first[0], Log) and first[0].level == logging.WARNING
    again = membership.handle(MessageReceived(b"id-b", hello("a"), 3.0, "KEY-A"))
    assert again == []  # logged once; a Hello cannot rebind the identity either
    assert worker.last_seen == 1.0 and worker.curve_key == "KEY-B" and worker.forgeries == 2
    assert membership.workers[b"id-b"] is worker


def test_without_curve_nothing_is_bound() -> None:
    membership = Membership("run")
    membership.handle(MessageReceived(b"id", hello("w"), 0.0))
    actions = membership.handle(MessageReceived(b"id", hello("w"), 1.0))
    assert any(isinstance(a, Send) for a in actions)  # Welcomed again
    assert membership.workers[b"id"].forgeries == 0
