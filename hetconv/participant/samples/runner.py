"""A participant's side of the sample split: each request to the round or chain that serves it.

:class:`SampleRunner` holds the participant's
:class:`~hetconv.participant.samples.layers.SliceLayers` and hands each request to the
code that serves it, by its type (protocol/samples.py): a chain, a whole pass or step in
one request (:mod:`~hetconv.participant.samples.chain`), or a round through the master,
an evaluation or an update (:mod:`~hetconv.participant.samples.rounds`).
"""
from __future__ import annotations

from collections.abc import Mapping

from hetconv.engine.shard import ConvShard
from hetconv.participant.samples.chain import backward_chain, forward_chain
from hetconv.participant.samples.layers import SampleRequestError, SliceLayers
from hetconv.participant.samples.rounds import (
    backward_round,
    evaluation_round,
    forward_round,
    update_round,
)
from hetconv.protocol import (
    SampleBackwardChain,
    SampleBackwardReply,
    SampleBackwardRound,
    SampleEvaluation,
    SampleForwardChain,
    SampleForwardReply,
    SampleForwardRound,
    SampleStepChain,
    SampleUpdateRound,
)
from hetconv.protocol.samples import SampleRequest

__all__ = ["SampleRequestError", "SampleRunner"]


class SampleRunner:
    """A participant's sample-split server: its held layers and the request dispatch."""

    __slots__ = ("layers",)

    def __init__(self) -> None:
        self.layers = SliceLayers()

    def serve(self, request: SampleRequest, shards: Mapping[int, ConvShard]
              ) -> SampleForwardReply | SampleBackwardReply:
        """The reply to one request, computed over ``shards`` (the layers held whole)."""
        held = self.layers
        match request:
            case SampleForwardRound():
                return forward_round(held, request, shards)
            case SampleEvaluation():
                return evaluation_round(held, request, shards)
            case SampleForwardChain() | SampleStepChain():
                return forward_chain(held, request, shards)
            case SampleBackwardRound():
                return backward_round(held, request, shards)
            case SampleBackwardChain():
                return backward_chain(held, request, shards)
            case SampleUpdateRound():
                return update_round(held, request, shards)
