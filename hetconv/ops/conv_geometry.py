"""The sizes of one convolution (:class:`ConvGeometry`, validated by :func:`make_geometry`)
and the choice of algorithm for them (:func:`choose_layout`), made by a cost model.

Two column layouts, chosen per shape by ``choose_layout``:

* ``batch_inner``: columns ordered (ho, wo, b). The input is first transposed to
  (C, H, W, B), so every im2col copy and every col2im add moves ``Wo*B`` contiguous
  numbers instead of ``Wo`` (deep layers have tiny ``Wo``, e.g. 10); the GEMMs are
  big (N = Ho*Wo*B). The price is a 2-D transpose of y and dy between (B, K*P) and
  (K*P, B), done in cache-sized blocks with the bias added while the block is hot.
* ``sample_major``: ``col[b]`` is (Q, P) and one GEMM per sample writes ``y[b]`` in
  place, so y and dy are never transposed. Best for large outputs (first layers),
  where P = Ho*Wo is already a good GEMM width and y is too big to transpose cheaply.

A third algorithm, ``shifted_taps`` (``hetconv.ops.conv_shifted``), never unfolds
the input: its extra work grows with the kernel share K instead of the channels C, so
it wins for small shares of deep layers. ``choose_layout`` picks per shape and share
with a two-term cost model (GEMM multiply-adds, numbers moved; ``estimated_seconds``).
The Winograd choice on top of these is made in :mod:`hetconv.ops.conv`.
"""
from __future__ import annotations

from dataclasses import dataclass

from hetconv.ops.conv_chunks import (
    BATCH_INNER,
    SAMPLE_MAJOR,
    SHIFTED_TAPS,  # no unfolding: see hetconv.ops.conv_shifted
)

LAYOUTS = (BATCH_INNER, SAMPLE_MAJOR, SHIFTED_TAPS)
SAMPLE_MAJOR_MIN_POSITIONS = 576  # Ho*Wo from which one GEMM per sample is cheaper ...
SAMPLE_MAJOR_MIN_POSITIONS_FEW_TAPS = 144  # ... or from here when K >= Q (y is the big one)
# choose_layout's cost model, measured at one BLAS thread (AMD EPYC, float32): GEMM
# multiply-adds per second, and seconds per number moved by a strided copy or add.
MODEL_FLOP_PER_S = 85e9
MODEL_COPY_S = 0.85e-9


@dataclass(frozen=True)
class ConvGeometry:
    """Sizes of one convolution (all counts; stride and padding in pixels)."""

    batch: int
    channels: int
    height: int
    width: int
    kernels: int
    kernel_h: int
    kernel_w: int
    stride: int
    padding: int

    @property
    def out_h(self) -> int:  # Ho = (H + 2*padding - kh)//stride + 1
        return (self.height + 2 * self.padding - self.kernel_h) // self.stride + 1

    @property
    def out_w(self) -> int:  # Wo, likewise
        return (self.width + 2 * self.padding - self.kernel_w) // self.stride + 1

    @property
    def taps(self) -> int:  # Q = C*kh*kw, the rows of the column matrix
        return self.channels * self.kernel_h * self.kernel_w

    @property
    def positions(self) -> int:  # P = Ho*Wo, output positions per sample
        return self.out_h * self.out_w

    @property
    def forward_flop(self) -> float:
        return 2.0 * self.batch * self.kernels * self.taps * self.positions



def make_geometry(x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: int,
                  padding: int) -> ConvGeometry:
    """Validate shapes and hyper-parameters; raise ValueError with what is wrong."""
    if len(x_shape) != 4 or len(w_shape) != 4 or x_shape[1] != w_shape[1]:
        raise ValueError(f"conv2d: x {x_shape} must be (B, C, H, W) and w {w_shape} "
                         "must be (K, C, kh, kw) with the same C")
    if int(stride) < 1 or int(padding) < 0:
        raise ValueError(f"conv2d: stride must be >= 1 and padding >= 0, got {stride}, {padding}")
    batch, channels, height, width = (int(v) for v in x_shape)
    g = ConvGeometry(batch, channels, height, width, int(w_shape[0]), int(w_shape[2]),
                     int(w_shape[3]), int(stride), int(padding))
    if g.out_h < 1 or g.out_w < 1:
        raise ValueError(f"conv2d: kernel {w_shape[2:]} larger than padded input {x_shape[2:]}")
    return g


def choose_im2col_layout(g: ConvGeometry) -> str:
    """The im2col column layout that is cheaper for this shape (see the module docstring).

    The batch-inner layout pays for transposing y and dy (B*K*P numbers) and saves on
    short copies in im2col/col2im (B*Q*P numbers in runs of Wo); with large outputs, or
    with more kernels than taps (first layers), the transposes cost more.
    """
    few_taps = g.kernels >= g.taps and g.positions >= SAMPLE_MAJOR_MIN_POSITIONS_FEW_TAPS
    return SAMPLE_MAJOR if few_taps or g.positions >= SAMPLE_MAJOR_MIN_POSITIONS else BATCH_INNER


def estimated_seconds(g: ConvGeometry, layout: str) -> float:
    """Rough seconds of forward + backward (dx included) at one thread (cost model).

    im2col: three GEMMs over the B*P output positions, plus unfolding twice (forward,
    and again in the backward pass) and folding dx back: 3*B*Q*P numbers moved, a
    cost independent of K. Shifted taps: three GEMMs over all B*Hp*Wp padded
    positions, plus the kh*kw shifted adds and the spread dy: about kh*kw*K*B*(2P +
    Hp*Wp) numbers, proportional to K.
    """
    padded_positions = (g.height + 2 * g.padding) * (g.width + 2 * g.padding)
    if layout == SHIFTED_TAPS:
        multiply_adds = 3 * 2.0 * g.batch * g.kernels * g.taps * padded_positions
        moved = g.batch * g.kernel_h * g.kernel_w * g.kernels * (2.0 * g.positions
                                                                  + padded_positions)
    else:
        multiply_adds = 3 * 2.0 * g.batch * g.kernels * g.taps * g.positions
        moved = 3.0 * g.batch * g.taps * g.positions
    return multiply_adds / MODEL_FLOP_PER_S + moved * MODEL_COPY_S


def choose_layout(g: ConvGeometry) -> str:
    """The algorithm for this shape and kernel share: shifted taps when the cost model
    says that avoiding the K-independent unfolding pays for its extra multiply-adds
    (small shares of deep layers), else the better im2col layout."""
    im2col = choose_im2col_layout(g)
    if g.kernels and estimated_seconds(g, SHIFTED_TAPS) < estimated_seconds(g, im2col):
        return SHIFTED_TAPS
    return im2col
