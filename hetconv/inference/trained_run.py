"""A trained run directory loaded back: ``config.json`` (the data, the network spec,
the input shape, the classes) and ``weights.npz`` (every array in the local-run layout,
:mod:`hetconv.names`). :func:`load_run` rebuilds the :class:`~hetconv.model.ModelConfig`
from the config and checks every array's shape against it; :func:`run_preprocessing`
finds how training normalised its images (:class:`Preprocessing`), from the config, from
``preprocessing.json`` beside the weights, or from the run's data loaded again. Every
bad input is a one-line :class:`~hetconv.errors.UserError`.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hetconv.data.loading import Dataset, DatasetError, load_dataset
from hetconv.engine.checkpoint import save_json
from hetconv.errors import UserError
from hetconv.model import (
    ModelConfig,
    conv_layer_shapes,
    dense_shapes,
    model_config,
    parse_network,
)
from hetconv.names import PARAMETER_NAMES, layer_key

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.npz"
PREPROCESSING_FILE = "preprocessing.json"
"""Written beside the weights the first time a run is used: the training set's
per-channel mean/std and the class names, so that later uses need not read the data."""


@dataclass(frozen=True)
class Preprocessing:
    """How training normalised its images, and what the outputs mean.

    A pixel ``p`` (0..255) of channel ``c`` becomes ``(p / 255 - mean[c]) / std[c]``
    as float32 (a std of 0 counts as 1). ``mean``/``std`` are in [0, 1] pixel units
    (the raw units of the synthetic set); ``class_names[i]`` names output ``i``.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    class_names: tuple[str, ...]

    def record(self) -> dict[str, Any]:
        return {"mean": list(self.mean), "std": list(self.std),
                "class_names": list(self.class_names)}


@dataclass(frozen=True)
class TrainedRun:
    """A run directory's network and weights, checked against each other.

    params: every array of weights.npz (float32), by ``hetconv.names`` key.
    network: the canonical spec text (``32:64`` or ``c32k3p1,pool,...``).
    """

    run_dir: Path
    config: dict[str, Any]
    model: ModelConfig
    params: dict[str, np.ndarray]
    network: str

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one input image."""
        return self.model.input_shape

    @property
    def classes(self) -> int:
        return self.model.classes


# --- loading ---------------------------------------------------------------------------
def read_run_config(run_dir: Path, flag: str = "") -> dict[str, Any]:
    """A run directory's ``config.json``; UserError with one line (led by ``flag``,
    e.g. ``--resume``) when it is missing, unreadable or not a run's."""
    path = run_dir / CONFIG_FILE
    lead = f"{flag} " if flag else ""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{lead}{run_dir}: no {CONFIG_FILE}; is it a run directory of "
                        "'hetconv train'?") from None
    except (OSError, ValueError) as error:
        raise UserError(f"{lead}{path}: unreadable ({error})") from None
    if not isinstance(config, dict):
        raise UserError(f"{lead}{path}: not a run's configuration")
    return config


def run_model_config(config: dict[str, Any], where: str = CONFIG_FILE) -> tuple[ModelConfig, str]:
    """(ModelConfig, canonical spec text) of a run's ``config.json`` record."""
    try:
        shape = tuple(int(v) for v in config["input_shape"])
        classes = int(config["classes"])
        kernel_size = int(config.get("kernel_size", 5))
        padding = int(config.get("padding", 0))
        arch = config.get("arch")
        text = config.get("network") or (":".join(str(k) for k in arch)
                                         if isinstance(arch, list) else str(arch))
    except (KeyError, TypeError, ValueError) as error:
        raise UserError(f"{where}: missing or bad network field ({error}); is it a run's "
                        "configuration?") from None
    if len(shape) != 3 or min(shape) < 1 or classes < 1:
        raise UserError(f"{where}: bad input_shape {list(shape)} or classes {classes}")
    spec = parse_network(text, kernel_size, padding, where=f"{where} network")
    input_shape = (shape[0], shape[1], shape[2])
    return model_config(spec, input_shape, classes, kernel_size, padding), spec.text


def expected_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every array a run's ``weights.npz`` must hold, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in conv_layer_shapes(model):
        k = layer.kernel_size
        shapes[layer_key(layer.index, "weight")] = (layer.kernels, layer.in_channels, k, k)
        for name in PARAMETER_NAMES[1:]:
            shapes[layer_key(layer.index, name)] = (layer.kernels,)
    for prefix, features, units in dense_shapes(model):
        shapes[f"{prefix}.weight"] = (units, features)
        shapes[f"{prefix}.bias"] = (units,)
    return shapes


def check_parameters(model: ModelConfig, params: dict[str, np.ndarray], where: str) -> None:
    """UserError naming the first array that is missing, misshapen or not finite."""
    for name, shape in expected_shapes(model).items():
        if name not in params:
            raise UserError(f"{where}: no array {name!r}; the weights do not belong to "
                            "this run's network")
        if tuple(params[name].shape) != shape:
            raise UserError(f"{where}: {name} has shape {tuple(params[name].shape)}, the "
                            f"network needs {shape}")
        if not np.isfinite(params[name]).all():
            raise UserError(f"{where}: {name} holds NaN or infinite values")


def load_run(run_dir: str | Path) -> TrainedRun:
    """The network and weights of a run directory; UserError with one line when the
    directory, its config.json or its weights.npz is missing or does not fit."""
    path = Path(run_dir)
    if not path.is_dir():
        raise UserError(f"{path}: no such run directory")
    config = read_run_config(path)
    model, text = run_model_config(config, str(path / CONFIG_FILE))
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise UserError(f"{path}: no {WEIGHTS_FILE} (the run ends an epoch before it "
                        "writes one); train it to the end of an epoch first")
    try:
        with open(weights, "rb") as handle, np.load(handle, allow_pickle=False) as data:
            params = {k: np.asarray(data[k], dtype=np.float32) for k in data.files}
    except Exception as error:  # zip/npy errors of a damaged file: one line, no traceback
        raise UserError(f"{weights}: unreadable ({type(error).__name__}: {error})") from None
    check_parameters(model, params, str(weights))
    return TrainedRun(path, config, model, params, text)


def load_run_data(run: TrainedRun, test_limit: int | None = None,
                  load: Callable[..., Dataset] = load_dataset) -> Dataset:
    """The run's dataset, loaded exactly as training loaded it (same data, directory,
    limit, image size: the same normalisation); the test set cut to ``test_limit``
    (default: the run's ``--test-limit``). Checks that its shape fits the network."""
    config = run.config
    try:
        data = load(str(config.get("data")), config.get("data_dir"),
                    limit=config.get("limit"), image_size=config.get("image_size"))
    except DatasetError as error:
        raise UserError(f"{run.run_dir}: cannot load the run's data: {error}") from None
    limit = test_limit if test_limit is not None else config.get("test_limit")
    if limit:
        data.test_images = data.test_images[:limit]
        data.test_labels = data.test_labels[:limit]
    if data.image_shape != run.input_shape or data.classes != run.classes:
        raise UserError(f"{run.run_dir}: the data now has {data.classes} classes of "
                        f"{'x'.join(map(str, data.image_shape))} images; the run was trained "
                        f"on {run.classes} of {'x'.join(map(str, run.input_shape))}")
    return data


def class_names_of(data: Dataset) -> tuple[str, ...]:
    """The dataset's class names (``class i`` where it has none)."""
    names = tuple(getattr(data, "class_names", ()) or ())
    if len(names) != data.classes:
        names = tuple(f"class {index}" for index in range(data.classes))
    return names


def preprocessing_of(data: Dataset) -> Preprocessing:
    return Preprocessing(tuple(float(m) for m in data.mean), tuple(float(s) for s in data.std),
                         class_names_of(data))


def _parse_preprocessing(record: Any, run: TrainedRun) -> Preprocessing | None:
    """A :class:`Preprocessing` from a record that fits the run, else None."""
    if not isinstance(record, dict):
        return None
    try:
        mean = tuple(float(v) for v in record["mean"])
        std = tuple(float(v) for v in record["std"])
        names = tuple(str(v) for v in record["class_names"])
    except (KeyError, TypeError, ValueError):
        return None
    channels = run.input_shape[0]
    if len(mean) != channels or len(std) != channels or len(names) != run.classes:
        return None
    return Preprocessing(mean, std, names)


def run_preprocessing(run: TrainedRun, data: Dataset | None = None,
                      load: Callable[..., Dataset] = load_dataset) -> Preprocessing:
    """The run's normalisation and class names: from ``config.json`` when it records
    them, else from ``preprocessing.json`` beside the weights, else from the data
    (``data``, or the run's dataset loaded as training loaded it), then kept in
    ``preprocessing.json`` (when the directory is writable) for the next use."""
    for record in (run.config, _read_json(run.run_dir / PREPROCESSING_FILE)):
        found = _parse_preprocessing(record, run)
        if found is not None:
            return found
    found = preprocessing_of(data if data is not None else load_run_data(run, load=load))
    try:
        save_json(run.run_dir / PREPROCESSING_FILE, {"data": run.config.get("data"),
                                                     **found.record()})
    except OSError:
        pass  # a read-only run directory: the data is read again next time
    return found


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
