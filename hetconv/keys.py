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

import os
from pathlib import Path

import zmq.auth

from hetconv.errors import UserError
from hetconv.protocol.transport import CurveClientKeys, CurveServerKeys


def create_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` (0600); refuse to overwrite."""
    directory = Path(directory)
    if not name or "/" in name or name.startswith("."):
        raise UserError(f"--name {name!r}: use a plain file name such as worker-a")
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise UserError(f"{path} exists; keys are never overwritten (remove it first)")
    directory.mkdir(parents=True, exist_ok=True)
    public_file, secret_file = zmq.auth.create_certificates(directory, name)
    os.chmod(secret_file, 0o600)
    return Path(public_file), Path(secret_file)


def _load(path: str | Path, need_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read CURVE key file {path}: {error}") from None
    if public is None or (need_secret and secret is None):
        kind = "secret key file (NAME.key_secret)" if need_secret else "public key file"
        raise UserError(f"{path} is not a {kind}; create keys with 'hetconv keygen'")
    return public, secret


def server_keys(secret_file: str | Path, allow_dir: str | Path) -> CurveServerKeys:
    """The master's keys and the worker public keys found in ``allow_dir``."""
    public, secret = _load(secret_file, need_secret=True)
    assert secret is not None
    if not Path(allow_dir).is_dir():
        raise UserError(f"--curve-allow {allow_dir}: not a directory of worker *.key files")
    allowed = frozenset(zmq.auth.load_certificates(str(allow_dir)))
    if not allowed:
        raise UserError(f"--curve-allow {allow_dir}: holds no public key files (*.key)")
    return CurveServerKeys(public_key=public, secret_key=secret, allowed_client_keys=allowed)


def client_keys(secret_file: str | Path, master_key_file: str | Path) -> CurveClientKeys:
    """A worker's keys and the master's public key."""
    public, secret = _load(secret_file, need_secret=True)
    master_public, _ = _load(master_key_file, need_secret=False)
    assert secret is not None
    return CurveClientKeys(public_key=public, secret_key=secret, server_public_key=master_public)
