"""Typed configuration: every setting a run or a daemon reads, and every choice.

The command line (``hetconv.commands``) builds these frozen dataclasses from flags,
then ``HETCONV_*`` environment variables, then defaults; nothing below the command
line sees an ``argparse.Namespace``. The tuples of choices (datasets, schedules,
split modes, wire dtypes) are defined here once and used by the flags, the
configuration checks and the code that acts on them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hetconv.errors import UserError
from hetconv.protocol import limits
from hetconv.protocol.transport import CurveClientKeys

DATASETS = ("fashion-mnist", "cifar10", "folder", "synthetic")
ARRAYS = "arrays"
"""The data of a run from the Python API's arrays in memory (hetconv.api.arrays)."""
SCHEDULES = ("cosine", "step", "constant")
SPLIT_MODES = ("model", "calibrated", "equal")
SPLIT_BY = ("auto", "kernels", "samples")
"""``--split-by``: what a conv layer is cut into (docs/sample-split.md); the first is the
default."""
WIRE_DTYPES = ("float32", "float16")
WIRE_DTYPE_AUTO = "auto"  # --wire-dtype auto: the planner picks per run (docs/scale-out.md)
WIRE_FLOAT16_GAIN = 0.03
"""--wire-dtype auto takes float16 only for a predicted step this much shorter."""
WIRE_DTYPE_FLAGS = WIRE_DTYPES + (WIRE_DTYPE_AUTO,)
ON_OFF = ("on", "off")  # --rebalance
ON_WORKER_LOSS = ("continue", "stop")  # --on-worker-loss
DATA_PLANES = ("peer", "star")  # peer (default): worker to worker; star: all via the master
BN_STATISTICS = ("batch", "slice")  # batch (default): the whole batch's; slice: per slice
DENSE_PARTS = ("auto", "replicas", "master")
"""``--dense-part``: auto (default) replicates the dense part on the participants where the
sample split's chains run (docs/dense-replica.md), else it stays on the master."""
STEPS_IN_FLIGHT = (2, 1)
"""``--steps-in-flight``: 2 (default) sends the sample split's next step chain before this
one's replies are gathered (docs/sample-split.md, "The step boundary"); 1 one at a time."""
BENCH_DENSE_PARTS = DENSE_PARTS  # hetconv bench scale --dense-part: what it compares
BENCH_PEERS = ("ddp",)  # hetconv bench scale --peer: what users would run instead
ACCURACY_PEERS = ("torch",)  # hetconv bench accuracy --peer: the same training in PyTorch
STEP_OPS = ("fused", "separate")  # hetconv bench step --ops: the conv layer paths timed
PADDINGS = (0, 1, 2)

MASTER_PARTICIPANT = "master"  # the participant id of the master's own device


def check_choice(flag: str, value: str, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else a one-line :class:`UserError`."""
    if value not in choices:
        raise UserError(f"{flag} {value!r}: choose one of {', '.join(choices)}")
    return value


ENDPOINT_SCHEMES = ("tcp", "ipc", "inproc")


def check_endpoint(flag: str, endpoint: str, *, bind: bool) -> str:
    """``endpoint`` if ZeroMQ can bind (``bind``) or connect to it, else one line.

    tcp needs a host and a port in 1-65535 (binding also takes ``*`` for both: any
    address, a free port); ipc and inproc need a name. Checked here, before any socket,
    because libzmq takes some bad ports (``tcp://*:310730``) without a word.
    """
    example = "tcp://*:5555" if bind else "tcp://192.168.1.10:5555"
    scheme, separator, address = endpoint.partition("://")
    if not separator or scheme not in ENDPOINT_SCHEMES:
        raise UserError(f"{flag} {endpoint!r}: expected an endpoint like {example} "
                        f"(schemes: {', '.join(ENDPOINT_SCHEMES)})")
    if not address:
        raise UserError(f"{flag} {endpoint!r}: names no address; e.g. {example}")
    if scheme != "tcp":
        return endpoint
    host, colon, port = address.rpartition(":")
    if not colon or not host or host == "[]":
        raise UserError(f"{flag} {endpoint!r}: expected tcp://HOST:PORT, e.g. {example}")
    if host == "*" and not bind:
        raise UserError(f"{flag} {endpoint!r}: name the host to connect to, e.g. {example}")
    if port == "*" and bind:
        return endpoint
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        accepted = "1-65535, or * for any free port" if bind else "1-65535"
        raise UserError(f"{flag} {endpoint!r}: port {port!r} is not a port number "
                        f"({accepted})")
    return endpoint


@dataclass(frozen=True)
class DataConfig:
    """Which dataset, where it lies, how much of it to use and how to vary it."""

    name: str = "fashion-mnist"
    data_dir: str | None = None
    limit: int | None = None  # train on the first N images
    test_limit: int | None = None  # evaluate on the first N test images
    image_size: int | None = None  # --data folder: resize to this side (None: detected)
    augment: bool = False  # random crop with padding and horizontal flips while training

    def __post_init__(self) -> None:
        check_choice("--data", self.name, DATASETS + (ARRAYS,))
        if self.image_size is not None and self.name != "folder":
            raise UserError(f"--image-size applies to --data folder only, not {self.name}")


@dataclass(frozen=True)
class MasterConfig:
    """How a distributed run finds, checks and uses its workers."""

    listen: str
    min_workers: int = 1
    wait_s: float = 60.0
    use_local_device: bool = True  # the master's own device computes a shard too
    split: str = "model"
    wire_dtype: str = "float32"
    curve_secret: str | None = None  # the master's NAME.key_secret
    curve_allow: str | None = None  # directory of allowed workers' NAME.key
    data_plane: str = DATA_PLANES[0]
    peer_timeout_s: float = limits.DEFAULT_PEER_TIMEOUT_S
    rebalance: bool | None = None  # re-split from measured step times; None: on for "model"
    on_worker_loss: str = ON_WORKER_LOSS[0]  # when the last worker is gone
    split_by: str = SPLIT_BY[0]  # auto (default), kernels (the paper's) or samples
    fall_back: bool = True  # train alone when the plan measures slower than the master alone
    # batch norm under the sample split: the whole batch's statistics (every layer waits for
    # every slice's moments) or each slice's own (PyTorch DDP's per-rank semantics)
    bn_statistics: str = BN_STATISTICS[0]
    dense_part: str = DENSE_PARTS[0]  # where the dense part runs under the sample split
    steps_in_flight: int = STEPS_IN_FLIGHT[0]  # the sample split's step chains sent ahead

    def __post_init__(self) -> None:
        check_endpoint("--listen", self.listen, bind=True)
        check_choice("--split-by", self.split_by, SPLIT_BY)
        check_choice("--split", self.split, SPLIT_MODES)
        check_choice("--on-worker-loss", self.on_worker_loss, ON_WORKER_LOSS)
        check_choice("--data-plane", self.data_plane, DATA_PLANES)
        check_choice("--bn-statistics", self.bn_statistics, BN_STATISTICS)
        if self.bn_statistics == "slice" and (self.data_plane != "peer"
                                              or self.split_by == "kernels"):
            raise UserError("--bn-statistics slice needs the sample split's chains: "
                            "--data-plane peer and --split-by samples or auto")
        check_choice("--dense-part", self.dense_part, DENSE_PARTS)
        if self.steps_in_flight not in STEPS_IN_FLIGHT:
            raise UserError(f"--steps-in-flight {self.steps_in_flight}: choose 1 or 2")
        if self.dense_part == "replicas" and (self.data_plane != "peer"
                                              or self.split_by == "kernels"):
            raise UserError("--dense-part replicas needs the sample split's chains: "
                            "--data-plane peer and --split-by samples or auto")
        check_choice("--wire-dtype", self.wire_dtype, WIRE_DTYPE_FLAGS)
        if self.min_workers < 0:
            raise UserError("--min-workers must be >= 0")
        if not self.use_local_device and self.min_workers < 1:
            raise UserError("--no-local needs at least one worker (--min-workers 1 or more)")
        if bool(self.curve_secret) != bool(self.curve_allow):
            raise UserError("CURVE needs both --curve-secret (the master's NAME.key_secret) "
                            "and --curve-allow (a directory of worker NAME.key files)")

    @property
    def rebalancing(self) -> bool:
        """Whether the run re-splits from measured step times (``--rebalance``; by
        default on for ``--split model``, off for the paper's ``calibrated``/``equal``)."""
        return self.split == "model" if self.rebalance is None else self.rebalance


@dataclass(frozen=True)
class TrainConfig:
    """One training run: data, network, optimisation, where results go."""

    data: DataConfig = field(default_factory=DataConfig)
    arch: str = "32:64"  # the paper's kernel counts or a layer-token spec (hetconv.model)
    model_file: str | None = None  # --model: the spec as a JSON, TOML or ONNX file instead
    fresh_weights: bool = False  # --model FILE.onnx: seeded weights, not the file's
    kernel_size: int = 5
    padding: int = 0
    epochs: int = 3
    batch: int = 128
    eval_batch: int = 1000
    learning_rate: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    schedule: str = "cosine"
    seed: int = 0
    threads: int | None = None  # BLAS threads on the master (None: all cores)
    device: str = "cpu"  # the master's own device
    run_dir: str | None = None
    overwrite: bool = False
    progress: bool = True
    checkpoint_every: int = 20  # steps between snapshots (0: epoch ends only)
    resume: bool = False  # go on from run_dir's checkpoint.npz
    master: MasterConfig | None = None  # None: a local run

    def __post_init__(self) -> None:
        check_choice("--schedule", self.schedule, SCHEDULES)
        if self.padding not in PADDINGS:
            raise UserError(f"--padding {self.padding}: choose one of 0, 1, 2")

    @property
    def distributed(self) -> bool:
        return self.master is not None

    def record(self) -> dict[str, Any]:
        """The flat ``config.json`` / ``run_start`` record (schema: docs/metrics.md)."""
        master = self.master
        return {
            "mode": "distributed" if master else "local",
            "data": self.data.name, "data_dir": self.data.data_dir, "limit": self.data.limit,
            "test_limit": self.data.test_limit, "image_size": self.data.image_size,
            "augment": self.data.augment,
            "epochs": self.epochs, "batch": self.batch, "eval_batch": self.eval_batch,
            "lr": self.learning_rate, "momentum": self.momentum,
            "weight_decay": self.weight_decay, "schedule": self.schedule, "seed": self.seed,
            "threads": self.threads, "device": self.device,
            "listen": master.listen if master else None,
            "min_workers": master.min_workers if master else 0,
            "no_local": not master.use_local_device if master else False,
            "split": master.split if master else "model",
            "split_by": master.split_by if master else None,
            "wire_dtype": master.wire_dtype if master else "float32",
            "data_plane": master.data_plane if master else None,
            "rebalance": master.rebalancing if master else False,
            "checkpoint_every": self.checkpoint_every,
            "on_worker_loss": master.on_worker_loss if master else None,
            "fall_back": master.fall_back if master else None,
            "bn_statistics": master.bn_statistics if master else None,
            "dense_part": master.dense_part if master else None,
            "steps_in_flight": master.steps_in_flight if master else None,
        }


@dataclass(frozen=True)
class CalibrateConfig:
    """``hetconv calibrate``: membership and calibration only, for one input shape."""

    master: MasterConfig
    input_shape: tuple[int, int, int]
    arch: str = "32:64"
    kernel_size: int = 5
    padding: int = 0
    batch: int = 128
    device: str = "cpu"
    threads: int | None = None


@dataclass(frozen=True)
class WorkerConfig:
    """Settings of one worker daemon (flags > HETCONV_* variables > defaults)."""

    master: str
    device: str = "cpu"
    threads: int | None = None
    name: str | None = None
    heartbeat_interval_s: float = limits.DEFAULT_HEARTBEAT_INTERVAL_S
    master_timeout_s: float = limits.MASTER_SILENCE_TIMEOUT_S
    hello_backoff_s: tuple[float, float] = (0.25, 5.0)  # first and longest retry delay
    poll_interval_s: float = 0.1
    once: bool = False  # exit after the first run instead of waiting for the next
    curve: CurveClientKeys | None = None  # None: plain ZMTP (trusted LAN)
    data_port: int = 0  # the peer data plane's TCP port (0: any free port)
    advertise: str | None = None  # address peers reach us at (None: route to the master)

    def __post_init__(self) -> None:
        if not 0 <= self.data_port <= 65535:
            raise UserError(f"--data-port {self.data_port}: expected 0 (any) to 65535")
        check_endpoint("--master", self.master, bind=False)
