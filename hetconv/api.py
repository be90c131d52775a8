"""hetconv from Python: a network, data, ``train``, and the trained :class:`Run`.

The layer under the command line: ``hetconv train`` and :func:`train` go through the same
run (``hetconv.commands.train.run_training``), so a script gets exactly what the command
gets, run directory and report included. Errors are :class:`hetconv.UserError` with the
command's one-line messages; nothing here exits the process. The run's lines go to the
``emit`` channel of :mod:`hetconv.logs` (stdout; ``quiet=True`` drops them).

    import hetconv
    data = hetconv.arrays(x, y, test_x=tx, test_y=ty)        # uint8 or float images
    run = hetconv.train("resnet20", data, epochs=2)           # local
    run = hetconv.train(hetconv.Network.from_onnx("net.onnx"), data,
                        listen="tcp://*:5555", workers=2)     # over worker daemons
    run.test_accuracy, run.history, run.predict(images), run.export("safetensors")

docs/python-api.md is the reference; tests/unit/test_python_api.py checks it names every
public name.
"""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hetconv.config import ARRAYS, DataConfig, MasterConfig, TrainConfig
from hetconv.data.dataset import Dataset, dataset_from_uint8, normalize_channels
from hetconv.errors import UserError
from hetconv.model import NetworkSpec, load_network_file, parse_network

__all__ = ["Network", "Run", "Worker", "arrays", "load_data", "train", "start_worker",
           "UserError"]


@dataclass(frozen=True)
class Network:
    """A network: hetconv's layer tokens (``"resnet20"``, ``"c32k3p1,pool,fc128"``, a
    token list), a ``--model`` file, or an ONNX model whose weights are the starting
    point (:meth:`from_onnx`)."""

    tokens: tuple[str, ...]
    onnx_path: str | None = None
    fresh_weights: bool = False

    def __init__(self, spec: str | Sequence[str], *, _onnx: str | None = None,
                 _fresh: bool = False):
        tokens = (spec,) if isinstance(spec, str) else tuple(str(t) for t in spec)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "onnx_path", _onnx)
        object.__setattr__(self, "fresh_weights", _fresh)
        self.spec()  # a bad spec is one line now, not at training time

    @classmethod
    def from_file(cls, path: str | Path) -> Network:
        """A JSON or TOML ``--model`` file (``{"layers": [...]}``)."""
        return cls(load_network_file(path))

    @classmethod
    def from_onnx(cls, path: str | Path, fresh_weights: bool = False) -> Network:
        """An ONNX model (``torch.onnx.export``); training starts from its initializers
        unless ``fresh_weights`` (docs/python-api.md lists the ops it reads)."""
        from hetconv.export.onnx_import import load_onnx

        imported = load_onnx(path, where="Network.from_onnx")
        return cls(list(imported.tokens), _onnx=str(path), _fresh=fresh_weights)

    @property
    def text(self) -> str:
        """The spec as ``--arch`` takes it."""
        return ",".join(self.tokens)

    def spec(self) -> NetworkSpec:
        return parse_network(self.text if len(self.tokens) == 1 else list(self.tokens),
                             where="Network")


def _as_network(network: Network | str | Sequence[str]) -> Network:
    return network if isinstance(network, Network) else Network(network)


def arrays(x: np.ndarray, y: np.ndarray, test_x: np.ndarray | None = None,
           test_y: np.ndarray | None = None, class_names: Sequence[str] | None = None,
           test_fraction: float = 0.1, name: str = "arrays") -> Dataset:
    """A dataset from arrays in memory: images (N, C, H, W) or (N, H, W) (uint8 pixels,
    or floats), labels (N,) of class ids 0..classes-1. Without test arrays the last
    ``test_fraction`` of the images is held out. Images are normalised per channel with
    the training images' mean and standard deviation, as the built-in datasets are."""
    images = _images(x, "x")
    labels = _labels(y, len(images), "y")
    if test_x is None or test_y is None:
        if test_x is not None or test_y is not None:
            raise UserError("arrays: give both test_x and test_y, or neither")
        if not 0.0 < test_fraction < 1.0:
            raise UserError(f"arrays: test_fraction {test_fraction} must lie in (0, 1)")
        cut = len(images) - max(1, int(round(len(images) * test_fraction)))
        if cut < 1:
            raise UserError(f"arrays: {len(images)} images leave nothing to train on")
        images, test_images, labels, test_labels = (images[:cut], images[cut:], labels[:cut],
                                                    labels[cut:])
    else:
        test_images = _images(test_x, "test_x")
        test_labels = _labels(test_y, len(test_images), "test_y")
        if test_images.shape[1:] != images.shape[1:]:
            raise UserError(f"arrays: test_x images are {test_images.shape[1:]}, x images "
                            f"{images.shape[1:]}")
    classes = int(max(labels.max(), test_labels.max())) + 1
    if class_names is not None:
        if len(class_names) < classes:
            raise UserError(f"arrays: {len(class_names)} class names for labels up to "
                            f"{classes - 1}")
        classes = len(class_names)
    names = tuple(class_names) if class_names is not None else tuple(
        f"class {i}" for i in range(classes))
    if images.dtype == np.uint8 and test_images.dtype == np.uint8:
        data = dataset_from_uint8(name, images, labels, test_images, test_labels, names)
    else:
        images, test_images = images.astype(np.float32), test_images.astype(np.float32)
        mean = images.mean(axis=(0, 2, 3), dtype=np.float64)
        std = images.std(axis=(0, 2, 3), dtype=np.float64)
        data = Dataset(normalize_channels(images, mean, std), labels,
                       normalize_channels(test_images, mean, std), test_labels, name, classes,
                       tuple(float(m) for m in mean), tuple(float(s) for s in std))
    data.class_names = names
    return data


def _images(x: Any, name: str) -> np.ndarray:
    images = np.asarray(x)
    if images.ndim == 3:
        images = images[:, None]
    if images.ndim != 4 or not len(images) or images.dtype.kind not in "uif":
        raise UserError(f"arrays: {name} must be images (N, C, H, W) or (N, H, W) of "
                        f"numbers, got {images.dtype} {images.shape}")
    if images.dtype != np.uint8:
        images = images.astype(np.float32)
        if not np.isfinite(images).all():
            raise UserError(f"arrays: {name} holds NaN or Inf")
    return np.ascontiguousarray(images)


def _labels(y: Any, count: int, name: str) -> np.ndarray:
    labels = np.asarray(y)
    if labels.shape != (count,) or labels.dtype.kind not in "iu" or \
            (count and int(labels.min()) < 0):
        raise UserError(f"arrays: {name} must be {count} class ids >= 0, got {labels.dtype} "
                        f"{labels.shape}")
    return labels.astype(np.int64)


def load_data(name: str = "fashion-mnist", data_dir: str | None = None,
              limit: int | None = None, image_size: int | None = None) -> Dataset:
    """A built-in dataset, as ``hetconv train --data NAME`` loads it ("fashion-mnist",
    "cifar10", "folder" (``data_dir``: one sub-folder of images per class), "synthetic")."""
    from hetconv.data.loading import DatasetError, load_dataset

    try:
        return load_dataset(name, data_dir, limit=limit, image_size=image_size)
    except DatasetError as error:
        raise UserError(str(error)) from None


def train(network: Network | str | Sequence[str], data: Dataset | str = "fashion-mnist", *,
          epochs: int = 3, batch: int = 128, lr: float = 0.05, momentum: float = 0.9,
          weight_decay: float = 5e-4, schedule: str = "cosine", seed: int = 0,
          threads: int | None = None, device: str = "cpu", run_dir: str | Path | None = None,
          overwrite: bool = False, progress: bool = True, quiet: bool = False,
          checkpoint_every: int = 20, augment: bool = False,
          listen: str | None = None, workers: int = 1, wait: float = 60.0,
          **distributed: Any) -> Run:
    """Train ``network`` on ``data`` (a :class:`Dataset`, e.g. from :func:`arrays`, or a
    built-in dataset's name) and return the :class:`Run`. Local unless ``listen`` (an
    endpoint, ``tcp://*:5555``): then over ``workers`` worker daemons, with any of
    ``hetconv train``'s distributed settings as keywords (``split_by="samples"``,
    ``data_plane="star"``, ``wire_dtype="float16"``, ``no_local=True``, ...; see
    :class:`hetconv.config.MasterConfig`). Each setting has the command's flag's
    default and check."""
    net = _as_network(network)
    dataset = load_data(data) if isinstance(data, str) else data
    if not isinstance(dataset, Dataset):
        raise UserError("train: data must be a Dataset (hetconv.arrays, hetconv.load_data) "
                        "or a dataset name")
    master = None
    if listen is not None:
        options = dict(distributed)
        if "no_local" in options:
            options["use_local_device"] = not options.pop("no_local")
        known = set(MasterConfig.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise UserError(f"train: unknown setting(s) {', '.join(unknown)}; distributed "
                            f"settings are {', '.join(sorted(known - {'listen'}))}")
        master = MasterConfig(listen=listen, min_workers=workers, wait_s=wait, **options)
    elif distributed:
        raise UserError(f"train: {', '.join(sorted(distributed))} apply to a distributed "
                        "run: give listen='tcp://*:PORT' and workers=N")
    onnx = net.onnx_path
    config = TrainConfig(
        data=DataConfig(name=_data_name(dataset), augment=augment),  # given, not loaded
        arch=net.text if onnx is None else "32:64", model_file=onnx,
        fresh_weights=net.fresh_weights, epochs=epochs, batch=batch, learning_rate=lr,
        momentum=momentum, weight_decay=weight_decay, schedule=schedule, seed=seed,
        threads=threads, device=device, run_dir=None if run_dir is None else str(run_dir),
        overwrite=overwrite, progress=progress and not quiet,
        checkpoint_every=checkpoint_every, master=master)
    from hetconv.commands.train import run_training

    lines: list[str] = []
    with _captured(lines, quiet):
        run_training(config, data=dataset)
    folder = _run_dir_of(lines, run_dir)
    _keep_preprocessing(folder, dataset)
    return Run.open(folder, data=dataset)


def _keep_preprocessing(folder: Path, dataset: Dataset) -> None:
    """The normalisation and class names beside the weights (``preprocessing.json``):
    what ``predict`` and ``export`` need, which arrays in memory cannot give later."""
    from hetconv.engine.checkpoint import save_json
    from hetconv.inference.trained_run import PREPROCESSING_FILE, preprocessing_of

    path = folder / PREPROCESSING_FILE
    if not path.exists():
        save_json(path, {"data": _data_name(dataset), **preprocessing_of(dataset).record()})


def _data_name(dataset: Dataset) -> str:
    """The ``data`` recorded for the run: a built-in dataset's own name, else ARRAYS."""
    from hetconv.config import DATASETS

    return dataset.name if dataset.name in DATASETS else ARRAYS


class _Tee(io.TextIOBase):
    """stdout that keeps every line it is given (and passes it on unless ``quiet``)."""

    def __init__(self, lines: list[str], through: Any, quiet: bool):
        self.lines, self.through, self.quiet = lines, through, quiet

    def write(self, text: str) -> int:
        self.lines.extend(part for part in text.splitlines() if part)
        if not self.quiet:
            self.through.write(text)
        return len(text)

    def flush(self) -> None:
        if not self.quiet:
            self.through.flush()


@contextlib.contextmanager
def _captured(lines: list[str], quiet: bool) -> Iterator[None]:
    """The run's stdout lines into ``lines`` (and through, unless ``quiet``)."""
    original = sys.stdout
    sys.stdout = _Tee(lines, original, quiet)
    try:
        yield
    finally:
        sys.stdout = original


def _run_dir_of(lines: list[str], run_dir: str | Path | None) -> Path:
    if run_dir is not None:
        return Path(run_dir)
    for line in lines:
        if " -> " in line and line.startswith("hetconv: "):
            return Path(line.rsplit(" -> ", 1)[1].strip())
    raise UserError("train: the run did not say where it wrote its results")


@dataclass
class Run:
    """A trained run: its directory, the accuracy and loss of every epoch, the network
    in evaluation mode (:meth:`predict`, :meth:`evaluate`), :meth:`export` and
    :meth:`report`."""

    run_dir: Path
    history: list[dict[str, Any]] = field(default_factory=list)  # one record per epoch
    losses: list[float] = field(default_factory=list)  # every step's
    data: Dataset | None = None

    @classmethod
    def open(cls, run_dir: str | Path, data: Dataset | None = None) -> Run:
        """A finished (or stopped) run directory of ``hetconv train`` or :func:`train`."""
        path = Path(run_dir)
        metrics = path / "metrics.jsonl"
        if not metrics.is_file():
            raise UserError(f"{path}: no such run (no metrics.jsonl)")
        history, losses = [], []
        for line in metrics.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut off by a crash
            if record.get("type") == "epoch":
                history.append(record)
            elif record.get("type") == "step":
                losses.append(float(record["loss"]))
        return cls(path, history, losses, data)

    @property
    def test_accuracy(self) -> float:
        """The last epoch's test accuracy (NaN before the first epoch ends)."""
        return float(self.history[-1]["test_accuracy"]) if self.history else float("nan")

    def _trained(self) -> Any:
        from hetconv.inference.trained_run import load_run

        return load_run(self.run_dir)

    def predict(self, images: np.ndarray | Sequence[str | Path], top: int = 1
                ) -> np.ndarray | list[Any]:
        """Class probabilities (N, classes) of images already normalised as the training
        data (e.g. ``data.test_images``); or, for image files, their top classes as
        ``hetconv predict`` gives them."""
        from hetconv.inference.classifier import Classifier

        run = self._trained()
        if isinstance(images, np.ndarray):
            if images.ndim != 4 or tuple(images.shape[1:]) != tuple(run.input_shape):
                raise UserError(f"predict: images must be (N, "
                                f"{', '.join(map(str, run.input_shape))}), got {images.shape}")
            probabilities: np.ndarray = Classifier(run.model, run.params).probabilities(
                np.asarray(images, np.float32))
            return probabilities
        from hetconv.commands.predict import predictions

        return predictions(self.run_dir, [str(p) for p in images], top)

    def evaluate(self, images: np.ndarray | None = None, labels: np.ndarray | None = None
                 ) -> Any:
        """Test accuracy, per class, and the confusion matrix
        (:class:`hetconv.inference.evaluation.Evaluation`) on the run's test set (the
        arrays it trained with, or its built-in dataset) or on ``images``/``labels``."""
        from hetconv.inference.classifier import Classifier
        from hetconv.inference.evaluation import evaluate_classifier
        from hetconv.inference.trained_run import class_names_of, load_run_data

        run = self._trained()
        if images is None or labels is None:
            if self.data is not None:
                images, labels, names = (self.data.test_images, self.data.test_labels,
                                         class_names_of(self.data))
            elif run.config.get("data") == ARRAYS:
                raise UserError(f"{self.run_dir}: trained on arrays in memory: pass "
                                "evaluate(images, labels)")
            else:
                loaded = load_run_data(run)
                images, labels, names = (loaded.test_images, loaded.test_labels,
                                         class_names_of(loaded))
        else:
            names = tuple(f"class {i}" for i in range(run.classes))
        return evaluate_classifier(Classifier(run.model, run.params), np.asarray(images),
                                   np.asarray(labels), names)

    def export(self, format: str = "safetensors", path: str | Path | None = None) -> Path:
        """Write the network as ONNX or safetensors (docs/export.md); returns the file.
        A run from an ONNX model keeps that model's names (docs/python-api.md)."""
        from hetconv.commands.export import output_path, run_export

        target = output_path(self._trained(), format, None if path is None else str(path))
        run_export(str(self.run_dir), format, str(target), out=lambda line: None)
        return target

    def report(self, html: bool = True) -> str:
        """The workload-balance report as text (and ``report.html`` in the run)."""
        from hetconv.commands.report import run_report

        lines: list[str] = []
        run_report([str(self.run_dir)], json_output=False, html=html, out=lines.append)
        return "\n".join(lines)


@dataclass
class Worker:
    """A worker daemon started by :func:`start_worker` (a process of its own); stop it
    with :meth:`stop` or use it as a context manager."""

    process: subprocess.Popen[bytes]
    name: str

    def stop(self, timeout: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return int(self.process.returncode)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_worker(master: str, name: str | None = None, device: str = "cpu",
                 threads: int | None = None, *extra: str, log: str | Path | None = None
                 ) -> Worker:
    """Start ``hetconv worker --master MASTER`` as a process of its own (the daemon a LAN
    machine runs; it retries until the master is there). ``extra``: more of its flags."""
    import os

    command = [sys.executable, "-m", "hetconv", "worker", "--master", master,
               "--device", device]
    if name is not None:
        command += ["--name", name]
    if threads is not None:
        command += ["--threads", str(threads)]
    command += list(extra)
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                               env=dict(os.environ))
    return Worker(process, name or f"pid {process.pid}")
