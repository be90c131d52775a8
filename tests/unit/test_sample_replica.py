"""The sample split's layer phases (hetconv/participant/samples/replica.py) against the whole batch
on one machine (ConvShard.forward/backward): same outputs, gradients, updates and
running statistics, for 1, 2 and 3 slices of unequal size."""
from __future__ import annotations

import numpy as np
import pytest

from hetconv.engine.shard import ConvShard
from hetconv.engine.stage import layer_settings
from hetconv.model import ModelConfig, conv_layer_shapes, init_parameters, layer_parameters
from hetconv.participant.samples.replica import SampleReplica, add_in_order, moments_to_statistics


def _network(pool: str = "max", batch_norm: bool = True):
    model = ModelConfig((4, 6), (2, 16, 16))
    params = init_parameters(model, seed=3)
    settings = layer_settings(model, momentum=0.9, weight_decay=5e-4)
    if pool != "max" or not batch_norm:
        from dataclasses import replace
        settings = replace(settings, pool=pool, batch_norm=batch_norm,
                           per_layer=tuple(replace(s, pool=pool, batch_norm=batch_norm)
                                           for s in settings.per_layer))
    return model, params, settings


def _shards(model, params, settings):
    return [ConvShard(s.index, 0, s.kernels, settings, layer_parameters(params, s.index))
            for s in conv_layer_shapes(model)]


def _run_split(replicas_per_slice, x, dy, slices, lr):
    """Forward and backward of every layer with the batch cut into ``slices``,
    coordinated as the master does; returns the whole output."""
    total = x.shape[0]
    layers = len(replicas_per_slice[0])
    acts = [x[a:b] for a, b in slices]
    for layer in range(layers):
        parts = [reps[layer].start_forward(a, total) for reps, a in zip(replicas_per_slice, acts)]
        if parts[0] is None:
            acts = [reps[layer].finish_forward(None, None) for reps in replicas_per_slice]
        else:
            mean, var = moments_to_statistics(parts)
            acts = [reps[layer].finish_forward(mean, var) for reps in replicas_per_slice]
    out = np.concatenate(acts, axis=0)
    grads = [dy[a:b] for a, b in slices]
    for layer in reversed(range(layers)):
        sums = [reps[layer].start_backward(g) for reps, g in zip(replicas_per_slice, grads)]
        dgamma = add_in_order([s[0] for s in sums])
        dbeta = add_in_order([s[1] for s in sums])
        results = [reps[layer].finish_backward(dgamma, dbeta, layer > 0)
                   for reps in replicas_per_slice]
        dweight = add_in_order([r[1] for r in results])
        for reps in replicas_per_slice:
            reps[layer].apply_update(dweight, lr)
        grads = [r[0] for r in results]
    return out


@pytest.mark.parametrize("cuts", [[12], [5, 7], [3, 4, 5], [1, 11]])
@pytest.mark.parametrize("variant", [("max", True), ("avg", True), ("none", False)])
def test_slices_reproduce_the_whole_batch(cuts, variant):
    model, params, settings = _network(*variant)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 2, 16, 16)).astype(np.float32)
    reference = _shards(model, params, settings)
    slices, start = [], 0
    for n in cuts:
        slices.append((start, start + n))
        start += n
    replicas = [[SampleReplica(s) for s in _shards(model, params, settings)] for _ in cuts]
    for step in range(3):
        h = x
        for shard in reference:
            h = shard.forward_host(h, True)
        dy = np.random.default_rng(step).standard_normal(h.shape).astype(np.float32) / 12
        g = dy
        for shard in reversed(reference):
            g = shard.backward_host(g, shard.layer > 0, 0.05)
        out = _run_split(replicas, x, dy, slices, 0.05)
        np.testing.assert_allclose(out, h, rtol=1e-4, atol=1e-5)
        for shard, *copies in zip(reference, *replicas):
            for name, value in shard.snapshot().items():
                for copy in copies:
                    # float32 sums in another order: within 1e-5 of the array's peak
                    peak = float(np.abs(value).max()) or 1.0
                    np.testing.assert_allclose(copy.shard.snapshot()[name], value, rtol=1e-4,
                                               atol=1e-5 * peak, err_msg=f"{name} step {step}")
    # every replica holds the same bits
    for layer_copies in zip(*replicas):
        first = layer_copies[0].shard.snapshot()
        for copy in layer_copies[1:]:
            for name, value in copy.shard.snapshot().items():
                np.testing.assert_array_equal(value, first[name])


def test_an_odd_map_before_a_pool_is_refused():
    model = ModelConfig((4,), (1, 11, 11), kernel_size=3)
    params = init_parameters(model, seed=1)
    settings = layer_settings(model, 0.9, 5e-4)
    replica = SampleReplica(_shards(model, params, settings)[0])
    with pytest.raises(ValueError, match="cannot be split by samples"):
        replica.start_forward(np.zeros((2, 1, 11, 11), np.float32), 4)
