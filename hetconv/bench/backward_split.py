"""``hetconv bench backward-split``: the sample split's two-part backward against the
one-part backward it replaces.

``hetconv bench backward-split [--batch 62] [--repeats 30]`` times, on one
thread, a conv block's backward after its barrier (the block's forward and its batch
norm sums first, untimed): ``SampleReplica.finish_backward`` (dx and dW in one pass)
and ``finish_backward_split`` with its weight gradient computed at once (the sample
split's backward chain: dx, then dW while the next barrier's pieces travel),
interleaved repeat by repeat, on the demo network's second layer (32 -> 64 channels,
14 x 14, 3 x 3, batch norm, 2 x 2 max pool) by default. Prints the medians after
three warm-up repeats and the split's cost over the one-part backward; only the ratio
means anything on a shared machine.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from hetconv.backend import computing_threads
from hetconv.engine.shard import ConvShard
from hetconv.engine.stage import layer_settings
from hetconv.model import ModelConfig, conv_layer_shapes, init_parameters, layer_parameters
from hetconv.participant.samples.replica import SampleReplica, moments_to_statistics

WARM_UP = 3


def replica_of(model: ModelConfig, layer: int) -> SampleReplica:
    """A replica of ``layer`` of ``model`` (seeded weights, SGD settings of a run)."""
    params = init_parameters(model, seed=5)
    settings = layer_settings(model, momentum=0.9, weight_decay=5e-4)
    shape = conv_layer_shapes(model)[layer]
    return SampleReplica(ConvShard(shape.index, 0, shape.kernels, settings,
                                   layer_parameters(params, shape.index)))


def time_backwards(batch: int, repeats: int) -> dict[str, float]:
    """Median seconds of the one-part and the two-part backward of the demo network's
    second layer on ``batch`` samples, interleaved."""
    model = ModelConfig((32, 64), (1, 28, 28), kernel_size=3, padding=1)
    replica = replica_of(model, 1)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, 32, 14, 14)).astype(np.float32)
    dy = rng.standard_normal((batch, 64, 7, 7)).astype(np.float32)
    seconds: dict[str, list[float]] = {"one part": [], "two parts": []}
    for repeat in range(WARM_UP + repeats):
        for name in seconds:
            moments = replica.start_forward(x, batch)
            assert moments is not None
            replica.finish_forward(*moments_to_statistics([moments]))
            sums = replica.start_backward(dy)
            started = time.perf_counter()
            if name == "one part":
                replica.finish_backward(*sums, need_dx=True)
            else:
                _, weight_gradient = replica.finish_backward_split(*sums)
                weight_gradient()
            if repeat >= WARM_UP:
                seconds[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in seconds.items()}


def run_backward_split_bench(batch: int, repeats: int) -> list[str]:
    """Print the comparison and return it as markdown lines (one thread)."""
    with computing_threads(1):
        medians = time_backwards(batch, repeats)
    one, two = medians["one part"], medians["two parts"]
    print(f"layer 2 of 32:64, {batch} samples, 1 thread, medians of {repeats}: one-part "
          f"backward {one * 1e3:.2f} ms, two parts {two * 1e3:.2f} ms "
          f"({(two / one - 1) * 100:+.0f} %)")
    return ["| layer | samples | one-part backward ms | two parts ms | two parts over one |",
            "|---|---|---|---|---|",
            f"| 2 of 32:64 (32 -> 64 channels, 14 x 14) | {batch} | {one * 1e3:.2f} | "
            f"{two * 1e3:.2f} | {(two / one - 1) * 100:+.0f} % |"]
