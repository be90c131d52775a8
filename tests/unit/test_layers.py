"""Layer ops against float64 finite differences, naive references and PyTorch.

Covers batch norm (train and eval), ReLU, 2x2 max pooling, linear, softmax
cross-entropy and the whole conv layer, plus the property the distributed
service relies on: a slice of kernels computes exactly the slice of the result.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hetconv.ops.activation import relu, relu_backward
from hetconv.ops.batchnorm import batch_norm_backward, batch_norm_forward
from hetconv.ops.linear import linear, linear_backward
from hetconv.ops.loss import softmax_cross_entropy, softmax_cross_entropy_backward
from hetconv.ops.pooling import max_pool2x2, max_pool2x2_backward


def numerical_gradient(loss: Callable[[], float], array: np.ndarray,
                       step: float = 1e-6) -> np.ndarray:
    """Central finite differences of ``loss()`` with respect to ``array`` (edited in place)."""
    grad = np.zeros_like(array)
    flat, flat_grad = array.reshape(-1), grad.reshape(-1)
    assert np.shares_memory(flat, array)
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


def random_splits(rng: np.random.Generator, total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous shares of range(total), some possibly empty."""
    cuts = np.sort(rng.integers(0, total + 1, parts - 1))
    bounds = [0, *cuts.tolist(), total]
    return list(zip(bounds[:-1], bounds[1:]))


# ------------------------------------------------------------------------ ReLU


def test_relu_forward_and_backward() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 5))
    x[np.abs(x) < 1e-3] = 0.5  # keep finite differences away from the kink
    weights = rng.standard_normal(x.shape)
    y = relu(x)
    np.testing.assert_array_equal(y, np.where(x > 0, x, 0.0))
    numeric = numerical_gradient(lambda: float((relu(x) * weights).sum()), x)
    assert_gradient(relu_backward(y, weights), numeric)


def test_relu_gradient_at_zero_is_zero_and_dtype_kept() -> None:
    x = np.array([-1.0, 0.0, 2.0], dtype=np.float32)
    y = relu(x)
    dx = relu_backward(y, np.ones(3, dtype=np.float32))
    assert y.dtype == np.float32 and dx.dtype == np.float32
    np.testing.assert_array_equal(dx, [0.0, 0.0, 1.0])


# --------------------------------------------------------------------- pooling


def naive_max_pool(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Loop reference: pooled values and (B, C, Ho, Wo, 2) first-argmax positions."""
    batch, channels, height, width = x.shape
    y = np.zeros((batch, channels, height // 2, width // 2), x.dtype)
    where = np.zeros((*y.shape, 2), int)
    for b, c, i, j in np.ndindex(*y.shape):
        window = x[b, c, 2 * i:2 * i + 2, 2 * j:2 * j + 2]
        flat = int(np.argmax(window))  # first maximum in row-major order
        y[b, c, i, j] = window.flat[flat]
        where[b, c, i, j] = divmod(flat, 2)
    return y, where


@pytest.mark.parametrize("shape", [(2, 3, 6, 8), (1, 2, 5, 7), (2, 1, 1, 3)])
def test_max_pool_matches_naive_and_finite_differences(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape)
    y, cache = max_pool2x2(x)
    expected, _ = naive_max_pool(x)
    assert y.shape == (shape[0], shape[1], shape[2] // 2, shape[3] // 2)
    np.testing.assert_array_equal(y, expected)
    weights = rng.standard_normal(y.shape)
    numeric = numerical_gradient(lambda: float((max_pool2x2(x)[0] * weights).sum()), x)
    assert_gradient(max_pool2x2_backward(cache, weights), numeric)


def test_max_pool_ties_go_to_first_maximum_in_row_major_order() -> None:
    rng = np.random.default_rng(2)
    # Few distinct values: many ties, including whole windows of equal values.
    x = rng.integers(0, 3, (3, 4, 8, 10)).astype(np.float32)
    x[0, 0, :2, :2] = 1.0
    y, cache = max_pool2x2(x)
    dx = max_pool2x2_backward(cache, np.ones_like(y))
    _, where = naive_max_pool(x)
    expected = np.zeros_like(x)
    for b, c, i, j in np.ndindex(*y.shape):
        row, col = where[b, c, i, j]
        expected[b, c, 2 * i + row, 2 * j + col] = 1.0
    np.testing.assert_array_equal(dx, expected)
    assert dx[0, 0, 0, 0] == 1.0 and dx[0, 0, :2, :2].sum() == 1.0
    assert int((dx != 0).sum()) == y.size  # exactly one position per window


def test_max_pool_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(3).standard_normal((2, 3, 7, 9)).astype(np.float32)
    expected = torch.nn.functional.max_pool2d(torch.from_numpy(x), 2).numpy()
    np.testing.assert_array_equal(max_pool2x2(x)[0], expected)


# ---------------------------------------------------------------------- linear


def test_linear_forward_and_finite_differences() -> None:
    rng = np.random.default_rng(4)
    x, w, b = rng.standard_normal((4, 6)), rng.standard_normal((3, 6)), rng.standard_normal(3)
    weights = rng.standard_normal((4, 3))
    np.testing.assert_allclose(linear(x, w, b), x @ w.T + b, rtol=1e-14)

    def loss() -> float:
        return float((linear(x, w, b) * weights).sum())

    dx, dw, db = linear_backward(x, w, weights)
    assert_gradient(dx, numerical_gradient(loss, x))
    assert_gradient(dw, numerical_gradient(loss, w))
    assert_gradient(db, numerical_gradient(loss, b))


def test_linear_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="incompatible"):
        linear(np.zeros((2, 3)), np.zeros((4, 5)), np.zeros(4))


# ------------------------------------------------------------------------ loss


def test_softmax_cross_entropy_value_gradient_and_stability() -> None:
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((5, 4)) * 3
    labels = rng.integers(0, 4, 5)
    loss, probs = softmax_cross_entropy(logits, labels)
    exp = np.exp(logits)
    naive = -np.mean(np.log(exp[np.arange(5), labels] / exp.sum(axis=1)))
    assert isinstance(loss, float) and loss == pytest.approx(naive, rel=1e-12)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-12)
    numeric = numerical_gradient(lambda: softmax_cross_entropy(logits, labels)[0], logits)
    assert_gradient(softmax_cross_entropy_backward(probs, labels), numeric)

    huge = np.array([[1000.0, -1000.0, 0.0], [-5000.0, 5000.0, 4990.0]], dtype=np.float32)
    loss, probs = softmax_cross_entropy(huge, np.array([0, 2]))
    assert np.isfinite(loss) and np.all(np.isfinite(probs)) and probs.dtype == np.float32
    assert loss == pytest.approx(5.0, rel=1e-4)  # (0 + 10) / 2


def test_softmax_cross_entropy_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    logits, labels = rng.standard_normal((8, 10)), rng.integers(0, 10, 8)
    tensor = torch.from_numpy(logits.copy()).requires_grad_()
    expected = torch.nn.functional.cross_entropy(tensor, torch.from_numpy(labels))
    expected.backward()
    loss, probs = softmax_cross_entropy(logits, labels)
    assert loss == pytest.approx(expected.item(), rel=1e-12)
    np.testing.assert_allclose(softmax_cross_entropy_backward(probs, labels),
                               tensor.grad.numpy(), rtol=1e-10, atol=1e-14)


def test_softmax_cross_entropy_rejects_bad_labels() -> None:
    with pytest.raises(ValueError, match="labels"):
        softmax_cross_entropy(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(ValueError, match="labels"):
        softmax_cross_entropy(np.zeros((2, 3)), np.array([-1, 0]))


# ------------------------------------------------------------------ batch norm


def bn_inputs(rng: np.random.Generator, shape: tuple[int, int, int, int],
              dtype: Any = np.float64) -> tuple[np.ndarray, ...]:
    channels = shape[1]
    x = (rng.standard_normal(shape) * 2 + 1).astype(dtype)
    gamma = rng.uniform(0.5, 1.5, channels).astype(dtype)
    beta = rng.standard_normal(channels).astype(dtype)
    running_mean = rng.standard_normal(channels).astype(dtype)
    running_var = rng.uniform(0.5, 2.0, channels).astype(dtype)
    return x, gamma, beta, running_mean, running_var


@pytest.mark.parametrize("train", [True, False])
def test_batch_norm_finite_differences(train: bool) -> None:
    rng = np.random.default_rng(7)
    x, gamma, beta, running_mean, running_var = bn_inputs(rng, (3, 2, 3, 4))
    weights = rng.standard_normal(x.shape)

    def loss() -> float:
        y = batch_norm_forward(x, gamma, beta, running_mean, running_var, train)[0]
        return float((y * weights).sum())

    _, cache, _, _ = batch_norm_forward(x, gamma, beta, running_mean, running_var, train)
    dx, dgamma, dbeta = batch_norm_backward(cache, weights)
    assert_gradient(dx, numerical_gradient(loss, x))
    assert_gradient(dgamma, numerical_gradient(loss, gamma))
    assert_gradient(dbeta, numerical_gradient(loss, beta))


@pytest.mark.parametrize("train", [True, False])
def test_batch_norm_matches_torch(train: bool) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    x, gamma, beta, running_mean, running_var = bn_inputs(rng, (4, 3, 5, 6))
    dy = rng.standard_normal(x.shape)
    originals = (running_mean.copy(), running_var.copy())
    y, cache, new_mean, new_var = batch_norm_forward(
        x, gamma, beta, running_mean, running_var, train, momentum=0.2, eps=1e-3)
    dx, dgamma, dbeta = batch_norm_backward(cache, dy)

    tensors = [torch.from_numpy(a.copy()).requires_grad_() for a in (x, gamma, beta)]
    torch_mean = torch.from_numpy(running_mean.copy())
    torch_var = torch.from_numpy(running_var.copy())
    expected = torch.nn.functional.batch_norm(tensors[0], torch_mean, torch_var, tensors[1],
                                              tensors[2], training=train, momentum=0.2, eps=1e-3)
    expected.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(y, expected.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(new_mean, torch_mean.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(new_var, torch_var.numpy(), rtol=1e-12, atol=1e-14)
    for ours, tensor in zip((dx, dgamma, dbeta), tensors):
        np.testing.assert_allclose(ours, tensor.grad.numpy(), rtol=1e-10, atol=1e-12)
    # Pure: the inputs are untouched.
    np.testing.assert_array_equal(running_mean, originals[0])
    np.testing.assert_array_equal(running_var, originals[1])
    if not train:
        assert new_mean is running_mean and new_var is running_var


def test_batch_norm_keeps_float32() -> None:
    rng = np.random.default_rng(9)
    arrays = bn_inputs(rng, (4, 3, 5, 5), np.float32)
    for train in (True, False):
        y, cache, new_mean, new_var = batch_norm_forward(*arrays, train)
        dx, dgamma, dbeta = batch_norm_backward(cache, np.ones_like(y))
        for array in (y, new_mean, new_var, dx, dgamma, dbeta, cache.x_hat, cache.inv_std):
            assert array.dtype == np.float32


def test_batch_norm_rejects_single_value_per_channel_in_training() -> None:
    arrays = bn_inputs(np.random.default_rng(10), (1, 2, 1, 1))
    with pytest.raises(ValueError, match="more than 1 value"):
        batch_norm_forward(*arrays, True)


@pytest.mark.parametrize("seed", range(4))
def test_batch_norm_channel_slices_are_exact(seed: int) -> None:
    rng = np.random.default_rng(seed)
    channels = 7
    x, gamma, beta, running_mean, running_var = bn_inputs(rng, (16, channels, 12, 11), np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    train = seed % 2 == 0
    full = batch_norm_forward(x, gamma, beta, running_mean, running_var, train)
    full_grads = batch_norm_backward(full[1], dy)
    for begin, end in random_splits(rng, channels, 4) + [(0, 0), (3, 4), (0, channels)]:
        part = slice(begin, end)
        # Each device holds its own contiguous slice, as after its own convolution.
        x_part, dy_part = np.ascontiguousarray(x[:, part]), np.ascontiguousarray(dy[:, part])
        y, cache, new_mean, new_var = batch_norm_forward(
            x_part, gamma[part], beta[part], running_mean[part], running_var[part], train)
        np.testing.assert_array_equal(y, full[0][:, part])
        np.testing.assert_array_equal(new_mean, full[2][part])
        np.testing.assert_array_equal(new_var, full[3][part])
        for ours, whole in zip(batch_norm_backward(cache, dy_part), full_grads):
            np.testing.assert_array_equal(ours, whole[:, part] if ours.ndim == 4 else whole[part])


# ------------------------------------------------------------------ conv layer


@pytest.fixture(scope="module")
def block() -> Any:
    """hetconv.ops.conv_layer (skips when the conv module it builds on is not importable)."""
    import hetconv.ops.conv_layer as block_module

    return block_module


def block_inputs(rng: np.random.Generator, batch: int = 2, channels: int = 2, size: int = 6,
                 kernels: int = 3, kernel_size: int = 3) -> tuple[np.ndarray, ...]:
    x = rng.standard_normal((batch, channels, size, size))
    weight = rng.standard_normal((kernels, channels, kernel_size, kernel_size)) * 0.5
    gamma = rng.uniform(0.5, 1.5, kernels)
    beta = rng.standard_normal(kernels) * 0.3
    running_mean = rng.standard_normal(kernels) * 0.1
    running_var = rng.uniform(0.5, 2.0, kernels)
    return x, weight, gamma, beta, running_mean, running_var


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("stride,padding", [(1, 1), (2, 0)])
def test_conv_block_finite_differences(block: Any, train: bool, stride: int,
                                       padding: int) -> None:
    rng = np.random.default_rng(11)
    x, weight, gamma, beta, running_mean, running_var = block_inputs(rng, size=7)

    def forward() -> Any:
        return block.conv_layer_forward(x, weight, gamma, beta, running_mean, running_var,
                                        train, stride=stride, padding=padding)

    weights = rng.standard_normal(forward()[0].shape)

    def loss() -> float:
        return float((forward()[0] * weights).sum())

    dx, dweight, dgamma, dbeta = block.conv_layer_backward(forward()[1], weights, True)
    assert_gradient(dx, numerical_gradient(loss, x))
    assert_gradient(dweight, numerical_gradient(loss, weight))
    assert_gradient(dgamma, numerical_gradient(loss, gamma))
    assert_gradient(dbeta, numerical_gradient(loss, beta))


@pytest.mark.parametrize("train", [True, False])
def test_conv_block_matches_torch(block: Any, train: bool) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(12)
    x, weight, gamma, beta, running_mean, running_var = block_inputs(rng, batch=3, size=9,
                                                                     kernels=4)
    y, cache, new_mean, new_var = block.conv_layer_forward(
        x, weight, gamma, beta, running_mean, running_var, train, padding=1, bn_momentum=0.3)
    dy = rng.standard_normal(y.shape)
    dx, dweight, dgamma, dbeta = block.conv_layer_backward(cache, dy, True)

    tensors = [torch.from_numpy(a.copy()).requires_grad_() for a in (x, weight, gamma, beta)]
    torch_mean = torch.from_numpy(running_mean.copy())
    torch_var = torch.from_numpy(running_var.copy())
    functional = torch.nn.functional
    conv = functional.conv2d(tensors[0], tensors[1], padding=1)
    normalized = functional.batch_norm(conv, torch_mean, torch_var, tensors[2], tensors[3],
                                       training=train, momentum=0.3)
    expected = functional.max_pool2d(functional.relu(normalized), 2)
    expected.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(y, expected.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(new_mean, torch_mean.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(new_var, torch_var.numpy(), rtol=1e-10, atol=1e-12)
    for ours, tensor in zip((dx, dweight, dgamma, dbeta), tensors):
        np.testing.assert_allclose(ours, tensor.grad.numpy(), rtol=1e-9, atol=1e-11)


def test_conv_block_empty_share_and_need_dx(block: Any) -> None:
    rng = np.random.default_rng(13)
    x, weight, gamma, beta, running_mean, running_var = block_inputs(rng, size=8)
    empty = slice(0, 0)
    y, cache, new_mean, new_var = block.conv_layer_forward(
        x, weight[empty], gamma[empty], beta[empty], running_mean[empty], running_var[empty],
        True, padding=1)
    assert y.shape == (2, 0, 4, 4) and new_mean.shape == (0,) and new_var.shape == (0,)
    dx, dweight, dgamma, dbeta = block.conv_layer_backward(cache, np.zeros(y.shape), True)
    assert dx.shape == x.shape and not dx.any()
    assert dweight.shape == (0, 2, 3, 3) and dgamma.shape == (0,) and dbeta.shape == (0,)
    assert block.conv_layer_backward(cache, np.zeros(y.shape), False)[0] is None

    _, cache, _, _ = block.conv_layer_forward(x, weight, gamma, beta, running_mean,
                                              running_var, True)
    dx, dweight, _, _ = block.conv_layer_backward(cache, np.ones((2, 3, 3, 3)), False)
    assert dx is None and dweight.shape == weight.shape


@pytest.mark.parametrize("seed", range(3))
def test_conv_block_kernel_shares_compose_to_full_block(block: Any, seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    kernels = 6
    x, weight, gamma, beta, running_mean, running_var = block_inputs(
        rng, batch=4, channels=3, size=10, kernels=kernels)
    train = seed != 1
    full_y, full_cache, full_mean, full_var = block.conv_layer_forward(
        x, weight, gamma, beta, running_mean, running_var, train, padding=1)
    dy = rng.standard_normal(full_y.shape)
    full_dx, full_dweight, full_dgamma, full_dbeta = block.conv_layer_backward(full_cache, dy,
                                                                               True)
    shares = random_splits(rng, kernels, 4) + [(2, 2)]
    outputs, means, variances, dweights, dgammas, dbetas = [], [], [], [], [], []
    dx_sum = np.zeros_like(x)
    for begin, end in shares[:-1]:
        part = slice(begin, end)
        y, cache, new_mean, new_var = block.conv_layer_forward(
            x, weight[part], gamma[part], beta[part], running_mean[part], running_var[part],
            train, padding=1)
        dx, dweight, dgamma, dbeta = block.conv_layer_backward(cache, dy[:, part], True)
        outputs.append(y)
        means.append(new_mean)
        variances.append(new_var)
        dweights.append(dweight)
        dgammas.append(dgamma)
        dbetas.append(dbeta)
        dx_sum += dx
    close = {"rtol": 1e-12, "atol": 1e-12}
    np.testing.assert_allclose(np.concatenate(outputs, axis=1), full_y, **close)
    np.testing.assert_allclose(np.concatenate(means), full_mean, **close)
    np.testing.assert_allclose(np.concatenate(variances), full_var, **close)
    np.testing.assert_allclose(dx_sum, full_dx, **close)
    np.testing.assert_allclose(np.concatenate(dweights), full_dweight, **close)
    np.testing.assert_allclose(np.concatenate(dgammas), full_dgamma, **close)
    np.testing.assert_allclose(np.concatenate(dbetas), full_dbeta, **close)


def test_conv_block_keeps_float32(block: Any) -> None:
    rng = np.random.default_rng(14)
    arrays = [a.astype(np.float32) for a in block_inputs(rng, size=8)]
    y, cache, new_mean, new_var = block.conv_layer_forward(*arrays, True, padding=1)
    grads = block.conv_layer_backward(cache, np.ones_like(y), True)
    for array in (y, new_mean, new_var, *grads):
        assert array.dtype == np.float32
