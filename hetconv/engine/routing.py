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

:class:`Routing` is the pure description; :class:`ForwardRoute` and
:class:`BackwardRoute` keep one pass's activations and gradients for whoever runs the
layers (a participant's sample-split chain); :func:`run_forward` and :func:`run_backward`
chain any per-layer forward / backward (a local stage, a distributed one) through them,
host numpy arrays in and out.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hetconv.backend import host_threads, run_parallel
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
        return cls.from_routes([(s.input_from, s.shortcut_from) for s in shapes])

    @classmethod
    def from_routes(cls, routes: Sequence[tuple[int, int]]) -> Routing:
        """From each layer's (input_from, shortcut_from) (NO_ROUTE: the layer before's
        output / none); ValueError where a layer reads or adds an activation that is not
        an earlier one (its own input at the latest)."""
        inputs = tuple(i if src == NO_ROUTE else src for i, (src, _) in enumerate(routes))
        shortcuts = tuple(None if sc == NO_ROUTE else sc for _, sc in routes)
        for layer, (src, sc) in enumerate(zip(inputs, shortcuts)):
            if not 0 <= src <= layer or (sc is not None and not 0 <= sc <= layer):
                raise ValueError(f"layer {layer} reads activation {src} and adds "
                                 f"{sc}: each must be an earlier one (0..{layer})")
        return cls(inputs, shortcuts)

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


JOIN_CHUNK_VALUES = 1 << 18
"""Values per piece of the join's passes (a few pieces per host thread, each in cache)."""


def _pieces(array: np.ndarray) -> list[slice]:
    """Sample ranges of ``array`` (B, ...) of about JOIN_CHUNK_VALUES values each."""
    per_sample = max(1, array.size // max(1, array.shape[0]))
    step = max(1, JOIN_CHUNK_VALUES // per_sample)
    return [slice(start, start + step) for start in range(0, array.shape[0], step)]


def _owned(array: np.ndarray) -> np.ndarray:
    """``array`` itself when it is a writeable C-contiguous float32 array, else a copy."""
    if array.dtype == np.float32 and array.flags.c_contiguous and array.flags.writeable:
        return array
    return np.array(array, dtype=np.float32, order="C")


def join(y: np.ndarray, shortcut: np.ndarray) -> np.ndarray:
    """relu(y + shortcut) (B, K, H, W) float32, written over ``y`` where it may be (the
    layer's fresh output), in pieces over the host threads."""
    out = _owned(y)
    parts = _pieces(out)

    def piece(index: int) -> None:
        part = parts[index]
        np.add(out[part], shortcut[part], out=out[part])
        np.maximum(out[part], np.float32(0), out=out[part])
    run_parallel(piece, len(parts), host_threads(len(parts)))
    return out


def join_backward(joined: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """The join's gradient: ``grad`` where its output was positive, else 0 (written over
    ``grad`` where it may be: the gradient is the route's own)."""
    out = _owned(grad)
    parts = _pieces(out)

    def piece(index: int) -> None:
        part = parts[index]
        np.multiply(out[part], np.greater(joined[part], np.float32(0)), out=out[part])
    run_parallel(piece, len(parts), host_threads(len(parts)))
    return out


class ForwardRoute:
    """One forward pass's activations as the layers run, in order: :meth:`input` gives
    layer i the activation it reads, :meth:`output` takes its output (joined to the
    shortcut where it has one) and returns activation i + 1. Activations no later
    layer reads are dropped at once; the joins' outputs go to ``tape``."""

    def __init__(self, routing: Routing, x: np.ndarray, first: int = 0):
        """``x``: activation ``first``, the input of layer ``first`` (a straight
        network's pass may start at any layer; a routed one's at 0)."""
        if first and not routing.straight:
            raise ValueError("a residual network's forward pass starts at layer 0")
        self.routing = routing
        self.activations: dict[int, np.ndarray] = {first: x}
        self.last_use = {a: max(routing.readers(a), default=-1)
                         for a in range(routing.layers + 1)}
        self.tape = ForwardTape({})

    def input(self, layer: int) -> np.ndarray:
        return self.activations[self.routing.inputs[layer]]

    def output(self, layer: int, y: np.ndarray) -> np.ndarray:
        shortcut = self.routing.shortcuts[layer]
        if shortcut is not None:
            y = join(y, self.activations[shortcut])
            self.tape.joined[layer] = y
        self.activations[layer + 1] = y
        for held in [a for a in self.activations if a <= layer and self.last_use[a] <= layer]:
            del self.activations[held]
        return y


class BackwardRoute:
    """One backward pass's gradients as the layers run from the last: :meth:`gradient`
    gives layer i the gradient of its own output (through the join's mask, the
    shortcut's share added to the shortcut activation's), :meth:`input_gradient` takes
    its input's gradient."""

    def __init__(self, routing: Routing, tape: ForwardTape, grad: np.ndarray,
                 top: int | None = None):
        """``grad``: the gradient of layer ``top``'s output (default: the last layer's;
        a straight network's pass may start lower)."""
        top = routing.layers - 1 if top is None else top
        if top != routing.layers - 1 and not routing.straight:
            raise ValueError("a residual network's backward pass starts at its last layer")
        self.routing, self.tape = routing, tape
        self.grads: dict[int, np.ndarray] = {top + 1: grad}

    def gradient(self, layer: int) -> np.ndarray:
        dy = self.grads.pop(layer + 1)
        shortcut = self.routing.shortcuts[layer]
        if shortcut is not None:
            dy = join_backward(self.tape.joined.pop(layer), dy)
            _accumulate(self.grads, shortcut, dy)
        return dy

    def need_dx(self, layer: int) -> bool:
        """Whether layer's input gradient is needed (not for the network's input)."""
        return self.routing.inputs[layer] > 0

    def input_gradient(self, layer: int, dx: np.ndarray | None) -> None:
        if self.need_dx(layer) and dx is not None:
            _accumulate(self.grads, self.routing.inputs[layer], dx)


def run_forward(routing: Routing, layer_forward: Callable[[int, np.ndarray], np.ndarray],
                x: np.ndarray) -> tuple[np.ndarray, ForwardTape]:
    """Every layer in order, each given the activation it reads: (the last layer's
    output, the tape for the backward pass)."""
    route = ForwardRoute(routing, x)
    for layer in range(routing.layers):
        x = route.output(layer, layer_forward(layer, route.input(layer)))
    return x, route.tape


def run_backward(routing: Routing, tape: ForwardTape,
                 layer_backward: Callable[[int, np.ndarray, bool], np.ndarray | None],
                 grad: np.ndarray) -> None:
    """Every layer from the last: ``layer_backward(layer, dy, need_dx)`` gets the gradient
    of the layer's own output (after the join's mask) and returns its input's gradient
    (None when not needed: only activation 0's is never needed)."""
    route = BackwardRoute(routing, tape, grad)
    for layer in reversed(range(routing.layers)):
        route.input_gradient(layer, layer_backward(layer, route.gradient(layer),
                                                   route.need_dx(layer)))


def _accumulate(grads: dict[int, np.ndarray], activation: int, grad: np.ndarray) -> None:
    """grads[activation] += grad. The first gradient is kept as it is (no copy): the
    layers' backward passes read their dy and return fresh arrays, and each pass runs to
    its end before the next layer adds to what it read."""
    held = grads.get(activation)
    if held is None:
        grads[activation] = _owned(grad)
    else:
        held += grad
