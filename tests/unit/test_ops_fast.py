"""The fused conv layer (``hetconv.ops.block_fast`` inside the conv's chunks) against
the separate ops (``fast=False``), the slow references and PyTorch; its determinism;
the workspaces and the per-op timers it relies on."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import hetconv.ops.conv as conv
from hetconv.ops import block_fast, conv_winograd, timers
from hetconv.ops.conv_layer import conv_layer_backward, conv_layer_forward
from hetconv.ops.conv_reference import conv2d_backward_reference, conv2d_reference
from hetconv.ops.workspace import Workspace, thread_scratch

POOLS = ("max", "avg", "none")
KINDS = [(pool, bn) for pool in POOLS for bn in (True, False)]
IDS = [f"{pool}-{'bn' if bn else 'nobn'}" for pool, bn in KINDS]


def layer(rng: np.random.Generator, batch: int = 6, channels: int = 3, size: int = 8,
          kernels: int = 5, kernel: int = 3, dtype: Any = np.float64
          ) -> tuple[np.ndarray, ...]:
    x = rng.standard_normal((batch, channels, size, size)).astype(dtype)
    weight = (rng.standard_normal((kernels, channels, kernel, kernel)) * 0.4).astype(dtype)
    gamma = rng.uniform(0.5, 1.5, kernels).astype(dtype)
    beta = (rng.standard_normal(kernels) * 0.3).astype(dtype)
    running_mean = (rng.standard_normal(kernels) * 0.1).astype(dtype)
    running_var = rng.uniform(0.5, 2.0, kernels).astype(dtype)
    return x, weight, gamma, beta, running_mean, running_var


def both(arrays: tuple[np.ndarray, ...], train: bool, pool: str, bn: bool, dy_seed: int = 5,
         padding: int = 1, need_dx: bool = True, **fast_options: Any
         ) -> tuple[list[Any], list[Any]]:
    """(fused results, separate-ops results): y, running mean, running var, dx, dw,
    dgamma, dbeta for the same inputs and dy."""
    results = []
    for fast in (True, False):
        options = fast_options if fast else {}
        y, cache, mean, var = conv_layer_forward(*arrays, train, padding=padding, pool=pool,
                                                 batch_norm=bn, fast=fast, **options)
        dy = np.random.default_rng(dy_seed).standard_normal(y.shape).astype(y.dtype)
        grads = conv_layer_backward(cache, dy, need_dx)
        results.append([y, mean, var, *grads])
    return results[0], results[1]


def assert_close(got: list[Any], want: list[Any], rtol: float, atol: float) -> None:
    names = ("y", "running_mean", "running_var", "dx", "dweight", "dgamma", "dbeta")
    for name, a, b in zip(names, got, want, strict=True):
        if b is None:
            assert a is None, name
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, name
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=name)


@pytest.fixture
def many_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 2 samples on the thread pool, so that the chunk hooks really combine."""
    monkeypatch.setattr(conv, "MIN_SINK_CHUNK", 2)
    monkeypatch.setattr(conv, "SINK_WORKING_BYTES", 1)
    monkeypatch.setattr(conv, "PARALLEL_MIN_FLOP", 0.0)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("pool,bn", KINDS, ids=IDS)
def test_fused_layer_equals_the_separate_ops(many_chunks: None, pool: str, bn: bool,
                                             train: bool) -> None:
    arrays = layer(np.random.default_rng(1))
    fused, separate = both(arrays, train, pool, bn)
    assert_close(fused, separate, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("pool,bn", KINDS, ids=IDS)
def test_fused_layer_in_float32_keeps_float32(many_chunks: None, pool: str, bn: bool) -> None:
    arrays = layer(np.random.default_rng(2), dtype=np.float32)
    fused, separate = both(arrays, True, pool, bn)
    assert all(a.dtype == np.float32 for a in fused)
    assert_close(fused, separate, rtol=2e-4, atol=2e-5)


def test_fused_layer_matches_the_slow_reference(many_chunks: None) -> None:
    """conv_reference, then batch norm, ReLU and max pool written out one channel and
    one window at a time."""
    x, weight, gamma, beta, mean, var = layer(np.random.default_rng(3), batch=4, size=6)
    y, *_ = conv_layer_forward(x, weight, gamma, beta, mean, var, True, padding=1, fast=True)
    conv_out = conv2d_reference(x, weight, None, padding=1)
    expected = np.empty_like(y)
    for k in range(weight.shape[0]):
        channel = conv_out[:, k]
        normal = gamma[k] * (channel - channel.mean()) / np.sqrt(channel.var() + 1e-5) + beta[k]
        for i in range(3):
            for j in range(3):
                window = normal[:, 2 * i:2 * i + 2, 2 * j:2 * j + 2].reshape(len(x), 4)
                expected[:, k, i, j] = np.maximum(window.max(axis=1), 0.0)
    np.testing.assert_allclose(y, expected, rtol=1e-10, atol=1e-12)


def test_fused_conv_gradients_match_the_reference_without_batch_norm(many_chunks: None
                                                                     ) -> None:
    """With no pool and no batch norm the layer is conv + bias + ReLU: its dx and dw
    are the reference conv's for the ReLU-masked dy."""
    x, weight, _, beta, mean, var = layer(np.random.default_rng(4))
    y, cache, _, _ = conv_layer_forward(x, weight, np.ones(5), beta, mean, var, True,
                                        padding=1, pool="none", batch_norm=False, fast=True)
    dy = np.random.default_rng(6).standard_normal(y.shape)
    dx, dweight, _, dbeta = conv_layer_backward(cache, dy, True)
    masked = np.where(y > 0, dy, 0.0)
    dx_ref, dw_ref, db_ref = conv2d_backward_reference(x, weight, masked, padding=1)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dweight, dw_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dbeta, db_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("gamma_values", [(-1.2, 0.7, -0.3, 0.9, 1.1), (0.0, 1.0, -0.0, 2.0, 0.5)],
                         ids=["negative", "zero"])
def test_max_pool_before_the_normalisation_follows_gamma_s_sign(many_chunks: None,
                                                               gamma_values: tuple[float, ...]
                                                               ) -> None:
    """Negative gamma pools the smallest conv output, zero gamma the first position:
    output and gradients equal pooling the normalised map."""
    x, weight, _, beta, mean, var = layer(np.random.default_rng(7))
    arrays = (x, weight, np.array(gamma_values), beta, mean, var)
    fused, separate = both(arrays, True, "max", True)
    assert_close(fused, separate, rtol=1e-10, atol=1e-12)


def test_shares_of_the_kernels_get_their_slice(many_chunks: None) -> None:
    """The chunks do not depend on the kernel count: a share's channels, statistics and
    gradients are the whole layer's (to float32 rounding: BLAS blocks the products of
    different kernel counts differently)."""
    x, weight, gamma, beta, mean, var = layer(np.random.default_rng(8), kernels=6,
                                              dtype=np.float32)
    y, cache, new_mean, new_var = conv_layer_forward(x, weight, gamma, beta, mean, var, True,
                                                     padding=1, fast=True)
    dy = np.random.default_rng(9).standard_normal(y.shape).astype(np.float32)
    _, _, dgamma, dbeta = conv_layer_backward(cache, dy, True)
    for part in (slice(0, 2), slice(2, 6)):
        ys, cs, ms, vs = conv_layer_forward(x, weight[part], gamma[part], beta[part],
                                            mean[part], var[part], True, padding=1, fast=True)
        close = {"rtol": 1e-5, "atol": 1e-5}
        np.testing.assert_allclose(ys, y[:, part], **close)
        np.testing.assert_allclose(ms, new_mean[part], **close)
        np.testing.assert_allclose(vs, new_var[part], **close)
        _, _, dg, db = conv_layer_backward(cs, np.ascontiguousarray(dy[:, part]), True)
        np.testing.assert_allclose(dg, dgamma[part], **close)
        np.testing.assert_allclose(db, dbeta[part], **close)


def test_results_do_not_depend_on_thread_timing(many_chunks: None) -> None:
    """The same inputs on the thread pool, ten times: the same bits every time."""
    arrays = layer(np.random.default_rng(10), batch=12, dtype=np.float32)
    runs = [both(arrays, True, "max", True)[0] for _ in range(10)]
    for run in runs[1:]:
        for got, want in zip(run, runs[0], strict=True):
            np.testing.assert_array_equal(got, want)


def test_a_kept_workspace_gives_the_results_of_fresh_arrays(many_chunks: None) -> None:
    """Two training steps through one workspace, with an evaluation between them, give
    what fresh arrays give."""
    arrays = layer(np.random.default_rng(11), dtype=np.float32)
    workspace = Workspace()
    for pool in POOLS:
        for step in range(2):
            kept, _ = both(arrays, True, pool, True, dy_seed=step, workspace=workspace)
            conv_layer_forward(*arrays, False, padding=1, pool=pool, fast=True)  # evaluation
            fresh, _ = both(arrays, True, pool, True, dy_seed=step)
            for got, want in zip(kept, fresh, strict=True):
                np.testing.assert_array_equal(got, want)
    assert workspace.nbytes() > 0


def test_odd_maps_before_a_pool_use_the_separate_ops() -> None:
    """A 7x7 conv output before a 2x2 pool drops its last row and column: the separate
    ops handle it, the fused pass is not used."""
    assert not block_fast.supported("max", 7, 8) and block_fast.supported("none", 7, 7)
    x, weight, gamma, beta, mean, var = layer(np.random.default_rng(12), size=7)
    y, cache, _, _ = conv_layer_forward(x, weight, gamma, beta, mean, var, True, padding=1)
    assert cache.fused is None and y.shape == (6, 5, 3, 3)


@pytest.mark.parametrize("pool", POOLS)
def test_fused_layer_matches_torch(many_chunks: None, pool: str) -> None:
    torch = pytest.importorskip("torch")
    x, weight, gamma, beta, _, _ = layer(np.random.default_rng(13), batch=8, size=10,
                                         dtype=np.float32)
    mean, var = np.zeros(5, np.float32), np.ones(5, np.float32)
    y, cache, new_mean, new_var = conv_layer_forward(x, weight, gamma, beta, mean, var, True,
                                                     padding=1, pool=pool, fast=True)
    dy = np.random.default_rng(14).standard_normal(y.shape).astype(np.float32)
    dx, dweight, dgamma, dbeta = conv_layer_backward(cache, dy, True)
    tx, tw = (torch.from_numpy(a.copy()).requires_grad_() for a in (x, weight))
    norm = torch.nn.BatchNorm2d(5).train()
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(gamma))
        norm.bias.copy_(torch.from_numpy(beta))
    out = torch.relu(norm(torch.nn.functional.conv2d(tx, tw, padding=1)))
    if pool == "max":
        out = torch.nn.functional.max_pool2d(out, 2)
    elif pool == "avg":
        out = torch.nn.functional.avg_pool2d(out, 2)
    out.backward(torch.from_numpy(dy))
    pairs = [(y, out), (new_mean, norm.running_mean), (new_var, norm.running_var),
             (dx, tx.grad), (dweight, tw.grad), (dgamma, norm.weight.grad),
             (dbeta, norm.bias.grad)]
    for ours, theirs in pairs:
        want = theirs.detach().numpy()
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4 * scale)


# ---------------------------------------------------------------- workspaces and timers
def test_workspace_reuses_memory_and_keeps_zeros_once() -> None:
    workspace = Workspace()
    a = workspace.get("a", (4, 5), np.float32)
    a[...] = 7
    b = workspace.get("a", (2, 3), np.float64)  # smaller: the same memory, another view
    assert np.shares_memory(a, b) and b.shape == (2, 3) and b.dtype == np.float64
    c = workspace.get("a", (100,), np.float64)  # larger: a new buffer
    assert not np.shares_memory(a, c)
    padded = workspace.kept_zeros("p", (3, 3), np.float32)
    assert not padded.any()
    padded[1, 1] = 5  # an inside that the caller overwrites every time
    again = workspace.kept_zeros("p", (3, 3), np.float32)
    assert again[1, 1] == 5 and again.sum() == 5  # not zeroed again
    assert not workspace.kept_zeros("p", (2, 2), np.float32).any()  # a new shape: zeroed
    assert thread_scratch() is thread_scratch()


def test_timers_add_up_only_inside_collect() -> None:
    with timers.timed("conv forward"):
        pass  # off: nothing recorded anywhere
    with timers.collect() as totals:
        for _ in range(3):
            with timers.timed("conv forward"):
                sum(range(1000))
        with timers.timed("dense"):
            pass
    assert set(totals) == {"conv forward", "dense"} and totals["conv forward"] > 0
    with timers.timed("dense"):
        pass
    assert len(totals) == 2


# ---------------------------------------------------------------- Winograd
WINOGRAD_GRID = [  # (batch, channels, height, width, kernels, kernel, padding)
    (2, 3, 6, 6, 4, 3, 1), (3, 2, 10, 8, 5, 3, 0), (2, 4, 8, 8, 3, 5, 2), (3, 3, 10, 12, 2, 5, 0),
    (1, 1, 6, 6, 1, 3, 0), (2, 3, 8, 12, 4, 3, 1),  # these two: 4x4 tiles
    (2, 64, 14, 14, 3, 3, 1), (1, 64, 14, 10, 2, 3, 1), (2, 64, 12, 12, 2, 3, 0)]  # ragged 4x4


@pytest.mark.parametrize("shape", WINOGRAD_GRID)
def test_winograd_matches_the_reference(shape: tuple[int, ...],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conv, "PARALLEL_MIN_FLOP", 0.0)
    batch, channels, height, width, kernels, size, padding = shape
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal((batch, channels, height, width))
    w = rng.standard_normal((kernels, channels, size, size))
    b = rng.standard_normal(kernels)
    y, cache = conv.conv2d_forward_cached(x, w, b, 1, padding, layout=conv.WINOGRAD)
    dy = rng.standard_normal(y.shape)
    dx, dw, db = conv.conv2d_backward_cached(cache, dy)
    dx_ref, dw_ref, db_ref = conv2d_backward_reference(x, w, dy, 1, padding)
    for got, want in ((y, conv2d_reference(x, w, b, 1, padding)), (dx, dx_ref), (dw, dw_ref),
                      (db, db_ref)):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_ragged_4x4_tiles_where_they_save_work() -> None:
    """F(4x4, 3x3) on maps 4 does not divide only with many channels and little waste;
    the grid above runs three such maps through the forward and backward passes."""
    def geometry(channels: int, size: int, kernel: int = 3, padding: int = 1) -> Any:
        return conv.make_geometry((2, channels, size, size), (4, channels, kernel, kernel), 1,
                                  padding)

    assert (conv_winograd.tile_of(geometry(64, 14)), conv_winograd.ragged(geometry(64, 14))
            ) == (4, True)
    assert conv_winograd.tiles_of(geometry(64, 14)) == (4, 4)
    assert conv_winograd.tiled_extent(geometry(64, 14)) == (18, 18)  # 16 + 2 past 14 + 2
    assert conv_winograd.tile_of(geometry(32, 14)) == 2  # too few channels
    assert conv_winograd.tile_of(geometry(64, 6)) == 2  # 8x8 over 6x6: too much waste
    assert (conv_winograd.tile_of(geometry(16, 16)), conv_winograd.ragged(geometry(16, 16))
            ) == (4, False)
    assert conv_winograd.tile_of(geometry(64, 14, kernel=5, padding=2)) == 2
    ragged_shapes = [s for s in WINOGRAD_GRID if conv_winograd.ragged(
        conv.make_geometry(s[:4], (s[4], s[1], s[5], s[5]), 1, s[6]))]
    assert len(ragged_shapes) == 3


def test_winograd_refuses_what_it_cannot_do() -> None:
    x = np.zeros((1, 2, 7, 7))
    with pytest.raises(ValueError, match="Winograd"):
        conv.conv2d_forward_cached(x, np.zeros((2, 2, 3, 3)), layout=conv.WINOGRAD)  # 5x5 out
    with pytest.raises(ValueError, match="Winograd"):
        conv.conv2d_forward_cached(x, np.zeros((2, 2, 2, 2)), layout=conv.WINOGRAD)


@pytest.mark.parametrize("size,side", [(3, 8), (5, 8), (3, 14)])
def test_the_fused_layer_uses_winograd_for_wide_layers(many_chunks: None, size: int,
                                                       side: int) -> None:
    """Enough channels and kernels: the training path's conv is Winograd, and the layer
    still equals the separate ops (float64) and PyTorch's within float32 rounding. 3x3
    on 8x8: F(4x4, 3x3); on 14x14 with 64 channels: ragged F(4x4, 3x3)."""
    channels = max(conv.WINOGRAD_MIN_CHANNELS[size],
                   conv_winograd.RAGGED_MIN_CHANNELS if side % 4 else 0)
    arrays = layer(np.random.default_rng(15), batch=4, channels=channels, size=side,
                   kernels=channels, kernel=size)
    _, cache, _, _ = conv_layer_forward(*arrays, True, padding=size // 2, fast=True)
    assert cache.conv.layout == conv.WINOGRAD
    assert conv_winograd.ragged(cache.conv.geometry) == (side == 14)
    fused, separate = both(arrays, True, "max", True, padding=size // 2)
    assert_close(fused, separate, rtol=1e-9, atol=1e-11)
    single = tuple(a.astype(np.float32) for a in arrays)
    fused32, separate32 = both(single, True, "max", True, padding=size // 2)
    assert_close(fused32, separate32, rtol=2e-3, atol=2e-4)


def test_winograd_is_the_default_for_wide_5x5_layers_cached_or_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conv, "PARALLEL_MIN_FLOP", 0.0)
    rng = np.random.default_rng(16)
    x, w, b = rng.standard_normal((3, 8, 10, 10)), rng.standard_normal((9, 8, 5, 5)), None
    y, cache = conv.conv2d_forward_cached(x, w, b, 1, 1)
    assert cache.layout == conv.WINOGRAD
    assert conv.conv2d_forward_cached(x, w, b, 1, 1, winograd=False)[1].layout != conv.WINOGRAD
    dy = rng.standard_normal(y.shape)
    dx_ref, dw_ref, db_ref = conv2d_backward_reference(x, w, dy, 1, 1)
    np.testing.assert_allclose(y, conv2d_reference(x, w, b, 1, 1), rtol=1e-10, atol=1e-10)
    for grads in (conv.conv2d_backward_cached(cache, dy), conv.conv2d_backward(x, w, dy, 1, 1)):
        for got, want in zip(grads, (dx_ref, dw_ref, db_ref), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_pool_with_mixed_gamma_signs_equals_pooling_channel_by_channel() -> None:
    """The fused pool takes the channels of gamma < 0 and == 0 together (a few calls);
    channel by channel (``max_windows`` per channel, how it was done) gives the same bits,
    ties included."""
    from hetconv.ops.block_kernels import Ops, max_windows, pool_max
    rng = np.random.default_rng(11)
    gamma = np.array([1.0, -0.5, 0.0, 2.0, -1.0, -0.0, 0.3, -2.0], np.float32)
    conv = rng.integers(-3, 4, (8, 6, 6, 5)).astype(np.float32)  # small integers: ties
    four = [conv[:, i::2, j::2] for i in (0, 1) for j in (0, 1)]
    ops = Ops(np)
    pooled, winners = np.empty((8, 3, 3, 5), np.float32), np.empty((8, 3, 3, 5), np.uint8)
    pool_max(ops, four, gamma, pooled, winners)
    for k in range(8):
        want, want_winners = np.empty((1, 3, 3, 5), np.float32), np.empty((1, 3, 3, 5), np.uint8)
        if gamma[k] == 0:
            want[0], want_winners[0] = four[0][k], 0
        else:
            max_windows(Ops(np), [view[k:k + 1] for view in four], want, want_winners,
                        bool(gamma[k] < 0))
        np.testing.assert_array_equal(pooled[k:k + 1], want)
        np.testing.assert_array_equal(winners[k:k + 1], want_winners)
