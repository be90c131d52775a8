"""A whole conv layer on one participant of a sample split: its slice of the batch.

Under the sample split (``--split-by samples``, docs/sample-split.md) every participant
holds the whole layer (every kernel, as a :class:`~hetconv.engine.shard.ConvShard` of kernels
[0, K)) and runs samples [s_i, e_i) of the batch through it. Batch norm still sees the
whole batch: the layer's phases stop where the participants must agree, and the
coordinator (the master) combines what they report in participant order:

forward (training)
    :meth:`SampleReplica.start_forward` x (B_i, C, H, W) -> this slice's moments
    (count, sum (K,), M2 (K,)) of the conv output; the coordinator combines every
    slice's with ``combine_moments``; :meth:`finish_forward` (mean, var) -> the block
    output (B_i, K, H', W') and the new running statistics (equal on every participant).
backward
    :meth:`start_backward` dy (B_i, K, H', W') -> this slice's batch-norm sums
    (dgamma_i, dbeta_i) (K,); the coordinator adds them in participant order;
    :meth:`finish_backward` (dgamma, dbeta) -> (dx (B_i, C, H, W) or None, this slice's
    dweight_i (K, C, k, k)) (or :meth:`finish_backward_split`: dx now, dweight_i
    later, the sample chain's way of filling the next barrier's wait with it); the
    coordinator adds the dweight_i in participant order;
    :meth:`apply_update` (dweight) updates weight, gamma and beta with the whole batch's
    gradients (the same SGD step on every participant, so the replicas stay equal).

A slice of 0 samples is not run (the coordinator leaves it out); the update still
applies. Evaluation needs no agreement: ``shard.forward_host(x, False)``. The layer
must take the fused block pass (``block_fast.supported``); :func:`sample_splittable`
says so.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hetconv.backend import on_device, to_module, to_numpy
from hetconv.engine.optim import sgd_update
from hetconv.engine.shard import ConvShard
from hetconv.ops import block_fast
from hetconv.ops.block_fast import combine_moments
from hetconv.ops.conv import conv2d_backward_cached, conv2d_forward_cached
from hetconv.ops.conv_layer import conv_output_size
from hetconv.ops.conv_split import conv2d_backward_split

__all__ = ["SampleReplica", "combine_moments", "sample_splittable", "add_in_order",
           "moments_to_statistics"]


def sample_splittable(pool: str, height: int, width: int, kernel_size: int, stride: int,
                      padding: int) -> bool:
    """Whether a layer of these settings on (H, W) inputs can be split by samples (it
    takes the fused block pass, whose batch-norm phases can be synchronised)."""
    conv_h = conv_output_size(height, kernel_size, stride, padding)
    conv_w = conv_output_size(width, kernel_size, stride, padding)
    return block_fast.supported(pool, conv_h, conv_w)


def add_in_order(arrays: list[np.ndarray]) -> np.ndarray:
    """The float32 sum of ``arrays`` added left to right (participant order), so every
    run with the same participants gets the same bits."""
    total = np.array(arrays[0], dtype=np.float32, copy=True)
    for array in arrays[1:]:
        total += array
    return total


def moments_to_statistics(parts: list[tuple[int, np.ndarray, np.ndarray]]
                          ) -> tuple[np.ndarray, np.ndarray]:
    """The whole batch's (mean, biased variance) (K,) float32 from every slice's
    (count, sum, M2), combined in participant order."""
    count, total, squares = combine_moments(
        [(n, np.asarray(s, np.float32), np.asarray(m, np.float32)) for n, s, m in parts])
    return (total / np.float32(count)).astype(np.float32), \
        (squares / np.float32(count)).astype(np.float32)


class SampleReplica:
    """One participant's copy of a whole conv layer under the sample split (see the
    module doc). Host arrays in and out; the shard's device computes."""

    def __init__(self, shard: ConvShard):
        if shard.kernel_start != 0:
            raise ValueError("a sample-split replica holds the whole layer (kernels from 0)")
        self.shard = shard
        self._pass: block_fast.BlockPass | None = None
        self._conv_cache: Any = None
        self._input_shape: tuple[int, ...] = ()
        self._sums: tuple[Any, Any] | None = None  # the whole batch's (dgamma, dbeta)

    @property
    def layer(self) -> int:
        return self.shard.layer

    def start_forward(self, x: np.ndarray, total_batch: int, train: bool = True
                      ) -> tuple[int, np.ndarray, np.ndarray] | None:
        """Convolve this slice x (B_i, C, H, W); returns its moments (count, sum (K,),
        M2 (K,)) when batch norm needs the whole batch's statistics (training with batch
        norm), else None (the output is final: :meth:`finish_forward` with no
        statistics)."""
        shard, settings = self.shard, self.shard.settings
        s = shard.state
        with on_device(shard.device):
            xp = shard.xp
            x_dev = to_module(np.ascontiguousarray(x, dtype=np.float32), xp)
            weight = s["weight"]
            conv_h = conv_output_size(x.shape[2], weight.shape[2], settings.stride,
                                      settings.padding)
            conv_w = conv_output_size(x.shape[3], weight.shape[3], settings.stride,
                                      settings.padding)
            if not block_fast.supported(settings.pool, conv_h, conv_w):
                raise ValueError(f"layer {shard.layer}: this block cannot be split by samples "
                                 f"(a {settings.pool} pool of an odd {conv_h}x{conv_w} map)")
            dtype = xp.result_type(x_dev.dtype, weight.dtype)
            fused = block_fast.BlockPass(
                xp, x.shape[0], (conv_h, conv_w), s["gamma"], s["beta"], s["running_mean"],
                s["running_var"], train, settings.pool, settings.batch_norm,
                settings.bn_momentum, settings.bn_eps, dtype,
                keep=shard.workspace if train else None, total_batch=total_batch,
                relu=settings.relu)
            _, conv_cache = conv2d_forward_cached(
                x_dev, weight, None, stride=settings.stride, padding=settings.padding,
                sink=fused, workspace=shard.workspace if train else None)
            self._pass, self._conv_cache = fused, conv_cache
            self._input_shape = tuple(x.shape)
            if fused.statistics_later:
                count, total, squares = fused.local_statistics(conv_cache.chunks,
                                                               conv_cache.threads)
                return count, to_numpy(total).astype(np.float32), \
                    to_numpy(squares).astype(np.float32)
        return None

    def finish_forward(self, mean: np.ndarray | None, var: np.ndarray | None,
                       running: bool = True) -> np.ndarray:
        """The block output (B_i, K, H', W') float32 of this slice, normalised with the
        whole batch's (mean, var) (K,) (None where :meth:`start_forward` returned None);
        keeps what the backward pass needs and, with ``running``, the new running
        statistics (without: the slice's own statistics, the running ones to follow from
        the whole batch's by :meth:`follow_statistics`)."""
        fused, shard = self._pass, self.shard
        if fused is None:
            raise RuntimeError(f"layer {shard.layer}: finish_forward without start_forward")
        with on_device(shard.device):
            xp = shard.xp
            if fused.statistics_later:
                if mean is None or var is None:
                    raise ValueError(f"layer {shard.layer}: the batch statistics are missing")
                y, new_mean, new_var = fused.finish_with(to_module(mean, xp), to_module(var, xp))
            else:
                y, new_mean, new_var = fused.finish(self._conv_cache.chunks,
                                                    self._conv_cache.threads)
            if fused.train and running:
                shard.state["running_mean"], shard.state["running_var"] = new_mean, new_var
            return to_numpy(y)

    def start_backward(self, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """dy (B_i, K, H', W') of this slice -> its batch-norm sums (dgamma_i, dbeta_i)
        (K,) float32 (dgamma_i zero without batch norm)."""
        fused, shard = self._pass, self.shard
        if fused is None or not fused.train:
            raise RuntimeError(f"layer {shard.layer}: backward without a training forward")
        with on_device(shard.device):
            dgamma, dbeta = fused.backward_sums(to_module(
                np.ascontiguousarray(dy, dtype=np.float32), shard.xp))
            return to_numpy(dgamma).astype(np.float32), to_numpy(dbeta).astype(np.float32)

    def _pass_with_sums(self, dgamma: np.ndarray, dbeta: np.ndarray) -> tuple[Any, Any]:
        """(the kept block pass, its conv cache) for the backward's second part: the
        block given the whole batch's sums (K,), which are kept for the update; the
        replica holds the pass no more (a failed backward is retried from a new
        forward). Call on the shard's device."""
        fused, shard = self._pass, self.shard
        if fused is None:
            raise RuntimeError(f"layer {shard.layer}: backward without a training forward")
        sums = (to_module(np.asarray(dgamma, np.float32), shard.xp),
                to_module(np.asarray(dbeta, np.float32), shard.xp))
        fused.set_sums(*sums)
        cache = self._conv_cache
        self._sums = sums
        self._pass, self._conv_cache = None, None
        return fused, cache

    def finish_backward(self, dgamma: np.ndarray, dbeta: np.ndarray, need_dx: bool
                        ) -> tuple[np.ndarray | None, np.ndarray]:
        """With the whole batch's sums (K,): (dx (B_i, C, H, W) float32 or None, this
        slice's weight gradient (K, C, k, k) float32). The sums are kept for the update."""
        with on_device(self.shard.device):
            fused, cache = self._pass_with_sums(dgamma, dbeta)
            dx, dweight, _ = conv2d_backward_cached(cache, None, need_dx=need_dx,
                                                    need_db=False, source=fused)
            return (to_numpy(dx) if need_dx and dx is not None else None), \
                to_numpy(dweight).astype(np.float32)

    def finish_backward_split(self, dgamma: np.ndarray, dbeta: np.ndarray
                              ) -> tuple[np.ndarray, Callable[[], np.ndarray]]:
        """:meth:`finish_backward` with dx, in two parts: dx (B_i, C, H, W) float32 now,
        and a callable that returns this slice's weight gradient (K, C, k, k) float32
        (call it once, before this replica's next forward: e.g. while the next layer
        down waits at its barrier)."""
        shard = self.shard
        with on_device(shard.device):
            fused, cache = self._pass_with_sums(dgamma, dbeta)
            dx, pending = conv2d_backward_split(cache, fused)

        def weight_gradient() -> np.ndarray:
            with on_device(shard.device):
                return to_numpy(pending.compute()).astype(np.float32)
        return to_numpy(dx), weight_gradient

    def apply_update(self, dweight: np.ndarray, learning_rate: float,
                     sums: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """The SGD step with the whole batch's weight gradient (K, C, k, k) and the sums
        of :meth:`finish_backward` (or ``sums`` (dgamma, dbeta), for a replica that had
        no slice), momentum and weight decay as the layer's settings."""
        shard, cfg = self.shard, self.shard.settings
        s = shard.state
        with on_device(shard.device):
            xp = shard.xp
            if sums is not None:
                self._sums = (to_module(np.asarray(sums[0], np.float32), xp),
                              to_module(np.asarray(sums[1], np.float32), xp))
            if self._sums is None:
                raise RuntimeError(f"layer {shard.layer}: an update without a backward pass")
            dgamma, dbeta = self._sums
            sgd_update(s["weight"], to_module(np.asarray(dweight, np.float32), xp),
                       s["velocity_weight"], learning_rate, cfg.momentum, cfg.weight_decay)
            sgd_update(s["gamma"], dgamma, s["velocity_gamma"], learning_rate, cfg.momentum, 0.0)
            sgd_update(s["beta"], dbeta, s["velocity_beta"], learning_rate, cfg.momentum, 0.0)
        self._sums = None

    @property
    def started(self) -> bool:
        """Whether a forward pass of this replica's slice waits for its statistics."""
        return self._pass is not None

    def follow_statistics(self, mean: np.ndarray, var: np.ndarray, count: int) -> None:
        """For a replica without a slice: the running statistics' update that every
        participant's :meth:`finish_forward` makes from the whole batch's (mean, var) over
        ``count`` values per channel (B·Ho·Wo; the same arithmetic as ``BlockPass``), so
        this replica stays equal to theirs."""
        shard, cfg = self.shard, self.shard.settings
        if not cfg.batch_norm:
            return
        with on_device(shard.device):
            xp = shard.xp
            mean_d = to_module(np.asarray(mean, np.float32), xp)
            var_d = to_module(np.asarray(var, np.float32), xp)
            unbiased = var_d * (count / max(count - 1, 1))
            s = shard.state
            rm, rv = s["running_mean"], s["running_var"]
            s["running_mean"] = ((1.0 - cfg.bn_momentum) * rm + cfg.bn_momentum * mean_d
                                 ).astype(rm.dtype, copy=False)
            s["running_var"] = ((1.0 - cfg.bn_momentum) * rv + cfg.bn_momentum * unbiased
                                ).astype(rv.dtype, copy=False)

    def forward_eval(self, x: np.ndarray) -> np.ndarray:
        """The evaluation-mode block output of x (running statistics; nothing to agree)."""
        return self.shard.forward_host(x, False)
