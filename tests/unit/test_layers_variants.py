"""The conv layer's variants: 3x3 "same" convs with or without batch norm, followed by
a 2x2 max pool, a 2x2 average pool or no pool; forward and backward against a slow
reference (and PyTorch when installed) and float64 finite differences; kernel shares
(ConvShard, as the workers hold them) reproduce the whole layer; seeded dropout."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hetconv.engine.shard import ConvShard, LayerSettings
from hetconv.names import PARAMETER_NAMES, TRAINABLE_NAMES
from hetconv.ops.conv_layer import conv_layer_backward, conv_layer_forward
from hetconv.ops.conv_reference import conv2d_reference
from hetconv.ops.dropout import dropout_backward, dropout_forward, dropout_mask
from hetconv.ops.pooling import avg_pool2x2, avg_pool2x2_backward

VARIANTS = [(pool, bn) for pool in ("max", "avg", "none") for bn in (True, False)]
IDS = [f"{pool}-{'bn' if bn else 'nobn'}" for pool, bn in VARIANTS]


def numerical_gradient(loss: Callable[[], float], array: np.ndarray,
                       step: float = 1e-6) -> np.ndarray:
    """Central finite differences of ``loss()`` with respect to ``array`` (in place)."""
    grad = np.zeros_like(array)
    flat, flat_grad = array.reshape(-1), grad.reshape(-1)
    for index in range(flat.size):
        original = flat[index]
        flat[index] = original + step
        plus = loss()
        flat[index] = original - step
        minus = loss()
        flat[index] = original
        flat_grad[index] = (plus - minus) / (2 * step)
    return grad


def assert_gradient(analytic: np.ndarray, numeric: np.ndarray, tol: float = 1e-6) -> None:
    scale = max(1.0, float(np.abs(numeric).max()))
    np.testing.assert_allclose(analytic, numeric, rtol=0, atol=tol * scale)


def layer_inputs(rng: np.random.Generator, batch: int = 2, channels: int = 2, size: int = 6,
                 kernels: int = 3) -> tuple[np.ndarray, ...]:
    x = rng.standard_normal((batch, channels, size, size))
    weight = rng.standard_normal((kernels, channels, 3, 3)) * 0.5
    gamma = rng.uniform(0.5, 1.5, kernels)
    beta = rng.standard_normal(kernels) * 0.3
    running_mean = rng.standard_normal(kernels) * 0.1
    running_var = rng.uniform(0.5, 2.0, kernels)
    return x, weight, gamma, beta, running_mean, running_var


def slow_reference(x: np.ndarray, weight: np.ndarray, gamma: np.ndarray, beta: np.ndarray,
                   running_mean: np.ndarray, running_var: np.ndarray, train: bool, pool: str,
                   batch_norm: bool, eps: float = 1e-5) -> np.ndarray:
    """The layer written out loop by loop: conv (padding 1) -> BN or bias -> ReLU -> pool."""
    conv = conv2d_reference(x, weight, None, stride=1, padding=1)
    out = np.empty_like(conv)
    for k in range(conv.shape[1]):
        channel = conv[:, k]
        if batch_norm:
            mean = channel.mean() if train else running_mean[k]
            var = channel.var() if train else running_var[k]
            out[:, k] = gamma[k] * (channel - mean) / np.sqrt(var + eps) + beta[k]
        else:
            out[:, k] = channel + beta[k]
    out = np.maximum(out, 0.0)
    if pool == "none":
        return out
    b, c, h, w = out.shape
    pooled = np.empty((b, c, h // 2, w // 2))
    for i in range(h // 2):
        for j in range(w // 2):
            window = out[:, :, 2 * i:2 * i + 2, 2 * j:2 * j + 2]
            pooled[:, :, i, j] = window.max(axis=(2, 3)) if pool == "max" else window.mean(
                axis=(2, 3))
    return pooled


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("pool,batch_norm", VARIANTS, ids=IDS)
def test_forward_matches_the_slow_reference(pool: str, batch_norm: bool, train: bool) -> None:
    rng = np.random.default_rng(21)
    arrays = layer_inputs(rng, size=7)
    y, _, new_mean, new_var = conv_layer_forward(*arrays, train, padding=1, pool=pool,
                                                 batch_norm=batch_norm)
    expected = slow_reference(*arrays, train, pool, batch_norm)
    assert y.shape == expected.shape == ((2, 3, 3, 3) if pool != "none" else (2, 3, 7, 7))
    np.testing.assert_allclose(y, expected, rtol=1e-10, atol=1e-12)
    if not (train and batch_norm):  # the running statistics move only with batch norm
        np.testing.assert_array_equal(new_mean, arrays[4])
        np.testing.assert_array_equal(new_var, arrays[5])
    else:
        assert not np.array_equal(new_mean, arrays[4])


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("pool,batch_norm", VARIANTS, ids=IDS)
def test_backward_matches_finite_differences(pool: str, batch_norm: bool, train: bool) -> None:
    rng = np.random.default_rng(22)
    x, weight, gamma, beta, running_mean, running_var = layer_inputs(rng, size=6)

    def forward() -> Any:
        return conv_layer_forward(x, weight, gamma, beta, running_mean, running_var, train,
                                  padding=1, pool=pool, batch_norm=batch_norm)

    weights = rng.standard_normal(forward()[0].shape)

    def loss() -> float:
        return float((forward()[0] * weights).sum())

    dx, dweight, dgamma, dbeta = conv_layer_backward(forward()[1], weights, True)
    assert_gradient(dx, numerical_gradient(loss, x))
    assert_gradient(dweight, numerical_gradient(loss, weight))
    assert_gradient(dgamma, numerical_gradient(loss, gamma))
    assert_gradient(dbeta, numerical_gradient(loss, beta))
    if not batch_norm:
        assert not dgamma.any()  # gamma is unused without batch norm


@pytest.mark.parametrize("pool,batch_norm", VARIANTS, ids=IDS)
def test_matches_torch(pool: str, batch_norm: bool) -> None:
    torch = pytest.importorskip("torch")
    functional = torch.nn.functional
    rng = np.random.default_rng(23)
    x, weight, gamma, beta, running_mean, running_var = layer_inputs(rng, batch=3, size=9,
                                                                     kernels=4)
    y, cache, _, _ = conv_layer_forward(x, weight, gamma, beta, running_mean, running_var,
                                        True, padding=1, pool=pool, batch_norm=batch_norm)
    dy = rng.standard_normal(y.shape)
    ours = conv_layer_backward(cache, dy, True)
    tx, tw, tg, tb = (torch.from_numpy(a.copy()).requires_grad_()
                      for a in (x, weight, gamma, beta))
    if batch_norm:
        out = functional.batch_norm(functional.conv2d(tx, tw, padding=1),
                                    torch.from_numpy(running_mean.copy()),
                                    torch.from_numpy(running_var.copy()), tg, tb, training=True)
    else:
        out = functional.conv2d(tx, tw, tb, padding=1) + 0.0 * tg.sum()
    out = functional.relu(out)
    if pool == "max":
        out = functional.max_pool2d(out, 2)
    elif pool == "avg":
        out = functional.avg_pool2d(out, 2)
    out.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(y, out.detach().numpy(), rtol=1e-10, atol=1e-12)
    for mine, tensor in zip(ours, (tx, tw, tg, tb)):
        np.testing.assert_allclose(mine, tensor.grad.numpy(), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("pool,batch_norm", VARIANTS, ids=IDS)
def test_kernel_shards_reproduce_the_whole_layer(pool: str, batch_norm: bool) -> None:
    """Shards of kernels [0, 2), [2, 2), [2, 5) (float32, as on the workers) give the
    whole layer's output channels, its summed input gradient and its updated state
    (to float32 rounding: the products are blocked differently per share)."""
    rng = np.random.default_rng(24)
    x, weight, gamma, beta, running_mean, running_var = (
        a.astype(np.float32) for a in layer_inputs(rng, batch=4, channels=3, size=8, kernels=5))
    state = dict(zip(PARAMETER_NAMES, (weight, gamma, beta, running_mean, running_var)))
    settings = LayerSettings(stride=1, padding=1, pool=pool, batch_norm=batch_norm)
    whole = ConvShard(1, 0, 5, settings, state)
    y = whole.forward_host(x, True)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx = whole.backward_host(dy, True, 0.1)
    assert dx is not None
    outputs, dx_sum, states = [], np.zeros_like(x), []
    for start, stop in ((0, 2), (2, 2), (2, 5)):
        shard = ConvShard(1, start, stop, settings,
                          {name: value[start:stop] for name, value in state.items()})
        outputs.append(shard.forward_host(x, True))
        part = shard.backward_host(dy[:, start:stop], True, 0.1)
        assert part is not None
        dx_sum += part
        states.append(shard.snapshot())
    close = {"rtol": 1e-5, "atol": 1e-5}  # float32 products blocked differently per share
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), y, **close)
    np.testing.assert_allclose(dx_sum, dx, **close)
    snapshot = whole.snapshot()
    for name in snapshot:
        np.testing.assert_allclose(np.concatenate([s[name] for s in states]),
                                   snapshot[name], err_msg=name, **close)
    moved = {name for name in TRAINABLE_NAMES if not np.array_equal(snapshot[name], state[name])}
    assert moved == ({"weight", "gamma", "beta"} if batch_norm else {"weight", "beta"})


def test_network_settings_pick_each_layer_s_own() -> None:
    layers = (LayerSettings(padding=1, pool="none"), LayerSettings(padding=1, pool="avg",
                                                                   batch_norm=False))
    network = LayerSettings(per_layer=layers)
    assert network.for_layer(1) is layers[1]
    assert LayerSettings().for_layer(5) == LayerSettings()
    state = {name: np.ones(2, np.float32) for name in PARAMETER_NAMES}
    state["weight"] = np.ones((2, 1, 3, 3), np.float32)
    shard = ConvShard(1, 0, 2, network, state)
    assert shard.settings.pool == "avg" and not shard.settings.batch_norm
    assert shard.forward_host(np.ones((2, 1, 6, 6), np.float32), True).shape == (2, 2, 3, 3)
    with pytest.raises(ValueError):
        network.for_layer(2)


def test_empty_share_has_the_variant_s_output_size() -> None:
    rng = np.random.default_rng(25)
    x, weight, gamma, beta, running_mean, running_var = layer_inputs(rng, size=8)
    none = slice(0, 0)
    for pool, side in (("none", 8), ("avg", 4), ("max", 4)):
        y, cache, _, _ = conv_layer_forward(x, weight[none], gamma[none], beta[none],
                                            running_mean[none], running_var[none], True,
                                            padding=1, pool=pool)
        assert y.shape == (2, 0, side, side)
        dx, dweight, _, _ = conv_layer_backward(cache, y, True)
        assert dx is not None and dx.shape == x.shape and not dx.any()


def test_unknown_pool_is_refused() -> None:
    arrays = layer_inputs(np.random.default_rng(26))
    with pytest.raises(ValueError, match="pool"):
        conv_layer_forward(*arrays, True, padding=1, pool="min")


def test_avg_pool_odd_sizes_and_gradient() -> None:
    rng = np.random.default_rng(27)
    x = rng.standard_normal((2, 3, 5, 7))
    y, cache = avg_pool2x2(x)
    assert y.shape == (2, 3, 2, 3)
    np.testing.assert_allclose(y[1, 2, 1, 2], x[1, 2, 2:4, 4:6].mean())
    weights = rng.standard_normal(y.shape)
    dx = avg_pool2x2_backward(cache, weights)
    assert_gradient(dx, numerical_gradient(lambda: float((avg_pool2x2(x)[0] * weights).sum()),
                                           x))
    assert not dx[:, :, 4, :].any() and not dx[:, :, :, 6].any()


def test_dropout_mask_is_seeded_by_seed_step_and_layer() -> None:
    a = dropout_mask((64, 50), 0.25, seed=3, step=7, layer=1)
    assert a.dtype == np.float32
    np.testing.assert_array_equal(a, dropout_mask((64, 50), 0.25, seed=3, step=7, layer=1))
    for other in (dropout_mask((64, 50), 0.25, 4, 7, 1), dropout_mask((64, 50), 0.25, 3, 8, 1),
                  dropout_mask((64, 50), 0.25, 3, 7, 2)):
        assert not np.array_equal(a, other)
    assert set(np.unique(a)) == {0.0, np.float32(1 / 0.75)}
    assert 0.15 < float((a == 0).mean()) < 0.35
    assert np.all(dropout_mask((4, 4), 0.0, 0, 0, 0) == 1.0)
    x = np.ones((64, 50), np.float32)
    np.testing.assert_array_equal(dropout_forward(x, a), a)
    np.testing.assert_array_equal(dropout_backward(a, x * 2), 2 * a)
    for rate in (1.0, -0.1):
        with pytest.raises(ValueError):
            dropout_mask((2, 2), rate, 0, 0, 0)
