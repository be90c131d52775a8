"""Telling a dead link from a silent peer, from the kernel's view of the TCP connections.

A worker that stops answering is either stopped or dead (SIGSTOP, a hung process) or
behind a link that carries nothing (a cut cable, a partition). From the sockets both
look alike; the kernel tells them apart. To a stopped process the master's bytes are
still acknowledged by its kernel; on a cut link they are not, and the master's kernel
retransmits them with a growing back-off, so after the link heals the first segment
arrives late (up to a few seconds). :func:`stalled_peers` reads ``/proc/net/tcp`` and
``/proc/net/tcp6`` for the connections on the master's port whose unacknowledged
bytes are being retransmitted after at least one retransmission timeout went
unanswered, and returns their remote addresses (bytes merely in flight, or waiting for
a delayed acknowledgement, run the same timer, but no timeout has passed: a stopped
peer's kernel acknowledges within 200 ms, or closes its window, which runs the
zero-window probe timer instead);
``master/membership.py`` gives a silent worker at such an address up to
``link_retry_s`` (10 s) instead of ``liveness_timeout_s`` (5 s) before it is lost.
Where the evidence cannot be read (no ``/proc``, the worker's address unknown) the
5 s limit holds. Pure parsing plus one file read; no sockets.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from pathlib import Path

PROC_TCP = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
TCP_ESTABLISHED = 0x01
TIMER_RETRANSMIT = 1  # the "tr" column: the retransmission timer is running
MIN_TIMEOUTS = 1  # the "retrnsmt" column: retransmission timeouts without progress


def _address(hex_address: str) -> tuple[str, int]:
    """``0100007F:1F90`` (kernel byte order per 32-bit word) -> ("127.0.0.1", 8080)."""
    host, port = hex_address.split(":")
    words = [bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8)]
    packed = b"".join(words)
    ip = ipaddress.ip_address(packed)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def canonical_address(text: str) -> str:
    """An IP address as :func:`stalled_peers` writes it (an IPv4-mapped IPv6 address as
    IPv4); "" for anything that is not an address."""
    if not text:
        return ""
    try:
        ip = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return ""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def stalled_peers(port: int, tables: Iterable[str]) -> frozenset[str]:
    """Remote addresses of the established connections on local ``port`` that hold
    unacknowledged bytes under a running retransmission timer that has already timed
    out at least ``MIN_TIMEOUTS`` times without an acknowledgement, from the text of
    ``/proc/net/tcp``-style tables."""
    out: set[str] = set()
    for table in tables:
        for line in table.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 7:
                continue
            try:
                _, local_port = _address(fields[1])
                remote, _ = _address(fields[2])
                state = int(fields[3], 16)
                tx_queue = int(fields[4].split(":")[0], 16)
                timer = int(fields[5].split(":")[0], 16)
                timeouts = int(fields[6], 16)
            except ValueError:
                continue
            if local_port == port and state == TCP_ESTABLISHED and tx_queue > 0 \
                    and timer == TIMER_RETRANSMIT and timeouts >= MIN_TIMEOUTS:
                out.add(remote)
    return frozenset(out)


def read_stalled_peers(port: int) -> frozenset[str]:
    """:func:`stalled_peers` of this machine's TCP tables (empty where unreadable)."""
    tables = []
    for path in PROC_TCP:
        try:
            tables.append(path.read_text(encoding="ascii"))
        except OSError:
            continue
    return stalled_peers(port, tables)
