"""``hetconv keygen``: a CURVE key pair for encrypted, authenticated traffic."""
from __future__ import annotations

import argparse
from typing import Any

from hetconv.keys import create_keypair


def add_parser(sub: Any) -> None:
    p = sub.add_parser("keygen", help="create a CURVE key pair (NAME.key, NAME.key_secret)")
    p.add_argument("--dir", default="keys", help="where to write the files (default keys/)")
    p.add_argument("--name", required=True, help="e.g. master or worker-a")


def run(args: argparse.Namespace) -> int:
    public, secret = create_keypair(args.dir, args.name)
    print(f"hetconv: wrote {public} (public: copy it to the peers) and {secret} "
          "(secret: keep it on this machine)")
    return 0
