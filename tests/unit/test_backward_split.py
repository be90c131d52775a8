"""The backward pass in two parts (``conv2d_backward_split``, used by the sample split's
backward chain to compute a layer's weight gradient while the next layer's batch-norm
barrier is in flight) against the one-part backward it replaces (the slow reference):
the same dx and the same weight gradient, in every layout a chunk source allows."""
from __future__ import annotations

import functools

import numpy as np
import pytest

import hetconv.participant.samples.replica as sample_replica
from hetconv.bench.backward_split import replica_of
from hetconv.model import ModelConfig
from hetconv.ops import conv_winograd
from hetconv.ops.conv import BATCH_INNER, SHIFTED_TAPS, WINOGRAD, conv2d_forward_cached
from hetconv.participant.samples.replica import SampleReplica, moments_to_statistics


def _replica(layer: int, model: ModelConfig) -> SampleReplica:
    return replica_of(model, layer)


def _through_the_barrier(replica: SampleReplica, x: np.ndarray, dy: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Forward and the backward's sums of one slice that is the whole batch: (dgamma,
    dbeta), the replica ready to finish its backward."""
    moments = replica.start_forward(x, x.shape[0])
    assert moments is not None
    mean, var = moments_to_statistics([moments])
    replica.finish_forward(mean, var)
    return replica.start_backward(dy)


@pytest.mark.parametrize("layout", [BATCH_INNER, SHIFTED_TAPS, WINOGRAD, "ragged"])
@pytest.mark.parametrize("channels", [(16, 24), (16, 16)])
def test_two_parts_give_the_one_part_gradients(monkeypatch, layout, channels):
    ragged = layout == "ragged"
    if ragged:  # F(4x4, 3x3) over the 6x6 map: 8x8 computed, the rest cut off
        monkeypatch.setattr(conv_winograd, "RAGGED_MIN_CHANNELS", 16)
        monkeypatch.setattr(conv_winograd, "RAGGED_MAX_WASTE", 2.0)
        layout = WINOGRAD
    model = ModelConfig(channels, (3, 12, 12), kernel_size=3, padding=1)
    forced = functools.partial(conv2d_forward_cached, layout=layout)
    monkeypatch.setattr(sample_replica, "conv2d_forward_cached", forced)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((10, channels[0], 6, 6)).astype(np.float32)
    one, two = _replica(1, model), _replica(1, model)
    outputs = None
    for _ in range(2):  # the second pass reuses the workspaces of the first
        dy_shape = (10, channels[1], 3, 3)
        dy = rng.standard_normal(dy_shape).astype(np.float32)
        sums_one = _through_the_barrier(one, x, dy)
        sums_two = _through_the_barrier(two, x, dy)
        assert two._conv_cache is not None and two._conv_cache.layout == layout
        assert conv_winograd.ragged(two._conv_cache.geometry) == ragged
        for a, b in zip(sums_one, sums_two):
            np.testing.assert_array_equal(a, b)
        dx_one, dw_one = one.finish_backward(*sums_one, need_dx=True)
        dx_two, later = two.finish_backward_split(*sums_two)
        dw_two = later()
        assert dx_one is not None and dx_two.dtype == np.float32 == dw_two.dtype
        np.testing.assert_array_equal(dx_two, dx_one)
        assert dw_two.shape == dw_one.shape == (channels[1], channels[0], 3, 3)
        if layout == SHIFTED_TAPS:  # stride 1 without dx: the views' GEMMs, another order
            np.testing.assert_allclose(dw_two, dw_one, rtol=1e-5,
                                       atol=1e-6 * float(np.abs(dw_one).max()))
        else:
            np.testing.assert_array_equal(dw_two, dw_one)
        with pytest.raises(RuntimeError, match="computed already"):
            later()
        one.apply_update(dw_one, 0.05)
        two.apply_update(dw_one, 0.05)  # the same weights again for the next pass
        outputs = (dx_one, dw_one)
    assert outputs is not None and np.abs(outputs[1]).max() > 0


@pytest.mark.parametrize("layout", [BATCH_INNER, SHIFTED_TAPS, WINOGRAD, "ragged"])
def test_two_parts_over_several_chunks_keep_each_chunks_gradient(monkeypatch, layout):
    """Under Winograd the first part keeps each chunk's transformed dy for the second:
    with the batch cut into several chunks, no chunk's may overwrite another's."""
    import hetconv.ops.conv as conv

    ragged = layout == "ragged"
    if ragged:
        monkeypatch.setattr(conv_winograd, "RAGGED_MIN_CHANNELS", 8)
        monkeypatch.setattr(conv_winograd, "RAGGED_MAX_WASTE", 2.0)
        layout = WINOGRAD

    monkeypatch.setattr(conv, "CHUNK_WORKING_BYTES", 1)  # the smallest chunks allowed
    monkeypatch.setattr(conv, "SINK_WORKING_BYTES", 1)
    forced = functools.partial(conv2d_forward_cached, layout=layout)
    monkeypatch.setattr(sample_replica, "conv2d_forward_cached", forced)
    model = ModelConfig((8, 12), (3, 12, 12), kernel_size=3, padding=1)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((40, 8, 6, 6)).astype(np.float32)
    dy = rng.standard_normal((40, 12, 3, 3)).astype(np.float32)
    one, two = _replica(1, model), _replica(1, model)
    sums = _through_the_barrier(one, x, dy)
    _through_the_barrier(two, x, dy)
    assert two._conv_cache is not None and len(two._conv_cache.chunks) > 2
    assert conv_winograd.ragged(two._conv_cache.geometry) == (layout == WINOGRAD and ragged)
    dx_one, dw_one = one.finish_backward(*sums, need_dx=True)
    dx_two, later = two.finish_backward_split(*sums)
    np.testing.assert_array_equal(dx_two, dx_one)
    np.testing.assert_allclose(later(), dw_one, rtol=1e-5,
                               atol=1e-6 * float(np.abs(dw_one).max()))


def test_the_split_benchmark_times_both_backwards(capsys):
    """``hetconv bench backward-split`` (docs/figures/backward-split.md)."""
    from hetconv.bench.backward_split import run_backward_split_bench

    table = run_backward_split_bench(4, 1)
    assert "one-part backward" in capsys.readouterr().out
    assert table[0].startswith("| layer |") and len(table) == 3
