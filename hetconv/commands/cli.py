"""The ``hetconv`` command: the top-level parser and dispatch to one module per subcommand.

Subcommands (each a module of this package with ``add_parser`` and ``run``):
``train``, ``worker``, ``report``, ``calibrate``, ``keygen``, ``bench``, ``plan``,
``evaluate``, ``predict``, ``export`` and ``status``. Settings
come from flags, then ``HETCONV_*`` environment variables, then defaults; every
subcommand turns its flags into a typed configuration (``hetconv.config``) before
anything else sees them. A :class:`UserError` (or a bad flag) prints one line,
``hetconv: error: ...``, and exits with status 2. Logging is set up by
:mod:`hetconv.logs` (``--log-format`` where a subcommand has it; other libraries'
loggers stay at WARNING).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

from hetconv import __version__, logs
from hetconv.commands.options import Parser
from hetconv.errors import UserError

# each a module hetconv.commands.<name>, imported only when needed: a worker daemon or
# `hetconv status` does not pay for importing bench, report and export (0.2 s a start)
SUBCOMMANDS: tuple[str, ...] = ("train", "worker", "report", "calibrate", "keygen", "bench",
                                "plan", "evaluate", "predict", "export", "status")


def subcommand(name: str) -> ModuleType:
    """The module of subcommand ``name`` (one of SUBCOMMANDS)."""
    return importlib.import_module(f"hetconv.commands.{name}")


def chosen(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not an option, the top-level
    options taking no value), or None where that is not one of SUBCOMMANDS."""
    first = next((word for word in argv if not word.startswith("-")), None)
    return first if first in SUBCOMMANDS else None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``hetconv`` parser: with every subcommand, or with ``only`` that one (the same
    parsing for a command line naming it; help and errors about the command need all)."""
    parser = Parser(prog="hetconv", description=(
        "Train convolutional networks with every conv layer's kernels spread over CPU and "
        "GPU worker daemons on mismatched machines. Start 'hetconv worker' on each machine, "
        "'hetconv train --listen' on the master, then read 'hetconv report RUN_DIR'."))
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"hetconv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for name in SUBCOMMANDS:
        if only is None or name == only:
            subcommand(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        words = list(sys.argv[1:] if argv is None else argv)
        args = build_parser(chosen(words)).parse_args(words)
        logs.configure(args.verbose, getattr(args, "log_format", "text"),
                       getattr(args, "progress_every", None))
        run: Callable[[argparse.Namespace], int] = subcommand(args.command).run
        return run(args)
    except UserError as error:
        print(f"hetconv: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hetconv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (hetconv ... | head): not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout
        return 0


if __name__ == "__main__":
    sys.exit(main())
