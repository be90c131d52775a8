"""A participant's side of the sample split: each request to the round or chain that serves it.

:class:`SampleRunner` holds the participant's
:class:`~hetconv.participant.samples.layers.SliceLayers` and hands each request to the
code that serves it: a whole pass in one request (``sync_id`` > 0,
:mod:`~hetconv.participant.samples.chain`) or one round of the master's
(:mod:`~hetconv.participant.samples.rounds`).
"""
from __future__ import annotations

from collections.abc import Mapping

from hetconv.engine.shard import ConvShard
from hetconv.participant.samples.chain import backward_chain, forward_chain
from hetconv.participant.samples.layers import SampleRequestError, SliceLayers
from hetconv.participant.samples.rounds import backward_round, forward_round
from hetconv.protocol import (
    SampleBackwardReply,
    SampleBackwardRequest,
    SampleForwardReply,
    SampleForwardRequest,
)

__all__ = ["SampleRequestError", "SampleRunner"]


class SampleRunner:
    """A participant's sample-split server: its held layers and the request dispatch."""

    __slots__ = ("layers",)

    def __init__(self) -> None:
        self.layers = SliceLayers()

    def forward(self, request: SampleForwardRequest, shards: Mapping[int, ConvShard]
                ) -> SampleForwardReply:
        if request.sync_id > 0:
            return forward_chain(self.layers, request, shards)
        return forward_round(self.layers, request, shards)

    def backward(self, request: SampleBackwardRequest, shards: Mapping[int, ConvShard]
                 ) -> SampleBackwardReply:
        if request.sync_id > 0:
            return backward_chain(self.layers, request, shards)
        return backward_round(self.layers, request, shards)
