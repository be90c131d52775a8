"""A training step's memory, estimated before the run (hetconv/planning/memory.py): the
estimate bounds what a step really allocates, and a network that cannot fit is one line
before anything starts."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import hetconv
from hetconv.model import (
    conv_layer_shapes,
    dense_shapes,
    model_config,
    parse_network,
)
from hetconv.planning.memory import calibration_bytes, check_fits, step_need
from hetconv.protocol import CalibrateRequest
from tests.conftest import REPO, child_env

PEAK_PROBE = """
import sys, tracemalloc
import numpy as np
from hetconv.bench.step import hetconv_step
from hetconv.model import init_parameters, model_config, parse_network
model = model_config(parse_network(sys.argv[1]), (1, 28, 28))
rng = np.random.default_rng(0)
x = rng.standard_normal((64, 1, 28, 28)).astype(np.float32)
labels = rng.integers(0, 10, 64)
tracemalloc.start()
with hetconv_step(model, init_parameters(model, 0), x, labels, 64) as step:
    step()
    step()
    print(tracemalloc.get_traced_memory()[1])
"""


@pytest.mark.parametrize("arch", ["c16k3p1,pool,c32k3p1,pool,fc64", "c8k3p1,res8,res16s2,gap",
                                  "16:32", "resnet20", "c64k3p1,c64k3p1,pool,c128k3p1,pool"])
def test_the_estimate_is_within_its_stated_band_of_the_real_peak(arch: str) -> None:
    """tracemalloc's peak from the stage's creation over two steps (numpy reports its
    arrays to it), in a fresh process (a warm one reuses scratch buffers allocated before
    the peak was traced): the estimate lies in 0.4x-1.5x of it (hetconv/planning/memory.py)."""
    probe = subprocess.run([sys.executable, "-c", PEAK_PROBE, arch], capture_output=True,
                           text=True, timeout=120, env=child_env(), cwd=REPO)
    assert probe.returncode == 0, probe.stderr[-2000:]
    peak = int(probe.stdout.split()[-1])
    model = model_config(parse_network(arch), (1, 28, 28))
    dense = sum(units * (features + 1) for _, features, units in dense_shapes(model))
    need = step_need(conv_layer_shapes(model), 64, dense).total
    assert 0.4 * peak <= need <= 1.5 * peak, (peak, need)


def test_a_network_that_cannot_fit_is_refused_before_the_run(tmp_path: Path) -> None:
    with pytest.raises(hetconv.UserError, match=r"^the network needs at least about \d+\.\d GiB for a "
                       r"training step at batch 8192 \(conv layer 2 alone") as caught:
        hetconv.train("c2048k3p1,c2048k3p1", "synthetic", batch=8192,
                      run_dir=tmp_path / "run", quiet=True)
    assert "--batch" in str(caught.value) and not (tmp_path / "run").exists()
    with pytest.raises(hetconv.UserError, match="1.0 GiB available"):
        check_fits(step_need(conv_layer_shapes(model_config(parse_network("c64k3p1"),
                                                            (1, 512, 512))), 256), 2**30, 256)


def test_a_worker_knows_what_timing_a_layer_needs() -> None:
    small = CalibrateRequest(request_id=1, layer=0, batch=64, in_channels=1, height=28,
                             width=28, kernels=16, kernel_size=3, stride=1, padding=1,
                             repeats=1, pool="none")
    big = CalibrateRequest(request_id=1, layer=1, batch=4096, in_channels=4096, height=28,
                           width=28, kernels=4096, kernel_size=3, stride=1, padding=1,
                           repeats=1, pool="none")
    assert calibration_bytes(small) < 2**26 and calibration_bytes(big) > 2**36


def test_the_master_refuses_to_time_a_layer_it_cannot_hold() -> None:
    from hetconv.master.calibration import own_fit

    shapes = conv_layer_shapes(model_config(parse_network("c4096k3p1,c4096k3p1"), (1, 28, 28)))
    own_fit(shapes[1], 8, 16, 1)  # small: no error
    with pytest.raises(hetconv.UserError, match=r"^the master cannot time layer 2 .*--no-local"):
        own_fit(shapes[1], 65536, 4096, 1)
