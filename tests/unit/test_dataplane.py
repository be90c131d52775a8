"""The peer data plane's pure logic, and participants exchanging over in-memory ports."""
from __future__ import annotations

from collections import defaultdict, deque

import numpy as np
import pytest

from hetconv.engine.shard import ConvShard, LayerSettings
from hetconv.participant.kernels.exchange import (
    PeerParticipant,
    assemble_input,
    reduce_gradient,
    row_chunks,
    rows_per_piece,
    split_gradient,
)
from hetconv.participant.peer_pieces import Inbox, PieceKey, RowGather
from hetconv.participant.peer_plan import PHASE_BACKWARD, PHASE_FORWARD, KernelRange, PeerPlan
from hetconv.participant.ports import PeerLost
from hetconv.protocol import PeerPiece, decode, encode

R = KernelRange


def plan_abc() -> PeerPlan:
    """Layer 0: m 2, a 1, b 0 (empty); layer 1: m 0 (empty), a 3, b 2; layer 2: b 4."""
    return PeerPlan([[R("m", 0, 2), R("a", 2, 3), R("b", 3, 3)],
                     [R("m", 0, 0), R("a", 0, 3), R("b", 3, 5)],
                     [R("m", 0, 0), R("a", 0, 0), R("b", 0, 4)]])


def piece(layer: int, phase: str, sender: str, start: int, stop: int, pass_id: int = 1,
          step: int = 0, batch: int = 2, size: int = 3, rows: tuple[int, int] | None = None
          ) -> PeerPiece:
    first, last = (0, batch) if rows is None else rows
    data = np.ones((last - first, stop - start, size, size), np.float32)
    return PeerPiece(pass_id=pass_id, step=step, layer=layer, phase=phase, attempt=0,
                     sender=sender, kernel_start=start, kernel_stop=stop, batch_start=first,
                     batch_stop=last, batch_size=batch, data=data)


# --- routes ------------------------------------------------------------------------------
def test_forward_routes_skip_empty_shards() -> None:
    plan = plan_abc()
    assert plan.forward_targets(0, "m") == ["a", "b"]  # holders of layer 1
    assert plan.forward_targets(0, "b") == []  # b has no kernels in layer 0: sends nothing
    assert plan.forward_sources(1, "b") == [R("m", 0, 2), R("a", 2, 3)]
    assert plan.forward_sources(1, "m") == []  # m has no kernels in layer 1: needs nothing
    assert plan.forward_targets(1, "a") == ["b"]
    assert plan.forward_targets(2, "b") == []  # the last layer's output goes to the master
    assert plan.forward_sources(0, "m") == []  # layer 0's input comes with the request


def test_backward_routes_are_the_reverse() -> None:
    plan = plan_abc()
    assert plan.backward_targets(1, "a") == [R("m", 0, 2), R("a", 2, 3)]
    assert plan.backward_sources(0, "m") == [R("a", 0, 3), R("b", 3, 5)]
    assert plan.backward_sources(0, "b") == []
    assert plan.backward_targets(0, "m") == []  # nobody needs layer 0's input gradient
    assert plan.backward_sources(2, "b") == []  # the last layer's dy comes with the request


def test_layer_0_input_is_relayed_by_the_first_worker_only() -> None:
    plan = PeerPlan([[R("master", 0, 1), R("a", 1, 2), R("b", 2, 2), R("c", 2, 3)]])
    assert plan.input_relay() == "a"
    assert plan.input_targets("a") == ["c"]  # not the master (has x), not b (no kernels)
    assert plan.input_targets("c") == []
    inbox = Inbox("c", plan)
    assert inbox.offer(piece(0, "input", "a", 0, 1)) is None
    assert "unexpected" in (inbox.offer(piece(0, "input", "master", 0, 1)) or "")
    assert "channels" in (inbox.offer(piece(0, "input", "a", 1, 2, step=1)) or "")
    assert PeerPlan([[R("master", 0, 2)]]).input_relay() is None


def test_plan_round_trips_the_wire_and_rejects_gaps() -> None:
    plan = plan_abc()
    assert PeerPlan.from_wire(plan.to_wire()).layers == plan.layers
    with pytest.raises(ValueError):
        PeerPlan([[R("m", 0, 2), R("a", 3, 4)]])
    with pytest.raises(ValueError):
        PeerPlan.from_wire([[["m", 0, "2"]]])


# --- the inbox ---------------------------------------------------------------------------
def test_inbox_keeps_expected_pieces_and_drops_the_rest() -> None:
    inbox = Inbox("b", plan_abc())
    inbox.begin_pass(1)
    assert inbox.offer(piece(0, PHASE_FORWARD, "m", 0, 2)) is None
    assert "duplicate" in (inbox.offer(piece(0, PHASE_FORWARD, "m", 0, 2)) or "")
    assert "expected [2, 3)" in (inbox.offer(piece(0, PHASE_FORWARD, "a", 2, 4)) or "")
    assert "unexpected" in (inbox.offer(piece(2, PHASE_FORWARD, "m", 0, 4)) or "")
    assert "unexpected" in (inbox.offer(piece(0, PHASE_BACKWARD, "m", 3, 5)) or "")
    assert "unknown phase" in (inbox.offer(piece(0, "sideways", "m", 0, 2)) or "")
    assert "this participant" in (inbox.offer(piece(0, PHASE_FORWARD, "b", 0, 2)) or "")
    key = PieceKey(1, 0, 0, PHASE_FORWARD, 0)
    assert inbox.missing(key, plan_abc().forward_sources(1, "b")) == ["a"]
    assert inbox.offer(piece(0, PHASE_FORWARD, "a", 2, 3)) is None
    assert inbox.missing(key, plan_abc().forward_sources(1, "b")) == []
    assert sorted(inbox.take(key)) == ["a", "m"]


def test_inbox_drops_stale_and_far_future_pieces_and_keeps_the_next_pass() -> None:
    inbox = Inbox("b", plan_abc())
    inbox.begin_pass(5)
    assert "stale" in (inbox.offer(piece(0, PHASE_FORWARD, "m", 0, 2, pass_id=4)) or "")
    assert "ahead" in (inbox.offer(piece(0, PHASE_FORWARD, "m", 0, 2, pass_id=7)) or "")
    assert inbox.offer(piece(0, PHASE_FORWARD, "m", 0, 2, pass_id=6)) is None  # a fast peer
    assert inbox.offer(piece(0, PHASE_FORWARD, "a", 2, 3, pass_id=5)) is None
    inbox.begin_pass(6)  # pass 5 is over: its leftovers go
    assert [k.pass_id for k in inbox.pieces] == [6]


def test_inbox_checks_the_array_shape() -> None:
    inbox = Inbox("b", plan_abc())
    bad = piece(0, PHASE_FORWARD, "m", 0, 2)
    wrong = PeerPiece(**{**vars(bad), "data": np.ones((2, 3, 3, 3), np.float32)})
    assert "shape" in (inbox.offer(wrong) or "")


def test_inbox_checks_sample_ranges() -> None:
    inbox = Inbox("b", plan_abc())
    assert inbox.offer(piece(0, PHASE_FORWARD, "m", 0, 2, batch=8, rows=(0, 3))) is None
    assert inbox.offer(piece(0, PHASE_FORWARD, "m", 0, 2, batch=8, rows=(3, 8))) is None
    assert "duplicate" in (inbox.offer(piece(0, PHASE_FORWARD, "m", 0, 2, batch=8,
                                             rows=(2, 4))) or "")
    assert "batch has 9" in (inbox.offer(piece(0, PHASE_FORWARD, "a", 2, 3, batch=9,
                                               rows=(0, 1))) or "")
    bad = piece(0, PHASE_FORWARD, "a", 2, 3, batch=8, rows=(5, 9))
    assert "samples [5, 9) of 8" in (inbox.offer(bad) or "")
    short = PeerPiece(**{**vars(piece(0, PHASE_FORWARD, "a", 2, 3, batch=8, rows=(0, 4))),
                         "data": np.ones((3, 1, 3, 3), np.float32)})
    assert "samples [0, 4)" in (inbox.offer(short) or "")
    key = PieceKey(1, 0, 0, PHASE_FORWARD, 0)
    assert [(p.batch_start, p.batch_stop) for p in inbox.take(key)["m"]] == [(0, 3), (3, 8)]


def test_row_gather_assembles_in_kernel_order_as_pieces_come() -> None:
    sources = [R("m", 0, 2), R("a", 2, 3)]
    gather = RowGather(sources, concat=True)
    assert gather.ready_rows() == 0 and not gather.allocated
    m = np.arange(6 * 2 * 4, dtype=np.float32).reshape(6, 2, 2, 2)
    a = -np.arange(6 * 1 * 4, dtype=np.float16).reshape(6, 1, 2, 2)

    def rows(data: np.ndarray, sender: str, start: int, stop: int) -> PeerPiece:
        return PeerPiece(pass_id=1, step=0, layer=0, phase=PHASE_FORWARD, attempt=0,
                         sender=sender, kernel_start=0, kernel_stop=data.shape[1],
                         batch_start=start, batch_stop=stop, batch_size=6,
                         data=data[start:stop])
    assert gather.add("m", rows(m, "m", 2, 6)) is None
    assert gather.ready_rows() == 0  # m has no sample 0 yet, a nothing
    assert gather.add("a", rows(a, "a", 0, 4)) is None
    assert gather.add("m", rows(m, "m", 0, 2)) is None
    assert gather.ready_rows() == 4 and not gather.complete
    assert "duplicate" in (gather.add("a", rows(a, "a", 3, 5)) or "")
    assert "not a source" in (gather.add("z", rows(a, "z", 4, 6)) or "")
    assert gather.add("a", rows(a, "a", 4, 6)) is None
    assert gather.complete and gather.buffer is not None
    assert np.array_equal(gather.buffer, assemble_input({"m": m, "a": a}, sources))


def test_rows_per_piece_bounds_the_piece_size_and_count() -> None:
    assert rows_per_piece(128, 1 << 10, piece_bytes=64 << 10, max_pieces=8) == 64  # 2 pieces
    assert rows_per_piece(128, 1 << 20, piece_bytes=64 << 10, max_pieces=8) == 16  # at most 8
    assert rows_per_piece(128, 10, piece_bytes=64 << 10) == 128  # small: one piece
    assert rows_per_piece(3, 1 << 20, max_pieces=8) == 1  # never below one sample
    assert row_chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]


# --- assembling and reducing ---------------------------------------------------------
def test_assemble_in_kernel_order_and_reduce_in_a_fixed_order() -> None:
    sources = [R("m", 0, 2), R("a", 2, 3)]
    pieces = {"a": np.full((1, 1, 2, 2), 3.0, np.float16), "m": np.zeros((1, 2, 2, 2))}
    whole = assemble_input(pieces, sources)
    assert whole.dtype == np.float32 and whole.shape == (1, 3, 2, 2)
    assert (whole[:, 2] == 3).all() and (whole[:, :2] == 0).all()
    rng = np.random.default_rng(0)
    parts = {name: rng.standard_normal((2, 3, 4, 4)).astype(np.float32) for name in "xyz"}
    order = [R("x", 0, 1), R("y", 1, 2), R("z", 2, 3)]
    expected = (parts["x"] + parts["y"]) + parts["z"]
    assert np.array_equal(reduce_gradient(parts, order), expected)
    dx = rng.standard_normal((2, 5, 3, 3))
    slices = split_gradient(dx, [R("m", 0, 2), R("a", 2, 5)])
    assert [r.participant for r, _ in slices] == ["m", "a"]
    assert np.array_equal(np.concatenate([s for _, s in slices], axis=1), dx)


# --- participants over in-memory ports ---------------------------------------------------
class Switch:
    """In-memory delivery: every piece is encoded and decoded as on the wire."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[list[bytes]]] = defaultdict(deque)
        self.dead: set[str] = set()

    def port(self, me: str) -> MemoryPort:
        return MemoryPort(self, me)


class MemoryPort:
    def __init__(self, switch: Switch, me: str):
        self.switch, self.me = switch, me

    def send(self, participant: str, message: PeerPiece) -> int:
        if self.me not in self.switch.dead:
            self.switch.queues[participant].append(
                [bytes(frame) for frame in encode(message)])
        return int(message.data.nbytes)

    def receive(self, timeout_s: float) -> PeerPiece | None:
        queue = self.switch.queues[self.me]
        if not queue:
            return None
        message = decode(queue.popleft())
        assert isinstance(message, PeerPiece)
        return message


SETTINGS = LayerSettings(padding=1)


def layer_state(rng: np.random.Generator, kernels: int, channels: int) -> dict[str, np.ndarray]:
    return {"weight": rng.standard_normal((kernels, channels, 3, 3)).astype(np.float32) * 0.3,
            "gamma": rng.uniform(0.5, 1.5, kernels).astype(np.float32),
            "beta": rng.standard_normal(kernels).astype(np.float32) * 0.1,
            "running_mean": np.zeros(kernels, np.float32),
            "running_var": np.ones(kernels, np.float32)}


def build(plan: PeerPlan, channels: list[int], switch: Switch, timeout_s: float = 1.0,
          streaming: bool = True) -> tuple[list[ConvShard], dict[str, PeerParticipant]]:
    rng = np.random.default_rng(1)
    states = [layer_state(rng, sum(r.kernels for r in plan.layers[layer]), channels[layer])
              for layer in range(len(plan.layers))]
    whole = [ConvShard(layer, 0, len(states[layer]["gamma"]), SETTINGS, states[layer])
             for layer in range(len(plan.layers))]
    names = {r.participant for ranges in plan.layers for r in ranges}
    participants = {}
    for name in sorted(names):
        shards = {layer: ConvShard(layer, r.start, r.stop, SETTINGS,
                                   {k: v[r.start:r.stop] for k, v in states[layer].items()})
                  for layer in range(len(plan.layers))
                  if (r := plan.range_of(layer, name)) is not None}
        participants[name] = PeerParticipant(name, plan, shards, switch.port(name),
                                             timeout_s=timeout_s, streaming=streaming)
    return whole, participants


def test_three_participants_reproduce_the_whole_layers() -> None:
    plan = plan_abc()
    switch = Switch()
    whole, participants = build(plan, [2, 3, 5], switch)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 2, 16, 16)).astype(np.float32)
    for step in range(2):
        reference = x
        for shard in whole:
            reference = shard.forward_host(reference, True)
        outputs: dict[str, np.ndarray] = {}
        for layer in range(3):
            for r in plan.holders(layer):
                given = layer == 0 and r.participant == plan.input_relay()
                y, _ = participants[r.participant].forward(step + 1, step, layer, True,
                                                           x if given else None)
                if y is not None:
                    outputs[r.participant] = y
        np.testing.assert_allclose(outputs["b"], reference, rtol=1e-5, atol=1e-6)
        dy = rng.standard_normal(reference.shape).astype(np.float32)
        gradient: np.ndarray | None = dy
        for layer in reversed(range(3)):
            assert gradient is not None
            gradient = whole[layer].backward_host(gradient, layer > 0, 0.1)
            for r in plan.holders(layer):
                participants[r.participant].backward(step + 1, step, layer, 0.1,
                                                     dy[:, r.start:r.stop]
                                                     if layer == 2 else None)
        for layer in range(3):  # every shard's weights moved exactly like the whole layer's
            for r in plan.holders(layer):
                np.testing.assert_allclose(
                    participants[r.participant].shards[layer].state["weight"],
                    whole[layer].state["weight"][r.start:r.stop], rtol=1e-5, atol=1e-6)
    assert not any(switch.queues.values())  # nothing sent that nobody took


def test_a_silent_peer_is_named_after_the_deadline() -> None:
    plan = plan_abc()
    switch = Switch()
    _, participants = build(plan, [2, 3, 5], switch, timeout_s=0.2)
    x = np.ones((2, 2, 16, 16), np.float32)
    switch.dead.add("a")  # a computes but its pieces never arrive
    participants["m"].forward(1, 0, 0, True, x)  # the relay: passes x on to a
    participants["a"].forward(1, 0, 0, True, None)
    with pytest.raises(PeerLost) as error:
        participants["b"].forward(1, 0, 1, True, None)
    assert error.value.peers == ["a"] and "peer a within 0.2 s" in str(error.value)


def test_a_cancelled_wait_ends_at_once() -> None:
    plan = plan_abc()
    switch = Switch()
    _, participants = build(plan, [2, 3, 5], switch, timeout_s=30.0)
    participants["b"].cancelled = lambda: True
    with pytest.raises(PeerLost, match="cancelled"):
        participants["b"].forward(1, 0, 1, True, None)
