"""The sample split's rounds through the master: one layer boundary per round.

Under ``--data-plane star`` a training step is 2L + 2 rounds: forward, round l finishes
layer l-1 with the whole batch's batch-norm statistics (combined here from every
slice's moments, in participant order) and starts layer l; one more round returns the
last layer's output slices, joined along the batch axis. Backward, round l finishes
layer l+1 with the whole batch's batch-norm sums, starts layer l, and carries the
pending update; one last round applies layer 0's. Evaluation is one round that runs
every layer on every slice; an update-only round applies the pending update everywhere
(``flush``: before a snapshot or an evaluation, on either data plane).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from hetconv.config import MASTER_PARTICIPANT
from hetconv.master.cluster import Cluster, WorkerLost
from hetconv.master.results import checked_result
from hetconv.master.samples.figures import NO_BATCH, StepState
from hetconv.master.samples.members import SampleMembers
from hetconv.master.samples.peers import SamplePeers
from hetconv.master.samples.plan import Slice
from hetconv.master.samples.replicas import MasterReplicas
from hetconv.master.samples.rounds import Rounds
from hetconv.master.samples.settings import SampleSetup
from hetconv.master.samples.updates import PendingUpdate, Updates, update_fields
from hetconv.participant.samples.replica import add_in_order, moments_to_statistics
from hetconv.participant.wire_cast import to_wire
from hetconv.protocol import (
    SampleBackwardRound,
    SampleEvaluation,
    SampleForwardRound,
    SampleUpdateRound,
)
from hetconv.protocol.samples import NO_LAYER


class LayerRounds:
    """Training rounds layer by layer, evaluation and update-only rounds (module doc)."""

    def __init__(self, cluster: Cluster, setup: SampleSetup, members: SampleMembers,
                 replicas: MasterReplicas, rounds: Rounds, updates: Updates,
                 state: StepState, peers: SamplePeers | None):
        self.cluster = cluster
        self.setup = setup
        self.members = members
        self.replicas = replicas
        self.rounds = rounds
        self.updates = updates
        self.state = state
        self.peers = peers
        # the whole batch's statistics (mean, var), each (K,), of the layer started last
        self.statistics: tuple[np.ndarray, np.ndarray] | None = None
        self.eval_output = NO_BATCH  # the last evaluation's joined output

    # --- the update between rounds ---------------------------------------------------
    def take_update(self) -> PendingUpdate | None:
        """The pending update, taken to travel with the next round. Summed by the master,
        it applies it to its own replica at once when it has no slice (with a slice its
        own runner gets it in the round, as the workers do); reduced by the peers, its
        own runner always takes part in the round."""
        update = self.updates.take()
        if update is not None and update.dweight is not None and update.sums is not None \
                and not self.state.master_has_samples():
            self.replicas.replica(update.layer).apply_update(
                update.dweight, self.updates.learning_rate,
                sums=(update.sums[0], update.sums[1]))
        return update

    def flush(self) -> None:
        """Apply a pending update everywhere now (before a snapshot or an evaluation)."""
        if self.updates.pending is not None:
            self.backward_round(self.state.step, self.updates.learning_rate, NO_LAYER,
                                NO_LAYER, None)

    # --- forward -----------------------------------------------------------------------
    def forward(self, layer: int, step: int, update: PendingUpdate | None) -> np.ndarray | None:
        """Finish layer ``layer - 1`` and start ``layer`` on every slice; at the last
        layer, the joined output (B, K, Hp, Wp); None before it."""
        state = self.state
        replies = self.forward_round(step, layer - 1, layer, False, update)
        parts = []
        for piece in state.slices:
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
        self.statistics = moments_to_statistics(parts) if parts else None
        if self.statistics is not None and not state.master_has_samples():
            # the master holds every layer even without a slice: same statistics, same bits
            self.replicas.replica(layer).follow_statistics(*self.statistics, self._count(layer))
        if layer < self.setup.layers - 1:
            return None
        replies = self.forward_round(step, layer, NO_LAYER, True)
        shape = self.setup.shapes[layer]
        outputs = [checked_result(piece.participant, layer, "y", replies[piece.participant].y,
                                  (piece.samples, shape.kernels, shape.pooled_height,
                                   shape.pooled_width))
                   for piece in state.slices if piece.samples > 0]
        return np.concatenate(outputs, axis=0) if len(outputs) > 1 else outputs[0]

    def forward_round(self, step: int, finish: int, start: int, output: bool,
                      update: PendingUpdate | None = None) -> dict[str, Any]:
        state = self.state
        statistics = self.statistics if finish >= 0 else None
        total = state.x.shape[0]
        learning_rate = self.updates.learning_rate

        def make(piece: Slice) -> SampleForwardRound:
            local = piece.participant == MASTER_PARTICIPANT
            x = None
            if start == 0:
                x = state.x[piece.start:piece.stop]
                x = x if local else to_wire(x, self.setup.wire_for(piece.participant))
            return SampleForwardRound(
                request_id=self.cluster.request_id(), step=step, attempt=0,
                total_batch=total, finish_layer=finish, start_layer=start,
                return_output=output, learning_rate=learning_rate,
                total_count=self._count(finish) if finish >= 0 else 0,
                mean=None if statistics is None else statistics[0],
                var=None if statistics is None else statistics[1], x=x,
                **update_fields(update))

        def idle(piece: Slice) -> SampleForwardRound | None:
            """A worker without samples this step still applies every update and follows
            the running statistics (the master's own replica follows them in ``forward``)."""
            follow = finish >= 0 and statistics is not None \
                and piece.participant != MASTER_PARTICIPANT
            if update is None and not follow:
                return None
            return SampleForwardRound(
                request_id=self.cluster.request_id(), step=step, attempt=0,
                total_batch=total, finish_layer=finish if follow else NO_LAYER,
                start_layer=NO_LAYER, return_output=False, learning_rate=learning_rate,
                total_count=self._count(finish) if follow else 0,
                mean=statistics[0] if statistics is not None and follow else None,
                var=statistics[1] if statistics is not None and follow else None, x=None,
                **update_fields(update))

        layer = start if start >= 0 else finish
        what = (f"forward of layer {layer + 1} (step {step})" if not output
                else f"output of layer {layer + 1} (step {step})")
        return self.rounds.run(what, layer, "forward", make, state.slices, state.figures,
                               idle, peer_update=update is not None and update.reduce_id > 0)

    def evaluate(self, layer: int, x: np.ndarray) -> np.ndarray | None:
        """Evaluation: one round at layer 0 runs every layer on every slice; the joined
        output at the last layer (None before it)."""
        layers = self.setup.layers
        if layer > 0:
            return self.eval_output if layer == layers - 1 else None
        x = np.ascontiguousarray(x, dtype=np.float32)
        self.flush()
        slices = self.state.slices = self.members.slices(x.shape[0])

        def make(piece: Slice) -> SampleEvaluation:
            part = x[piece.start:piece.stop]
            return SampleEvaluation(
                request_id=self.cluster.request_id(), step=-1, attempt=0,
                total_batch=x.shape[0], stop_layer=layers,
                x=part if piece.participant == MASTER_PARTICIPANT
                else to_wire(part, self.setup.wire_for(piece.participant)))

        replies = self.rounds.run("evaluation forward", 0, "forward", make, slices, None)
        last = self.setup.shapes[-1]
        outputs = [checked_result(p.participant, layers - 1, "y", replies[p.participant].y,
                                  (p.samples, last.kernels, last.pooled_height,
                                   last.pooled_width))
                   for p in slices if p.samples > 0]
        self.eval_output = np.concatenate(outputs, axis=0) if len(outputs) > 1 else outputs[0]
        return self.eval_output if layers == 1 else None

    # --- backward ----------------------------------------------------------------------
    def backward(self, layer: int, dy: np.ndarray, learning_rate: float, step: int) -> None:
        """The backward rounds of ``layer`` (the last: with its ``dy``, (B, K, Hp, Wp))."""
        if layer == self.setup.layers - 1:
            self.backward_round(step, learning_rate, NO_LAYER, layer, dy)
        else:
            self.backward_round(step, learning_rate, layer + 1, layer, None)
        if layer == 0:  # its update travels with the next round (see ``flush``)
            self.backward_round(step, learning_rate, 0, NO_LAYER, None)

    def backward_round(self, step: int, learning_rate: float, finish: int, start: int,
                       dy: np.ndarray | None) -> None:
        """Apply the pending update, finish ``finish``, start ``start`` (see the module
        doc); keeps the new sums and the summed weight gradient for the next round."""
        state, updates = self.state, self.updates
        updates.learning_rate = learning_rate
        update = self.take_update()
        sums = updates.sums.get(finish) if finish >= 0 else None
        reduce_id = self.cluster.request_id() if finish >= 0 and self.peers is not None else 0

        def make(piece: Slice) -> SampleBackwardRound | SampleUpdateRound:
            if finish < 0 and start < 0:  # the update alone (see ``flush``)
                return SampleUpdateRound(
                    request_id=self.cluster.request_id(), step=step, attempt=0,
                    learning_rate=learning_rate, **update_fields(update))
            local = piece.participant == MASTER_PARTICIPANT
            part = None
            if dy is not None:
                part = dy[piece.start:piece.stop]
                part = np.ascontiguousarray(part, np.float32) if local \
                    else to_wire(part, self.setup.wire_for(piece.participant))
            return SampleBackwardRound(
                request_id=self.cluster.request_id(), step=step, attempt=0,
                learning_rate=learning_rate, finish_layer=finish, start_layer=start,
                dgamma=None if sums is None else sums[0],
                dbeta=None if sums is None else sums[1], dy=part, reduce_id=reduce_id,
                **update_fields(update))

        def idle(piece: Slice) -> SampleUpdateRound | None:
            """A worker without samples this step still applies every update."""
            if update is None:
                return None
            return SampleUpdateRound(
                request_id=self.cluster.request_id(), step=step, attempt=0,
                learning_rate=learning_rate, **update_fields(update))

        layer = start if start >= 0 else max(finish, 0)
        record = finish >= 0 or start >= 0
        replies = self.rounds.run(f"backward of layer {layer + 1} (step {step})", layer,
                                  "backward", make, state.slices,
                                  state.figures if record else None, idle,
                                  peer_update=update is not None and update.reduce_id > 0)
        active = [p for p in state.slices if p.samples > 0]
        if finish >= 0 and reduce_id > 0:
            updates.pending = PendingUpdate(finish, None, np.stack(updates.sums[finish]),
                                            reduce_id, tuple(p.participant for p in active))
        elif finish >= 0:
            shape = self.replicas.local[finish].state["weight"].shape
            updates.pending = PendingUpdate(finish, add_in_order([
                checked_result(p.participant, finish, "dweight", replies[p.participant].dweight,
                               tuple(shape)) for p in active]), np.stack(updates.sums[finish]))
        if start >= 0:
            updates.sums[start] = (
                add_in_order([self._vector(p.participant, start, "dgamma",
                                           replies[p.participant].dgamma) for p in active]),
                add_in_order([self._vector(p.participant, start, "dbeta",
                                           replies[p.participant].dbeta) for p in active]))

    # --- helpers ---------------------------------------------------------------------
    def _vector(self, participant: str, layer: int, name: str, array: Any) -> np.ndarray:
        kernels = self.setup.shapes[layer].kernels
        return checked_result(participant, layer, name, array, (kernels,))

    def _count(self, layer: int) -> int:
        """Values per channel of layer ``layer``'s conv output over the batch: B·Ho·Wo."""
        shape = self.setup.shapes[layer]
        return int(self.state.x.shape[0]) * shape.conv_height * shape.conv_width
