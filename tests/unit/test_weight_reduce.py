"""The sample split's weight-gradient reduction among the peers (hetconv/participant/samples/weight_reduce.py),
over an in-memory port: the reduced sum has exactly the bits of the master's
``add_in_order``, every participant ends with the same array, and lost, late, hostile
and malformed pieces are named."""
from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from hetconv.config import MASTER_PARTICIPANT
from hetconv.participant.ports import PeerLost
from hetconv.participant.samples.reduction_plan import reduce_plan, reduce_ranges
from hetconv.participant.samples.replica import add_in_order
from hetconv.participant.samples.weight_reduce import PHASE_GATHER, PHASE_REDUCE, GradientExchange
from hetconv.protocol import PeerPiece


class Network:
    """Queues of pieces per participant; ``lost`` participants send nothing."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[PeerPiece]] = {}
        self.lost: set[str] = set()

    def port(self, me: str) -> Port:
        self.queues.setdefault(me, deque())
        return Port(self, me)


class Port:
    def __init__(self, network: Network, me: str):
        self.network, self.me = network, me

    def send(self, participant: str, piece: PeerPiece) -> int:
        if self.me not in self.network.lost:
            self.network.queues.setdefault(participant, deque()).append(piece)
        return int(piece.data.nbytes)

    def receive(self, timeout_s: float) -> PeerPiece | None:
        queue = self.network.queues[self.me]
        return queue.popleft() if queue else None


SHAPE = (10, 3, 3, 3)


@pytest.fixture(autouse=True)
def two_hops(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the reduce-scatter + all-gather; a layer this small would
    be reduced directly (tests/unit/test_weight_reduce_direct.py)."""
    import hetconv.participant.samples.reduction_plan

    monkeypatch.setattr(hetconv.participant.samples.reduction_plan, "DIRECT_BYTES", 0)


def _gradients(names: list[str], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(SHAPE) * 10.0 ** rng.integers(-3, 3)).astype(np.float32)
            for n in names}


def _run(everyone: list[str], owners: list[str], contributors: list[str],
         timeout_s: float = 0.2) -> dict[str, np.ndarray]:
    """Scatter, then reduce (all), then gather (all): every participant's ΣdW."""
    network = Network()
    plan = reduce_plan([SHAPE[0]], owners, everyone)
    exchanges = {n: GradientExchange(n, plan, network.port(n), timeout_s) for n in everyone}
    grads = _gradients(contributors)
    for name in contributors:
        exchanges[name].scatter(7, 3, 0, grads[name])
    own = {n: exchanges[n].reduce(7, 3, 0, contributors, SHAPE) for n in everyone}
    return {n: exchanges[n].gather(7, 0, own[n], SHAPE) for n in everyone}


def test_ranges_share_the_kernels_evenly_among_owners_in_order() -> None:
    ranges = reduce_ranges(10, ["w1", "w2", "w3"], ["master", "w1", "w2", "w3"])
    assert [(r.participant, r.start, r.stop) for r in ranges] == [
        ("master", 0, 0), ("w1", 0, 4), ("w2", 4, 7), ("w3", 7, 10)]
    tiny = reduce_ranges(2, ["a", "b", "c"], ["a", "b", "c"])
    assert [r.kernels for r in tiny] == [1, 1, 0]


@pytest.mark.parametrize("everyone, owners, contributors", [
    (["master", "w1"], ["master", "w1"], ["master", "w1"]),
    (["master", "w1", "w2", "w3"], ["master", "w1", "w2", "w3"], ["master", "w1", "w2", "w3"]),
    (["master", "w1", "w2", "w3"], ["w1", "w2", "w3"], ["w1", "w2", "w3"]),  # --no-local
    (["master", "w1", "w2"], ["master", "w1", "w2"], ["w1", "w2"]),  # master without samples
    (["master", "w1", "w2"], ["master", "w1", "w2"], ["w2"]),  # one slice only
])
def test_every_participant_gets_the_exact_bits_of_the_masters_sum(
        everyone: list[str], owners: list[str], contributors: list[str]) -> None:
    results = _run(everyone, owners, contributors)
    grads = _gradients(contributors)
    expected = add_in_order([grads[n] for n in contributors])
    for name, total in results.items():
        assert total.dtype == np.float32 and total.shape == SHAPE
        assert np.array_equal(total.view(np.uint32), expected.view(np.uint32)), name


def test_bytes_per_link_are_about_two_shares_of_the_gradient() -> None:
    everyone = ["master", "w1", "w2", "w3"]
    network = Network()
    plan = reduce_plan([SHAPE[0]], everyone, everyone)
    exchanges = {n: GradientExchange(n, plan, network.port(n), 0.2) for n in everyone}
    grads = _gradients(everyone)
    for name in everyone:
        exchanges[name].scatter(1, 0, 0, grads[name])
    own = {n: exchanges[n].reduce(1, 0, 0, everyone, SHAPE) for n in everyone}
    for n in everyone:
        exchanges[n].gather(1, 0, own[n], SHAPE)
    whole = grads["master"].nbytes
    for name, exchange in exchanges.items():
        sent, received, _ = exchange.take_stats()
        # 2 (P - 1) / P of the gradient each way (kernels 10 over 4: ranges of 3, 3, 2, 2)
        assert 1.2 * whole <= sent <= 1.8 * whole, (name, sent / whole)
        assert 1.2 * whole <= received <= 1.8 * whole, (name, received / whole)


def test_a_peer_that_never_sends_is_named_after_the_deadline() -> None:
    everyone = ["master", "w1", "w2"]
    network = Network()
    network.lost.add("w2")
    plan = reduce_plan([SHAPE[0]], everyone, everyone)
    exchanges = {n: GradientExchange(n, plan, network.port(n), 0.1) for n in everyone}
    grads = _gradients(everyone)
    for name in everyone:
        exchanges[name].scatter(1, 0, 0, grads[name])
    with pytest.raises(PeerLost) as lost:
        exchanges["w1"].reduce(1, 0, 0, everyone, SHAPE)
    assert lost.value.peers == ["w2"] and not lost.value.bad_data
    assert "within 0.1 s" in str(lost.value)


def test_a_cancelled_wait_ends_at_once() -> None:
    network = Network()
    plan = reduce_plan([SHAPE[0]], ["master", "w1"], ["master", "w1"])
    exchange = GradientExchange("w1", plan, network.port("w1"), 30.0, cancelled=lambda: True)
    exchange.scatter(1, 0, 0, np.zeros(SHAPE, np.float32))
    with pytest.raises(PeerLost, match="cancelled"):
        exchange.reduce(1, 0, 0, ["master", "w1"], SHAPE)


def _piece(sender: str, phase: str, start: int, stop: int, data: np.ndarray,
           reduce_id: int = 1, layer: int = 0) -> PeerPiece:
    return PeerPiece(pass_id=reduce_id, step=0, layer=layer, phase=phase, attempt=0,
                     sender=sender, kernel_start=start, kernel_stop=stop, batch_start=0,
                     batch_stop=1, batch_size=1, data=data)


def test_hostile_and_malformed_pieces_are_dropped_or_blamed() -> None:
    everyone = [MASTER_PARTICIPANT, "w1", "w2"]
    plan = reduce_plan([SHAPE[0]], everyone, everyone)  # master [0,4) w1 [4,7) w2 [7,10)
    exchange = GradientExchange("w1", plan, Network().port("w1"), 0.1)
    chunk = np.zeros((3,) + SHAPE[1:], np.float32)
    assert "forward" in (exchange.offer(_piece("w2", "forward", 4, 7, chunk)) or "")
    assert "not a participant" in (exchange.offer(_piece("eve", PHASE_REDUCE, 4, 7, chunk)) or "")
    assert "kernels" in (exchange.offer(_piece("w2", PHASE_REDUCE, 0, 4, chunk)) or "")
    assert "not in the plan" in (exchange.offer(_piece("w2", PHASE_REDUCE, 4, 7, chunk,
                                                       layer=5)) or "")
    assert "this participant" in (exchange.offer(_piece("w1", PHASE_GATHER, 4, 7, chunk)) or "")
    assert exchange.offer(_piece("w2", PHASE_REDUCE, 4, 7, chunk)) is None
    assert "duplicate" in (exchange.offer(_piece("w2", PHASE_REDUCE, 4, 7, chunk)) or "")
    # a NaN or a wrong shape from a peer is bad data of that peer
    exchange.offer(_piece("master", PHASE_REDUCE, 4, 7, np.full_like(chunk, np.nan)))
    exchange.scatter(1, 0, 0, np.zeros(SHAPE, np.float32))
    with pytest.raises(PeerLost) as bad:
        exchange.reduce(1, 0, 0, everyone, SHAPE)
    assert bad.value.bad_data and bad.value.peers == ["master"]
    wrong = GradientExchange("w1", plan, Network().port("w1"), 0.1)
    wrong.offer(_piece("w2", PHASE_GATHER, 7, 10, np.zeros((3, 2, 3, 3), np.float32)))
    with pytest.raises(PeerLost) as shape:
        wrong.gather(1, 0, chunk, SHAPE)
    assert shape.value.bad_data and shape.value.peers == ["w2"]


def test_pieces_of_an_older_reduction_are_stale() -> None:
    everyone = ["master", "w1"]
    network = Network()
    plan = reduce_plan([SHAPE[0]], everyone, everyone)
    w1 = GradientExchange("w1", plan, network.port("w1"), 0.1)
    w1.scatter(5, 0, 0, np.ones(SHAPE, np.float32))
    chunk = np.zeros((5,) + SHAPE[1:], np.float32)
    assert w1.offer(_piece("master", PHASE_REDUCE, 5, 10, chunk, reduce_id=4)) is None
    assert w1.offer(_piece("master", PHASE_REDUCE, 5, 10, chunk, reduce_id=5)) is None
    w1.reduce(5, 0, 0, everyone, SHAPE)
    assert "stale" in (w1.offer(_piece("master", PHASE_REDUCE, 5, 10, chunk, reduce_id=4))
                       or "")


def test_far_ahead_pieces_are_purged_never_kept() -> None:
    """Forged pieces of reductions far ahead (a stranger who learnt the request counter)
    never fill the inbox: a nearer reduction's pieces push the farthest out, and a piece
    farther than every one held is dropped once MAX_HELD_REDUCTIONS are held."""
    from hetconv.participant.samples.weight_reduce import MAX_HELD_REDUCTIONS

    everyone = ["master", "w1"]
    plan = reduce_plan([SHAPE[0]], everyone, everyone)
    w1 = GradientExchange("w1", plan, Network().port("w1"), 0.1)
    chunk = np.zeros((5,) + SHAPE[1:], np.float32)
    for forged in range(1000, 1000 + MAX_HELD_REDUCTIONS):
        assert w1.offer(_piece("master", PHASE_REDUCE, 5, 10, chunk, reduce_id=forged)) is None
    assert "too far ahead" in (w1.offer(_piece("master", PHASE_REDUCE, 5, 10, chunk,
                                               reduce_id=5000)) or "")
    assert w1.offer(_piece("master", PHASE_REDUCE, 5, 10, chunk, reduce_id=5)) is None
    assert 1000 + MAX_HELD_REDUCTIONS - 1 not in {k[0] for k in w1._inbox}  # pushed out
    w1.scatter(5, 0, 0, np.ones(SHAPE, np.float32))
    w1.reduce(5, 0, 0, everyone, SHAPE)  # the honest one is there when needed


def test_a_bulk_piece_goes_out_after_the_next_barrier_message(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reduction piece of at least BULK_BYTES waits in its sender's queue and goes out
    right after that sender's next batch-norm message, not ahead of it in the link's
    one queue; a wait for reduction pieces sends what a peer may wait for first."""
    import hetconv.participant.samples.weight_reduce
    from hetconv.participant.samples.weight_reduce import PHASE_MOMENTS

    monkeypatch.setattr(hetconv.participant.samples.weight_reduce, "BULK_BYTES", SHAPE[1] * 9 * 4 * 3)
    network = Network()
    everyone = ["master", "w1"]
    plan = reduce_plan([SHAPE[0]], everyone, everyone)
    master, w1 = (GradientExchange(n, plan, network.port(n), 0.2) for n in everyone)
    grads = _gradients(everyone)
    master.scatter(7, 3, 0, grads["master"])  # w1's range: 5 kernels, 540 bytes: queued
    assert not network.queues["w1"]
    master.share(9, 4, 0, PHASE_MOMENTS, np.ones((2, SHAPE[0]), np.float32))
    assert [p.phase for p in network.queues["w1"]] == [PHASE_MOMENTS, PHASE_REDUCE]
    w1.scatter(7, 3, 0, grads["w1"])  # queued on w1's side until its reduce's wait
    own = {"w1": w1.reduce(7, 3, 0, everyone, SHAPE)}  # sends its queued piece, then waits
    own["master"] = master.reduce(7, 3, 0, everyone, SHAPE)  # the gather piece: queued
    master.flush()  # the request's end
    totals = {n: e.gather(7, 0, own[n], SHAPE) for n, e in (("w1", w1), ("master", master))}
    expected = add_in_order([grads[n] for n in everyone])
    for total in totals.values():
        assert np.array_equal(total.view(np.uint32), expected.view(np.uint32))
