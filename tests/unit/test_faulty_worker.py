"""The tests' faulty worker (tests/support/faulty_worker.py) through the worker
service's injection point, without processes; and that a real worker has no faults."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from hetconv.engine.shard import ConvShard
from hetconv.protocol import Ack, ForwardReply, ForwardRequest
from hetconv.worker.service import WorkerService
from tests.support.faulty_worker import FaultyShard, WorkerFaults, fault_parser
from tests.unit.test_worker_service import assign

X = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)


def forward(service: WorkerService, step: int) -> np.ndarray:
    reply = service.handle(ForwardRequest(request_id=2, step=step, layer=0, attempt=0,
                                          train=True, x=X))
    assert isinstance(reply, ForwardReply), reply
    return np.asarray(reply.y)


def test_a_real_worker_has_no_faults_and_plain_shards() -> None:
    service = WorkerService("cpu")
    assert service.faults is None
    assert isinstance(service.handle(assign()), Ack)
    assert type(service.shards[0]) is ConvShard
    assert np.isfinite(forward(service, 99)).all()


def test_no_faults_asked_gives_plain_shards() -> None:
    service = WorkerService("cpu", faults=WorkerFaults())
    service.handle(assign())
    assert type(service.shards[0]) is ConvShard


@pytest.mark.parametrize("mode", ["nan", "scale", "crop"])
def test_corrupt_from_a_step_on(mode: str) -> None:
    clean = WorkerService("cpu")
    clean.handle(assign())
    expected = forward(clean, 0)
    service = WorkerService("cpu", faults=WorkerFaults(corrupt_from_step=3, corrupt_mode=mode))
    service.handle(assign())
    assert isinstance(service.shards[0], FaultyShard)
    np.testing.assert_array_equal(forward(service, 2), expected)
    wrong = forward(service, 3)
    if mode == "nan":
        assert np.isnan(wrong).all()
    elif mode == "scale":
        np.testing.assert_allclose(wrong, expected * 1000, rtol=1e-6)
    else:
        assert wrong.shape == (*expected.shape[:2], expected.shape[2] - 1, expected.shape[3] - 1)


def test_corrupt_while_the_flag_file_exists(tmp_path: Path) -> None:
    flag = tmp_path / "bad"
    service = WorkerService("cpu", faults=WorkerFaults(corrupt_file=str(flag)))
    service.handle(assign())
    assert np.isfinite(forward(service, 50)).all()
    flag.touch()
    assert np.isnan(forward(service, 0)).all()
    flag.unlink()
    assert np.isfinite(forward(service, 51)).all()


def test_delay_per_kernel_in_training_only() -> None:
    service = WorkerService("cpu", faults=WorkerFaults(delay_per_kernel_s=0.02))
    service.handle(assign())  # 3 kernels: 60 ms per training forward
    start = time.perf_counter()
    forward(service, 0)
    assert time.perf_counter() - start >= 0.06


def test_the_flags_carry_every_fault_to_the_worker_process() -> None:
    faults = WorkerFaults(delay_per_kernel_s=0.003, corrupt_from_step=25, corrupt_mode="crop",
                          corrupt_file="/tmp/flag")
    launcher = faults.spec()["launcher"]
    assert launcher[:2] == ("-m", "tests.support.faulty_worker")
    options = fault_parser().parse_args([*launcher[2:], "worker", "--master", "tcp://h:1",
                                         "--name", "w"])
    assert WorkerFaults(options.delay_per_kernel_s, options.corrupt_from_step,
                        options.corrupt_mode, options.corrupt_file) == faults
    assert options.command == ["worker", "--master", "tcp://h:1", "--name", "w"]
