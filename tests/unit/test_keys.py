"""CURVE key files: written safely, and every bad file is one line that names it."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import zmq.auth

from hetconv.errors import UserError
from hetconv.keys import client_keys, create_keypair, server_keys


def test_the_secret_file_is_created_0600_and_never_chmodded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_chmod(*args: object, **kwargs: object) -> None:
        raise AssertionError("created readable, then chmodded")

    monkeypatch.setattr(os, "chmod", no_chmod)
    old_umask = os.umask(0)  # nothing masks the mode we ask for
    try:
        public, secret = create_keypair(tmp_path / "keys", "w")
    finally:
        os.umask(old_umask)
    assert secret.stat().st_mode & 0o777 == 0o600
    assert public.stat().st_mode & 0o777 == 0o644
    # the format of zmq.auth.create_certificates: pyzmq and hetconv both read it
    public_key, secret_key = zmq.auth.load_certificate(secret)
    assert zmq.auth.load_certificate(public) == (public_key, None)
    assert secret_key is not None and zmq.curve_public(secret_key) == public_key


def test_keys_are_never_overwritten(tmp_path: Path) -> None:
    create_keypair(tmp_path, "w")
    with pytest.raises(UserError, match="never overwritten"):
        create_keypair(tmp_path, "w")
    (tmp_path / "x.key_secret").write_text("mine")
    with pytest.raises(UserError, match="x.key_secret exists"):
        create_keypair(tmp_path, "x")
    assert (tmp_path / "x.key_secret").read_text() == "mine"


@pytest.mark.parametrize("content, expected", [
    (b"\x00\xff\xfe not a certificate", "is not a public key file"),
    (b'curve\n    public-key = "short"\n', "not 40 z85 characters"),
    (b'curve\n    public-key = "' + b"~" * 40 + b'"\n', "not 40 z85 characters"),
    (None, "Is a directory"),
])
def test_a_bad_allowed_key_file_is_one_line_naming_it(tmp_path: Path, content: bytes | None,
                                                      expected: str) -> None:
    _, master_secret = create_keypair(tmp_path / "keys", "master")
    allow = tmp_path / "allow"
    create_keypair(allow, "good")
    bad = allow / "bad.key"
    if content is None:
        bad.mkdir()
    else:
        bad.write_bytes(content)
    with pytest.raises(UserError) as raised:
        server_keys(master_secret, allow)
    text = str(raised.value)
    assert str(bad) in text and expected in text and "\n" not in text


def test_a_damaged_secret_file_is_one_line(tmp_path: Path) -> None:
    public, secret = create_keypair(tmp_path, "w")
    secret.write_text(secret.read_text().replace('secret-key = "', 'secret-key = "x'))
    with pytest.raises(UserError, match=f"{secret}: its key is not 40 z85"):
        client_keys(secret, public)
