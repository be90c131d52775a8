"""Whether a network fits across a distributed run's machines (hetconv/planning/memory_spread.py)."""
from __future__ import annotations

from hetconv.model import conv_layer_shapes, model_config, parse_network
from hetconv.planning.memory import USABLE, step_need
from hetconv.planning.memory_spread import (
    kernel_capacity,
    kernel_need,
    machine_memory,
    sample_capacity,
    spread_refusal,
)

GIB = 2**30
SHAPES = conv_layer_shapes(model_config(parse_network("c256k3p1,c256k3p1"), (1, 28, 28)))
BATCH = 512


def cpu(host: str, memory: int, boot: int = 1, available: int | None = None) -> dict[str, object]:
    info: dict[str, object] = {"kind": "cpu", "device": "cpu", "hostname": host,
                               "boot_time": boot, "memory_bytes": memory}
    if available is not None:
        info["memory_available_bytes"] = available
    return info


def test_capacities_are_the_largest_share_whose_estimate_fits() -> None:
    memory = 2 * GIB
    samples = sample_capacity(SHAPES, BATCH, 0, memory)
    assert 0 < samples < BATCH
    assert step_need(SHAPES, samples).total <= USABLE * memory < step_need(SHAPES, samples + 1).total
    share = kernel_capacity(SHAPES, BATCH, memory)
    assert 0 < share < 1
    assert kernel_need(SHAPES, BATCH, share) <= USABLE * memory
    assert kernel_need(SHAPES, BATCH, share + 0.01) > USABLE * memory
    assert sample_capacity(SHAPES, BATCH, 0, 1000 * GIB) == BATCH
    assert kernel_capacity(SHAPES, BATCH, 1000 * GIB) == 1.0


def test_participants_of_one_machine_share_its_memory() -> None:
    memory = machine_memory([
        ("master", True, cpu("h1", 16 * GIB)),
        ("a", False, cpu("h1", 16 * GIB)),       # the master's machine: its available
        ("b", False, cpu("h2", 8 * GIB, available=6 * GIB)),
        ("c", False, cpu("h2", 8 * GIB, available=5 * GIB)),
        ("d", False, cpu("h2", 8 * GIB, boot=2)),  # a clone's hostname, another boot
        ("g", False, {**cpu("h2", 4 * GIB), "kind": "gpu", "device": "gpu:0"}),
    ], own_available=10 * GIB)
    assert memory == {"master+a": 10 * GIB, "b+c": 5 * GIB, "d": 8 * GIB, "g": 4 * GIB}
    old = {"kind": "cpu", "hostname": "h1", "memory_bytes": GIB}  # no boot time: its own
    assert machine_memory([("x", False, old), ("y", False, old)], GIB) == {"x": GIB, "y": GIB}
    assert machine_memory([("x", False, {"kind": "cpu"})], GIB) is None


def test_a_network_is_refused_only_when_no_split_spreads_it() -> None:
    small = {"m": 2 * GIB}
    line = spread_refusal(SHAPES, BATCH, 0, small, ["samples", "kernels"])
    assert line is not None and line.startswith("the network cannot fit at batch 512")
    assert "samples split by samples or" in line and "of the kernels split by kernels" in line
    assert "m 2.0 GiB" in line and "--batch" in line
    # enough machines: the slices (or the kernels) spread over them fit
    many = {f"w{i}": 2 * GIB for i in range(8)}
    assert spread_refusal(SHAPES, BATCH, 0, many, ["samples", "kernels"]) is None
    assert spread_refusal(SHAPES, BATCH, 0, many, ["samples"]) is None
    # one split pinned: only it counts
    pinned = spread_refusal(SHAPES, BATCH, 0, small, ["kernels"])
    assert pinned is not None and "split by samples" not in pinned


def test_no_split_named_concludes_nothing() -> None:
    assert spread_refusal(SHAPES, BATCH, 0, {"m": 2 * GIB}, []) is None
