"""The GPU path on the strict stand-in for cupy (tests/support/strict_gpu.py), in process.

The stand-in's arrays refuse implicit host/device conversions and work on the wrong
device, and count explicit copies, so a passing test here proves the ops, the shards,
the local stage, calibration and the worker service keep host and device apart.
"""
from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from hetconv import backend
from hetconv.engine.shard import ConvShard, LayerSettings
from hetconv.engine.stage import LocalConvStage
from hetconv.model import ModelConfig, init_parameters
from hetconv.ops import conv as fast
from hetconv.ops.conv import conv2d_backward_cached, conv2d_forward_cached
from hetconv.ops.conv_layer import conv_layer_backward, conv_layer_forward
from hetconv.ops.conv_reference import conv2d_reference
from hetconv.participant.calibration import time_block
from hetconv.protocol import (
    Ack,
    AssignShard,
    BackwardReply,
    BackwardRequest,
    CalibrateReply,
    CalibrateRequest,
    ForwardReply,
    ForwardRequest,
    SnapshotReply,
    SnapshotRequest,
)
from hetconv.worker.service import WorkerService
from tests.support import strict_gpu
from tests.support.strict_gpu import StrictDeviceError

STATE = ("weight", "gamma", "beta", "running_mean", "running_var")


@pytest.fixture
def strict(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """The backend with the strict stand-in as its GPU module, counters at zero."""
    monkeypatch.setattr(backend, "_cupy", strict_gpu)
    strict_gpu.reset()
    yield strict_gpu
    strict_gpu.reset()


def copies(direction: str) -> dict[str, int]:
    return dict(strict_gpu.counters()["copies"][direction])


def no_violations() -> None:
    assert strict_gpu.counters()["violations"] == []


# ---------------------------------------------------------------- the stand-in itself
def test_implicit_conversions_are_refused_and_recorded(strict: Any) -> None:
    a = strict.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    host = np.ones((2, 3), np.float32)
    refusals = [
        lambda: np.asarray(a), lambda: np.array(a, dtype=np.float32),
        lambda: np.concatenate([a, a]), lambda: np.ascontiguousarray(a),
        lambda: a + host, lambda: host + a, lambda: host * a, lambda: a @ host.T,
        lambda: float(a.sum()), lambda: bool(a.max() > 0), lambda: a[np.array([0, 1])],
        lambda: a.__setitem__(0, host[0]), lambda: strict.where(a > 0, a, host),
        lambda: strict.zeros_like(host), lambda: strict.ascontiguousarray(host),
    ]
    for refusal in refusals:
        with pytest.raises(StrictDeviceError):
            refusal()
    assert len(strict.counters()["violations"]) == len(refusals)


def test_copies_are_counted_per_direction_and_device(strict: Any) -> None:
    host = np.ones((4, 5), np.float32)
    a = strict.asarray(host)
    assert strict.asarray(a) is a  # already on the device: no copy
    with strict.cuda.Device(1):
        b = strict.asarray(host)
        assert b.device.id == 1
    np.testing.assert_array_equal(strict.asnumpy(a), host)
    np.testing.assert_array_equal(b.get(), host)
    assert copies("host_to_device") == {"gpu:0": 1, "gpu:1": 1}
    assert copies("device_to_host") == {"gpu:0": 1, "gpu:1": 1}
    assert strict.counters()["bytes"]["host_to_device"]["gpu:1"] == host.nbytes
    host[0, 0] = 7  # device memory never aliases host memory
    assert strict.asnumpy(a)[0, 0] == 1


def test_arrays_refuse_work_while_another_device_is_current(strict: Any) -> None:
    with strict.cuda.Device(1):
        a = strict.asarray(np.ones(3, np.float32))
        _ = a + 1  # fine on its own device
    with pytest.raises(StrictDeviceError, match="gpu:1 used while gpu:0"):
        _ = a + 1
    seen: list[BaseException] = []

    def other_thread() -> None:  # the current device belongs to the thread, as in CUDA
        with strict.cuda.Device(1):
            pass
        try:
            _ = a * 2
        except StrictDeviceError as error:
            seen.append(error)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert len(seen) == 1
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        strict.cuda.Device(strict.device_count())


# ---------------------------------------------------------------- ops on the stand-in
@pytest.mark.parametrize("layout", fast.LAYOUTS)
@pytest.mark.parametrize("shape", [(2, 3, 7, 9, 4, 3, 3, 1, 1), (3, 2, 8, 6, 5, 5, 5, 1, 2),
                                   (2, 4, 9, 7, 3, 2, 3, 2, 0), (1, 3, 6, 6, 0, 3, 3, 1, 0)])
def test_conv_on_the_stand_in_is_numpy_bit_for_bit(strict: Any, shape: tuple[int, ...],
                                                   layout: str) -> None:
    batch, channels, height, width, kernels, kh, kw, stride, padding = shape
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, channels, height, width), dtype=np.float32)
    w = rng.standard_normal((kernels, channels, kh, kw), dtype=np.float32)
    b = rng.standard_normal(kernels, dtype=np.float32)
    y, cache = conv2d_forward_cached(x, w, b, stride, padding, layout=layout)
    dy = rng.standard_normal(y.shape, dtype=np.float32)
    grads = conv2d_backward_cached(cache, dy)
    gx, gw, gb, gdy = (strict.asarray(a) for a in (x, w, b, dy))
    y_dev, cache_dev = conv2d_forward_cached(gx, gw, gb, stride, padding, layout=layout)
    assert isinstance(y_dev, strict.ndarray)
    np.testing.assert_array_equal(strict.asnumpy(y_dev), y)
    for got, want in zip(conv2d_backward_cached(cache_dev, gdy), grads, strict=True):
        np.testing.assert_array_equal(strict.asnumpy(got), want)
    y_ref = conv2d_reference(gx, gw, gb, stride, padding)
    np.testing.assert_allclose(strict.asnumpy(y_ref), y, rtol=1e-4, atol=1e-4)
    no_violations()


def test_conv_block_on_the_stand_in_is_numpy_bit_for_bit(strict: Any) -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 3, 12, 12), dtype=np.float32)
    params = [rng.standard_normal((5, 3, 3, 3), dtype=np.float32), np.ones(5, np.float32),
              np.zeros(5, np.float32), np.zeros(5, np.float32), np.ones(5, np.float32)]
    for train in (True, False):
        y, cache, mean, var = conv_layer_forward(x, *params, train, padding=1)
        dy = rng.standard_normal(y.shape, dtype=np.float32)
        device = [strict.asarray(a) for a in (x, *params)]
        y_dev, cache_dev, mean_dev, var_dev = conv_layer_forward(*device, train, padding=1)
        for got, want in ((y_dev, y), (mean_dev, mean), (var_dev, var)):
            np.testing.assert_array_equal(strict.asnumpy(got), want)
        for got, want in zip(conv_layer_backward(cache_dev, strict.asarray(dy), True),
                             conv_layer_backward(cache, dy, True), strict=True):
            np.testing.assert_array_equal(strict.asnumpy(got), want)
    no_violations()


# ---------------------------------------------------------------- shards, stage, service
def conv0_state(start: int = 0, stop: int = 6) -> dict[str, np.ndarray]:
    params = init_parameters(ModelConfig((6, 4), (3, 16, 16)), 0)
    return {name: np.ascontiguousarray(params[f"conv0.{name}"][start:stop]) for name in STATE}


def test_shard_on_gpu1_computes_there_from_any_thread(strict: Any) -> None:
    rng = np.random.default_rng(3)
    cpu = ConvShard(0, 0, 6, LayerSettings(), conv0_state())
    gpu = ConvShard(0, 0, 6, LayerSettings(), conv0_state(), device="gpu:1")
    assert gpu.device == "gpu:1" and gpu.xp is strict
    assert copies("host_to_device") == {"gpu:1": len(STATE)}  # the parameters, once
    x = rng.standard_normal((3, 3, 16, 16), dtype=np.float32)
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(gpu.forward_host(x, True)))
    thread.start()  # a fresh thread starts on gpu:0, like the master's helper thread
    thread.join()
    np.testing.assert_array_equal(results[0], cpu.forward_host(x, True))
    dy = rng.standard_normal(results[0].shape, dtype=np.float32)
    np.testing.assert_array_equal(gpu.backward_host(dy, True, 0.1),
                                  cpu.backward_host(dy, True, 0.1))
    for name, value in gpu.snapshot().items():
        np.testing.assert_array_equal(value, cpu.snapshot()[name], err_msg=name)
    counted = strict.counters()
    assert counted["devices_used"] == ["gpu:1"]
    assert counted["copies"]["host_to_device"] == {"gpu:1": len(STATE) + 2}  # + x, dy
    assert counted["copies"]["device_to_host"] == {"gpu:1": 2 + 8}  # y, dx, 8 state arrays
    no_violations()


def test_shard_refuses_input_from_another_device(strict: Any) -> None:
    gpu = ConvShard(0, 0, 6, LayerSettings(), conv0_state(), device="gpu:1")
    x0 = strict.asarray(np.zeros((2, 3, 16, 16), np.float32))  # made on gpu:0
    with pytest.raises(StrictDeviceError):
        gpu.forward(x0, True)


def test_local_stage_on_gpu1_matches_cpu_and_copies_once_each_way(strict: Any) -> None:
    model = ModelConfig((6, 4), (3, 16, 16))
    params = init_parameters(model, 0)
    stages = [LocalConvStage(model, params, LayerSettings(), device=d) for d in ("cpu", "gpu:1")]
    strict.reset()
    x = np.random.default_rng(4).standard_normal((2, 3, 16, 16), dtype=np.float32)
    y_cpu, y_gpu = (stage.forward(0, x, True, 0) for stage in stages)
    np.testing.assert_array_equal(y_gpu, y_cpu)
    dy = np.ones_like(y_cpu)
    dx_cpu, dx_gpu = (stage.backward(0, dy, True, 0.1, 0) for stage in stages)
    np.testing.assert_array_equal(dx_gpu, dx_cpu)
    assert copies("host_to_device") == {"gpu:1": 2}
    assert copies("device_to_host") == {"gpu:1": 2}
    assert strict.counters()["devices_used"] == ["gpu:1"]
    no_violations()


def test_calibration_on_gpu1_times_the_copies_of_a_step(strict: Any) -> None:
    seconds = time_block(2, 3, 10, 10, 4, 3, padding=1, repeats=2, device="gpu:1",
                         min_total_s=0.0)
    assert seconds > 0
    runs = 3  # a warm-up and two timed runs
    assert copies("host_to_device") == {"gpu:1": len(STATE) + 2 * runs}  # + x and dy each run
    assert copies("device_to_host") == {"gpu:1": 2 * runs}  # y and dx each run
    assert strict.counters()["devices_used"] == ["gpu:1"]
    no_violations()


def test_worker_service_on_gpu1_matches_cpu(strict: Any) -> None:
    state = conv0_state(2, 5)
    message = AssignShard(request_id=1, layer=0, kernel_start=2, kernel_stop=5, stride=1,
                          padding=0, need_dx=True, bn_momentum=0.1, bn_eps=1e-5, momentum=0.9,
                          weight_decay=5e-4, velocity_weight=np.zeros_like(state["weight"]),
                          velocity_gamma=np.zeros_like(state["gamma"]),
                          velocity_beta=np.zeros_like(state["beta"]), **state)
    services = [WorkerService("cpu"), WorkerService("gpu:1")]
    x = np.random.default_rng(5).standard_normal((2, 3, 16, 16)).astype(np.float16)
    replies: list[list[Any]] = []
    for service in services:
        assert isinstance(service.handle(message), Ack)
        forward = service.handle(ForwardRequest(request_id=2, step=0, layer=0, attempt=0,
                                                train=True, x=x))
        assert isinstance(forward, ForwardReply) and forward.y.dtype == np.float16
        backward = service.handle(BackwardRequest(request_id=3, step=0, layer=0, attempt=0,
                                                  learning_rate=0.1, dy=np.ones_like(forward.y)))
        assert isinstance(backward, BackwardReply) and backward.dx is not None
        snapshot = service.handle(SnapshotRequest(request_id=4, layer=0))
        assert isinstance(snapshot, SnapshotReply)
        calibrate = service.handle(CalibrateRequest(
            request_id=5, layer=0, batch=2, in_channels=3, height=8, width=8, kernels=2,
            kernel_size=3, stride=1, padding=0, repeats=1))
        assert isinstance(calibrate, CalibrateReply), calibrate
        replies.append([forward.y, backward.dx, snapshot.weight, snapshot.velocity_weight])
    for got, want in zip(replies[1], replies[0], strict=True):
        np.testing.assert_array_equal(got, want)
    assert strict.counters()["devices_used"] == ["gpu:1"]
    assert copies("host_to_device")["gpu:1"] >= len(STATE) + 2
    no_violations()


def test_backend_module_helpers(strict: Any) -> None:
    assert backend.array_module_for("gpu:1") is strict
    assert backend.gpu_count() == strict.device_count()
    assert backend.current_device(strict) == "gpu:0"
    with backend.on_device("gpu:1"):
        assert backend.current_device(strict) == "gpu:1"
        a = backend.to_module(np.ones(2, np.float32), strict)
    assert backend.get_array_module(a) is strict
    assert backend.current_device(np) == "cpu"
    assert isinstance(backend.to_numpy(a), np.ndarray)


# ---------------------------------------------------------------- host threads (numpy)
def test_run_parallel_keeps_order_and_restores_blas_threads() -> None:
    before = backend.blas_threads()
    seen_inside: list[int] = []

    def task(index: int) -> int:
        seen_inside.append(backend.blas_threads())
        return index * index

    assert backend.run_parallel(task, 7, 3) == [i * i for i in range(7)]
    assert set(seen_inside) == {1}  # BLAS held to one thread while the pool runs
    assert backend.blas_threads() == before
    assert backend.run_parallel(task, 3, 1) == [0, 1, 4]
    assert 1 <= backend.host_threads(2) <= 2
