"""The base class of every message type, apart so that every message module can share it."""
from __future__ import annotations

from typing import ClassVar


class Message:
    """Base class of all message dataclasses (for ``isinstance`` and typing)."""

    TYPE: ClassVar[str] = ""
