"""Protocol version of the hetconv wire format.

Bump ``PROTOCOL_VERSION`` whenever any message's header schema, field set, field
types or array framing changes. The handshake messages (``Hello``, ``Welcome``,
``Refuse``) keep their schema frozen across versions so that peers of different
versions can always tell each other that they do not match (see docs/protocol.md).
"""
from __future__ import annotations

PROTOCOL_VERSION = 15
