"""The conv stage: where a network's conv layers run.

The trainer talks to its conv layers only through the :class:`ConvStage`
interface, so the same training loop runs them on the master's own device
(:class:`LocalConvStage`, here) or spread over worker daemons (the distributed
stage in ``master/``). Inputs and outputs cross this interface as host numpy
arrays: x (B, C, H, W) in, block output (B, K, H', W') out (pooled or not, as the
layer's spec says).
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

import numpy as np

from hetconv.config import MASTER_PARTICIPANT
from hetconv.engine.shard import ConvShard, LayerSettings
from hetconv.errors import UserError
from hetconv.model import ModelConfig, conv_layer_shapes, layer_parameters
from hetconv.names import PARAMETER_NAMES, STATE_NAMES, layer_key, split_key


class StageFault(UserError):
    """A step's conv work was lost: a participant died, went silent, lost a peer or
    answered wrongly. ``participant`` names the one at fault (None: unknown);
    ``gone`` says it is known to be dead or gone (not merely late), ``evict`` that it
    must go although alive (wrong or non-finite results). The trainer
    restores its last snapshot and replays (see docs/resilience.md)."""

    def __init__(self, message: str, participant: str | None = None, gone: bool = False,
                 evict: bool = False):
        super().__init__(message)
        self.participant = participant
        self.gone = gone
        self.evict = evict  # its results were wrong: evict it even though it is alive


@runtime_checkable
class WholeStepStage(Protocol):
    """A stage that can run the dense part too, replicated on its participants (the
    sample split's step chain: docs/dense-replica.md). While ``replicates_dense``, the
    trainer hands it whole steps instead of the conv calls."""

    @property
    def replicates_dense(self) -> bool: ...

    def attach_dense(self, part: Any, optimizer: Any) -> None:
        """The trainer's :class:`~hetconv.engine.dense_part.DensePart` (its arrays: the
        master's replica) and optimizer settings, once, before the first step."""
        ...

    @property
    def runs_ahead(self) -> bool:
        """Whether ``train_step`` takes the next step ahead (two steps in flight)."""
        ...

    def train_step(self, x: np.ndarray, labels: np.ndarray, step: int,
                   learning_rate: float,
                   ahead: tuple[np.ndarray, np.ndarray, int, float] | None = None
                   ) -> dict[str, Any]:
        """One SGD step; the trainer's step record (loss, correct, images, step_s,
        conv_s, dense_s). ``ahead`` (x, labels, step, learning rate): the next step,
        started before this one ends; given only where nothing reads the stage's
        state between the two (no snapshot, evaluation or epoch end)."""
        ...


@runtime_checkable
class RoutingStage(Protocol):
    """A stage whose participants chain a residual network's layers themselves (the
    sample split's chains join the shortcuts: hetconv/engine/routing.py). The trainer
    hands it the layers in order as for a straight network."""

    @property
    def routes_shortcuts(self) -> bool: ...


@runtime_checkable
class EarlyReplanStage(Protocol):
    """A stage that may need a snapshot (and the re-plan point after it) before the
    next one due: the master-alone trial, once it can decide (master/samples/trial_alone.py).
    The trainer asks after every step; such a stage never runs steps ahead."""

    def wants_replan_point(self) -> bool: ...


class ConvStage(Protocol):
    """What the trainer needs from whatever runs the conv layers."""

    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray: ...

    def backward(self, layer: int, dy: np.ndarray, need_dx: bool, learning_rate: float,
                 step: int) -> np.ndarray | None: ...

    def end_step(self) -> dict[str, Any]:
        """The training step is over: every decision that watches steps hears of it (the
        run state machine, re-balancing, trials, a model fitted in place, whatever the
        stage has), then its record: per-layer, per-device timings and bytes, and its
        communication seconds: ``{"layers": [{"layer", "participants": [...]}], "comm_s"}``
        (and ``"sent_ahead"``, where the stage runs steps ahead: docs/metrics.md)."""
        ...

    def snapshot(self) -> dict[str, np.ndarray]:
        """Every layer's whole state by ``conv{i}.<name>`` key (STATE_NAMES)."""
        ...

    def restore(self, state: dict[str, np.ndarray]) -> None:
        """Put every shard back to ``state`` (a :meth:`snapshot`), between steps."""
        ...

    def recover(self, fault: StageFault, state: dict[str, np.ndarray]) -> ConvStage:
        """After ``fault``: drop what failed, re-plan over what is left, restore every
        shard to ``state`` and return the stage to go on with (this one, or a local one
        when no worker is left). Raises when it cannot go on."""
        ...

    def replan_point(self, state: dict[str, np.ndarray]) -> ConvStage:
        """Right after a snapshot (``state``, the current state): take in participants
        that joined, if any; the stage to go on with."""
        ...

    def close(self) -> None: ...


def layer_settings(model: ModelConfig, momentum: float, weight_decay: float) -> LayerSettings:
    """The network's :class:`LayerSettings`: the paper's shared ones, plus one entry
    per conv layer (stride, padding, pool, batch norm) when the layers differ."""
    shared = LayerSettings(stride=1, padding=model.padding, bn_momentum=model.bn_momentum,
                           bn_eps=model.bn_eps, momentum=momentum, weight_decay=weight_decay)
    if not model.convs:
        return shared
    return replace(shared, per_layer=tuple(
        replace(shared, stride=spec.stride, padding=spec.padding, pool=spec.pool,
                batch_norm=spec.batch_norm, relu=spec.relu, input_from=spec.input_from,
                shortcut_from=spec.shortcut_from) for spec in model.convs))


class LocalConvStage:
    """Every conv layer whole on the master's own device (``cpu`` or ``gpu:N``)."""

    def __init__(self, model: ModelConfig, params: dict[str, np.ndarray],
                 settings: LayerSettings, device: str = "cpu"):
        self.device = device
        self.shards = [
            ConvShard(shape.index, 0, shape.kernels, settings,
                      layer_parameters(params, shape.index), device=device)
            for shape in conv_layer_shapes(model)
        ]
        self._timings: dict[int, dict[str, Any]] = {}

    def _record(self, layer: int, key: str, seconds: float) -> None:
        entry = self._timings.setdefault(layer, {
            "participant": MASTER_PARTICIPANT, "kernels": self.shards[layer].kernels,
            "forward_s": 0.0, "backward_s": 0.0, "wait_s": 0.0, "bytes_sent": 0,
            "bytes_received": 0})
        entry[key] += seconds

    def forward(self, layer: int, x: np.ndarray, train: bool, step: int) -> np.ndarray:
        start = time.perf_counter()
        out = self.shards[layer].forward_host(x, train)
        if train:
            self._record(layer, "forward_s", time.perf_counter() - start)
        return out

    def backward(self, layer: int, dy: np.ndarray, need_dx: bool, learning_rate: float,
                 step: int) -> np.ndarray | None:
        start = time.perf_counter()
        out = self.shards[layer].backward_host(dy, need_dx, learning_rate)
        self._record(layer, "backward_s", time.perf_counter() - start)
        return out

    def end_step(self) -> dict[str, Any]:
        layers = [{"layer": layer, "participants": [entry]}
                  for layer, entry in sorted(self._timings.items())]
        self._timings = {}
        return {"layers": layers, "comm_s": 0.0}

    def snapshot(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for shard in self.shards:
            state = shard.snapshot()
            for name, value in state.items():
                out[layer_key(shard.layer, name)] = value
        return out

    def restore(self, state: dict[str, np.ndarray]) -> None:
        self.shards = [ConvShard(shard.layer, 0, shard.kernels, shard.settings,
                                 {name: state[layer_key(shard.layer, name)]
                                  for name in STATE_NAMES}, device=self.device)
                       for shard in self.shards]

    def recover(self, fault: StageFault, state: dict[str, np.ndarray]) -> ConvStage:
        raise fault  # nothing here can fail that a restore would mend

    def replan_point(self, state: dict[str, np.ndarray]) -> ConvStage:
        return self

    def close(self) -> None:
        self.shards = []


def split_snapshot(snapshot: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray],
                                                             dict[str, np.ndarray]]:
    """(model parameters, optimizer velocities) from a stage snapshot."""
    params = {k: v for k, v in snapshot.items()
              if (parsed := split_key(k)) is not None and parsed[1] in PARAMETER_NAMES}
    velocities = {k: v for k, v in snapshot.items() if k not in params}
    return params, velocities
