"""Which participant reduces what among the peers: the sample split's reduction plan.

Pure functions of the shapes and the participants, the same on every participant
(the master builds the plan, :class:`~hetconv.participant.peer_plan.PeerPlan`, and hands it out in
``AssignPeers.plan``; every participant decides per layer from it and the shapes):

- :func:`reduce_ranges`: each owner's kernel range of a layer for the two-hop
  reduction (reduce-scatter to the owners, then all-gather);
- :func:`reduced_directly`: a layer too small for two hops, sent whole in one;
- :func:`bucket_sizes`: the first layers whose gradients go together as one piece.

:mod:`hetconv.participant.samples.weight_reduce` moves the pieces the plan describes.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hetconv.participant.peer_plan import KernelRange, PeerPlan

DIRECT_BYTES = 16 * 1024
"""A layer whose whole float32 weight gradient is smaller than this is reduced directly
(phase ``whole``, one hop)."""
BUCKET_BYTES = 128 * 1024
"""The first layers whose float32 weight gradients add up to at most this many bytes
are reduced together, as one ``whole`` piece (docs/sample-split.md, "The first layers
together")."""


def reduce_ranges(kernels: int, owners: Sequence[str], everyone: Sequence[str]
                  ) -> list[KernelRange]:
    """Kernel ranges of one layer tiling [0, ``kernels``) in the order of ``everyone``:
    the ``owners`` share them evenly (the first ones one more when they do not divide),
    the others get empty ranges."""
    ranges: list[KernelRange] = []
    position = 0
    count = max(len(owners), 1)
    index = 0
    for participant in everyone:
        size = 0
        if participant in owners:
            size = kernels // count + (1 if index < kernels % count else 0)
            index += 1
        ranges.append(KernelRange(participant, position, position + size))
        position += size
    return ranges


def bucket_sizes(sizes: Sequence[int]) -> list[int]:
    """The elements of each layer in the bucket: the longest prefix of ``sizes`` (the
    weight-gradient elements of layers 0, 1, ...) within :data:`BUCKET_BYTES` in float32."""
    bucket: list[int] = []
    for size in sizes:
        if 4 * (sum(bucket) + size) > BUCKET_BYTES:
            break
        bucket.append(int(size))
    return bucket


def reduce_plan(kernels: Sequence[int], owners: Sequence[str], everyone: Sequence[str],
                sizes: Sequence[int] = ()) -> PeerPlan:
    """The :class:`PeerPlan` of a run's reduction: :func:`reduce_ranges` per layer, and
    the bucket of the layers whose weight gradients have ``sizes`` elements (none when
    not given)."""
    return PeerPlan([reduce_ranges(k, owners, everyone) for k in kernels],
                    bucket=bucket_sizes(sizes))


def reduced_directly(shape: Sequence[int]) -> bool:
    """Whether a layer whose weight gradient has ``shape`` is reduced directly (every
    participant decides it alike from the shape alone)."""
    return int(np.prod(shape, dtype=np.int64)) * 4 < DIRECT_BYTES
