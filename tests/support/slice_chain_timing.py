"""Time one participant's forward and backward chains alone, with the whole batch's
batch-norm statistics and with its slice's own (``--bn-statistics slice``), alternated:
the chain's own compute, without peers or a LAN (docs/sample-split.md, "Measured").

    python -m tests.support.slice_chain_timing [SAMPLES]

Prints milliseconds per step (forward + backward chain, the update riding along) for 6
steps of each, twice, on the VGG-style network of figures/accuracy-vgg.md, one thread."""
from __future__ import annotations

import os
import queue
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from hetconv.engine.shard import ConvShard  # noqa: E402
from hetconv.engine.stage import layer_settings  # noqa: E402
from hetconv.model import (  # noqa: E402
    conv_layer_shapes,
    init_parameters,
    layer_parameters,
    model_config,
    parse_network,
)
from hetconv.participant.samples.reduction_plan import reduce_plan  # noqa: E402
from hetconv.participant.samples.runner import SampleRunner  # noqa: E402
from hetconv.participant.samples.weight_reduce import GradientExchange  # noqa: E402
from tests.support.queue_port import QueuePort  # noqa: E402
from tests.unit.test_sample_chain import _backward, _forward  # noqa: E402

NETWORK = "c32k3p1,c32k3p1,pool,c64k3p1,c64k3p1,pool,fc256,drop0.5"


def main(samples: int = 32) -> None:
    model = model_config(parse_network(NETWORK), (1, 28, 28))
    params = init_parameters(model, seed=3)
    settings = layer_settings(model, momentum=0.9, weight_decay=5e-4)
    shapes = conv_layer_shapes(model)
    layers, positions = len(shapes), [s.conv_height * s.conv_width for s in shapes]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, 1, 28, 28)).astype(np.float32)
    last = shapes[-1]
    dy = rng.standard_normal((samples, last.kernels, last.pooled_height,
                              last.pooled_width)).astype(np.float32)
    for by_slice in (False, True, False, True):
        plan = reduce_plan([s.kernels for s in shapes], ["a"], ["a"])
        runner = SampleRunner()
        runner.layers.exchange = GradientExchange("a", plan, QueuePort({"a": queue.Queue()}, "a"), 5.0)
        shards = {s.index: ConvShard(s.index, 0, s.kernels, settings,
                                     layer_parameters(params, s.index)) for s in shapes}
        times = []
        for step in range(6):
            sync = 10 + 3 * step
            started = time.perf_counter()
            runner.serve(_forward(step, sync, ["a"], [samples], x, layers, positions,
                                  sync - 2 if step else 0, ("a",) if step else (),
                                  by_slice=by_slice), shards)
            runner.serve(_backward(step, sync + 1, ["a"], dy, layers, by_slice=by_slice),
                         shards)
            times.append(time.perf_counter() - started)
        print(f"{'slice' if by_slice else 'batch'}: "
              + " ".join(f"{t * 1e3:.1f}" for t in times) + " ms per step")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 32)
