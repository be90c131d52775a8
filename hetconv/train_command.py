"""``hetconv train``: turn flags into a model, a run directory and a trainer.

Local runs build a :class:`LocalConvStage`; distributed runs (``--listen``) ask
``master`` for its distributed stage. Either way the run directory gets
``config.json``, ``metrics.jsonl`` (schema in docs/metrics.md) and ``weights.npz``.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from hetconv.backend import set_blas_threads
from hetconv.checkpoint import save_json
from hetconv.data import DatasetError, load_dataset
from hetconv.device_info import describe_device
from hetconv.errors import UserError
from hetconv.metrics import SCHEMA_VERSION, MetricsWriter
from hetconv.model import ModelConfig, conv_layer_shapes, init_parameters, parse_arch
from hetconv.optim import OptimizerConfig
from hetconv.stage import ConvStage, LocalConvStage, block_settings
from hetconv.training import LoopConfig, Trainer


def prepare_run_dir(run_dir: str | None, overwrite: bool) -> Path:
    """Create the run directory; refuse to mix a new run into an old one."""
    path = Path(run_dir) if run_dir else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    if path.exists() and not path.is_dir():
        raise UserError(f"--run-dir {path} exists and is not a directory")
    if (path / "metrics.jsonl").exists():
        if not overwrite:
            raise UserError(f"--run-dir {path} already holds a run; choose another directory "
                            "or pass --overwrite")
        for name in ("metrics.jsonl", "weights.npz", "config.json", "report.html"):
            if (path / name).exists():
                (path / name).unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _config_record(args: argparse.Namespace, model: ModelConfig) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "mode": "distributed" if args.listen else "local",
        "data": args.data, "data_dir": args.data_dir, "limit": args.limit,
        "test_limit": args.test_limit, "arch": list(model.conv_kernels),
        "kernel_size": model.kernel_size, "padding": model.padding,
        "input_shape": list(model.input_shape), "classes": model.classes,
        "epochs": args.epochs, "batch": args.batch, "eval_batch": args.eval_batch,
        "lr": args.lr, "momentum": args.momentum, "weight_decay": args.weight_decay,
        "schedule": args.schedule, "seed": args.seed, "threads": args.threads,
        "device": args.device, "listen": args.listen, "min_workers": args.min_workers,
        "no_local": args.no_local, "split": args.split, "wire_dtype": args.wire_dtype,
    }


def run_train(args: argparse.Namespace) -> int:
    arch = parse_arch(args.arch)
    set_blas_threads(args.threads)
    try:
        data = load_dataset(args.data, args.data_dir, limit=args.limit)
    except DatasetError as error:
        raise UserError(str(error)) from None
    if args.test_limit:
        data.test_images = data.test_images[:args.test_limit]
        data.test_labels = data.test_labels[:args.test_limit]
    model = ModelConfig(conv_kernels=arch, input_shape=tuple(data.train_images.shape[1:]),
                        classes=int(data.classes), kernel_size=args.kernel_size,
                        padding=args.padding)
    shapes = conv_layer_shapes(model)
    run_dir = prepare_run_dir(args.run_dir, args.overwrite)
    config = _config_record(args, model)
    save_json(run_dir / "config.json", config)
    params = init_parameters(model, args.seed)
    optimizer = OptimizerConfig(learning_rate=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay, schedule=args.schedule)
    loop = LoopConfig(epochs=args.epochs, batch=args.batch, eval_batch=args.eval_batch,
                      seed=args.seed, optimizer=optimizer, progress=not args.no_progress)
    settings = block_settings(model, optimizer.momentum, optimizer.weight_decay)
    print(f"hetconv: {data.name} ({len(data.train_images)} train / {len(data.test_images)} test "
          f"images of {'x'.join(map(str, model.input_shape))}), arch {args.arch}, "
          f"batch {args.batch}, {args.epochs} epochs -> {run_dir}", flush=True)
    with MetricsWriter(run_dir / "metrics.jsonl") as metrics:
        metrics.write("run_start", pid=os.getpid(), config=config,
                      layers=[shape.__dict__ for shape in shapes])
        status, error_text = "failed", None
        stage: ConvStage | None = None
        try:
            if args.listen:
                from master.session import open_distributed_stage

                stage = open_distributed_stage(args, model, params, settings, metrics)
            else:
                stage = LocalConvStage(model, params, settings, device=args.device)
                device = describe_device(args.device, threads=args.threads)
                metrics.write("devices", devices=[{"id": "master", **device}])
            trainer = Trainer(model, params, stage, loop, metrics, run_dir)
            result = trainer.fit(data)
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
            if stage is not None:
                stage.close()
    print(f"hetconv: done: test accuracy {result.test_accuracy:.4f}; "
          f"weights in {run_dir / 'weights.npz'}", flush=True)
    return 0
