"""A step record's timing entry: one participant's figures of one conv layer (both splits).

The fields are docs/metrics.md's ``step`` record's; the phases or rounds add to them
as replies arrive, and the stage's ``end_step`` hands them to the trainer.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PEER_ENTRY_FIELDS: Mapping[str, Any] = {
    "peer_bytes_sent": 0, "peer_bytes_received": 0, "peer_wait_s": 0.0}
"""The peer data plane's fields of every timing entry (docs/metrics.md)."""


def timing_entry(participant: str, kernels: int, samples: int | None = None,
                 peers: bool = False) -> dict[str, Any]:
    """``participant``'s empty entry of one layer holding ``kernels`` kernels (and, under
    the sample split, ``samples`` samples of the batch); the peer fields with ``peers``."""
    entry: dict[str, Any] = {"participant": participant, "kernels": kernels}
    if samples is not None:
        entry.update(samples=samples, split_by="samples")
    entry.update(forward_s=0.0, backward_s=0.0, wait_s=0.0, forward_latency_s=0.0,
                 backward_latency_s=0.0, bytes_sent=0, bytes_received=0)
    if peers:
        entry.update(PEER_ENTRY_FIELDS)
    return entry
