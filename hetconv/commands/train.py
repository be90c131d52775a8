"""``hetconv train``: flags -> :class:`TrainConfig` -> model, run directory, trainer.

Local runs build a :class:`LocalConvStage`; distributed runs (``--listen``) ask
``hetconv.master`` for its distributed stage. Either way the run directory gets
``config.json``, ``metrics.jsonl`` (schema in docs/metrics.md) and ``weights.npz``.
"""
from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hetconv.backend import set_blas_threads
from hetconv.commands.options import (
    add_curve_master,
    add_membership,
    env,
    env_positive_int,
    non_negative_float,
    non_negative_int,
    positive_int,
)
from hetconv.config import (
    BN_STATISTICS,
    DATA_PLANES,
    DATASETS,
    DENSE_PARTS,
    MASTER_PARTICIPANT,
    ON_OFF,
    ON_WORKER_LOSS,
    PADDINGS,
    SCHEDULES,
    SPLIT_BY,
    SPLIT_MODES,
    STEPS_IN_FLIGHT,
    WIRE_DTYPE_AUTO,
    WIRE_DTYPE_FLAGS,
    WIRE_DTYPES,
    DataConfig,
    MasterConfig,
    TrainConfig,
)
from hetconv.data.dataset import Dataset
from hetconv.data.loading import DatasetError, load_dataset
from hetconv.device_info import describe_device
from hetconv.engine.checkpoint import save_json
from hetconv.engine.optim import OptimizerConfig
from hetconv.engine.stage import ConvStage, LocalConvStage, layer_settings
from hetconv.engine.train_state import CHECKPOINT_NAME, CheckpointError, TrainingState
from hetconv.engine.training import LoopConfig, Trainer
from hetconv.errors import UserError
from hetconv.export.onnx_import import OnnxStart, is_onnx, load_onnx
from hetconv.logs import add_output_flags, emit
from hetconv.metrics import SCHEMA_VERSION, MetricsWriter
from hetconv.model import (
    ModelConfig,
    NetworkSpec,
    conv_layer_shapes,
    dense_shapes,
    init_parameters,
    load_network_file,
    model_config,
    parse_network,
)
from hetconv.planning.memory import available_bytes, check_fits, step_need
from hetconv.prometheus import add_metrics_port, serve, training_exporter

RESUME_FLAGS = {
    "data": "--data", "data_dir": "--data-dir", "limit": "--limit", "test_limit": "--test-limit",
    "arch": "--arch", "kernel_size": "--kernel-size", "padding": "--padding",
    "epochs": "--epochs", "batch": "--batch", "lr": "--lr", "momentum": "--momentum",
    "weight_decay": "--weight-decay", "schedule": "--schedule", "seed": "--seed",
    "wire_dtype": "--wire-dtype", "image_size": "--image-size", "augment": "--augment",
    "threads": "--threads", "device": "--device", "bn_statistics": "--bn-statistics",
    "dense_part": "--dense-part"}
"""config.json key -> the flag that sets it: what a resumed run must keep (the threads
and the device too: they change how sums are split, so the float rounding; the
batch-norm statistics of a distributed run, absent (None) from a local one's)."""
_parser: argparse.ArgumentParser | None = None  # for the defaults, when resuming


def add_parser(sub: Any) -> None:
    global _parser
    p = sub.add_parser("train", help="train the network (locally or over worker daemons)")
    _parser = p
    where = p.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true",
                       help="train on this machine's own device only (the default without --listen)")
    where.add_argument("--listen", metavar="ENDPOINT", default=env("LISTEN", None),
                       help="distributed: bind here and wait for workers, e.g. tcp://*:5555")
    add_membership(p, listen_required=False)
    p.add_argument("--split", choices=SPLIT_MODES, default=SPLIT_MODES[0],
                   help="distributed: 'model' (default) balances each participant's calibrated "
                   "fixed + per-kernel cost; 'calibrated' is the paper's equation (1); "
                   "'equal' gives every participant the same share")
    p.add_argument("--split-by", choices=SPLIT_BY, default=SPLIT_BY[0],
                   help="distributed: cut every conv layer into kernel ranges ('kernels', "
                   "the paper's method) or the batch into sample slices, every participant "
                   "holding whole layers ('samples': only weight gradients and batch-norm "
                   "sums travel between layers); 'auto' (default) takes the one the model "
                   "predicts shorter (without a model, --split equal|calibrated: samples "
                   "where every layer moves fewer bytes that way; docs/sample-split.md)")
    p.add_argument("--device", default=env("DEVICE", "cpu"),
                   help="the master's own device: cpu or gpu:N (default cpu)")
    p.add_argument("--wire-dtype", choices=WIRE_DTYPE_FLAGS, default=WIRE_DTYPE_AUTO,
                   help="distributed: activations and gradients on the wire; float16 halves "
                   "the traffic (computation stays float32; its effect on accuracy: "
                   "docs/scale-out.md); 'auto' "
                   "(default) lets the planner take float16 when it predicts a shorter "
                   "step (with --split model; float32 otherwise)")
    p.add_argument("--data-plane", choices=DATA_PLANES, default=DATA_PLANES[0],
                   help="distributed: 'peer' (default) has the participants exchange every "
                   "layer's input and gradients among themselves, so the master's link "
                   "carries only the first input and the last output; 'star' sends them "
                   "all through the master")
    p.add_argument("--bn-statistics", choices=BN_STATISTICS, default=BN_STATISTICS[0],
                   help="distributed, split by samples: batch norm normalises with the whole "
                   "batch's statistics ('batch', default: the local run's result, every layer "
                   "waits for every slice) or each slice's own ('slice': PyTorch DDP's "
                   "per-rank semantics, no wait between layers; the running statistics stay "
                   "the whole batch's)")
    p.add_argument("--dense-part", choices=DENSE_PARTS, default=DENSE_PARTS[0],
                   help="distributed, split by samples: where the dense layers and the loss "
                   "run: on every participant's slice ('replicas': one request per worker "
                   "per step, only weight gradients travel between the participants), or on "
                   "the master for the whole batch ('master': the last conv output and its "
                   "gradient cross the master's link); 'auto' (default) replicates them "
                   "where the sample split's chains run (docs/dense-replica.md)")
    p.add_argument("--steps-in-flight", type=int, choices=STEPS_IN_FLIGHT,
                   default=STEPS_IN_FLIGHT[0],
                   help="distributed, split by samples with the dense part replicated: 2 "
                   "(default) sends the next step to every participant before this step's "
                   "replies are gathered, so that nobody idles at the step boundary; 1 sends "
                   "one step at a time (the same loss trace either way)")
    p.add_argument("--rebalance", choices=ON_OFF, default=None,
                   help="distributed: re-split the kernels when the measured step times show "
                   "the calibration was off (default: on for --split model, off for "
                   "calibrated and equal)")
    p.add_argument("--fall-back", choices=ON_OFF, default="on",
                   help="distributed: 'on' (default) measures the master alone at set-up and "
                   "trains alone from the start where it is no slower than the plan with "
                   "workers is predicted to be; split by samples, it then tries the master "
                   "alone from one snapshot to the next when the last 9 steps measured over 0.75 "
                   "of its estimate of the master alone (an estimate that errs by up to a "
                   "third; after a trial, over 1.05 of the corrected one), and trains on "
                   "alone if the trial was faster (else back to the workers); 'off' keeps "
                   "them")
    p.add_argument("--on-worker-loss", choices=ON_WORKER_LOSS, default=ON_WORKER_LOSS[0],
                   help="distributed: when the last worker is lost, 'continue' (default) "
                   "training on the master alone or 'stop' with one line")
    p.add_argument("--checkpoint-every", type=non_negative_int, default=20, metavar="STEPS",
                   help="take a snapshot (and write RUN_DIR/checkpoint.npz) every STEPS steps "
                   "and at every epoch end; a failed worker costs at most this many replayed "
                   "steps (default 20; 0: epoch ends only)")
    p.add_argument("--data", default=env("DATA", DATASETS[0]), choices=DATASETS, help="dataset")
    p.add_argument("--data-dir", default=env("DATA_DIR", None),
                   help="dataset directory (default: Debian's /usr/share/datasets/fashion-mnist); "
                   "for --data folder: one sub-folder of PNG/JPEG images per class, or train/ "
                   "and test/ holding such sub-folders")
    p.add_argument("--image-size", type=positive_int, default=None, metavar="N",
                   help="--data folder: resize every image to NxN (default: the images' own "
                   "size when they all have the same, else 32)")
    p.add_argument("--augment", action="store_true",
                   help="random crop of the image padded by an eighth of its side (4 px for "
                   "32x32) and random horizontal flips, while training")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="train on the first N training images only")
    p.add_argument("--test-limit", type=positive_int, default=None,
                   help="evaluate on the first N test images only")
    p.add_argument("--arch", default="32:64",
                   help="the network: kernels per paper block (5x5 conv, batch norm, ReLU, "
                   "2x2 max pool), e.g. 50:500 (default 32:64); or comma-separated layers: "
                   "c<K>k<size>[p<pad>][s<stride>][nobn] a conv of K kernels (batch norm "
                   "and ReLU after it unless nobn), pool / avgpool 2x2 pooling of the conv "
                   "before, fc<N> a hidden dense layer with ReLU, drop<p> dropout; the "
                   "classifier is added, e.g. c32k3p1,c32k3p1,pool,c64k3p1,pool,fc128,drop0.5")
    p.add_argument("--model", metavar="FILE", default=None,
                   help="the --arch layer list from a file: JSON ({\"layers\": [\"c32k3p1\", "
                   "\"pool\", ...]} or a list), TOML (layers = [...], a .toml file), or an "
                   "ONNX model (a .onnx file, e.g. from torch.onnx.export: its weights are "
                   "the starting point; docs/python-api.md)")
    p.add_argument("--fresh-weights", action="store_true",
                   help="with --model FILE.onnx: start from hetconv's seeded weights "
                   "instead of the file's")
    p.add_argument("--kernel-size", type=positive_int, default=5, help="conv kernel size (5)")
    p.add_argument("--padding", type=int, default=0, choices=PADDINGS,
                   help="conv zero padding (default 0: valid convolution as in the paper)")
    p.add_argument("--epochs", type=positive_int, default=3)
    p.add_argument("--batch", type=positive_int, default=128)
    p.add_argument("--eval-batch", type=positive_int, default=1000)
    p.add_argument("--lr", type=non_negative_float, default=0.05, help="base learning rate")
    p.add_argument("--momentum", type=non_negative_float, default=0.9)
    p.add_argument("--weight-decay", type=non_negative_float, default=5e-4)
    p.add_argument("--schedule", choices=SCHEDULES, default=SCHEDULES[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=env_positive_int("THREADS"),
                   help="BLAS threads on the master (default: all cores)")
    p.add_argument("--run-dir", default=None,
                   help="where config.json, metrics.jsonl and weights.npz go (default runs/<time>)")
    p.add_argument("--overwrite", action="store_true",
                   help="allow a --run-dir that already holds a run")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="go on with the run in RUN_DIR from its last checkpoint "
                   "(RUN_DIR/checkpoint.npz): same data, network and optimisation as it "
                   "was started with (a flag that would change the result is refused); "
                   "local or distributed as the other flags say")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_curve_master(p)
    add_output_flags(p, progress=True)
    add_metrics_port(p)


def master_config(args: argparse.Namespace) -> MasterConfig:
    return MasterConfig(listen=args.listen, min_workers=args.min_workers, wait_s=args.wait,
                        use_local_device=not args.no_local,
                        split=getattr(args, "split", SPLIT_MODES[0]),
                        wire_dtype=getattr(args, "wire_dtype", WIRE_DTYPES[0]),
                        data_plane=getattr(args, "data_plane", DATA_PLANES[0]),
                        rebalance=_on_off(getattr(args, "rebalance", None)),
                        on_worker_loss=getattr(args, "on_worker_loss", ON_WORKER_LOSS[0]),
                        split_by=getattr(args, "split_by", SPLIT_BY[0]),
                        fall_back=getattr(args, "fall_back", "on") == "on",
                        bn_statistics=getattr(args, "bn_statistics", BN_STATISTICS[0]),
                        dense_part=getattr(args, "dense_part", DENSE_PARTS[0]),
                        steps_in_flight=getattr(args, "steps_in_flight", STEPS_IN_FLIGHT[0]),
                        curve_secret=args.curve_secret, curve_allow=args.curve_allow)


def _on_off(value: str | None) -> bool | None:
    return None if value is None else value == "on"


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The typed configuration of ``hetconv train`` from parsed flags."""
    return TrainConfig(
        data=DataConfig(name=args.data, data_dir=args.data_dir, limit=args.limit,
                        test_limit=args.test_limit, image_size=args.image_size,
                        augment=args.augment),
        arch=args.arch, model_file=args.model, fresh_weights=args.fresh_weights,
        kernel_size=args.kernel_size,
        padding=args.padding, epochs=args.epochs,
        batch=args.batch, eval_batch=args.eval_batch, learning_rate=args.lr,
        momentum=args.momentum, weight_decay=args.weight_decay, schedule=args.schedule,
        seed=args.seed, threads=args.threads, device=args.device, run_dir=args.run_dir,
        overwrite=args.overwrite, progress=not args.no_progress,
        checkpoint_every=args.checkpoint_every,
        master=master_config(args) if args.listen and not args.local else None)


def prepare_run_dir(run_dir: str | None, overwrite: bool) -> Path:
    """Create the run directory; refuse to mix a new run into an old one. A directory
    that cannot be made or written is one line."""
    path = Path(run_dir) if run_dir else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    if path.exists() and not path.is_dir():
        raise UserError(f"--run-dir {path} exists and is not a directory")
    try:
        if (path / "metrics.jsonl").exists():
            if not overwrite:
                raise UserError(f"--run-dir {path} already holds a run; choose another "
                                "directory or pass --overwrite")
            for name in ("metrics.jsonl", "weights.npz", "config.json", "report.html",
                         CHECKPOINT_NAME):
                if (path / name).exists():
                    (path / name).unlink()
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # what the run will do: write files there
            pass
    except OSError as error:
        raise UserError(f"--run-dir {path}: cannot create or write it: "
                        f"{error.strerror or error}; choose another directory") from None
    return path


def network_spec(config: TrainConfig) -> NetworkSpec:
    """The parsed network of ``--arch`` or ``--model`` (UserError on a bad spec)."""
    if config.fresh_weights and (config.model_file is None or not is_onnx(config.model_file)):
        raise UserError("--fresh-weights applies to --model FILE.onnx (a network with its "
                        "own weights); other networks start from seeded weights anyway")
    if config.model_file is None:
        return parse_network(config.arch, config.kernel_size, config.padding)
    if config.arch != "32:64":
        raise UserError("--arch and --model both describe the network: give one of them")
    where = f"--model {config.model_file}"
    if is_onnx(config.model_file):
        return parse_network(list(load_onnx(config.model_file).tokens), where=where)
    return parse_network(load_network_file(config.model_file), where=where)


def _config_record(config: TrainConfig, model: ModelConfig, spec: NetworkSpec
                   ) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, **config.record(),
            "arch": list(model.conv_kernels), "network": spec.text,
            "kernel_size": model.kernel_size,
            "padding": model.padding, "input_shape": list(model.input_shape),
            "classes": model.classes}


def run(args: argparse.Namespace) -> int:
    exporter = training_exporter()
    server = serve(exporter, args.metrics_port)  # before anything is written
    try:
        return _run(args, [exporter.observe_record] if server else [])
    finally:
        if server is not None:
            server.close()


def _run(args: argparse.Namespace, observers: list[Callable[[dict[str, Any]], None]]) -> int:
    if args.resume is None:
        return run_training(train_config(args), observers=observers)
    run_dir = Path(args.resume)
    saved = _saved_config(run_dir)
    if args.overwrite:
        raise UserError("--resume goes on with a run; --overwrite would start over: "
                        "pass one of them")
    if args.run_dir is not None and Path(args.run_dir) != run_dir:
        raise UserError(f"--resume {run_dir} writes to that directory; drop --run-dir")
    _take_saved_flags(args, saved)
    args.run_dir = str(run_dir)
    try:
        state = TrainingState.load(run_dir / CHECKPOINT_NAME)
    except CheckpointError as error:
        raise UserError(f"--resume: {error}") from None
    for name in (CHECKPOINT_NAME, "weights.npz", "report.html", "config.json"):
        for leftover in run_dir.glob(f".{name}.*.tmp"):  # a write the kill interrupted
            leftover.unlink(missing_ok=True)
    if state.epoch >= args.epochs:
        raise UserError(f"--resume: nothing left to do: {run_dir} finished its "
                        f"{args.epochs} epoch(s)")
    return run_training(train_config(args), resume=state, observers=observers)


def _saved_config(run_dir: Path) -> dict[str, Any]:
    from hetconv.inference.use import read_run_config

    return read_run_config(run_dir, "--resume")


def _take_saved_flags(args: argparse.Namespace, saved: dict[str, Any]) -> None:
    """Every result-changing flag from the saved run; one given on the command line
    that differs from it is refused, naming the flag."""
    assert _parser is not None
    for key, flag in RESUME_FLAGS.items():
        dest = flag[2:].replace("-", "_")
        if key not in saved or (key in ("bn_statistics", "dense_part") and saved[key] is None):
            continue
        value = saved[key]
        if key == "arch":
            value = saved.get("network") or (
                ":".join(str(k) for k in value) if isinstance(value, list) else str(value))
            if args.model is not None:
                given_spec = parse_network(load_network_file(args.model)).text
                if given_spec != parse_network(str(value)).text:
                    raise UserError(f"--resume: --model {args.model} differs from the run's "
                                    f"network {value}; start a new run for that")
                args.model = None
        given = getattr(args, dest)
        if given != _parser.get_default(dest):
            same = (parse_network(str(given)).text == parse_network(str(value)).text
                    if key == "arch" else given == value)
            if not same:
                raise UserError(f"--resume: {flag} {given} differs from the run's {value}; "
                                "resuming with it would change the result (start a new run "
                                "for that)")
        setattr(args, dest, value)


def run_training(config: TrainConfig, resume: TrainingState | None = None,
                 observers: Sequence[Callable[[dict[str, Any]], None]] = (),
                 data: Dataset | None = None, start: StartingPoint | None = None) -> int:
    """One whole training run as configured (from ``resume`` on, when given); returns
    the exit status. ``data``: the dataset itself (the Python API's arrays) instead of
    loading ``config.data``; ``start``: starting weights and their source names (a model
    read from ONNX) instead of seeded ones."""
    spec = network_spec(config)  # a bad spec stops here, before anything starts
    if start is None and config.model_file is not None and is_onnx(config.model_file):
        start = OnnxStart(load_onnx(config.model_file), config.fresh_weights)
    set_blas_threads(config.threads)
    if data is None:
        try:
            data = load_dataset(config.data.name, config.data.data_dir,
                                limit=config.data.limit, image_size=config.data.image_size)
        except DatasetError as error:
            raise UserError(str(error)) from None
    if config.data.test_limit:
        data.test_images = data.test_images[:config.data.test_limit]
        data.test_labels = data.test_labels[:config.data.test_limit]
    model = model_config(spec, tuple(data.train_images.shape[1:]), int(data.classes),
                         config.kernel_size, config.padding)
    shapes = conv_layer_shapes(model)
    if start is not None:
        start.check(model)
    if config.master is None:  # a network this machine cannot hold: one line, now
        dense_values = sum(units * (features + 1) for _, features, units in dense_shapes(model))
        check_fits(step_need(shapes, config.batch, dense_values), available_bytes(),
                   config.batch)
    record = _config_record(config, model, spec)
    if resume is None:
        run_dir = prepare_run_dir(config.run_dir, config.overwrite)
        save_json(run_dir / "config.json", record)
    else:
        run_dir = Path(str(config.run_dir))
    params = init_parameters(model, config.seed)
    if start is not None and resume is None:
        params = start.weights_for(params, run_dir)
    optimizer = OptimizerConfig(learning_rate=config.learning_rate, momentum=config.momentum,
                                weight_decay=config.weight_decay, schedule=config.schedule)
    loop = LoopConfig(epochs=config.epochs, batch=config.batch, eval_batch=config.eval_batch,
                      seed=config.seed, optimizer=optimizer, progress=config.progress,
                      checkpoint_every=config.checkpoint_every, augment=config.data.augment)
    settings = layer_settings(model, optimizer.momentum, optimizer.weight_decay)
    emit(f"hetconv: {data.name} ({len(data.train_images)} train / {len(data.test_images)} test "
          f"images of {'x'.join(map(str, model.input_shape))}), arch {spec.text}, "
          f"batch {config.batch}, {config.epochs} epochs -> {run_dir}")
    previous_term = signal.signal(signal.SIGTERM, _interrupt) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        return _train(config, resume, data, model, shapes, run_dir, record, params, loop,
                      settings, observers)
    finally:
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)


class StartingPoint(Protocol):
    """Starting weights from elsewhere (hetconv.export.onnx_import)."""

    def check(self, model: ModelConfig) -> None:
        """UserError (one line) where ``model`` (the data's images and classes) does not
        fit these weights."""
        ...

    def weights_for(self, seeded: dict[str, np.ndarray], run_dir: Path
                    ) -> dict[str, np.ndarray]:
        """The weights to start from, shaped as ``seeded`` (UserError where they do not
        fit); may write what the run needs to keep into ``run_dir``."""
        ...


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM ends a run like Ctrl-C: the workers are told, run_end is written, the
    last checkpoint stays for --resume."""
    raise KeyboardInterrupt


def _train(config: TrainConfig, resume: TrainingState | None, data: Any, model: ModelConfig,
           shapes: Any, run_dir: Path, record: dict[str, Any], params: Any, loop: LoopConfig,
           settings: Any, observers: Sequence[Callable[[dict[str, Any]], None]] = ()) -> int:
    with MetricsWriter(run_dir / "metrics.jsonl") as metrics:
        metrics.observers.extend(observers)  # --metrics-port: /metrics follows the records
        metrics.write("run_start", pid=os.getpid(), config=record,
                      layers=[shape.__dict__ for shape in shapes],
                      resumed_from=None if resume is None else resume.step)
        if resume is not None:
            emit(f"hetconv: resuming {run_dir} at step {resume.step} (epoch "
                 f"{resume.epoch + 1}, batch {resume.position})")
        status, error_text = "failed", None
        stage: ConvStage | None = None
        trainer: Trainer | None = None
        try:
            if config.master is not None:
                from hetconv.master.setup import open_distributed_stage

                stage = open_distributed_stage(config.master, model, params, settings, metrics,
                                               batch=config.batch, device=config.device,
                                               threads=config.threads, report=emit)
            else:
                stage = LocalConvStage(model, params, settings, device=config.device)
                device = describe_device(config.device, threads=config.threads)
                metrics.write("devices", devices=[{"id": MASTER_PARTICIPANT, **device}])
            trainer = Trainer(model, params, stage, loop, metrics, run_dir, out=emit)
            result = trainer.fit(data, resume)
            status = "completed"
        except UserError as error:
            error_text = str(error)
            raise
        except KeyboardInterrupt:
            status, error_text = "interrupted", "interrupted by the user"
            raise
        except Exception as error:  # recorded, then shown as a traceback: a bug
            error_text = f"{type(error).__name__}: {error}"
            raise
        finally:
            metrics.write("run_end", status=status, error=error_text)
            if stage is not None:  # the stage the trainer ended with (it may have fallen back)
                current = trainer.stage if trainer is not None else stage
                current.close()
    emit(f"hetconv: done: test accuracy {result.test_accuracy:.4f}; "
         f"weights in {run_dir / 'weights.npz'}", test_accuracy=result.test_accuracy)
    return 0
