"""``hetconv export RUN_DIR --format onnx|safetensors [--output FILE]``.

Writes the trained network for use outside hetconv (default ``RUN_DIR/model.onnx``
or ``RUN_DIR/model.safetensors``), with the class names and the normalisation in
the file's metadata. Needs the optional extra ``hetconv[export]``; names, layouts
and metadata keys are in docs/export.md.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetconv.errors import UserError
from hetconv.export import EXPORT_FORMATS, SUFFIXES
from hetconv.export.onnx_import import read_source
from hetconv.inference.use import TrainedRun, load_run, run_preprocessing


def add_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="write a trained run as ONNX or safetensors "
                       "(needs hetconv[export])")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of 'hetconv train'")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS,
                   help="onnx: a graph onnxruntime runs (input 'images', output "
                   "'probabilities'); safetensors: the weights under PyTorch's names")
    p.add_argument("--output", metavar="FILE", default=None,
                   help="where to write (default RUN_DIR/model.onnx or RUN_DIR/model.safetensors)")


def output_path(run: TrainedRun, fmt: str, output: str | None) -> Path:
    path = Path(output) if output else run.run_dir / f"model{SUFFIXES[fmt]}"
    if path.is_dir():
        raise UserError(f"--output {path}: is a directory; give a file name")
    if not path.parent.is_dir():
        raise UserError(f"--output {path}: directory {path.parent} does not exist")
    return path


def run_export(run_dir: str, fmt: str, output: str | None = None,
               out: Callable[[str], None] = print) -> int:
    if fmt not in EXPORT_FORMATS:
        raise UserError(f"--format {fmt!r}: choose one of {', '.join(EXPORT_FORMATS)}")
    run = load_run(run_dir)
    path = output_path(run, fmt, output)
    if fmt == "onnx":
        from hetconv.export.onnx import require_onnx, write_onnx

        require_onnx()  # a missing extra is reported before the data is read
        writer = write_onnx
    else:
        from hetconv.export.safetensors import require_safetensors, write_safetensors

        require_safetensors()
        writer = write_safetensors
    preprocessing = run_preprocessing(run)
    source = read_source(run.run_dir)  # a run from an ONNX file: its names
    try:
        size = writer(path, run.model, run.params, run.network, preprocessing, source)
    except OSError as error:
        raise UserError(f"cannot write {path}: {error.strerror or error}") from None
    out(f"wrote {path} ({size} bytes): {fmt}, network {run.network}, input "
        f"{'x'.join(map(str, run.input_shape))}, classes: {', '.join(preprocessing.class_names)}")
    return 0


def run(args: argparse.Namespace) -> int:
    return run_export(args.run_dir, args.format, args.output)
