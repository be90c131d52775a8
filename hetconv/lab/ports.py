"""TCP ports for the lab's masters: free now, and handed out once per host.

``bind(("127.0.0.1", 0))`` then closing the socket is the usual way to find a free
port, but it races: between the close and the master's own bind another process
can be given the same port, by the same trick (the kernel picks from the ephemeral
range, odd ports first, so two test processes on one host met on one port in CI) or
as the source port of an outgoing connection. Here a port is

- taken **below the kernel's ephemeral range** (``ip_local_port_range``), where
  neither ``bind(0)`` nor ``connect()`` ever puts a socket by itself;
- **claimed** for :data:`CLAIM_S` seconds by creating a file named after it in a
  directory shared by the user's processes on the host (``O_EXCL``: one winner), so
  two of them never get the same port in that time;
- checked free by binding it (a listening service keeps it).

Where the ephemeral range leaves no room below or above it, the kernel's ``bind(0)``
port is used, still claimed.
"""
from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

_RNG = random.SystemRandom()  # independent of any seed a caller set

CLAIM_S = 600.0
"""Seconds a port handed out stays reserved for the process that got it."""
LOWEST_PORT = 10000
"""No port below this is handed out (well-known and registered services live there)."""
MIN_RANGE = 2000
"""Fewest ports a range outside the ephemeral one must hold to be used."""
EPHEMERAL_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range(path: Path = EPHEMERAL_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (first, last); Linux's default if unreadable."""
    try:
        first, last = (int(word) for word in path.read_text().split()[:2])
    except (OSError, ValueError):
        return 32768, 60999
    return first, last


def candidate_range(ephemeral: tuple[int, int]) -> tuple[int, int] | None:
    """Ports (first, last) outside the ephemeral range to draw from, or None: the lower
    gap if it holds :data:`MIN_RANGE` ports, else the upper one, else neither."""
    first, last = ephemeral
    if first - LOWEST_PORT >= MIN_RANGE:
        return LOWEST_PORT, first - 1
    if 65535 - last >= MIN_RANGE:
        return last + 1, 65535
    return None


def claims_dir() -> Path | None:
    """Where this user's processes on this host record the ports they were handed (one
    directory per user: another user's is not writable); None where none can be made
    (then only the bind check and the range keep ports apart)."""
    path = Path(tempfile.gettempdir()) / f"hetconv-ports-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None


def claim(port: int, directory: Path | None, now: float | None = None) -> bool:
    """Record ``port`` as handed out; False when another process holds a live claim.
    True without a directory, or where a claim cannot be written (nothing to check)."""
    if directory is None:
        return True
    now = time.time() if now is None else now
    path = directory / str(port)
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            os.utime(path, (now, now))
            return True
        except FileExistsError:
            try:
                if now - path.stat().st_mtime < CLAIM_S:
                    return False
                path.unlink()  # an old claim: take it over (one retry)
            except FileNotFoundError:
                pass  # another process took it over just now: try once more
        except OSError:
            return True  # a full or read-only disk: no claims, the bind check still holds
    return False


def bindable(port: int) -> bool:
    """Whether a socket can bind 127.0.0.1:``port`` now."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def kernel_port() -> int:
    """A port the kernel picks for ``bind(0)``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port(attempts: int = 200) -> int:
    """A TCP port on 127.0.0.1 that is free, outside the ephemeral range where there is
    room, and not handed out to any other process of this host in the last
    :data:`CLAIM_S` seconds."""
    directory = claims_dir()
    span = candidate_range(ephemeral_range())
    for _ in range(attempts):
        port = _RNG.randint(*span) if span is not None else kernel_port()
        if bindable(port) and claim(port, directory):
            return port
    raise RuntimeError(f"no free TCP port on 127.0.0.1 after {attempts} tries")
