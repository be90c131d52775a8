"""The address rule for pieces without CURVE (hetconv.participant.piece_sources)."""
from __future__ import annotations

from hetconv.participant.piece_sources import (
    endpoint_addresses,
    local_addresses,
    normalized,
    source_refusal,
)

REGISTERED = {"b": frozenset({"10.0.0.2"}), "master": frozenset({"10.0.0.1"}),
              "local": frozenset({"127.0.0.1"}), "unresolved": frozenset()}
LOCAL = frozenset({"127.0.0.1", "10.0.0.3"})


def test_addresses_are_compared_as_ips() -> None:
    assert normalized("::ffff:10.0.0.2") == "10.0.0.2"
    assert normalized("[fe80::1%eth0]") == "fe80::1"
    assert normalized("not an ip") == ""
    assert endpoint_addresses("tcp://10.0.0.2:5601") == {"10.0.0.2"}
    assert endpoint_addresses("tcp://localhost:5601") >= {"127.0.0.1"} or \
        endpoint_addresses("tcp://localhost:5601") == {"::1"}
    assert endpoint_addresses("ipc:///tmp/x") == frozenset()
    assert endpoint_addresses("tcp://no-such-host.invalid:1") == frozenset()
    assert "127.0.0.1" in local_addresses()


def test_a_piece_from_its_senders_address_is_accepted() -> None:
    assert source_refusal("b", "10.0.0.2", REGISTERED, LOCAL) is None
    assert source_refusal("b", "::ffff:10.0.0.2", REGISTERED, LOCAL) is None


def test_a_piece_speaking_for_another_address_is_refused_with_why() -> None:
    refusal = source_refusal("b", "10.0.0.9", REGISTERED, LOCAL)
    assert refusal is not None
    assert "says it is from b but came from 10.0.0.9" in refusal
    assert "10.0.0.2" in refusal and "--advertise" in refusal
    # the master is a sender like any other
    assert source_refusal("master", "10.0.0.2", REGISTERED, LOCAL) is not None
    # a remote stranger cannot speak for a peer on this machine either
    assert source_refusal("local", "10.0.0.9", REGISTERED, LOCAL) is not None


def test_what_cannot_be_told_apart_is_accepted() -> None:
    # peers on this machine: any of its own addresses
    assert source_refusal("local", "10.0.0.3", REGISTERED, LOCAL) is None
    # no address known: ipc/inproc, a sender the plan checks, a host that did not resolve
    assert source_refusal("b", "", REGISTERED, LOCAL) is None
    assert source_refusal("stranger", "10.0.0.9", REGISTERED, LOCAL) is None
    assert source_refusal("unresolved", "10.0.0.9", REGISTERED, LOCAL) is None
