"""Overlap on the peer plane: streamed convolutions and exchanges equal the whole ones
bit for bit, whatever order and size the pieces come in."""
from __future__ import annotations

import threading
from collections import defaultdict, deque

import numpy as np
import pytest

import hetconv.ops.conv as conv
import hetconv.participant.kernels.exchange as dataplane
from hetconv.engine.shard import ConvShard, LayerSettings
from hetconv.ops.conv import LAYOUTS, conv2d_backward_cached, conv2d_forward_cached
from hetconv.participant.kernels.exchange import PeerParticipant
from hetconv.participant.peer_plan import KernelRange, PeerPlan
from hetconv.protocol import PeerPiece, decode, encode

R = KernelRange


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many conv chunks and many pieces, so that streaming really interleaves."""
    monkeypatch.setattr(conv, "CHUNK_WORKING_BYTES", 1 << 12)
    monkeypatch.setattr(conv, "MIN_CACHE_CHUNK", 1)
    monkeypatch.setattr(dataplane, "PIECE_BYTES", 1 << 10)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_streamed_convolution_equals_the_whole_one(small_chunks: None, layout: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((13, 3, 9, 9)).astype(np.float32)
    w = rng.standard_normal((5, 3, 3, 3)).astype(np.float32)
    dy = rng.standard_normal((13, 5, 9, 9)).astype(np.float32)
    y_ref, cache_ref = conv2d_forward_cached(x, w, padding=1, layout=layout)
    dx_ref, dw_ref, _ = conv2d_backward_cached(cache_ref, dy)

    buffer = np.full_like(x, np.nan)  # filled only when the convolution asks
    asked: list[int] = []

    def rows_ready(rows: int) -> None:
        asked.append(rows)
        buffer[:rows] = x[:rows]
    y, cache = conv2d_forward_cached(buffer, w, padding=1, layout=layout, rows_ready=rows_ready)
    assert len(asked) > 2 and asked == sorted(asked) and asked[-1] == 13
    assert np.array_equal(y, y_ref)
    handed: list[tuple[int, int]] = []
    copies: list[np.ndarray] = []

    def dx_rows(dx: np.ndarray, start: int, stop: int) -> None:
        handed.append((start, stop))
        copies.append(dx[start:stop].copy())  # final when handed out
    dx, dw, _ = conv2d_backward_cached(cache, dy, dx_rows=dx_rows)
    assert handed[0][0] == 0 and handed[-1][1] == 13 and len(handed) > 2
    assert all(a[1] == b[0] for a, b in zip(handed, handed[1:]))
    assert np.array_equal(np.concatenate(copies), dx_ref)
    assert np.array_equal(dw, dw_ref)


def test_a_streamed_input_must_be_float32() -> None:
    shard = ConvShard(0, 0, 2, LayerSettings(), {
        "weight": np.ones((2, 1, 3, 3), np.float32), "gamma": np.ones(2, np.float32),
        "beta": np.zeros(2, np.float32), "running_mean": np.zeros(2, np.float32),
        "running_var": np.ones(2, np.float32)})
    with pytest.raises(ValueError, match="float32"):
        shard.forward_host_streamed(np.ones((2, 1, 8, 8)), lambda rows: None, True)


class ThreadSwitch:
    """In-memory delivery between threads; every piece is encoded and decoded."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[list[bytes]]] = defaultdict(deque)
        self.ready = threading.Condition()
        self.pieces = 0

    def send(self, target: str, message: PeerPiece) -> int:
        with self.ready:
            self.queues[target].append([bytes(f) for f in encode(message)])
            self.pieces += 1
            self.ready.notify_all()
        return int(message.data.nbytes)

    def receive(self, me: str, timeout_s: float) -> PeerPiece | None:
        with self.ready:
            if not self.queues[me]:
                self.ready.wait(timeout_s)
            if not self.queues[me]:
                return None
            frames = self.queues[me].popleft()
        message = decode(frames)
        assert isinstance(message, PeerPiece)
        return message


class ThreadPort:
    def __init__(self, switch: ThreadSwitch, me: str):
        self.switch, self.me = switch, me

    def send(self, participant: str, piece: PeerPiece) -> int:
        return self.switch.send(participant, piece)

    def receive(self, timeout_s: float) -> PeerPiece | None:
        return self.switch.receive(self.me, timeout_s)


def run_steps(streaming: bool, wire: str, steps: int = 2
              ) -> tuple[list[np.ndarray], dict[str, dict[int, ConvShard]], int]:
    """Three participants, each in its own thread, two layers; the outputs per step,
    the shards after training, and how many pieces travelled."""
    plan = PeerPlan([[R("m", 0, 3), R("a", 3, 5), R("b", 5, 8)],
                     [R("m", 0, 2), R("a", 2, 5), R("b", 5, 6)]])
    rng = np.random.default_rng(3)
    channels = [2, 8]
    shards: dict[str, dict[int, ConvShard]] = {name: {} for name in "mab"}
    for layer, kernels in enumerate([8, 6]):
        state = {"weight": rng.standard_normal((kernels, channels[layer], 3, 3))
                 .astype(np.float32) * 0.3,
                 "gamma": rng.uniform(0.5, 1.5, kernels).astype(np.float32),
                 "beta": rng.standard_normal(kernels).astype(np.float32) * 0.1,
                 "running_mean": np.zeros(kernels, np.float32),
                 "running_var": np.ones(kernels, np.float32)}
        for r in plan.layers[layer]:
            shards[r.participant][layer] = ConvShard(
                layer, r.start, r.stop, LayerSettings(padding=1),
                {k: v[r.start:r.stop] for k, v in state.items()})
    switch = ThreadSwitch()
    participants = {name: PeerParticipant(name, plan, shards[name], ThreadPort(switch, name),
                                          wire_dtype=wire, timeout_s=5.0, streaming=streaming)
                    for name in "mab"}
    x = rng.standard_normal((12, 2, 12, 12)).astype(np.float32)
    outputs: list[np.ndarray] = []
    for step in range(steps):
        dy = rng.standard_normal((12, 6, 3, 3)).astype(np.float32)
        results: dict[str, np.ndarray] = {}
        errors: list[BaseException] = []

        def work(name: str, step: int = step, dy: np.ndarray = dy,
                 results: dict[str, np.ndarray] = results,
                 errors: list[BaseException] = errors) -> None:
            try:
                p = participants[name]
                p.forward(step + 1, step, 0, True, x if name == "m" else None)  # m relays
                y, _ = p.forward(step + 1, step, 1, True, None)
                assert y is not None
                results[name] = y
                own = plan.range_of(1, name)
                assert own is not None
                p.backward(step + 1, step, 1, 0.1, dy[:, own.start:own.stop])
                p.backward(step + 1, step, 0, 0.1, None)
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)
        threads = [threading.Thread(target=work, args=(name,)) for name in "mab"]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not errors, errors
        outputs.append(np.concatenate([results[n] for n in "mab"], axis=1))
    return outputs, shards, switch.pieces


@pytest.mark.parametrize("wire", ["float32", "float16"])
def test_streamed_exchange_equals_the_whole_exchange(small_chunks: None, wire: str) -> None:
    streamed, streamed_shards, streamed_pieces = run_steps(True, wire)
    whole, whole_shards, whole_pieces = run_steps(False, wire)
    assert streamed_pieces > 2 * whole_pieces  # it really went in pieces
    for a, b in zip(streamed, whole):
        assert np.array_equal(a, b)
    for name in "mab":
        for layer, shard in streamed_shards[name].items():
            for key, value in shard.snapshot().items():
                assert np.array_equal(value, whole_shards[name][layer].snapshot()[key]), key
