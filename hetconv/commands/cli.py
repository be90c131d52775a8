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
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

from hetconv import __version__, logs
from hetconv.commands import (
    bench,
    calibrate,
    evaluate,
    export,
    keygen,
    plan,
    predict,
    report,
    status,
    train,
    worker,
)
from hetconv.commands.options import Parser
from hetconv.errors import UserError

SUBCOMMANDS: dict[str, ModuleType] = {
    "train": train, "worker": worker, "report": report, "calibrate": calibrate,
    "keygen": keygen, "bench": bench, "plan": plan, "evaluate": evaluate, "predict": predict,
    "export": export, "status": status,
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hetconv", description=(
        "Train convolutional networks with every conv layer's kernels spread over CPU and "
        "GPU worker daemons on mismatched machines. Start 'hetconv worker' on each machine, "
        "'hetconv train --listen' on the master, then read 'hetconv report RUN_DIR'."))
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"hetconv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for module in SUBCOMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        logs.configure(args.verbose, getattr(args, "log_format", "text"),
                       getattr(args, "progress_every", None))
        run: Callable[[argparse.Namespace], int] = SUBCOMMANDS[args.command].run
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
