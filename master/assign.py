"""Handing out shards, and one scatter/gather of requests over workers.

:func:`assign` is the one place that gives participants their shards of every conv
layer with the arrays of a whole-layer state (``conv{i}.<name>``): the first
assignment of a run (seeded initial weights), a restore or recovery (a snapshot), a
join and a re-split (the current state). Workers get an ``AssignShard`` (an empty one
where a worker lost all of a layer's kernels, so no stale shard stays), the master's
own shards are rebuilt on its device. :func:`exchange` sends a set of requests and
gathers their replies (or raises ``WorkerLost``), in request order.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from hetconv.engine.shard import ConvShard, LayerSettings
from hetconv.master.cluster import Cluster, Reply, WorkerHandle, WorkerLost
from hetconv.master.plan import Shard
from hetconv.names import STATE_NAMES, TRAINABLE_NAMES, layer_key, velocity_name
from hetconv.protocol import AssignShard


def exchange(cluster: Cluster, requests: Sequence[tuple[WorkerHandle, Any]], what: str,
             timeout_s: float | None = None,
             done: Callable[[], bool] = lambda: True) -> list[Reply]:
    """Send every request (a message with a ``request_id``), gather every reply (in request order); also waits until
    ``done()``. Raises ``WorkerLost`` naming the first worker that failed."""
    pending: dict[int, WorkerHandle] = {}
    try:
        for worker, message in requests:
            cluster.send(worker, message)
            pending[message.request_id] = worker
    except BaseException:  # a later send failed: the requests already out are forgotten
        cluster.membership.abandon(pending)
        raise
    replies = cluster.gather(pending, what, done=done, timeout_s=timeout_s)
    return [replies[message.request_id] for _, message in requests]


def shard_state(state: Mapping[str, np.ndarray], layer: int, start: int,
                stop: int) -> dict[str, np.ndarray]:
    """Kernels [start, stop) of ``layer``'s arrays in a whole-layer ``state`` (the names of
    STATE_NAMES it has)."""
    return {name: state[layer_key(layer, name)][start:stop]
            for name in STATE_NAMES if layer_key(layer, name) in state}


def assign_shard(request_id: int, layer: int, start: int, stop: int, settings: LayerSettings,
                 state: dict[str, np.ndarray]) -> AssignShard:
    """The ``AssignShard`` of kernels [start, stop) of ``layer`` with this state (the
    arrays sliced to the shard; velocities missing from ``state`` start at zero).
    ``settings`` may be the whole network's: the layer's own are sent."""
    settings = settings.for_layer(layer)
    arrays = {name: np.ascontiguousarray(state[name], dtype=np.float32)
              for name in STATE_NAMES if name in state}
    for name in TRAINABLE_NAMES:
        arrays.setdefault(velocity_name(name), np.zeros_like(arrays[name]))
    return AssignShard(request_id=request_id, layer=layer, kernel_start=start, kernel_stop=stop,
                       stride=settings.stride, padding=settings.padding, need_dx=layer > 0,
                       bn_momentum=settings.bn_momentum, bn_eps=settings.bn_eps,
                       momentum=settings.momentum, weight_decay=settings.weight_decay,
                       pool=settings.pool, batch_norm=settings.batch_norm, relu=settings.relu,
                       input_from=settings.input_from, shortcut_from=settings.shortcut_from,
                       **arrays)


def assign(cluster: Cluster, shards: Sequence[Sequence[Shard]],
           state: Mapping[str, np.ndarray], settings: LayerSettings,
           local: Mapping[int, ConvShard], device: str, why: str,
           previous: Sequence[Sequence[Shard]] | None = None,
           changed_only: bool = False) -> dict[int, ConvShard]:
    """Give every participant its shard of ``shards`` with ``state``'s arrays; returns
    the master's own shards (``local`` updated; a rebuilt shard stays on the device it
    was on, a new one goes to ``device``).

    A shard is handed out when it holds kernels (with ``changed_only``: only when its
    range differs from ``previous``'s, the state being the current one), and an empty
    shard when ``previous`` had kernels there. A worker that is gone but would get
    kernels raises ``WorkerLost`` (gone) before anything is sent."""
    for shard in (s for row in shards for s in row if s.kernels > 0):
        if shard.worker is not None and shard.worker.gone:
            raise WorkerLost(f"worker {shard.participant} is gone; not assigning it kernels",
                             shard.participant, gone=True)
    own = dict(local)
    requests: list[tuple[WorkerHandle, Any]] = []
    for layer, row in enumerate(shards):
        before = list(previous[layer]) if previous is not None else [None] * len(row)
        for shard, old in zip(row, before):
            held = old is not None and old.kernels > 0
            same = old is not None and ((old.start, old.stop) == (shard.start, shard.stop)
                                        or old.kernels == shard.kernels == 0)
            if not (shard.kernels > 0 and not (changed_only and same)) and \
                    not (held and not same):
                if shard.worker is None and layer not in own:  # the master: always a shard
                    own[layer] = ConvShard(layer, shard.start, shard.stop, settings,
                                           shard_state(state, layer, shard.start, shard.stop),
                                           device=device)
                continue
            piece = shard_state(state, layer, shard.start, shard.stop)
            if shard.worker is None:
                old_local = own.get(layer)
                own[layer] = ConvShard(layer, shard.start, shard.stop, settings, piece,
                                       device=old_local.device if old_local else device)
            elif not shard.worker.gone:
                requests.append((shard.worker, assign_shard(
                    cluster.request_id(), layer, shard.start, shard.stop, settings, piece)))
    exchange(cluster, requests, f"{why} shard assignment")
    return own
