"""How a network's conv layers are chained: straight, or with residual shortcuts.

Activation 0 is the network's input, activation i+1 the output of conv layer i. A plain
network feeds activation i to layer i. A residual block (``res<K>`` in the grammar,
:mod:`hetconv.model`) routes: its second conv reads its first conv's output even when a
projection shortcut sits between them (``input_from``), and its output, batch norm's
without a ReLU, is joined to the shortcut activation (``shortcut_from``)::

    a_{i+1} = relu(layer_i(a_src) + a_shortcut)

Backward, the join's gradient (masked by the ReLU) goes both to the layer and, added,
to the shortcut activation; every activation's gradient is the sum of what the layers
that read it hand back, added in the order the layers run backward (the same order in
every run, so a distributed run adds exactly what the local one does).

:class:`Routing` is the pure description; :func:`run_forward` and :func:`run_backward`
chain any per-layer forward / backward (a local stage, a distributed one) through it,
host numpy arrays in and out.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hetconv.model import NO_ROUTE, ConvLayerShape


@dataclass(frozen=True)
class Routing:
    """Per conv layer: the activation it reads and the one joined to its output (or
    None). ``kept``: the activations a training step must keep past the layer after
    them (inputs of later layers, shortcuts)."""

    inputs: tuple[int, ...]
    shortcuts: tuple[int | None, ...]

    @classmethod
    def of(cls, shapes: Sequence[ConvLayerShape]) -> Routing:
        return cls(tuple(i if s.input_from == NO_ROUTE else s.input_from
                         for i, s in enumerate(shapes)),
                   tuple(None if s.shortcut_from == NO_ROUTE else s.shortcut_from
                         for s in shapes))

    @property
    def layers(self) -> int:
        return len(self.inputs)

    @property
    def straight(self) -> bool:
        """Every layer reads the one before's output and nothing is joined."""
        return all(src == i for i, src in enumerate(self.inputs)) \
            and all(s is None for s in self.shortcuts)

    def readers(self, activation: int) -> list[int]:
        """The layers whose input or shortcut is ``activation``."""
        return [i for i in range(self.layers)
                if self.inputs[i] == activation or self.shortcuts[i] == activation]


@dataclass
class ForwardTape:
    """What :func:`run_backward` needs of a training forward: the join's output of every
    joined layer (its ReLU mask)."""

    joined: dict[int, np.ndarray]


def join(y: np.ndarray, shortcut: np.ndarray) -> np.ndarray:
    """relu(y + shortcut), a new float32 array (B, K, H, W)."""
    out: np.ndarray = np.add(y, shortcut, dtype=np.float32)
    np.maximum(out, np.float32(0), out=out)
    return out


def join_backward(joined: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """The join's gradient: ``grad`` where its output was positive, else 0."""
    out: np.ndarray = np.where(joined > 0, grad, np.float32(0)).astype(np.float32, copy=False)
    return out


def run_forward(routing: Routing, layer_forward: Callable[[int, np.ndarray], np.ndarray],
                x: np.ndarray) -> tuple[np.ndarray, ForwardTape]:
    """Every layer in order, each given the activation it reads: (the last layer's
    output, the tape for the backward pass). Activations no later layer reads are
    dropped as soon as possible."""
    activations: dict[int, np.ndarray] = {0: x}
    last_use = {a: max(routing.readers(a), default=-1) for a in range(routing.layers + 1)}
    tape = ForwardTape({})
    for layer in range(routing.layers):
        y = layer_forward(layer, activations[routing.inputs[layer]])
        shortcut = routing.shortcuts[layer]
        if shortcut is not None:
            y = join(y, activations[shortcut])
            tape.joined[layer] = y
        activations[layer + 1] = y
        for held in [a for a in activations if a <= layer and last_use[a] <= layer]:
            del activations[held]
    return activations[routing.layers], tape


def run_backward(routing: Routing, tape: ForwardTape,
                 layer_backward: Callable[[int, np.ndarray, bool], np.ndarray | None],
                 grad: np.ndarray) -> None:
    """Every layer from the last: ``layer_backward(layer, dy, need_dx)`` gets the gradient
    of the layer's own output (after the join's mask) and returns its input's gradient
    (None when not needed: only activation 0's is never needed)."""
    grads: dict[int, np.ndarray] = {routing.layers: grad}
    for layer in reversed(range(routing.layers)):
        dy = grads.pop(layer + 1)
        shortcut = routing.shortcuts[layer]
        if shortcut is not None:
            dy = join_backward(tape.joined.pop(layer), dy)
            _accumulate(grads, shortcut, dy)
        source = routing.inputs[layer]
        dx = layer_backward(layer, dy, source > 0)
        if source > 0 and dx is not None:
            _accumulate(grads, source, dx)


def _accumulate(grads: dict[int, np.ndarray], activation: int, grad: np.ndarray) -> None:
    held = grads.get(activation)
    if held is None:
        grads[activation] = np.array(grad, dtype=np.float32, copy=True)
    else:
        held += grad
