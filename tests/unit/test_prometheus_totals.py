"""hetconv.prometheus without sockets: metrics records folded into totals (the counters a
fault-free run leaves at 0 included), a worker's requests counted, and hetconv status's
table from those totals."""
from __future__ import annotations

import numpy as np
import pytest

from hetconv.commands.status import from_totals, render
from hetconv.prometheus import TrainingTotals, WorkerTotals, array_bytes, training_families
from hetconv.protocol import ErrorReply, ForwardReply, ForwardRequest


def step(number: int, time: float, kernels: dict[str, int]) -> dict[str, object]:
    return {"type": "step", "time": time, "epoch": 0, "step": number, "loss": 1.0 / (number + 1),
            "accuracy": 0.5, "images": 64, "learning_rate": 0.05, "step_s": 0.25,
            "conv_s": 0.2, "dense_s": 0.01, "comm_s": 0.05, "data_s": 0.0,
            "layers": [{"layer": 0, "participants": [
                {"participant": name, "kernels": count, "forward_s": 0.01, "backward_s": 0.02,
                 "wait_s": 0.005, "bytes_sent": 1000, "bytes_received": 500}
                for name, count in kernels.items()]}]}


def test_records_fold_into_totals() -> None:
    totals = TrainingTotals()
    records = [
        {"type": "run_start"},
        {"type": "devices", "devices": [{"id": "a", "device": "cpu", "kind": "cpu",
                                         "name": "EPYC", "hostname": "h1"},
                                        {"id": "b", "device": "gpu:0", "kind": "gpu",
                                         "name": "T4", "hostname": "h2"}]},
        {"type": "calibration", "layer": 0, "participants": [{"participant": "a", "seconds": 0.5},
                                                        {"participant": "b", "seconds": 0.1}]},
        {"type": "checkpoint", "seconds": 0.3},
        step(0, 100.0, {"a": 2, "b": 6}),
        {"type": "recovery", "gone": True},
        {"type": "replan"},
        step(0, 101.0, {"b": 8}),  # the replayed step, after a's eviction
        {"type": "rebalance"},
        {"type": "checkpoint", "seconds": 0.4},
        {"type": "epoch", "epoch": 0, "test_accuracy": 0.9, "test_loss": 0.3,
         "images_per_s": 256.0},
        {"type": "run_end"},
    ]
    for record in records:
        totals.observe(record)
    assert (totals.step_records, totals.images, totals.recoveries, totals.workers_gone,
            totals.replans, totals.rebalances, totals.checkpoints, totals.epochs,
            totals.running) == (2, 128, 1, 1, 1, 1, 2, 1, 0)
    assert totals.checkpoint_seconds_sum == pytest.approx(0.7)
    assert totals.last_checkpoint_s == 0.4
    a, b = totals.participants["a"], totals.participants["b"]
    assert (a.kernels, b.kernels) == (0, 8)  # a held nothing in the latest step
    assert (a.last_seen, b.last_seen) == (100.0, 101.0)
    assert b.bytes_sent == 2000 and b.compute_s == pytest.approx(0.06)
    assert b.info == {"device": "gpu:0", "kind": "gpu", "name": "T4", "hostname": "h2"}
    assert a.calibrated_s == {0: 0.5}
    names = {family.name for family in training_families(totals)}
    assert {"hetconv_recoveries", "hetconv_participant_kernels", "hetconv_test_accuracy",
            "hetconv_last_checkpoint_seconds"} <= names

    table = render(from_totals(totals), now=111.0).splitlines()
    assert table[0] == "run: not running (ended or not started); step 0, epoch 1, loss 1.0000"
    assert table[2].split() == ["a", "cpu", "0.5000", "0", "11.0", "s", "ago", "EPYC,", "h1"]
    assert table[3].split()[:4] == ["b", "gpu:0", "0.1000", "8"]


def test_status_of_a_run_without_participants() -> None:
    text = render(from_totals(TrainingTotals(running=1)), now=0.0)
    assert text.splitlines() == [
        "run: running",
        "no participants yet (the master is waiting for workers or calibrating)"]


def test_worker_counts_requests_arrays_and_errors() -> None:
    totals = WorkerTotals()
    x = np.zeros((2, 3, 8, 8), np.float32)
    request = ForwardRequest(request_id=1, step=0, layer=0, attempt=0, train=True, x=x)
    reply = ForwardReply(request_id=1, step=0, layer=0, attempt=0, compute_s=0.125,
                         y=np.zeros((2, 4, 4, 4), np.float32))
    assert array_bytes(request) == x.nbytes
    totals.observe(request, reply, 0.2)
    totals.observe(request, ErrorReply(request_id=1, code="bad_request", message="no"), 0.1)
    assert totals.requests == {"forward_request": 2}
    assert (totals.errors, totals.compute_s, totals.bytes_received, totals.bytes_sent) == \
        (1, 0.125, 2 * x.nbytes, 2 * 4 * 4 * 4 * 4)
    assert totals.handle_s == pytest.approx(0.3)
