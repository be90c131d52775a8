"""The step chain (docs/dense-replica.md): the dense part replicated on the sample
split's participants. Participants in threads over an in-memory port run two step
chains and an update-only round; the losses, every conv layer's state and every dense
array and velocity equal the local trainer's two steps (the float sums are cut at the
slices: rtol 1e-5), and every replica holds the same bits, a participant without
samples included. The dense part's validation and its dropout rows are checked too."""
from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hetconv.engine.dense_part import DensePart, Rows
from hetconv.engine.optim import OptimizerConfig
from hetconv.engine.shard import ConvShard
from hetconv.engine.stage import LocalConvStage, layer_settings
from hetconv.engine.training import LoopConfig, Trainer
from hetconv.metrics import MetricsWriter
from hetconv.model import (
    conv_layer_shapes,
    dense_parameter_names,
    init_parameters,
    model_config,
    parse_network,
)
from hetconv.names import layer_key
from hetconv.participant.samples.dense_replica import DenseReplica, dense_refusal, replica_from
from hetconv.participant.samples.reduction_plan import reduce_plan
from hetconv.participant.samples.runner import SampleRequestError, SampleRunner
from hetconv.participant.samples.weight_reduce import GradientExchange
from hetconv.protocol import PeerPiece, SampleStepChain, SampleUpdateRound
from hetconv.protocol.samples import NO_LAYER
from tests.support.queue_port import QueuePort
from tests.unit.test_sample_chain import _in_threads

SPEC = "c4k3p1,pool,c6k3p1,pool,fc12,drop0.5"
LR = (0.05, 0.04)  # the two steps' learning rates
OPT = OptimizerConfig(momentum=0.9, weight_decay=5e-4)


def _model() -> tuple[Any, dict[str, np.ndarray], Any]:
    model = model_config(parse_network(SPEC), (2, 12, 12), classes=5)
    return model, init_parameters(model, 3), layer_settings(model, OPT.momentum,
                                                             OPT.weight_decay)


def _local_steps(tmp_path: Path, x: np.ndarray, labels: np.ndarray) -> tuple[list[float], Trainer]:
    model, params, settings = _model()
    writer = MetricsWriter(tmp_path / "local.jsonl")
    trainer = Trainer(model, params, LocalConvStage(model, params, settings),
                      LoopConfig(epochs=1, batch=x.shape[0], seed=7, optimizer=OPT,
                                 progress=False), writer, tmp_path, out=lambda line: None)
    losses = [trainer.train_step(x, labels, step, LR[step])["loss"] for step in (0, 1)]
    writer.close()
    return losses, trainer


def _runners(model: Any, params: dict[str, np.ndarray], settings: Any, members: list[str],
             everyone: list[str]) -> tuple[dict[str, SampleRunner], dict[str, Any]]:
    shapes = conv_layer_shapes(model)
    names = dense_parameter_names(model)
    size = sum(int(params[n].size) for n in names)
    plan = reduce_plan([s.kernels for s in shapes] + [size], members, everyone,
                       [s.weight_values for s in shapes])
    queues: dict[str, queue.Queue[PeerPiece]] = {n: queue.Queue() for n in everyone}
    runners, shards = {}, {}
    for name in everyone:
        runner = SampleRunner()
        runner.layers.exchange = GradientExchange(name, plan, QueuePort(queues, name), 5.0)
        part = DensePart(model.dense, {n: params[n].copy() for n in names},
                         {n: np.zeros_like(params[n]) for n in names}, seed=7)
        # each worker's replica as AssignDense carries it (the codec's check included)
        message = DenseReplica(part, len(shapes), OPT.momentum, OPT.weight_decay).message(1)
        assert dense_refusal(message) is None
        runner.layers.dense = replica_from(message)
        runners[name] = runner
        shards[name] = {s.index: ConvShard(s.index, 0, s.kernels, settings,
                                           {k: params[layer_key(s.index, k)].copy()
                                            for k in ("weight", "gamma", "beta",
                                                      "running_mean", "running_var")})
                        for s in shapes}
    return runners, shards


def _step(step: int, sync_id: int, members: list[str], cuts: list[int], x: Any, labels: Any,
          layers: int, positions: list[int], update_id: int) -> SampleStepChain:
    return SampleStepChain(
        request_id=sync_id, step=step, attempt=0, total_batch=sum(cuts), stop_layer=layers,
        learning_rate=LR[0] if update_id else 0.0, x=x, labels=labels,
        update_layer=0 if update_id else NO_LAYER, dweight=None, update_sums=None,
        update_id=update_id, contributors=list(members) if update_id else [],
        update_stop=layers + 1 if update_id else NO_LAYER, sync_id=sync_id,
        members=members, member_samples=cuts, positions=positions, slice_statistics=False)


@pytest.mark.parametrize("bulk_bytes", [None, 0, -1, -2],
                         ids=["default", "every piece queued", "no bucket", "late peers"])
@pytest.mark.parametrize("cuts", [[5, 7], [3, 4, 5]], ids=["2 members", "3 members"])
def test_step_chains_equal_the_local_trainer(cuts: list[int], tmp_path: Path,
                                             bulk_bytes: int | None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``bulk_bytes`` 0: every reduction piece waits for its sender's next barrier
    message or wait (hetconv/participant/samples/weight_reduce.py), as the large ones do: same results, no
    deadlock. By default both conv layers are in the plan's bucket; "no bucket" reduces
    each on its own. "Late peers": every barrier's pieces look out when first asked,
    so each applies every later update whose pieces are in (the dense part's too)
    before it waits; the values must not change."""
    import hetconv.participant.samples.reduction_plan
    import hetconv.participant.samples.weight_reduce
    inside: list[int] = []  # updates applied inside a barrier, by layer
    if bulk_bytes == -1:  # every layer's reduction on its own (two hops or direct)
        monkeypatch.setattr(hetconv.participant.samples.reduction_plan, "BUCKET_BYTES", 0)
    elif bulk_bytes == -2:
        arrived = GradientExchange.arrived
        ready = GradientExchange.ready_to_gather

        def late(self: GradientExchange, *args: Any) -> bool:
            arrived(self, *args)  # what the port holds is kept, as for real
            return False

        def counted(self: GradientExchange, reduce_id: int, layer: int) -> bool:
            answer = ready(self, reduce_id, layer)
            if answer:
                inside.append(layer)
            return answer
        monkeypatch.setattr(GradientExchange, "arrived", late)
        monkeypatch.setattr(GradientExchange, "ready_to_gather", counted)
    elif bulk_bytes is not None:
        monkeypatch.setattr(hetconv.participant.samples.weight_reduce, "BULK_BYTES", bulk_bytes)
    model, params, settings = _model()
    shapes = conv_layer_shapes(model)
    layers = len(shapes)
    positions = [s.conv_height * s.conv_width for s in shapes]
    rng = np.random.default_rng(11)
    batch = sum(cuts)
    x = rng.standard_normal((batch,) + model.input_shape).astype(np.float32)
    labels = rng.integers(0, 5, batch).astype(np.int64)
    local_losses, trainer = _local_steps(tmp_path, x, labels)

    members = [f"p{i}" for i in range(len(cuts))]
    everyone = members + ["idle"]
    runners, shards = _runners(model, params, settings, members, everyone)
    starts = np.cumsum([0] + cuts)

    def part(name: str, array: np.ndarray) -> np.ndarray | None:
        if name not in members:
            return None
        index = members.index(name)
        return np.ascontiguousarray(array[starts[index]:starts[index + 1]])

    def labels_of(name: str) -> np.ndarray | None:
        mine = part(name, labels)
        return None if mine is None else mine.astype(np.int32)

    losses = []
    for step, sync_id, update_id in ((0, 10, 0), (1, 20, 10)):
        requests = {n: _step(step, sync_id, members, cuts, part(n, x), labels_of(n), layers,
                             positions, update_id) for n in everyone}
        replies = _in_threads({n: (lambda n=n, r=requests[n]: runners[n].serve(r, shards[n]))
                               for n in everyone})
        for name, reply in replies.items():
            assert not isinstance(reply, BaseException), (name, reply)
        losses.append(sum(replies[m].loss_sum for m in members) / batch)
        correct = sum(replies[m].correct for m in members)
        assert 0 <= correct <= batch
        for member in members:  # the report's per-layer figures: [forward_s, backward_s,
            seconds = replies[member].layer_seconds  # forward_wait_s, backward_wait_s]
            assert len(seconds) == layers and all(f > 0 and b > 0 and fw >= 0 and bw >= 0
                                                  for f, b, fw, bw in seconds)
            assert sum(f + b for f, b, _, _ in seconds) <= replies[member].compute_s
            assert sum(fw + bw for _, _, fw, bw in seconds) \
                <= replies[member].peer_wait_s + 1e-9
    # the second step's update: an update-only round (as before a snapshot)
    flush = _in_threads({n: (lambda n=n: runners[n].serve(SampleUpdateRound(
        request_id=30, step=1, attempt=0, learning_rate=LR[1], update_layer=0, dweight=None,
        update_sums=None, update_id=20, contributors=list(members), update_stop=layers + 1),
        shards[n])) for n in everyone})
    for name, reply in flush.items():
        assert not isinstance(reply, BaseException), (name, reply)

    np.testing.assert_allclose(losses, local_losses, rtol=1e-5)
    if bulk_bytes == -2:  # the second step's chains applied later updates in a barrier
        assert layers in inside and set(inside) <= set(range(1, layers + 1)), inside
    local_conv = trainer.stage.snapshot()
    first = everyone[0]
    for name in everyone:  # every replica the same bits, the idle one included
        dense = runners[name].layers.dense
        assert dense is not None
        for key in dense.part.arrays:
            np.testing.assert_array_equal(dense.part.arrays[key],
                                          runners[first].layers.dense.part.arrays[key])  # type: ignore[union-attr]
            np.testing.assert_array_equal(dense.part.velocity[key],
                                          runners[first].layers.dense.part.velocity[key])  # type: ignore[union-attr]
            np.testing.assert_allclose(dense.part.arrays[key], trainer.dense[key],
                                       rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(dense.part.velocity[key], trainer.velocity[key],
                                       rtol=1e-4, atol=1e-7)
        for layer, shard in shards[name].items():
            for key, value in shard.snapshot().items():
                np.testing.assert_array_equal(value, shards[first][layer].snapshot()[key])
                np.testing.assert_allclose(value, local_conv[layer_key(layer, key)],
                                           rtol=1e-4, atol=1e-6)


def test_dropout_rows_are_the_whole_batch_mask_rows() -> None:
    model, params, _ = _model()
    names = dense_parameter_names(model)
    part = DensePart(model.dense, {n: params[n] for n in names},
                     {n: np.zeros_like(params[n]) for n in names}, seed=7)
    features = int(params[names[0]].shape[1])
    flat = np.random.default_rng(1).standard_normal((10, features)).astype(np.float32)
    whole, _ = part.forward(flat, True, 4)
    rows, _ = part.forward(flat[3:8], True, 4, Rows(3, 8, 10))
    # The mask is the whole batch's, bit for bit: the same entries are dropped (zero).
    # The kept values are the same products over fewer rows, which BLAS may block
    # differently (1 ulp seen on an AMD EPYC): equal within float32 rounding.
    np.testing.assert_array_equal(rows == 0, whole[3:8] == 0)
    np.testing.assert_allclose(rows, whole[3:8], rtol=1e-5, atol=0)


def _message() -> Any:
    model, params, _ = _model()
    names = dense_parameter_names(model)
    part = DensePart(model.dense, {n: params[n] for n in names},
                     {n: np.zeros_like(params[n]) for n in names}, seed=7)
    return DenseReplica(part, 2, 0.9, 5e-4).message(1)


@pytest.mark.parametrize("change, words", [
    ({"names": ["fc.weight", "fc.bias"]}, "names must be"),
    ({"layers": [["fc", 0, 0.0], ["dropout", 0, 0.5]]}, "units >= 1"),
    ({"layers": [["conv", 12, 0.0], ["dropout", 0, 0.5]]}, "kind fc, dropout or gap"),
    ({"shapes": [[12, 99], [12], [5, 12], [5]]}, None),  # values no longer fit
    ({"shapes": [[12, 96], [12], [5, 13], [5]]}, "chain from the layer before"),
    ({"momentum": 2.0}, "momentum"),
    ({"layer": -1}, "layer must be"),
    ({"values": np.zeros(3, np.float32)}, "values must be float32"),
    ({"velocity": np.full(1233, np.nan, np.float32)}, None),
])
def test_a_bad_assign_dense_is_refused_in_one_line(change: dict[str, Any],
                                                   words: str | None) -> None:
    from dataclasses import replace

    message = _message()
    bad = replace(message, **change)
    reason = dense_refusal(bad)
    assert reason is not None and "\n" not in reason
    if words is not None:
        assert words in reason, reason


def test_a_step_chain_without_the_dense_part_or_with_bad_labels_is_a_bad_request() -> None:
    model, params, settings = _model()
    shapes = conv_layer_shapes(model)
    positions = [s.conv_height * s.conv_width for s in shapes]
    runners, shards = _runners(model, params, settings, ["p0"], ["p0"])
    x = np.zeros((3,) + model.input_shape, np.float32)
    out_of_range = np.array([0, 1, 5], np.int32)  # 5 classes: ids 0..4
    with pytest.raises(SampleRequestError, match="labels"):
        runners["p0"].serve(_step(0, 10, ["p0"], [3], x, out_of_range, len(shapes),
                                  positions, 0), shards["p0"])
    runners["p0"].layers.dense = None
    with pytest.raises(SampleRequestError, match="AssignDense"):
        runners["p0"].serve(_step(0, 20, ["p0"], [3], x, np.zeros(3, np.int32),
                                  len(shapes), positions, 0), shards["p0"])


def test_the_result_audit_asks_the_dense_part_and_catches_a_diverged_replica() -> None:
    """The snapshot audit's request at layer L: a worker answers its dense part's
    evaluation-mode logits of the seeded features; the master compares them with its
    own dense part's (master/audit.py): equal replicas pass, a diverged one does not."""
    from hetconv.master.audit import audit_mismatch, dense_audit_input
    from hetconv.protocol import ErrorReply, ForwardReply, ForwardRequest
    from hetconv.worker.service import WorkerService

    model, params, _ = _model()
    names = dense_parameter_names(model)
    layers = len(conv_layer_shapes(model))
    master = DenseReplica(DensePart(model.dense, {n: params[n].copy() for n in names},
                                    {n: np.zeros_like(params[n]) for n in names}, seed=7),
                          layers, OPT.momentum, OPT.weight_decay)
    service = WorkerService("cpu")
    assert not isinstance(service.handle(master.message(1)), ErrorReply)
    x = dense_audit_input(conv_layer_shapes(model)[-1], 40, layers)
    request = ForwardRequest(request_id=2, step=40, layer=layers, attempt=0, train=False, x=x)
    reply = service.handle(request)
    assert isinstance(reply, ForwardReply), reply
    assert audit_mismatch(np.asarray(reply.y), master.evaluate(x)) is None
    assert service.sample.layers.dense is not None
    service.sample.layers.dense.part.arrays["fc.weight"] *= 1.5  # its replica diverged
    reply = service.handle(request)
    assert isinstance(reply, ForwardReply)
    assert audit_mismatch(np.asarray(reply.y), master.evaluate(x)) is not None
    wrong = ForwardRequest(request_id=3, step=40, layer=layers, attempt=0, train=False,
                           x=np.zeros((4, 3, 2, 2), np.float32))
    refused = service.handle(wrong)
    assert isinstance(refused, ErrorReply) and "features" in refused.message
