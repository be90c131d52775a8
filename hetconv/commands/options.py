"""Shared pieces of the command line: the one-line-error parser, flag types, env.

Flags win over ``HETCONV_*`` environment variables, which win over defaults:
:func:`env` reads a variable for a flag's default. The value types turn bad text
into a one-line ``hetconv: error: ...``.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from hetconv.errors import UserError

T = TypeVar("T")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line."""

    def error(self, message: str) -> Any:
        raise UserError(f"{message} (see '{self.prog} --help')")


def env(name: str, default: Any) -> Any:
    """The value of ``HETCONV_<name>``, or ``default`` when it is not set."""
    return os.environ.get(f"HETCONV_{name}", default)


def env_int(name: str, default: int) -> int:
    text = env(name, None)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise UserError(f"HETCONV_{name}={text!r}: expected an integer") from None


def _env_typed(name: str, default: T, parse: Callable[[str], T]) -> T:
    """``HETCONV_<name>`` through the flag type ``parse``, or ``default`` when unset."""
    text = env(name, None)
    if text is None:
        return default
    try:
        return parse(text)
    except argparse.ArgumentTypeError as error:
        raise UserError(f"HETCONV_{name}: {error}") from None


def env_float(name: str, default: float) -> float:
    return _env_typed(name, default, non_negative_float)


def env_positive_int(name: str) -> int | None:
    return _env_typed(name, None, positive_int)


def _int_at_least(text: str, lowest: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def check_output_path(flag: str, path: str) -> None:
    """Fail before any work when FILE (given with ``flag``) cannot be written."""
    folder = Path(path).parent
    if Path(path).is_dir():
        raise UserError(f"{flag} {path}: is a directory; give a file name")
    if not folder.is_dir():
        raise UserError(f"{flag} {path}: directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UserError(f"{flag} {path}: cannot write in {folder}")


def add_curve_master(p: argparse.ArgumentParser) -> None:
    p.add_argument("--curve-secret", default=env("CURVE_SECRET", None), metavar="FILE",
                   help="encrypt and authenticate: the master's NAME.key_secret")
    p.add_argument("--curve-allow", default=env("CURVE_ALLOW", None), metavar="DIR",
                   help="with --curve-secret: directory of allowed workers' NAME.key files")


def add_membership(p: argparse.ArgumentParser, listen_required: bool) -> None:
    """--listen, --min-workers, --wait, --no-local (train and calibrate)."""
    if listen_required:
        p.add_argument("--listen", required=env("LISTEN", None) is None,
                       default=env("LISTEN", None), metavar="ENDPOINT",
                       help="bind here and wait for workers, e.g. tcp://*:5555")
    p.add_argument("--min-workers", type=int, default=env_int("MIN_WORKERS", 1),
                   help="distributed: workers to wait for before starting (default 1)")
    p.add_argument("--wait", type=non_negative_float, default=env_float("WAIT", 60.0),
                   help="distributed: seconds to wait for --min-workers (default 60)")
    p.add_argument("--no-local", action="store_true",
                   help="distributed: the master's own device computes no kernels")
