"""The sample split's chain (hetconv/participant/samples/chain.py): participants in threads over an
in-memory port run a forward chain, a backward chain and the next forward chain (which
applies the update of every layer); the outputs and every replica's weights and running
statistics have exactly the bits of the master-coordinated rounds (the reference of
tests/unit/test_sample_replica.py), a participant without samples included."""
from __future__ import annotations

import queue
import threading
from typing import Any

import numpy as np
import pytest

from hetconv.model import conv_layer_shapes
from hetconv.participant.ports import PeerLost
from hetconv.participant.samples.reduction_plan import reduce_plan
from hetconv.participant.samples.replica import SampleReplica, add_in_order, moments_to_statistics
from hetconv.participant.samples.runner import SampleRequestError, SampleRunner
from hetconv.participant.samples.weight_reduce import GradientExchange
from hetconv.protocol import PeerPiece, SampleBackwardChain, SampleForwardChain
from hetconv.protocol.samples import NO_LAYER
from tests.support.queue_port import QueuePort
from tests.unit.test_sample_replica import _network, _run_split, _shards


def _in_threads(calls: dict[str, Any]) -> dict[str, Any]:
    results: dict[str, Any] = {}

    def run(name: str, call: Any) -> None:
        try:
            results[name] = call()
        except BaseException as error:  # checked by the caller
            results[name] = error

    threads = [threading.Thread(target=run, args=(n, c)) for n, c in calls.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def _forward(step: int, sync_id: int, members: list[str], samples: list[int], x: Any,
             layers: int, positions: list[int], update_id: int = 0,
             contributors: tuple[str, ...] = (), by_slice: bool = False
             ) -> SampleForwardChain:
    return SampleForwardChain(
        request_id=sync_id, step=step, attempt=0, total_batch=sum(samples),
        stop_layer=layers, learning_rate=0.05, x=x,
        update_layer=0 if update_id else NO_LAYER, dweight=None, update_sums=None,
        update_id=update_id, contributors=list(contributors),
        update_stop=layers if update_id else NO_LAYER, sync_id=sync_id, members=members,
        member_samples=samples, positions=positions, slice_statistics=by_slice)


def _backward(step: int, sync_id: int, members: list[str], dy: Any, layers: int,
              by_slice: bool = False) -> SampleBackwardChain:
    """A backward chain: its weight gradients are scattered as reduction ``sync_id``."""
    return SampleBackwardChain(
        request_id=sync_id, step=step, attempt=0, learning_rate=0.05,
        start_layer=layers - 1, dy=dy, sync_id=sync_id, members=members,
        slice_statistics=by_slice)


def _chain_case(cuts: list[int], seed: int) -> tuple[Any, Any, Any, np.ndarray, np.ndarray,
                                                    list[tuple[int, int]], list[int]]:
    """The test network, a batch x and an output gradient dy of sum(cuts) samples drawn
    from ``seed``, the consecutive slices of ``cuts`` and each layer's conv positions."""
    model, params, settings = _network()
    shapes = conv_layer_shapes(model)
    rng = np.random.default_rng(seed)
    batch = sum(cuts)
    x = rng.standard_normal((batch,) + model.input_shape).astype(np.float32)
    last = shapes[-1]
    dy = rng.standard_normal((batch, last.kernels, last.pooled_height,
                              last.pooled_width)).astype(np.float32)
    starts = np.cumsum([0] + cuts)
    slices = [(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]
    return model, params, settings, x, dy, slices, [s.conv_height * s.conv_width
                                                    for s in shapes]


def _participants(model: Any, params: Any, settings: Any, members: list[str],
                  everyone: list[str]) -> tuple[dict[str, SampleRunner], dict[str, Any]]:
    """A runner (its exchange over one in-memory port) and fresh shards per participant."""
    shapes = conv_layer_shapes(model)
    plan = reduce_plan([s.kernels for s in shapes], members, everyone,
                       [s.weight_values for s in shapes])
    queues: dict[str, queue.Queue[PeerPiece]] = {n: queue.Queue() for n in everyone}
    runners, shards = {}, {}
    for name in everyone:
        runners[name] = SampleRunner()
        runners[name].layers.exchange = GradientExchange(name, plan, QueuePort(queues, name), 5.0)
        shards[name] = {s.layer: s for s in _shards(model, params, settings)}
    return runners, shards


def _slice_of(name: str, array: np.ndarray, members: list[str],
              slices: list[tuple[int, int]]) -> np.ndarray | None:
    """A member's slice of ``array`` (contiguous); None for a participant without one."""
    if name not in members:
        return None
    a, b = slices[members.index(name)]
    return np.ascontiguousarray(array[a:b])


@pytest.mark.parametrize("cuts", [[5, 7], [3, 4, 5]], ids=["2 members", "3 members"])
def test_chains_reproduce_the_rounds_bit_for_bit(cuts: list[int]) -> None:
    model, params, settings, x, dy, slices, positions = _chain_case(cuts, 5)
    layers = len(positions)
    members = [f"p{i}" for i in range(len(cuts))]
    everyone = members + ["idle"]  # a participant without samples follows
    # the reference: the master-coordinated rounds (updates applied in the backward)
    reference = [[SampleReplica(s) for s in _shards(model, params, settings)] for _ in cuts]
    expected_y = _run_split(reference, x, dy, slices, 0.05)

    runners, shards = _participants(model, params, settings, members, everyone)

    def slice_of(name: str, array: np.ndarray) -> np.ndarray | None:
        return _slice_of(name, array, members, slices)

    forward = _in_threads({n: (lambda n=n: runners[n].serve(
        _forward(0, 10, members, cuts, slice_of(n, x), layers, positions), shards[n]))
        for n in everyone})
    assert not [r for r in forward.values() if isinstance(r, BaseException)], forward
    y = np.concatenate([forward[m].y for m in members])
    assert forward["idle"].y is None
    np.testing.assert_array_equal(y, expected_y)
    backward = _in_threads({n: (lambda n=n: runners[n].serve(
        _backward(0, 11, members, slice_of(n, dy), layers), shards[n])) for n in everyone})
    assert not [r for r in backward.values() if isinstance(r, BaseException)], backward
    # the next forward chain applies every layer's update first
    second = _in_threads({n: (lambda n=n: runners[n].serve(
        _forward(1, 12, members, cuts, slice_of(n, x), layers, positions, 11,
                 tuple(members)), shards[n])) for n in everyone})
    assert not [r for r in second.values() if isinstance(r, BaseException)], second
    for name in everyone:
        for layer in range(layers):
            held = shards[name][layer].state
            want = reference[0][layer].shard.state
            for key in ("weight", "gamma", "beta"):
                np.testing.assert_array_equal(held[key], want[key], err_msg=f"{name} {key}")
    # running statistics: after two forward passes, equal on every participant
    for layer in range(layers):
        for key in ("running_mean", "running_var"):
            values = [shards[n][layer].state[key] for n in everyone]
            for value in values[1:]:
                np.testing.assert_array_equal(value, values[0])


def test_a_member_without_its_slice_is_a_bad_request() -> None:
    model, params, settings = _network()
    shapes = conv_layer_shapes(model)
    plan = reduce_plan([s.kernels for s in shapes], ["a"], ["a"])
    runner = SampleRunner()
    runner.layers.exchange = GradientExchange("a", plan, QueuePort({"a": queue.Queue()}, "a"), 0.1)
    shards = {s.layer: s for s in _shards(model, params, settings)}
    request = _forward(0, 3, ["a"], [4], None, len(shapes), [1] * len(shapes))
    with pytest.raises(SampleRequestError, match="needs its x"):
        runner.serve(request, shards)


def test_a_silent_peer_is_named() -> None:
    model, params, settings = _network()
    shapes = conv_layer_shapes(model)
    positions = [s.conv_height * s.conv_width for s in shapes]
    plan = reduce_plan([s.kernels for s in shapes], ["a", "b"], ["a", "b"])
    queues: dict[str, queue.Queue[PeerPiece]] = {"a": queue.Queue(), "b": queue.Queue()}
    runner = SampleRunner()
    runner.layers.exchange = GradientExchange("a", plan, QueuePort(queues, "a"), 0.2)
    shards = {s.layer: s for s in _shards(model, params, settings)}
    x = np.zeros((3,) + model.input_shape, np.float32)
    with pytest.raises(PeerLost) as lost:
        runner.serve(_forward(0, 3, ["a", "b"], [3, 3], x, len(shapes), positions), shards)
    assert lost.value.peers == ["b"]


def _one_machine_per_slice(model: Any, params: Any, settings: Any, x: np.ndarray,
                           dy: np.ndarray, slices: list[tuple[int, int]], lr: float
                           ) -> tuple[np.ndarray, list[SampleReplica]]:
    """The reference of ``--bn-statistics slice``: each slice through the layers as one
    machine's whole batch (its own statistics, its own sums); then one update of fresh
    replicas with every slice's dW and gamma/beta sums added in slice order, and running
    statistics that follow the whole batch's (every slice's moments combined).
    (output (B, ...), the updated replicas)."""
    per_slice = [[SampleReplica(s) for s in _shards(model, params, settings)] for _ in slices]
    updated = [SampleReplica(s) for s in _shards(model, params, settings)]
    total = x.shape[0]
    acts = [x[a:b] for a, b in slices]
    for layer, (kept, shape) in enumerate(zip(updated, conv_layer_shapes(model))):
        parts = [reps[layer].start_forward(a, a.shape[0]) for reps, a in zip(per_slice, acts)]
        acts = [reps[layer].finish_forward(*moments_to_statistics([part]))
                for reps, part in zip(per_slice, parts)]
        kept.follow_statistics(*moments_to_statistics(parts),
                               total * shape.conv_height * shape.conv_width)
    out = np.concatenate(acts, axis=0)
    grads = [dy[a:b] for a, b in slices]
    for layer in reversed(range(len(updated))):
        sums = [reps[layer].start_backward(g) for reps, g in zip(per_slice, grads)]
        results = [reps[layer].finish_backward(own[0], own[1], layer > 0)
                   for reps, own in zip(per_slice, sums)]
        updated[layer].apply_update(
            add_in_order([r[1] for r in results]), lr,
            (add_in_order([own[0] for own in sums]), add_in_order([own[1] for own in sums])))
        grads = [r[0] for r in results]
    return out, updated


@pytest.mark.parametrize("cuts", [[5, 7], [3, 4, 5]], ids=["2 members", "3 members"])
def test_slice_statistics_equal_one_machine_per_slice(cuts: list[int]) -> None:
    """``--bn-statistics slice``: every member's output is its slice through the layers
    as one machine's batch; the update adds every slice's gradients; the running
    statistics are the whole batch's; every replica (an idle one too) ends equal."""
    model, params, settings, x, dy, slices, positions = _chain_case(cuts, 6)
    layers = len(positions)
    members = [f"p{i}" for i in range(len(cuts))]
    everyone = members + ["idle"]
    expected_y, expected = _one_machine_per_slice(model, params, settings, x, dy, slices, 0.05)
    # the whole batch's statistics give another output: the test can tell them apart
    whole = [[SampleReplica(s) for s in _shards(model, params, settings)] for _ in cuts]
    assert not np.array_equal(_run_split(whole, x, dy, slices, 0.05), expected_y)

    runners, shards = _participants(model, params, settings, members, everyone)

    def slice_of(name: str, array: np.ndarray) -> np.ndarray | None:
        return _slice_of(name, array, members, slices)

    forward = _in_threads({n: (lambda n=n: runners[n].serve(
        _forward(0, 10, members, cuts, slice_of(n, x), layers, positions, by_slice=True),
        shards[n])) for n in everyone})
    assert not [r for r in forward.values() if isinstance(r, BaseException)], forward
    np.testing.assert_array_equal(np.concatenate([forward[m].y for m in members]), expected_y)
    for name in everyone:  # the running statistics: the whole batch's, on every replica
        for layer in range(layers):
            for key in ("running_mean", "running_var"):
                np.testing.assert_array_equal(shards[name][layer].state[key],
                                              expected[layer].shard.state[key],
                                              err_msg=f"{name} layer {layer} {key}")
    backward = _in_threads({n: (lambda n=n: runners[n].serve(
        _backward(0, 11, members, slice_of(n, dy), layers, by_slice=True), shards[n]))
        for n in everyone})
    assert not [r for r in backward.values() if isinstance(r, BaseException)], backward
    second = _in_threads({n: (lambda n=n: runners[n].serve(
        _forward(1, 12, members, cuts, slice_of(n, x), layers, positions, 11,
                 tuple(members), by_slice=True), shards[n])) for n in everyone})
    assert not [r for r in second.values() if isinstance(r, BaseException)], second
    for name in everyone:
        for layer in range(layers):
            for key in ("weight", "gamma", "beta", "velocity_weight"):
                np.testing.assert_array_equal(shards[name][layer].state[key],
                                              expected[layer].shard.state[key],
                                              err_msg=f"{name} layer {layer} {key}")


# slice_statistics outside a chain: no such field on a round since protocol 13; the
# closest refusal left is a chain without its exchange (sync_id 0)
def test_a_chain_without_its_exchange_is_refused() -> None:
    from hetconv.worker.validation import refusal

    request = _forward(0, 0, ["a"], [4], np.zeros((4, 2, 16, 16), np.float32), 2, [1, 1],
                       by_slice=True)
    assert "sync_id must be at least 1" in str(refusal(request))
    assert refusal(_backward(0, 0, ["a"], None, 2, by_slice=True)) is not None
