"""The fast conv kernels against the slow reference, numerical gradients and PyTorch."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetconv import backend
from hetconv.ops import conv as fast
from hetconv.ops.conv import (
    conv2d,
    conv2d_backward,
    conv2d_backward_cached,
    conv2d_forward_cached,
)
from hetconv.ops.conv_reference import conv2d_backward_reference, conv2d_reference

# (batch, channels, height, width, kernels, kernel_h, kernel_w, stride, padding)
GRID = [
    (1, 1, 5, 5, 1, 1, 1, 1, 0),
    (2, 3, 7, 9, 4, 3, 3, 1, 1),
    (3, 2, 8, 6, 5, 5, 5, 1, 2),
    (2, 4, 9, 7, 3, 2, 3, 2, 0),
    (3, 1, 11, 10, 2, 4, 2, 2, 1),
    (1, 3, 6, 6, 0, 3, 3, 1, 0),
    (2, 2, 5, 5, 3, 5, 5, 1, 0),
    (3, 4, 13, 5, 5, 3, 1, 2, 2),
]


def _inputs(shape: tuple[int, ...], dtype: Any = np.float64, seed: int = 0
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    batch, channels, height, width, kernels, kh, kw, stride, padding = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, channels, height, width)).astype(dtype)
    w = rng.standard_normal((kernels, channels, kh, kw)).astype(dtype)
    b = rng.standard_normal(kernels).astype(dtype)
    out_h = (height + 2 * padding - kh) // stride + 1
    out_w = (width + 2 * padding - kw) // stride + 1
    dy = rng.standard_normal((batch, kernels, out_h, out_w)).astype(dtype)
    return x, w, b, dy


def _assert_matches_reference(shape: tuple[int, ...], layout: str | None) -> None:
    x, w, b, dy = _inputs(shape)
    stride, padding = shape[7], shape[8]
    y_ref = conv2d_reference(x, w, b, stride, padding)
    dx_ref, dw_ref, db_ref = conv2d_backward_reference(x, w, dy, stride, padding)
    y, cache = conv2d_forward_cached(x, w, b, stride, padding, layout=layout)
    dx, dw, db = conv2d_backward_cached(cache, dy)
    np.testing.assert_allclose(y, y_ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(db, db_ref, rtol=1e-10, atol=1e-10)
    assert y.shape == y_ref.shape and dx.shape == x.shape and dw.shape == w.shape
    _, dw_only, db_only = conv2d_backward_cached(cache, dy, need_dx=False)
    np.testing.assert_allclose(dw_only, dw_ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(db_only, db_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout", fast.LAYOUTS)
@pytest.mark.parametrize("shape", GRID)
def test_fast_matches_reference_on_grid(shape: tuple[int, ...], layout: str) -> None:
    _assert_matches_reference(shape, layout)


@st.composite
def conv_shapes(draw: Any) -> tuple[int, ...]:
    kh, kw = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    stride, padding = draw(st.integers(1, 2)), draw(st.integers(0, 2))
    height = draw(st.integers(max(1, kh - 2 * padding), 12))
    width = draw(st.integers(max(1, kw - 2 * padding), 12))
    return (draw(st.integers(1, 3)), draw(st.integers(1, 4)), height, width,
            draw(st.integers(0, 5)), kh, kw, stride, padding)


@settings(max_examples=30, deadline=None)
@given(shape=conv_shapes(), layout=st.sampled_from([None, *fast.LAYOUTS]))
def test_fast_matches_reference_random(shape: tuple[int, ...], layout: str | None) -> None:
    _assert_matches_reference(shape, layout)


def _numerical_gradients(x: np.ndarray, w: np.ndarray, b: np.ndarray, dy: np.ndarray,
                         stride: int, padding: int, eps: float = 1e-6) -> list[np.ndarray]:
    """Central differences of L = sum(conv2d_reference(x, w, b) * dy) for x, w, b."""
    grads = []
    for array in (x, w, b):
        grad = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            saved = array[index]
            array[index] = saved + eps
            plus = float((conv2d_reference(x, w, b, stride, padding) * dy).sum())
            array[index] = saved - eps
            minus = float((conv2d_reference(x, w, b, stride, padding) * dy).sum())
            array[index] = saved
            grad[index] = (plus - minus) / (2 * eps)
        grads.append(grad)
    return grads


@pytest.mark.parametrize("shape", [(2, 2, 5, 4, 3, 3, 2, 1, 1), (2, 3, 6, 5, 2, 3, 3, 2, 2)])
def test_backwards_match_finite_differences(shape: tuple[int, ...]) -> None:
    x, w, b, dy = _inputs(shape, seed=3)
    stride, padding = shape[7], shape[8]
    expected = _numerical_gradients(x, w, b, dy, stride, padding)
    candidates = {"reference": conv2d_backward_reference(x, w, dy, stride, padding)}
    for layout in fast.LAYOUTS:
        _, cache = conv2d_forward_cached(x, w, b, stride, padding, layout=layout)
        candidates[layout] = conv2d_backward_cached(cache, dy)
    candidates["uncached"] = conv2d_backward(x, w, dy, stride, padding)
    for name, grads in candidates.items():
        for got, want, what in zip(grads, expected, ("dx", "dw", "db"), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=f"{name} {what}")


@pytest.mark.parametrize("layout", fast.LAYOUTS)
@pytest.mark.parametrize("seed", range(4))
def test_kernel_slices_add_up_to_the_whole_layer(layout: str, seed: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast, "PARALLEL_MIN_FLOP", 0.0)  # exercise the thread pool too,
    monkeypatch.setattr(fast, "MIN_CHUNK_COLUMNS", 1)  # with more chunks than threads
    rng = np.random.default_rng(seed)
    x, w, b, dy = _inputs((3, 3, 9, 8, 7, 3, 3, 1, 1), seed=seed)
    y_full, cache_full = conv2d_forward_cached(x, w, b, 1, 1, layout=layout)
    dx_full, dw_full, db_full = conv2d_backward_cached(cache_full, dy)
    points = sorted(rng.integers(0, w.shape[0] + 1, size=3).tolist())
    edges = [0, *points, points[-1], w.shape[0]]  # repeated point: an empty share
    ys, dws, dbs, dx_sum = [], [], [], np.zeros_like(x)
    for start, stop in zip(edges[:-1], edges[1:], strict=True):
        y, cache = conv2d_forward_cached(x, w[start:stop], b[start:stop], 1, 1, layout=layout)
        dx, dw, db = conv2d_backward_cached(cache, dy[:, start:stop])
        assert y.shape == (3, stop - start, 9, 8) and dw.shape == (stop - start, 3, 3, 3)
        ys.append(y)
        dws.append(dw)
        dbs.append(db)
        dx_sum += dx
    np.testing.assert_allclose(np.concatenate(ys, axis=1), y_full, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.concatenate(dws), dw_full, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.concatenate(dbs), db_full, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx_sum, dx_full, rtol=1e-10, atol=1e-10)


def test_empty_share_gives_empty_outputs_and_zero_dx() -> None:
    x, w, _, _ = _inputs((2, 3, 6, 6, 4, 3, 3, 1, 0))
    y, cache = conv2d_forward_cached(x, w[2:2], None)
    dx, dw, db = conv2d_backward_cached(cache, np.zeros((2, 0, 4, 4)))
    assert y.shape == (2, 0, 4, 4) and dw.shape == (0, 3, 3, 3) and db.shape == (0,)
    assert dx is not None and dx.shape == x.shape and not dx.any()


def test_cached_pair_equals_uncached_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast, "PARALLEL_MIN_FLOP", 0.0)
    x, w, b, dy = _inputs((4, 3, 10, 9, 5, 3, 3, 2, 1))
    w_strided = np.repeat(w, 2, axis=0)[::2]  # a non-contiguous slice of kernels
    y, cache = conv2d_forward_cached(x, w_strided, b, 2, 1)
    np.testing.assert_array_equal(y, conv2d(x, w_strided, b, 2, 1))
    for got, want in zip(conv2d_backward_cached(cache, dy),
                         conv2d_backward(x, w_strided, dy, 2, 1), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert conv2d_backward(x, w, dy, 2, 1, need_dx=False)[0] is None


def test_float32_in_float32_out_and_blas_threads_restored(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setattr(fast, "PARALLEL_MIN_FLOP", 0.0)
    threads_before = backend.blas_threads()
    for layout in fast.LAYOUTS:
        x, w, b, dy = _inputs((4, 3, 12, 12, 6, 3, 3, 1, 1), dtype=np.float32)
        y, cache = conv2d_forward_cached(x, w, b, 1, 1, layout=layout)
        dx, dw, db = conv2d_backward_cached(cache, dy)
        assert {y.dtype, dx.dtype, dw.dtype, db.dtype} == {np.dtype(np.float32)}
        y_ref = conv2d_reference(x.astype(np.float64), w.astype(np.float64), b, 1, 1)
        np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-4)
    assert backend.blas_threads() == threads_before


def test_bad_shapes_raise_clear_errors() -> None:
    x, w, _, _ = _inputs((1, 2, 5, 5, 3, 3, 3, 1, 0))
    with pytest.raises(ValueError, match="same C"):
        conv2d(x, w[:, :1])
    with pytest.raises(ValueError, match="larger than"):
        conv2d(x, np.zeros((1, 2, 7, 7)))
    with pytest.raises(ValueError, match="stride"):
        conv2d(x, w, stride=0)
    _, cache = conv2d_forward_cached(x, w)
    with pytest.raises(ValueError, match="dy has shape"):
        conv2d_backward_cached(cache, np.zeros((1, 3, 2, 2)))


def test_matches_torch_on_a_mid_size_shape() -> None:
    torch = pytest.importorskip("torch")
    x, w, b, dy = _inputs((4, 8, 14, 14, 16, 5, 5, 1, 2), dtype=np.float32, seed=7)
    tx, tw, tb = (torch.from_numpy(a.copy()).requires_grad_() for a in (x, w, b))
    ty = torch.nn.functional.conv2d(tx, tw, tb, stride=1, padding=2)
    ty.backward(torch.from_numpy(dy))
    y, cache = conv2d_forward_cached(x, w, b, 1, 2)
    dx, dw, db = conv2d_backward_cached(cache, dy)
    for got, want in ((y, ty), (dx, tx.grad), (dw, tw.grad), (db, tb.grad)):
        want_np = want.detach().numpy()
        scale = float(np.abs(want_np).max())
        np.testing.assert_allclose(got, want_np, rtol=1e-3, atol=1e-3 * scale)


@pytest.mark.gpu
class TestOnGpu:
    """The same kernels on cupy arrays, compared with the numpy results."""

    @pytest.fixture(autouse=True)
    def _need_gpu(self) -> None:
        if not backend.gpu_available():
            pytest.skip("no CUDA GPU with cupy on this machine")

    @pytest.mark.parametrize("layout", fast.LAYOUTS)
    @pytest.mark.parametrize("shape", GRID[:5])
    def test_cupy_matches_numpy(self, shape: tuple[int, ...], layout: str) -> None:
        cupy = backend.cupy_or_none()
        assert cupy is not None
        x, w, b, dy = _inputs(shape, dtype=np.float32)
        stride, padding = shape[7], shape[8]
        y, cache = conv2d_forward_cached(x, w, b, stride, padding, layout=layout)
        grads = conv2d_backward_cached(cache, dy)
        gx, gw, gb, gdy = (cupy.asarray(a) for a in (x, w, b, dy))
        y_gpu, cache_gpu = conv2d_forward_cached(gx, gw, gb, stride, padding, layout=layout)
        assert isinstance(y_gpu, cupy.ndarray)
        np.testing.assert_allclose(backend.to_numpy(y_gpu), y, rtol=1e-4, atol=1e-4)
        for got, want in zip(conv2d_backward_cached(cache_gpu, gdy), grads, strict=True):
            np.testing.assert_allclose(backend.to_numpy(got), want, rtol=1e-4, atol=1e-4)
        y_ref = conv2d_reference(gx, gw, gb, stride, padding)
        np.testing.assert_allclose(backend.to_numpy(y_ref), y, rtol=1e-4, atol=1e-4)


def test_layout_choice_follows_the_kernel_share() -> None:
    """Small shares of deep layers skip the unfolding; wide shares and first layers keep it."""
    deep = dict(batch=128, channels=64, height=12, width=12, kernel_h=5, kernel_w=5,
                stride=1, padding=0)
    assert fast.choose_layout(fast.ConvGeometry(kernels=16, **deep)) == fast.SHIFTED_TAPS
    assert fast.choose_layout(fast.ConvGeometry(kernels=256, **deep)) == fast.BATCH_INNER
    first = dict(deep, channels=1, height=28, width=28)
    assert fast.choose_layout(fast.ConvGeometry(kernels=8, **first)) == fast.SAMPLE_MAJOR


def test_cache_sized_chunks_match_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, b, dy = _inputs((9, 3, 8, 7, 4, 3, 3, 1, 1))
    results = {}
    for working_bytes in (1 << 30, 1):  # one chunk, then MIN_CACHE_CHUNK-sample chunks
        monkeypatch.setattr(fast, "CHUNK_WORKING_BYTES", working_bytes)
        for layout in fast.LAYOUTS:
            y, cache = conv2d_forward_cached(x, w, b, 1, 1, layout=layout)
            assert len(cache.chunks) == (1 if working_bytes > 1 else 3)
            results[working_bytes, layout] = (y, *conv2d_backward_cached(cache, dy))
    for layout in fast.LAYOUTS:
        for got, want in zip(results[1, layout], results[1 << 30, layout], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
