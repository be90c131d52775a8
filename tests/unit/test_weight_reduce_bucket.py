"""The first layers' weight gradients reduced together (the plan's bucket,
hetconv/participant/samples/weight_reduce.py): one ``whole`` piece per peer carries every bucket layer's
dW_i, each layer's sum has exactly the bits of the master's ``add_in_order``, the
plan carries the bucket on the wire, and lost, hostile and malformed bucket pieces are
named. Over the in-memory port of tests/unit/test_weight_reduce.py."""
from __future__ import annotations

import numpy as np
import pytest

from hetconv.participant.peer_plan import KernelRange, PeerPlan
from hetconv.participant.ports import PeerLost
from hetconv.participant.samples.reduction_plan import BUCKET_BYTES, bucket_sizes, reduce_plan
from hetconv.participant.samples.replica import add_in_order
from hetconv.participant.samples.weight_reduce import PHASE_WHOLE, GradientExchange
from hetconv.protocol import PeerPiece
from tests.unit.test_weight_reduce import Network

# the VGG-style network's conv layers: 3.4, 36.9, 73.7 and 147.5 KB of float32
VGG = [(32, 3, 3, 3), (32, 32, 3, 3), (64, 32, 3, 3), (64, 64, 3, 3)]


def _sizes(shapes: list[tuple[int, ...]]) -> list[int]:
    return [int(np.prod(shape)) for shape in shapes]


def _grads(names: list[str], seed: int = 0) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {n: [(rng.standard_normal(s) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
                for s in VGG] for n in names}


def _plan(everyone: list[str], owners: list[str]) -> PeerPlan:
    return reduce_plan([s[0] for s in VGG], owners, everyone, _sizes(VGG))


def _step(network: Network, everyone: list[str], owners: list[str], contributors: list[str],
          grads: dict[str, list[np.ndarray]]) -> dict[str, list[np.ndarray]]:
    """A backward's scatters (last layer first), then the next step's reduce and gathers
    in layer order: every participant's ΣdW per layer."""
    plan = _plan(everyone, owners)
    exchanges = {n: GradientExchange(n, plan, network.port(n), 0.2) for n in everyone}
    for layer in range(len(VGG) - 1, -1, -1):
        for name in contributors:
            exchanges[name].scatter(7, 3, layer, grads[name][layer])
    for exchange in exchanges.values():
        exchange.flush()  # the request's end (the runner's figures)
    begun = {n: [e.reduce(7, 3, layer, contributors, VGG[layer]) for layer in range(len(VGG))]
             for n, e in exchanges.items()}
    for exchange in exchanges.values():
        exchange.flush()
    return {n: [e.gather(7, layer, begun[n][layer], VGG[layer]) for layer in range(len(VGG))]
            for n, e in exchanges.items()}


def test_the_bucket_is_the_longest_prefix_within_its_bytes() -> None:
    assert bucket_sizes(_sizes(VGG)) == _sizes(VGG)[:3]  # 114 KB; with layer 4 262 KB
    assert bucket_sizes([64 * 1 * 25, 64 * 32 * 25]) == [1600]  # 32:64: layer 1 alone
    assert bucket_sizes([BUCKET_BYTES // 4]) == [BUCKET_BYTES // 4]
    assert bucket_sizes([BUCKET_BYTES // 4 + 1, 1]) == []
    assert bucket_sizes([]) == []


@pytest.mark.parametrize("everyone, owners, contributors", [
    (["master", "w1"], ["master", "w1"], ["master", "w1"]),
    (["master", "w1", "w2", "w3"], ["master", "w1", "w2", "w3"], ["master", "w1", "w2", "w3"]),
    (["master", "w1", "w2"], ["w1", "w2"], ["w1", "w2"]),  # the master without samples
    (["master", "w1", "w2"], ["master", "w1", "w2"], ["w2"]),  # one slice only
])
def test_every_layer_gets_the_exact_bits_of_the_masters_sum(
        everyone: list[str], owners: list[str], contributors: list[str]) -> None:
    grads = _grads(contributors)
    results = _step(Network(), everyone, owners, contributors, grads)
    for layer, shape in enumerate(VGG):
        expected = add_in_order([grads[n][layer] for n in contributors])
        for name, sums in results.items():
            assert sums[layer].shape == shape and sums[layer].dtype == np.float32
            assert np.array_equal(sums[layer].view(np.uint32), expected.view(np.uint32)), \
                (name, layer)


class CountingNetwork(Network):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[PeerPiece] = []

    def port(self, me: str):  # type: ignore[no-untyped-def]
        port = super().port(me)
        send = port.send

        def counted(participant: str, piece: PeerPiece) -> int:
            self.sent.append(piece)
            return send(participant, piece)
        port.send = counted  # type: ignore[method-assign]
        return port


def test_one_piece_per_peer_carries_the_whole_bucket() -> None:
    everyone = ["master", "w1", "w2", "w3"]
    network = CountingNetwork()
    _step(network, everyone, everyone, everyone, _grads(everyone))
    bucket = [p for p in network.sent if p.layer < 3]
    assert len(bucket) == 4 * 3  # each participant: one piece to each of its three peers
    assert all(p.phase == PHASE_WHOLE and p.layer == 0 for p in bucket)
    assert all(p.data.shape == (sum(_sizes(VGG)[:3]),) for p in bucket)
    # layer 4 (outside the bucket) still goes in two hops: 3 scatter + 3 gather each
    assert len([p for p in network.sent if p.layer == 3]) == 4 * 6


def test_the_plan_carries_the_bucket_on_the_wire() -> None:
    plan = _plan(["master", "w1"], ["master", "w1"])
    back = PeerPlan.from_wire(plan.to_wire())
    assert back.bucket == _sizes(VGG)[:3] and back.layers == plan.layers
    assert PeerPlan.from_wire(reduce_plan([4], ["a"], ["a"]).to_wire()).bucket == []
    ranges = [[["a", 0, 4]], [["a", 0, 4]]]
    for bad in ([1, 2, 3], [0], [-5], [1 << 30], "12", [1.5]):
        with pytest.raises(ValueError, match="bucket"):
            PeerPlan.from_wire(ranges + [{"bucket": bad}])


def test_a_gradient_of_another_size_than_the_plans_bucket_is_refused() -> None:
    exchange = GradientExchange("w1", _plan(["master", "w1"], ["master", "w1"]),
                                Network().port("w1"), 0.1)
    with pytest.raises(PeerLost, match="the plan's bucket"):
        exchange.scatter(1, 0, 1, np.zeros((32, 32, 3, 1), np.float32))


def test_a_bucket_sent_without_one_of_its_layers_is_refused() -> None:
    exchange = GradientExchange("w1", _plan(["master", "w1"], ["master", "w1"]),
                                Network().port("w1"), 0.1)
    exchange.scatter(1, 0, 2, np.zeros(VGG[2], np.float32))
    with pytest.raises(PeerLost, match=r"layer\(s\) \[2\]"):
        exchange.scatter(1, 0, 0, np.zeros(VGG[0], np.float32))


def test_a_peer_that_never_sends_its_bucket_is_named() -> None:
    everyone = ["master", "w1", "w2"]
    network = Network()
    network.lost.add("w2")
    grads = _grads(everyone)
    plan = _plan(everyone, everyone)
    exchanges = {n: GradientExchange(n, plan, network.port(n), 0.1) for n in everyone}
    for layer in (2, 1, 0):
        for name in everyone:
            exchanges[name].scatter(1, 0, layer, grads[name][layer])
    exchanges["w1"].reduce(1, 0, 0, everyone, VGG[0])
    with pytest.raises(PeerLost) as lost:
        exchanges["w1"].gather(1, 0, None, VGG[0])
    assert lost.value.peers == ["w2"] and not lost.value.bad_data


@pytest.mark.parametrize("data, why", [
    (np.zeros(100, np.float32), "shape"),
    (np.full(sum(_sizes(VGG)[:3]), np.nan, np.float32), "NaN"),
])
def test_a_malformed_bucket_is_blamed_on_its_sender(data: np.ndarray, why: str) -> None:
    everyone = ["master", "w1"]
    network = Network()
    exchange = GradientExchange("w1", _plan(everyone, everyone), network.port("w1"), 0.1)
    network.queues["w1"].append(PeerPiece(
        pass_id=1, step=0, layer=0, phase=PHASE_WHOLE, attempt=0, sender="master",
        kernel_start=0, kernel_stop=32, batch_start=0, batch_stop=1, batch_size=1, data=data))
    exchange.reduce(1, 0, 0, everyone, VGG[0])
    with pytest.raises(PeerLost, match=why) as lost:
        exchange.gather(1, 0, None, VGG[0])
    assert lost.value.peers == ["master"] and lost.value.bad_data


def test_a_retried_step_forgets_the_older_bucket() -> None:
    everyone = ["master", "w1"]
    grads = _grads(everyone)
    network = Network()
    plan = _plan(everyone, everyone)
    exchanges = {n: GradientExchange(n, plan, network.port(n), 0.2) for n in everyone}
    for reduce_id in (1, 2):  # reduction 1 is abandoned after its scatter
        for layer in (3, 2, 1, 0):
            for name in everyone:
                exchanges[name].scatter(reduce_id, 0, layer, grads[name][layer])
        for exchange in exchanges.values():
            exchange.flush()
    owns: list[tuple[str, int, np.ndarray | None]] = []
    for n, e in exchanges.items():
        for layer in range(4):
            owns.append((n, layer, e.reduce(2, 0, layer, everyone, VGG[layer])))
    for exchange in exchanges.values():
        exchange.flush()
    for n, layer, own in owns:
        total = exchanges[n].gather(2, layer, own, VGG[layer])
        expected = add_in_order([grads[m][layer] for m in everyone])
        assert np.array_equal(total, expected), (n, layer)
    assert all(not e._bucket_sums and not e._own for e in exchanges.values())
    assert KernelRange  # the plan's ranges type, imported for readers of the wire test
