"""The real :class:`~hetconv.master.samples.stage.SampleConvStage` built over the fake
cluster of tests/support/fake_sample_cluster.py.

With the peer data plane, :class:`FakeSamplePeers` stands in for
:class:`hetconv.master.samples.peers.SamplePeers`: the same plan, handed out with real
``AssignPeers`` messages, over in-memory queues instead of data sockets.

:func:`make_sample_stage` is the one place that builds the stage (as
``master/samples/setup.py``'s ``open_sample_stage`` does, minus the calibration and the
report); when the stage's constructor changes, only it changes.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetconv.config import MASTER_PARTICIPANT
from hetconv.engine.shard import ConvShard, LayerSettings
from hetconv.engine.stage import ConvStage, LocalConvStage, layer_settings
from hetconv.master.assign import assign, exchange
from hetconv.master.cluster import WorkerHandle
from hetconv.master.plan import Participant, Shard
from hetconv.master.run import RunControl
from hetconv.master.samples.balance import SampleBalance
from hetconv.master.samples.settings import SampleSetup
from hetconv.master.samples.stage import SampleConvStage
from hetconv.metrics import MetricsWriter
from hetconv.model import ModelConfig, conv_layer_shapes, layer_parameters
from hetconv.participant.samples.reduction_plan import reduce_plan
from hetconv.participant.samples.weight_reduce import GradientExchange
from hetconv.protocol import (
    AssignPeers,
)
from hetconv.worker.service import FaultInjector
from tests.support.fake_sample_cluster import FakeSampleCluster
from tests.support.queue_port import QueuePort


class FakeSamplePeers:
    """:class:`hetconv.master.samples.peers.SamplePeers` over in-memory queues: the same
    reduction plan, handed to every worker in an ``AssignPeers`` (its service opens its
    port on the queues), and the master's :class:`GradientExchange`."""

    def __init__(self, cluster: FakeSampleCluster, timeout_s: float):
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.exchange: GradientExchange | None = None
        self.cancel = threading.Event()
        self.plans: list[Any] = []  # every plan handed out

    def assign(self, workers: dict[str, WorkerHandle], owners: Sequence[str],
               kernels: Sequence[int], sizes: Sequence[int] = ()) -> GradientExchange:
        live = {p: w for p, w in workers.items() if not w.gone}
        everyone = [MASTER_PARTICIPANT] + list(live)
        plan = reduce_plan(kernels, [o for o in owners if o in everyone], everyone, sizes)
        self.plans.append(plan)
        self.cluster.network = {name: queue.Queue() for name in everyone}
        endpoints = {name: f"inproc://peer-{name}" for name in everyone}
        self.exchange = None
        exchange(self.cluster, [(worker, AssignPeers(  # type: ignore[arg-type]
            request_id=self.cluster.request_id(), participant=participant,
            wire_dtype="float32", timeout_s=self.timeout_s, peers=dict(endpoints),
            peer_keys={name: "" for name in everyone}, plan=plan.to_wire()))
            for participant, worker in live.items()], "peer assignment")
        self.exchange = GradientExchange(MASTER_PARTICIPANT,
                                         plan, QueuePort(self.cluster.network,
                                                         MASTER_PARTICIPANT),
                                         self.timeout_s, cancelled=self.cancel.is_set)
        return self.exchange

    def close(self) -> None:
        self.exchange = None


class SlowLocalStage:
    """The master alone (a :class:`LocalConvStage`), ``delay_s`` slower per conv call:
    what the setup's ``local_stage`` gives where a test wants the master alone slow."""

    def __init__(self, local: LocalConvStage, delay_s: float):
        self.local, self.delay_s = local, delay_s

    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        if train:
            time.sleep(self.delay_s)
        return self.local.forward(layer, x, train, step)

    def backward(self, layer: int, dy: np.ndarray, need_dx: bool, learning_rate: float,
                 step: int) -> np.ndarray | None:
        time.sleep(self.delay_s)
        return self.local.backward(layer, dy, need_dx, learning_rate, step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)


def make_sample_stage(model: ModelConfig, params: dict[str, np.ndarray], run_dir: Path, *,
                      workers: Sequence[str] = ("w1", "w2"), data_plane: str = "star",
                      seconds: dict[str, float] | None = None, master_computes: bool = True,
                      batch: int = 8, settings: LayerSettings | None = None,
                      rebalancing: bool = False, fall_back: bool = False,
                      local_delay_s: float = 0.0,
                      faults: dict[str, FaultInjector] | None = None,
                      dense_replicas: bool = False, steps_in_flight: int = 1,
                      cluster: FakeSampleCluster | None = None,
                      report: Callable[[str], None] | None = None,
                      ) -> tuple[SampleConvStage, FakeSampleCluster]:
    """A :class:`SampleConvStage` over ``workers`` (in-process, on a fake cluster; each
    holds every layer of ``params`` when this returns) and the master (with a slice when
    ``master_computes``), as ``open_sample_stage`` builds it. ``seconds``: per-sample
    seconds per participant (the calibration's; default 1.0 each: equal slices).
    ``data_plane``: "star" (rounds through the master) or "peer" (chains, the weight
    reduction over :class:`FakeSamplePeers`). ``local_delay_s``: the master alone (the
    setup's ``local_stage``) sleeps that much per conv call. ``faults``: a worker's
    FaultInjector (tests/support/faulty_worker.py's WorkerFaults). ``dense_replicas``
    and ``steps_in_flight`` (the peer data plane only, as ``open_sample_stage`` sets
    them): the dense part on every participant, the next step sent ahead (2); the
    Trainer attaches its dense part (``attach_dense``: AssignDense to every worker, and
    the peers' plan again with the dense part's layer). ``report``: the console lines
    (default: kept in ``cluster.lines``)."""
    assert data_plane in ("star", "peer")
    assert data_plane == "peer" or not (dense_replicas or steps_in_flight > 1), \
        "the dense part is replicated, and steps run ahead, over the peer data plane only"
    settings = settings or layer_settings(model, 0.9, 0.0)
    shapes = conv_layer_shapes(model)
    cluster = cluster or FakeSampleCluster()
    cluster.layers = len(shapes)
    for name in workers:
        if name not in cluster.workers:
            cluster.add_worker(name, faults=(faults or {}).get(name))
    cluster.admit([cluster.workers[name].handle for name in workers])
    participants = ([Participant(MASTER_PARTICIPANT, None, {"device": "cpu"})]
                    if master_computes else []) + \
        [Participant(name, cluster.workers[name].handle, {"device": "cpu"}) for name in workers]
    seconds = seconds or {}
    balance = SampleBalance({p.participant: seconds.get(p.participant, 1.0)
                             for p in participants})
    members = [p for p in participants if p.worker is not None]
    rows = [[Shard(p.participant, p.worker, 0, shape.kernels) for p in members]
            for shape in shapes]
    fake: Any = cluster
    assign(fake, rows, params, settings, {}, "cpu", "first")
    local = {shape.index: ConvShard(shape.index, 0, shape.kernels, settings,
                                    layer_parameters(params, shape.index), device="cpu")
             for shape in shapes}
    alone_params = {k: v.copy() for k, v in params.items()}

    def local_stage() -> ConvStage:
        stage = LocalConvStage(model, alone_params, settings)
        return SlowLocalStage(stage, local_delay_s) if local_delay_s > 0 else stage

    metrics = MetricsWriter(run_dir / "metrics.jsonl")
    setup = SampleSetup(tuple(shapes), settings, "cpu", "float32", batch, master_computes,
                        local_stage, metrics, report or cluster.lines.append, rebalancing=rebalancing,
                        fall_back=fall_back, slice_statistics=False,
                        dense_replicas=dense_replicas and data_plane == "peer",
                        steps_in_flight=steps_in_flight)
    control = RunControl(p.participant for p in members)

    def finish() -> None:  # open_sample_stage's
        cluster.end_run("training finished")
        cluster.close()
        metrics.close()

    peers = FakeSamplePeers(cluster, cluster.peer_timeout_s) if data_plane == "peer" else None
    stage = SampleConvStage(fake, members, local, balance, control, setup, finish,
                            peers)  # type: ignore[arg-type]
    stage.assign_peers()
    return stage, cluster
