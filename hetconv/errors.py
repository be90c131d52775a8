"""Errors a user can act on.

Anything raised as a :class:`UserError` is printed by the CLI as one line
(``hetconv: error: ...``) with no traceback and a non-zero exit status.
"""
from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix: bad flag, missing dataset, unreachable peer."""
