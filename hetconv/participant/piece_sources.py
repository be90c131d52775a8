"""Which address a peer's pieces may come from, without CURVE.

With CURVE the data endpoint admits exactly the keys the master handed out, so a stranger
cannot connect at all. Plain TCP has no keys: a stranger that learned the request counter
could push pieces that say they come from worker b and get b (or the receiver) evicted.
So a piece is accepted only from the address its sender registered: the host of the data
endpoint the master handed out for it (``AssignPeers.peers``; the master's own is its
address on the route to the receiver, ``master/data_ports.py``), as libzmq reports the
connection's remote IP (the ``Peer-Address`` frame property). Pieces of peers on this
same machine come from one of this machine's own addresses, and cannot be told apart:
those are accepted when the sender's endpoint is on this machine too.

What plain TCP still cannot prevent: a stranger on the sender's own machine, or behind
the same NAT, speaks for it; only CURVE (``--curve``) binds a piece to its sender.
"""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from urllib.parse import urlsplit


def normalized(address: str) -> str:
    """``address`` as one comparable IP string: an IPv4-mapped IPv6 address as its IPv4
    (``::ffff:10.0.0.2`` -> ``10.0.0.2``), a scope id dropped; "" for what is no IP."""
    text = address.strip().strip("[]").split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return ""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def endpoint_addresses(endpoint: str) -> frozenset[str]:
    """The IP addresses the host of ``tcp://HOST:PORT`` resolves to (empty where it is
    no tcp endpoint or does not resolve: such a sender's pieces are not checked)."""
    parts = urlsplit(endpoint)
    host = parts.hostname
    if parts.scheme != "tcp" or not host:
        return frozenset()
    direct = normalized(host)
    if direct:
        return frozenset({direct})
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return frozenset()
    return frozenset(filter(None, (normalized(str(info[4][0])) for info in found)))


def local_addresses() -> frozenset[str]:
    """Every IP address of this machine's interfaces (psutil)."""
    import psutil

    found = {"127.0.0.1", "::1"}
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6):
                found.add(normalized(address.address))
    found.discard("")
    return frozenset(found)


def source_refusal(sender: str, source: str, registered: Mapping[str, frozenset[str]],
                   local: frozenset[str]) -> str | None:
    """Why a piece that says it comes from ``sender`` and came on a connection from
    ``source`` (a Peer-Address) is refused, or None to accept it. Accepted: no address
    known (``ipc://``, ``inproc://``, a sender not registered here: the plan checks it,
    or a host that did not resolve); ``source`` among the sender's registered addresses;
    ``source`` and the sender's endpoint both on this machine."""
    expected = registered.get(sender)
    if not expected or not source or source in expected:  # the common case, no parse
        return None
    ip = normalized(source)
    if not ip or ip in expected or (ip in local and expected & local):
        return None
    return (f"dropped a piece that says it is from {sender} but came from {ip}, not from "
            f"{sender}'s address {', '.join(sorted(expected))} (a stranger speaking for "
            f"{sender}, or {sender} reaches this machine from another address: set its "
            "--advertise to that one; --curve binds pieces to their sender)")
