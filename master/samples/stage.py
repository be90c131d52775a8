"""The distributed conv stage under the sample split (``--split-by samples``).

Every participant (the master's own device and each worker) holds every conv layer
whole and computes a slice of the batch, sized in proportion to its speed
(``master/samples/plan.py``). The trainer calls the stage layer by layer as for any
stage; each call here is one *round*: one request per worker with samples (the master
computes its own slice between sending and gathering), answered when the worker's part
is done. Forward, round l finishes layer l-1 with the whole batch's batch-norm
statistics (combined from every slice's moments in participant order) and starts layer
l; one more round returns the last layer's output slices, which the master joins along
the batch axis. Backward, round l finishes layer l+1 with the whole batch's batch-norm
sums, starts layer l, and applies the update of layer l+2 with the sum of every slice's
weight gradient; one last round applies layer 0's. Between layers nothing but per-channel
vectors and weight gradients travels (docs/sample-split.md).

The master keeps a replica of every layer that receives every update, so a snapshot is
its own state (then audited against every worker, as under the kernel split). Faults go
to the run's state machine (``master/run.py``) as under the kernel split, and its
commands are carried out here: evict, re-slice over the survivors (every survivor gets
the snapshot's layers), fall back to the master alone, stop; joiners are calibrated and
get the layers at the next snapshot. Re-balancing needs no data to move: only the
slices change (``SampleBalance``).

With ``--data-plane peer`` (the default) a training step is not rounds but two chains
(``master/samples/chains.py``, hetconv/participant/samples/chain.py): the statistics go among the
peers and the master sends one request per worker each way; the rounds above remain
for ``--data-plane star``, evaluation and update-only rounds.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hetconv.config import MASTER_PARTICIPANT
from hetconv.engine.shard import ConvShard
from hetconv.master.cluster import Cluster, WorkerLost
from hetconv.master.own_share import OwnShare
from hetconv.master.plan import Participant
from hetconv.master.results import checked_result
from hetconv.master.run import (
    RunControl,
)
from hetconv.master.samples.balance import SampleBalance
from hetconv.master.samples.between import (
    BetweenSteps,
    PendingUpdate,
    SampleSetup,
)
from hetconv.master.samples.between import update_fields as _update_fields
from hetconv.master.samples.chains import ChainedSteps, InFlightStep
from hetconv.master.samples.fall_back import AloneCheck
from hetconv.master.samples.peers import SamplePeers
from hetconv.master.samples.plan import Slice
from hetconv.master.samples.rounds import RoundTrips
from hetconv.master.samples.step_model import InPlaceModel
from hetconv.master.samples.trial_without import WithoutCheck
from hetconv.master.samples.without import WithoutTrials
from hetconv.participant.samples.dense_replica import DenseReplica
from hetconv.participant.samples.replica import add_in_order, moments_to_statistics
from hetconv.participant.samples.runner import SampleRunner
from hetconv.participant.wire_cast import to_wire
from hetconv.protocol import (
    SampleBackwardRequest,
    SampleForwardRequest,
)
from hetconv.protocol.samples import NO_LAYER

log = logging.getLogger("hetconv.master")

NO_OUTPUT = np.empty((0,), dtype=np.float32)
"""What ``forward`` returns for every layer but the last (the slices stay where they are)."""




class SampleConvStage(WithoutTrials, RoundTrips, ChainedSteps, BetweenSteps):
    """A :class:`hetconv.engine.stage.ConvStage` that splits every conv layer by samples."""

    def __init__(self, cluster: Cluster, workers: list[Participant], local: dict[int, ConvShard],
                 balance: SampleBalance, control: RunControl, setup: SampleSetup,
                 on_close: Callable[[], None], peers: SamplePeers | None = None):
        self.cluster = cluster
        self.workers = {p.participant: p for p in workers}  # in participant order
        self.local = local  # the master's whole layers (always: snapshots read them)
        self.balance = balance
        self.control = control
        self.setup = setup
        self._on_close = on_close
        self.peers = peers  # the weight reduction among the peers; None: via the master
        self.pending_fault: WorkerLost | None = None  # found while the run was set up
        self._closed = False
        self.runner = SampleRunner()  # the master's own slice, served like a worker's
        self.own_share = OwnShare(cluster)  # ... in a helper thread while replies arrive
        self.slices: list[Slice] = []
        self._x: np.ndarray = NO_OUTPUT
        self._statistics: tuple[np.ndarray, np.ndarray] | None = None
        self._sums: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # layer -> whole sums
        self._dweight: PendingUpdate | None = None  # the update still to apply
        self._learning_rate = 0.0  # of the step whose update is pending
        self._eval_output = NO_OUTPUT
        self._chain_output = NO_OUTPUT  # the forward chain's joined output
        self._timings: dict[int, dict[str, dict[str, Any]]] = {}
        self._comm_s = 0.0
        self._step_compute: dict[str, float] = {}  # participant -> its compute this step
        self._step_latency: dict[str, float] = {}  # participant -> its rounds this step
        self._step_waits: dict[str, float] = {}  # participant -> its peer waits this step
        self._step_wall = 0.0  # the step's rounds, first request sent to last reply
        self._step_dense: dict[str, float] = {}  # participant -> its dense part (step chain)
        self._step_rounds = 0  # rounds recorded this step
        self._step_started: float | None = None  # its first round's start (monotonic s)
        self._last_step_end: float | None = None  # the last step's figures taken (s)
        self._collected_at = 0.0  # when the last round was collected (monotonic s)
        self._ahead: InFlightStep | None = None  # a step chain sent ahead (two in flight)
        self._step_sent_ahead = False  # whether the step being gathered was sent ahead
        self.dense: DenseReplica | None = None  # the master's replica (attach_dense)
        self.step_model = InPlaceModel(setup.predicted_s)  # calibrated in place
        self.alone_check = AloneCheck()  # never slower than the master alone
        self.without_check = WithoutCheck()  # ... nor than with one worker fewer
        self.set_aside: set[str] = set()  # workers a trial left out for the run
        self.step = 0

    # --- who computes what -------------------------------------------------------------
    def _names(self) -> list[str]:
        own = [MASTER_PARTICIPANT] if self.setup.master_computes else []
        return own + [n for n in self.workers if n in self.balance.seconds]

    def _slice_batch(self, batch: int) -> list[Slice]:
        return self.balance.slices(self._names(), batch)

    @property
    def layers(self) -> int:
        return len(self.setup.shapes)

    def _vector(self, participant: str, layer: int, name: str, array: Any) -> np.ndarray:
        kernels = self.setup.shapes[layer].kernels
        return checked_result(participant, layer, name, array, (kernels,))

    # --- forward -----------------------------------------------------------------------
    @property
    def chained(self) -> bool:
        """Whether a step is two chains (hetconv/participant/samples/chain.py): the statistics
        exchanged among the peers; else 2L + 2 rounds through the master (star)."""
        return self.peers is not None

    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        if not train:
            return self._evaluate(layer, x)
        update = None
        if layer == 0 and self.pending_fault is not None:
            fault, self.pending_fault = self.pending_fault, None
            raise fault  # the trainer's recovery: a re-plan that checks again
        if layer == 0:
            update = self._begin_step(x, step)
            if self.chained:
                self._chain_output = self._forward_chain(step, update)
        if self.chained:
            return self._chain_output if layer == self.layers - 1 else NO_OUTPUT
        replies = self._forward_round(step, layer - 1, layer, False, update)
        parts = []
        for piece in self.slices:
            reply = replies.get(piece.participant)
            if reply is None:
                continue
            if reply.total is None:
                continue
            shape = self.setup.shapes[layer]
            expected = piece.samples * shape.conv_height * shape.conv_width
            if int(reply.count) != expected:
                raise WorkerLost(f"worker {piece.participant} sent moments of layer {layer + 1} "
                                 f"over {reply.count} values, expected {expected} (an output "
                                 "of the wrong shape); evicting it", piece.participant,
                                 evict=True)
            parts.append((int(reply.count),
                          self._vector(piece.participant, layer, "total", reply.total),
                          self._vector(piece.participant, layer, "m2", reply.m2)))
        self._statistics = moments_to_statistics(parts) if parts else None
        if self._statistics is not None and not self._master_slice():
            # the master holds every layer even without a slice: same statistics, same bits
            self.local_replica(layer).follow_statistics(*self._statistics,
                                                        self._count(layer))
        if layer < self.layers - 1:
            return NO_OUTPUT
        replies = self._forward_round(step, layer, NO_LAYER, True)
        shape = self.setup.shapes[layer]
        outputs = [checked_result(piece.participant, layer, "y", replies[piece.participant].y,
                                 (piece.samples, shape.kernels, shape.pooled_height,
                                  shape.pooled_width))
                   for piece in self.slices if piece.samples > 0]
        return np.concatenate(outputs, axis=0) if len(outputs) > 1 else outputs[0]

    def _begin_step(self, x: np.ndarray, step: int) -> PendingUpdate | None:
        """A training step's start: its batch x (B, C, H, W) sliced over the
        participants; the previous step's pending update, which rides along."""
        self.step = step
        self._step_started = time.monotonic()
        self._x = np.ascontiguousarray(x, dtype=np.float32)
        self.slices = self._slice_batch(x.shape[0])
        return self._take_update()

    def _take_update(self) -> PendingUpdate | None:
        """The pending update, taken to travel with the next round. Summed by the master,
        it applies it to its own replica at once when it has no slice (with a slice its
        own runner gets it in the round, as the workers do); reduced by the peers, its
        own runner always takes part in the round."""
        update, self._dweight = self._dweight, None
        if update is not None and update.dweight is not None and update.sums is not None \
                and not self._master_slice():
            self.local_replica(update.layer).apply_update(
                update.dweight, self._learning_rate, sums=(update.sums[0], update.sums[1]))
        return update

    def flush(self) -> None:
        """Apply a pending update everywhere now (before a snapshot or an evaluation)."""
        if self._ahead is not None:  # the trainer drains before reading the replicas
            raise RuntimeError(f"internal error: step {self._ahead.step} is in flight "
                               "where the replicas are read")
        if self._dweight is not None:
            self._backward_round(self.step, self._learning_rate, NO_LAYER, NO_LAYER, None)

    def _forward_round(self, step: int, finish: int, start: int, output: bool,
                       update: PendingUpdate | None = None) -> dict[str, Any]:
        statistics = self._statistics if finish >= 0 else None
        total = self._x.shape[0]

        def make(piece: Slice) -> SampleForwardRequest:
            local = piece.participant == MASTER_PARTICIPANT
            x = None
            if start == 0:
                x = self._x[piece.start:piece.stop]
                x = x if local else to_wire(x, self.setup.wire_for(piece.participant))
            return SampleForwardRequest(
                request_id=self.cluster.request_id(), step=step, attempt=0, train=True,
                total_batch=total, finish_layer=finish, start_layer=start,
                stop_layer=start + 1 if start >= 0 else NO_LAYER, return_output=output,
                learning_rate=self._learning_rate,
                total_count=self._count(finish) if finish >= 0 else 0,
                mean=None if statistics is None else statistics[0],
                var=None if statistics is None else statistics[1], x=x,
                **_update_fields(update))

        def idle(piece: Slice) -> SampleForwardRequest | None:
            """A worker without samples this step still applies every update and follows
            the running statistics (the master's own replica follows them in ``forward``)."""
            follow = finish >= 0 and statistics is not None \
                and piece.participant != MASTER_PARTICIPANT
            if update is None and not follow:
                return None
            return SampleForwardRequest(
                request_id=self.cluster.request_id(), step=step, attempt=0, train=True,
                total_batch=total, finish_layer=finish if follow else NO_LAYER,
                start_layer=NO_LAYER, stop_layer=NO_LAYER, return_output=False,
                learning_rate=self._learning_rate,
                total_count=self._count(finish) if follow else 0,
                mean=statistics[0] if statistics is not None and follow else None,
                var=statistics[1] if statistics is not None and follow else None, x=None,
                **_update_fields(update))

        layer = start if start >= 0 else finish
        what = (f"forward of layer {layer + 1} (step {step})" if not output
                else f"output of layer {layer + 1} (step {step})")
        return self._round(what, layer, "forward", make, True, idle,
                           peer_update=update is not None and update.reduce_id > 0)

    def _evaluate(self, layer: int, x: np.ndarray) -> np.ndarray:
        """Evaluation: one round at layer 0 runs every layer on every slice."""
        if layer > 0:
            return self._eval_output if layer == self.layers - 1 else NO_OUTPUT
        x = np.ascontiguousarray(x, dtype=np.float32)
        self.flush()
        self.slices = self._slice_batch(x.shape[0])

        def make(piece: Slice) -> SampleForwardRequest:
            part = x[piece.start:piece.stop]
            return SampleForwardRequest(
                request_id=self.cluster.request_id(), step=-1, attempt=0, train=False,
                total_batch=x.shape[0], finish_layer=NO_LAYER, start_layer=0,
                stop_layer=self.layers, return_output=True, learning_rate=0.0,
                total_count=0, mean=None, var=None,
                x=part if piece.participant == MASTER_PARTICIPANT
                else to_wire(part, self.setup.wire_for(piece.participant)),
                **_update_fields(None))

        replies = self._round("evaluation forward", 0, "forward", make, False)
        last = self.setup.shapes[-1]
        outputs = [checked_result(p.participant, self.layers - 1, "y", replies[p.participant].y,
                                 (p.samples, last.kernels, last.pooled_height,
                                  last.pooled_width))
                   for p in self.slices if p.samples > 0]
        self._eval_output = np.concatenate(outputs, axis=0) if len(outputs) > 1 else outputs[0]
        return self._eval_output if self.layers == 1 else NO_OUTPUT

    # --- backward ----------------------------------------------------------------------
    def backward(self, layer: int, dy: np.ndarray, need_dx: bool, learning_rate: float,
                 step: int) -> np.ndarray | None:
        last = self.layers - 1
        if self.chained:
            if layer == last:
                self._backward_chain(step, learning_rate, dy)
            return None
        if layer == last:
            self._backward_round(step, learning_rate, NO_LAYER, layer, dy)
        else:
            self._backward_round(step, learning_rate, layer + 1, layer, None)
        if layer == 0:  # its update travels with the next round (see ``flush``)
            self._backward_round(step, learning_rate, 0, NO_LAYER, None)
        return None

    def _backward_round(self, step: int, learning_rate: float, finish: int, start: int,
                        dy: np.ndarray | None) -> None:
        """Apply the pending update, finish ``finish``, start ``start`` (see the module
        doc); keeps the new sums and the summed weight gradient for the next round."""
        self._learning_rate = learning_rate
        update = self._take_update()
        sums = self._sums.get(finish) if finish >= 0 else None
        reduce_id = self.cluster.request_id() if finish >= 0 and self.peers is not None else 0

        def make(piece: Slice) -> SampleBackwardRequest:
            local = piece.participant == MASTER_PARTICIPANT
            part = None
            if dy is not None:
                part = dy[piece.start:piece.stop]
                part = np.ascontiguousarray(part, np.float32) if local \
                    else to_wire(part, self.setup.wire_for(piece.participant))
            return SampleBackwardRequest(
                request_id=self.cluster.request_id(), step=step, attempt=0,
                learning_rate=learning_rate, finish_layer=finish, start_layer=start,
                dgamma=None if sums is None else sums[0],
                dbeta=None if sums is None else sums[1], dy=part, reduce_id=reduce_id,
                **_update_fields(update))

        def idle(piece: Slice) -> SampleBackwardRequest | None:
            """A worker without samples this step still applies every update."""
            if update is None:
                return None
            return SampleBackwardRequest(
                request_id=self.cluster.request_id(), step=step, attempt=0,
                learning_rate=learning_rate, finish_layer=NO_LAYER, start_layer=NO_LAYER,
                dgamma=None, dbeta=None, dy=None, reduce_id=0, **_update_fields(update))

        layer = start if start >= 0 else max(finish, 0)
        replies = self._round(f"backward of layer {layer + 1} (step {step})", layer,
                              "backward", make, finish >= 0 or start >= 0, idle,
                              peer_update=update is not None and update.reduce_id > 0)
        active = [p for p in self.slices if p.samples > 0]
        if finish >= 0 and reduce_id > 0:
            self._dweight = PendingUpdate(finish, None, np.stack(self._sums[finish]),
                                          reduce_id, tuple(p.participant for p in active))
        elif finish >= 0:
            shape = self.local[finish].state["weight"].shape
            self._dweight = PendingUpdate(finish, add_in_order([
                checked_result(p.participant, finish, "dweight", replies[p.participant].dweight,
                              tuple(shape)) for p in active]), np.stack(self._sums[finish]))
        if start >= 0:
            self._sums[start] = (
                add_in_order([self._vector(p.participant, start, "dgamma",
                                           replies[p.participant].dgamma) for p in active]),
                add_in_order([self._vector(p.participant, start, "dbeta",
                                           replies[p.participant].dbeta) for p in active]))

    def local_replica(self, layer: int) -> Any:
        return self.runner.layers.replica(self.local, layer)

    def _master_slice(self) -> bool:
        return any(p.participant == MASTER_PARTICIPANT and p.samples > 0 for p in self.slices)

    def _count(self, layer: int) -> int:
        """Values per channel of layer ``layer``'s conv output over the batch: B·Ho·Wo."""
        shape = self.setup.shapes[layer]
        return int(self._x.shape[0]) * shape.conv_height * shape.conv_width

    # --- the rest of the ConvStage interface -------------------------------------------
    def close(self) -> None:
        if self._closed:  # a fall-back closed it; the trainer's end closes what it holds
            return
        self._closed = True
        self.drain()  # a step sent ahead that the trainer will not ask for
        self.own_share.close()  # first: the helper thread's wake-up socket
        if self.peers is not None:
            self.peers.close()
        self._on_close()

