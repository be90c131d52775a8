"""Small layers' weight gradients reduced directly among the peers (phase ``whole``,
hetconv/participant/samples/weight_reduce.py): one hop, every participant adds the contributors' whole
arrays in contributor order, with exactly the bits of the two-hop reduction and of the
master's ``add_in_order``; lost, hostile and malformed pieces are named as in the
two-hop reduction. Over the in-memory port of tests/unit/test_weight_reduce.py."""
from __future__ import annotations

import numpy as np
import pytest

import hetconv.participant.samples.reduction_plan as reduction_plan
from hetconv.participant.ports import PeerLost
from hetconv.participant.samples.reduction_plan import DIRECT_BYTES, reduce_plan, reduced_directly
from hetconv.participant.samples.replica import add_in_order
from hetconv.participant.samples.weight_reduce import PHASE_REDUCE, PHASE_WHOLE, GradientExchange
from hetconv.protocol import PeerPiece
from tests.unit.test_weight_reduce import Network

SMALL = (32, 1, 5, 5)  # 32:64's first layer: 3.2 KB
BIG = (64, 32, 5, 5)  # its second: 205 KB


def _grads(names: list[str], shape: tuple[int, ...], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
            for n in names}


def _exchanges(network: Network, everyone: list[str], owners: list[str],
               shape: tuple[int, ...], timeout_s: float = 0.2) -> dict[str, GradientExchange]:
    plan = reduce_plan([shape[0]], owners, everyone)
    return {n: GradientExchange(n, plan, network.port(n), timeout_s) for n in everyone}


def _reduce_all(exchanges: dict[str, GradientExchange], contributors: list[str],
                grads: dict[str, np.ndarray], shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    for name in contributors:
        exchanges[name].scatter(7, 3, 0, grads[name])
    own = {n: e.reduce(7, 3, 0, contributors, shape) for n, e in exchanges.items()}
    return {n: e.gather(7, 0, own[n], shape) for n, e in exchanges.items()}


def test_the_choice_is_the_shape_alone() -> None:
    assert reduced_directly(SMALL) and not reduced_directly(BIG)
    assert reduced_directly((DIRECT_BYTES // 4 - 1,)) and not reduced_directly(
        (DIRECT_BYTES // 4,))


@pytest.mark.parametrize("everyone, owners, contributors", [
    (["master", "w1"], ["master", "w1"], ["master", "w1"]),
    (["master", "w1", "w2", "w3"], ["master", "w1", "w2", "w3"], ["master", "w1", "w2", "w3"]),
    (["master", "w1", "w2"], ["w1", "w2"], ["w1", "w2"]),  # the master without samples
    (["master", "w1", "w2"], ["master", "w1", "w2"], ["w2"]),  # one slice only
])
def test_one_hop_gives_every_participant_the_bits_of_the_two_hop_sum(
        monkeypatch: pytest.MonkeyPatch, everyone: list[str], owners: list[str],
        contributors: list[str]) -> None:
    grads = _grads(contributors, SMALL)
    network = Network()
    direct = _reduce_all(_exchanges(network, everyone, owners, SMALL), contributors, grads,
                         SMALL)
    phases = {piece.phase for queue in network.queues.values() for piece in queue}
    assert not phases, phases  # everything sent was read
    monkeypatch.setattr(reduction_plan, "DIRECT_BYTES", 0)  # the two-hop reduction
    two_hops = _reduce_all(_exchanges(Network(), everyone, owners, SMALL), contributors,
                           grads, SMALL)
    expected = add_in_order([grads[n] for n in contributors])
    for name in everyone:
        assert direct[name].dtype == np.float32 and direct[name].shape == SMALL
        assert np.array_equal(direct[name].view(np.uint32), expected.view(np.uint32)), name
        assert np.array_equal(two_hops[name].view(np.uint32), expected.view(np.uint32)), name


class Recorder:
    """A port that records every piece sent, for counting phases."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, PeerPiece]] = []

    def send(self, participant: str, piece: PeerPiece) -> int:
        self.sent.append((participant, piece))
        return int(piece.data.nbytes)

    def receive(self, timeout_s: float) -> PeerPiece | None:
        return None


def test_a_small_layer_goes_whole_to_everyone_at_the_scatter_and_a_big_one_in_ranges() -> None:
    everyone = ["master", "w1", "w2", "w3"]
    plan = reduce_plan([SMALL[0], BIG[0]], everyone, everyone)
    port = Recorder()
    w1 = GradientExchange("w1", plan, port, 0.1)
    w1.scatter(3, 0, 0, np.ones(SMALL, np.float32))
    assert [(to, p.phase, p.kernel_start, p.kernel_stop, p.data.shape) for to, p in port.sent] \
        == [(to, PHASE_WHOLE, 0, SMALL[0], SMALL) for to in ("master", "w2", "w3")]
    port.sent.clear()
    w1.scatter(3, 0, 1, np.ones(BIG, np.float32))
    w1.flush()  # big pieces are queued as bulk until the next barrier message or the end
    assert {p.phase for _, p in port.sent} == {PHASE_REDUCE}
    assert sum(p.data.shape[0] for _, p in port.sent) == BIG[0] - 16  # all but w1's range


def _whole(sender: str, data: np.ndarray, start: int = 0, stop: int = SMALL[0],
           reduce_id: int = 7) -> PeerPiece:
    return PeerPiece(pass_id=reduce_id, step=3, layer=0, phase=PHASE_WHOLE, attempt=0,
                     sender=sender, kernel_start=start, kernel_stop=stop, batch_start=0,
                     batch_stop=1, batch_size=1, data=data)


def test_a_contributor_that_never_sends_is_named_and_bad_pieces_are_blamed() -> None:
    everyone = ["master", "w1", "w2"]
    network = Network()
    network.lost.add("w2")
    exchanges = _exchanges(network, everyone, everyone, SMALL, timeout_s=0.1)
    grads = _grads(everyone, SMALL)
    for name in everyone:
        exchanges[name].scatter(7, 3, 0, grads[name])
    assert exchanges["w1"].reduce(7, 3, 0, everyone, SMALL) is None
    with pytest.raises(PeerLost) as lost:
        exchanges["w1"].gather(7, 0, None, SMALL)
    assert lost.value.peers == ["w2"] and not lost.value.bad_data
    assert "within 0.1 s" in str(lost.value)

    plan = reduce_plan([SMALL[0]], everyone, everyone)
    exchange = GradientExchange("w1", plan, Network().port("w1"), 0.1)
    ok = np.zeros(SMALL, np.float32)
    assert "kernels" in (exchange.offer(_whole("w2", ok, 0, 8)) or "")
    assert "not a participant" in (exchange.offer(_whole("eve", ok)) or "")
    assert "this participant" in (exchange.offer(_whole("w1", ok)) or "")
    assert exchange.offer(_whole("master", np.full_like(ok, np.nan))) is None
    assert exchange.offer(_whole("w2", ok)) is None
    assert "duplicate" in (exchange.offer(_whole("w2", ok)) or "")
    exchange.scatter(7, 3, 0, ok)
    exchange.reduce(7, 3, 0, everyone, SMALL)
    with pytest.raises(PeerLost) as bad:
        exchange.gather(7, 0, None, SMALL)
    assert bad.value.bad_data and bad.value.peers == ["master"]

    wrong = GradientExchange("w1", plan, Network().port("w1"), 0.1)
    wrong.offer(_whole("w2", np.zeros((SMALL[0], 2, 5, 5), np.float32)))
    wrong.reduce(7, 3, 0, ["w2"], SMALL)
    with pytest.raises(PeerLost) as shape:
        wrong.gather(7, 0, None, SMALL)
    assert shape.value.bad_data and shape.value.peers == ["w2"]
    with pytest.raises(PeerLost, match="before its reduction"):
        wrong.gather(8, 0, None, SMALL)


def test_whole_pieces_of_an_older_reduction_are_stale() -> None:
    everyone = ["master", "w1"]
    plan = reduce_plan([SMALL[0]], everyone, everyone)
    w1 = GradientExchange("w1", plan, Network().port("w1"), 0.1)
    ones = np.ones(SMALL, np.float32)
    assert w1.offer(_whole("master", ones, reduce_id=6)) is None
    assert w1.offer(_whole("master", 2 * ones, reduce_id=7)) is None
    w1.scatter(7, 3, 0, ones)
    w1.reduce(7, 3, 0, everyone, SMALL)
    assert np.array_equal(w1.gather(7, 0, None, SMALL), 3 * ones)
    assert "stale" in (w1.offer(_whole("master", ones, reduce_id=6)) or "")
