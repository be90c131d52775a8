"""The command line: one module per ``hetconv`` subcommand (see :mod:`hetconv.commands.cli`).

This is the top of the import graph: it may import ``hetconv.master`` and
``hetconv.worker``; nothing else imports it.
"""
