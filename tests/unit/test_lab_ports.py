"""The lab's ports: outside the ephemeral range, never handed to two processes at once
(CI of 86967ce: two xdist processes were both given 127.0.0.1:47997 by ``bind(0)``)."""
from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path

from hetconv.lab import ports


def test_ports_come_from_outside_the_ephemeral_range() -> None:
    assert ports.candidate_range((32768, 60999)) == (10000, 32767)
    assert ports.candidate_range((1024, 60999)) == (61000, 65535)
    assert ports.candidate_range((1024, 65000)) is None  # then bind(0)'s port, still claimed
    first, _ = ports.ephemeral_range()
    port = ports.free_port()
    span = ports.candidate_range(ports.ephemeral_range())
    if span is not None:
        assert span[0] <= port <= span[1] and port < first


def test_an_unreadable_range_is_linuxs_default(tmp_path: Path) -> None:
    assert ports.ephemeral_range(tmp_path / "missing") == (32768, 60999)
    (tmp_path / "garbled").write_text("not numbers\n")
    assert ports.ephemeral_range(tmp_path / "garbled") == (32768, 60999)
    (tmp_path / "range").write_text("20000\t30000\n")
    assert ports.ephemeral_range(tmp_path / "range") == (20000, 30000)


def test_a_claim_has_one_winner_until_it_is_old(tmp_path: Path) -> None:
    assert ports.claim(20001, tmp_path, now=1000.0)
    assert not ports.claim(20001, tmp_path, now=1000.0 + ports.CLAIM_S - 1)
    assert ports.claim(20001, tmp_path, now=1000.0 + ports.CLAIM_S + 1)  # taken over
    assert ports.claim(20002, tmp_path, now=1000.0)


def test_without_a_writable_directory_the_bind_check_alone_decides(tmp_path: Path,
                                                                   monkeypatch) -> None:
    assert ports.claim(20003, None)
    (tmp_path / "20004").mkdir()  # not a file: os.open fails with another error than EEXIST
    assert ports.claim(20004, tmp_path / "20004" / "missing")
    monkeypatch.setattr(ports.tempfile, "gettempdir", lambda: str(tmp_path / "file"))
    (tmp_path / "file").write_text("")  # the "temporary directory" is a file
    assert ports.claims_dir() is None
    assert ports.free_port() > 0


def test_a_port_in_use_is_not_handed_out() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not ports.bindable(sock.getsockname()[1])


def _ports(count: int) -> list[int]:
    return [ports.free_port() for _ in range(count)]


def test_processes_asking_at_once_get_distinct_ports() -> None:
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        handed = [port for batch in pool.map(_ports, [50] * 4) for port in batch]
    assert len(set(handed)) == len(handed) == 200
