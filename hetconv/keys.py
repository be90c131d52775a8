"""CURVE key files for encrypted, authenticated master/worker traffic.

Keys are ZeroMQ certificate files (pyzmq's ``zmq.auth`` format): ``NAME.key`` holds
the public key and may be copied anywhere; ``NAME.key_secret`` holds both keys and
stays on its machine (written mode 0600). The master admits exactly the workers
whose public key files are in its allow directory; a worker must know the master's
public key. Turning CURVE on is all or nothing per run: the master's listening
socket enforces its ZAP domain, so a misconfiguration refuses every worker rather
than admitting any key.
"""
from __future__ import annotations

import datetime
import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from hetconv.errors import UserError
from hetconv.protocol.transport import CurveClientKeys, CurveServerKeys


def _key_file_text(public_key: bytes, secret_key: bytes | None) -> str:
    """A certificate in ``zmq.auth.create_certificates``'s format (``load_certificate``
    reads it)."""
    kind = "**Secret** Certificate" if secret_key else "Public Certificate"
    lines = [f"#   ****  Generated on {datetime.datetime.now()} by hetconv  ****",
             f"#   ZeroMQ CURVE {kind}",
             "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions."
             if secret_key else "#   Copy it to the peers that must know this key.",
             "", "metadata", "curve", f'    public-key = "{public_key.decode()}"']
    if secret_key:
        lines.append(f'    secret-key = "{secret_key.decode()}"')
    return "\n".join(lines) + "\n"


def _write_new(path: Path, text: str, mode: int) -> None:
    """Create ``path`` with ``mode`` from the start (never a moment more readable) and
    write ``text``; an existing file is an error, not overwritten."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise UserError(f"{path} exists; keys are never overwritten (remove it first)") from None
    except OSError as error:
        raise UserError(f"cannot write {path}: {error.strerror}") from None
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(text)


def create_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (0644) and ``NAME.key_secret`` (created 0600); refuse to
    overwrite either."""
    directory = Path(directory)
    if not name or "/" in name or name.startswith("."):
        raise UserError(f"--name {name!r}: use a plain file name such as worker-a")
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise UserError(f"{path} exists; keys are never overwritten (remove it first)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"--dir {directory}: cannot create it: {error.strerror}") from None
    public_key, secret_key = zmq.curve_keypair()
    _write_new(secret, _key_file_text(public_key, secret_key), 0o600)
    _write_new(public, _key_file_text(public_key, None), 0o644)
    return public, secret


def _is_z85_key(key: bytes) -> bool:
    """Whether ``key`` is a CURVE key as a certificate holds it (40 z85 characters)."""
    if len(key) != 40:
        return False
    try:
        return len(z85.decode(key)) == 32
    except (ValueError, KeyError, IndexError, TypeError):
        return False


def _load(path: str | Path, need_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except OSError as error:
        raise UserError(f"cannot read CURVE key file {path}: "
                        f"{error.strerror or 'no such file'}") from None
    except ValueError:
        public, secret = None, None
    if public is None or (need_secret and secret is None):
        kind = "secret key file (NAME.key_secret)" if need_secret else "public key file"
        raise UserError(f"{path} is not a {kind}; create keys with 'hetconv keygen'")
    if not _is_z85_key(public) or (secret is not None and not _is_z85_key(secret)):
        raise UserError(f"{path}: its key is not 40 z85 characters (damaged?); create keys "
                        "with 'hetconv keygen'")
    return public, secret


def _allowed_keys(allow_dir: str | Path) -> frozenset[bytes]:
    """The public keys of every ``*.key`` file in ``allow_dir`` (one line naming a bad
    one)."""
    if not Path(allow_dir).is_dir():
        raise UserError(f"--curve-allow {allow_dir}: not a directory of worker *.key files")
    try:
        files = sorted(Path(allow_dir).glob("*.key"))
    except OSError as error:
        raise UserError(f"--curve-allow {allow_dir}: cannot list it: {error.strerror}") from None
    return frozenset(_load(path, need_secret=False)[0] for path in files)


def server_keys(secret_file: str | Path, allow_dir: str | Path) -> CurveServerKeys:
    """The master's keys and the worker public keys found in ``allow_dir``."""
    public, secret = _load(secret_file, need_secret=True)
    assert secret is not None
    allowed = _allowed_keys(allow_dir)
    if not allowed:
        raise UserError(f"--curve-allow {allow_dir}: holds no public key files (*.key)")
    return CurveServerKeys(public_key=public, secret_key=secret, allowed_client_keys=allowed)


def client_keys(secret_file: str | Path, master_key_file: str | Path) -> CurveClientKeys:
    """A worker's keys and the master's public key."""
    public, secret = _load(secret_file, need_secret=True)
    master_public, _ = _load(master_key_file, need_secret=False)
    assert secret is not None
    return CurveClientKeys(public_key=public, secret_key=secret, server_public_key=master_public)
