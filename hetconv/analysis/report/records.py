"""A run directory parsed into typed records: the input of the report.

Reads ``config.json`` (optional) and ``metrics.jsonl`` (schema in
``docs/metrics.md``) through :func:`hetconv.metrics.iter_metrics`, which skips a
cut-off or non-JSON line with a logging warning; those warnings are captured here
too and kept in :attr:`RunRecords.warnings`, so the report can show them. Works on
a run still in progress (no ``epoch`` or ``run_end`` yet) and on a local run (no
``calibration`` records, one participant ``"master"``). A participant's id is read
through :func:`hetconv.metrics.participant_of`, so files written before its key was
``participant`` (it was ``device``) read the same. Nothing here computes figures;
that is :mod:`master.report.analysis`.

A step replayed after a recovery, or again after a ``--resume``, has several ``step``
records; the last one counts (it is the one the run went on from), so
:attr:`RunRecords.steps` holds one record per step, in step order, and
:attr:`RunRecords.replayed_steps` counts the records it left out. Membership events
(``recovery``, ``replan``, ``rebalance``, a resuming ``run_start``) become
:class:`MembershipEvent` s in time order (:mod:`master.report.events`), and every
``checkpoint`` record a :class:`CheckpointRecord`.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetconv.analysis.report.events import CheckpointRecord, MembershipEvent, membership_events
from hetconv.analysis.report.plan_record import (
    dense_part,
    not_chosen,
    seconds_per_sample,
    split_choice,
    wire_text,
)
from hetconv.errors import UserError
from hetconv.metrics import iter_metrics, participant_entries, participant_of

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class ParticipantInfo:
    """One participant as described by the ``devices`` record (``device``: what it
    computes on, ``cpu`` or ``gpu:N``)."""

    id: str
    kind: str = "?"
    name: str = "?"
    device: str = "?"
    hostname: str = "?"
    cores: int | None = None
    threads: int | None = None
    blas: str = ""  # numpy's BLAS kernels of a CPU participant ("openblas SkylakeX")


@dataclass(frozen=True)
class CalibratedParticipant:
    """One participant in a layer's calibration: its timing and the kernels it was given."""

    participant: str
    seconds: float
    kernels: int
    share: float
    fixed_s: float | None = None  # the fitted cost t(k) = fixed_s + per_kernel_s * k
    per_kernel_s: float | None = None


@dataclass(frozen=True)
class LayerCalibration:
    layer: int
    split: str
    kernels: int
    calibrated_kernels: int
    devices: tuple[CalibratedParticipant, ...]  # the record's ``devices`` list


@dataclass(frozen=True)
class ParticipantTiming:
    """One participant's share of one conv layer in one step (seconds, bytes)."""

    participant: str
    kernels: int
    forward_s: float
    backward_s: float
    wait_s: float = 0.0
    forward_latency_s: float | None = None
    backward_latency_s: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    peer_bytes_sent: int = 0  # worker-to-worker traffic (peer data plane)
    peer_bytes_received: int = 0
    by_samples: bool = False  # a sample split: ``kernels`` counts its samples

    @property
    def compute_s(self) -> float:
        """Forward plus backward compute seconds measured by the participant."""
        return self.forward_s + self.backward_s

    @property
    def peer_bytes(self) -> int:
        """Bytes the participant exchanged with other workers (both directions)."""
        return self.peer_bytes_sent + self.peer_bytes_received


@dataclass(frozen=True)
class LayerTiming:
    layer: int
    devices: tuple[ParticipantTiming, ...]  # the record's ``devices`` list


@dataclass(frozen=True)
class StepRecord:
    epoch: int
    step: int
    loss: float
    accuracy: float
    images: int
    step_s: float
    conv_s: float
    dense_s: float
    comm_s: float
    data_s: float
    layers: tuple[LayerTiming, ...]


@dataclass(frozen=True)
class EpochRecord:
    epoch: int
    train_loss: float
    train_accuracy: float
    test_loss: float | None
    test_accuracy: float | None
    train_s: float | None
    epoch_s: float | None
    images_per_s: float | None


@dataclass(frozen=True)
class LayerShape:
    """A conv layer's shape from ``run_start`` (``kernels`` is what matters here)."""

    index: int
    kernels: int
    in_channels: int | None = None
    height: int | None = None
    width: int | None = None
    kernel_size: int | None = None


@dataclass(frozen=True)
class StepModelCheck:
    """A ``model`` record: the step model calibrated in place (master/samples/step_model.py),
    its prediction (``compute_s`` + ``rounds`` x ``round_s`` + ``serial_s``) against the
    median of the ``checked_steps`` measured after its fit (seconds)."""

    predicted_s: float
    measured_s: float
    compute_s: float
    rounds: int
    round_s: float
    serial_s: float
    checked_steps: int
    attempt: int = 1  # the check's number: a check off by more than 10 % fits again


@dataclass(frozen=True)
class RunRecords:
    """Everything the report needs from one run directory."""

    run_dir: str
    config: dict[str, Any]
    layers: tuple[LayerShape, ...]
    devices: tuple[ParticipantInfo, ...]  # the ``devices`` record
    calibration: tuple[LayerCalibration, ...]
    steps: tuple[StepRecord, ...]
    epochs: tuple[EpochRecord, ...]
    status: str | None  # run_end status; None while the run is in progress
    error: str | None
    warnings: tuple[str, ...]
    plan_predicted_step_s: float | None = None  # the planner's conv + transfer prediction
    rehearsal_predicted_step_s: float | None = None  # set-up's rehearsed plan: a whole step
    step_model: StepModelCheck | None = None  # the last ``model`` record (sample split)
    dense_part: str = "master"  # the last ``plan`` record's: "replicas" or "master"
    events: tuple[MembershipEvent, ...] = ()  # joins, losses, re-plans, ... in time order
    checkpoints: tuple[CheckpointRecord, ...] = ()  # every training snapshot taken
    replayed_steps: int = 0  # step records left out: an earlier record of a replayed step
    start_time: float | None = None  # Unix time of the first record
    seconds_per_sample: dict[str, float] = field(default_factory=dict)
    wire: str = ""  # the wire dtype(s) the plan chose (``wire_text``); "" without a plan
    split: tuple[str, str] = ("", "")  # the plan's split and why (``split_choice``)
    not_used: tuple[str, ...] = ()  # participants the last plan left out (``not_chosen``)
    """The sample split's calibration (the last ``plan`` record): per participant,
    seconds per sample of the whole conv chain, forward and backward."""

    @property
    def name(self) -> str:
        return Path(self.run_dir).name or self.run_dir

    @property
    def mode(self) -> str:
        return str(self.config.get("mode") or ("distributed" if self.calibration else "local"))


class _Collect(logging.Handler):
    """Keeps the messages that ``iter_metrics`` logs about skipped lines."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _records_with_warnings(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    collector = _Collect()
    logger = logging.getLogger("hetconv.metrics")
    logger.addHandler(collector)
    try:
        records = list(iter_metrics(path))
    finally:
        logger.removeHandler(collector)
    # the path is in the report's title already
    return records, [message.replace(str(path), path.name) for message in collector.messages]


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _participant_info(raw: dict[str, Any]) -> ParticipantInfo:
    return ParticipantInfo(id=str(raw["id"]), kind=str(raw.get("kind") or "?"),
                           name=str(raw.get("name") or "?"),
                           device=str(raw.get("device") or "?"),
                           hostname=str(raw.get("hostname") or "?"),
                           cores=_opt_int(raw.get("cores")),
                           threads=_opt_int(raw.get("threads")),
                           blas=str(raw.get("blas") or ""))


def _calibration(raw: dict[str, Any]) -> LayerCalibration:
    by_samples = raw.get("split_by") == "samples"  # work units: samples, not kernels
    devices = tuple(CalibratedParticipant(participant=participant_of(d),
                                          seconds=float(d["seconds"]),
                                          kernels=int(d["samples"] if by_samples
                                                      else d["kernels"]),
                                          share=float(d.get("share", 0.0)),
                                          fixed_s=_opt_float(d.get("fixed_s")),
                                          per_kernel_s=_opt_float(d.get("per_kernel_s")))
                    for d in participant_entries(raw))
    return LayerCalibration(layer=int(raw["layer"]), split=str(raw.get("split", "?")),
                            kernels=int(raw["kernels"]),
                            calibrated_kernels=int(raw["calibrated_kernels"]), devices=devices)


def _participant_timing(raw: dict[str, Any]) -> ParticipantTiming:
    by_samples = raw.get("split_by") == "samples"  # work units: samples, not kernels
    return ParticipantTiming(participant=participant_of(raw),
                             kernels=int(raw["samples"] if by_samples else raw["kernels"]),
                             by_samples=by_samples,
                             forward_s=float(raw["forward_s"]),
                             backward_s=float(raw["backward_s"]),
                             wait_s=float(raw.get("wait_s", 0.0)),
                             forward_latency_s=_opt_float(raw.get("forward_latency_s")),
                             backward_latency_s=_opt_float(raw.get("backward_latency_s")),
                             bytes_sent=int(raw.get("bytes_sent", 0)),
                             bytes_received=int(raw.get("bytes_received", 0)),
                             peer_bytes_sent=int(raw.get("peer_bytes_sent", 0)),
                             peer_bytes_received=int(raw.get("peer_bytes_received", 0)))


def _step(raw: dict[str, Any]) -> StepRecord:
    layers = tuple(LayerTiming(layer=int(layer["layer"]),
                               devices=tuple(_participant_timing(d) for d in participant_entries(layer)))
                   for layer in raw.get("layers", []))
    return StepRecord(epoch=int(raw["epoch"]), step=int(raw["step"]), loss=float(raw["loss"]),
                      accuracy=float(raw["accuracy"]), images=int(raw.get("images", 0)),
                      step_s=float(raw["step_s"]), conv_s=float(raw["conv_s"]),
                      dense_s=float(raw["dense_s"]), comm_s=float(raw.get("comm_s", 0.0)),
                      data_s=float(raw.get("data_s", 0.0)), layers=layers)


def _epoch(raw: dict[str, Any]) -> EpochRecord:
    return EpochRecord(epoch=int(raw["epoch"]), train_loss=float(raw["train_loss"]),
                       train_accuracy=float(raw["train_accuracy"]),
                       test_loss=_opt_float(raw.get("test_loss")),
                       test_accuracy=_opt_float(raw.get("test_accuracy")),
                       train_s=_opt_float(raw.get("train_s")),
                       epoch_s=_opt_float(raw.get("epoch_s")),
                       images_per_s=_opt_float(raw.get("images_per_s")))


def _layer_shape(raw: dict[str, Any]) -> LayerShape:
    return LayerShape(index=int(raw["index"]), kernels=int(raw["kernels"]),
                      in_channels=_opt_int(raw.get("in_channels")),
                      height=_opt_int(raw.get("height")), width=_opt_int(raw.get("width")),
                      kernel_size=_opt_int(raw.get("kernel_size")))


def _read_config(run_dir: Path, warnings: list[str]) -> dict[str, Any]:
    path = run_dir / CONFIG_FILE
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        warnings.append(f"{path}: unreadable ({error}); ignored")
        return {}
    return config if isinstance(config, dict) else {}


def check_run_dir(run_dir: str | Path) -> Path:
    """The metrics file of a run directory, or a one-line :class:`UserError`."""
    directory = Path(run_dir)
    if not directory.is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    metrics = directory / METRICS_FILE
    if not metrics.is_file():
        raise UserError(f"{run_dir}: no {METRICS_FILE} here; is this a run directory "
                        "(made by 'hetconv train --run-dir')?")
    return metrics


def _dispatch(records: list[dict[str, Any]], warnings: list[str]) -> Iterator[tuple[str, Any]]:
    """(record type, parsed object) per usable record; malformed ones become warnings."""
    parsers: dict[str, Callable[[dict[str, Any]], Any]] = {
        "devices": lambda r: tuple(_participant_info(d) for d in r["devices"]),
        "calibration": _calibration, "step": _step, "epoch": _epoch,
        "run_start": lambda r: r, "run_end": lambda r: r,
        "plan": lambda r: (None if r.get("predicted_step_s") is None
                           else float(r["predicted_step_s"])),
        "rehearsal": lambda r: float(r["predicted_step_s"]),
        "model": lambda r: StepModelCheck(
            float(r["predicted_step_s"]), float(r["measured_step_s"]), float(r["compute_s"]),
            int(r["rounds"]), float(r["round_s"]), float(r["serial_s"]),
            int(r["checked_steps"]), int(r.get("attempt", 1)))}
    for number, raw in enumerate(records, start=1):
        parser = parsers.get(raw["type"])
        if parser is None:
            continue  # a record type from a newer schema: not ours to judge
        try:
            yield raw["type"], parser(raw)
        except (KeyError, TypeError, ValueError) as error:
            warnings.append(f"record {number} ({raw['type']}) is malformed ({error!r}); skipped")


def parse_run(run_dir: str | Path) -> RunRecords:
    """Parse a run directory; raises :class:`UserError` when there is nothing to read."""
    metrics_path = check_run_dir(run_dir)
    directory = Path(run_dir)
    raw_records, warnings = _records_with_warnings(metrics_path)
    if not raw_records:
        raise UserError(f"{metrics_path}: no metrics records yet (empty file); "
                        "is the run still starting?")
    config = _read_config(directory, warnings)
    layers: tuple[LayerShape, ...] = ()
    devices: tuple[ParticipantInfo, ...] = ()
    calibration: dict[int, LayerCalibration] = {}
    steps: dict[int, StepRecord] = {}  # the last record of each step counts
    step_records = 0
    epochs: list[EpochRecord] = []
    status: str | None = None
    error: str | None = None
    predicted: float | None = None
    step_model: StepModelCheck | None = None
    rehearsed: float | None = None
    for kind, item in _dispatch(raw_records, warnings):
        if kind == "run_start":
            status = error = None  # a resumed run: what the earlier process ended with is past
            config = {**config, **(item.get("config") or {})}
            try:
                layers = tuple(_layer_shape(layer) for layer in item.get("layers") or [])
            except (KeyError, TypeError, ValueError) as problem:
                warnings.append(f"run_start layers are malformed ({problem!r}); ignored")
        elif kind == "devices":
            devices = item
        elif kind == "calibration":
            calibration[item.layer] = item
        elif kind == "step":
            steps[item.step] = item
            step_records += 1
        elif kind == "epoch":
            epochs.append(item)
        elif kind == "plan":
            predicted = item
        elif kind == "model":
            step_model = item
        elif kind == "rehearsal":
            rehearsed = item
        elif kind == "run_end":
            status = str(item.get("status") or "?")
            error = item.get("error")
    ordered = [steps[number] for number in sorted(steps)]
    if not layers:
        layers = _layers_from(ordered, calibration)
    events, checkpoints = membership_events(raw_records, warnings)
    if status is None:
        warnings.append("no run_end record: the run is in progress, or its master was killed")
    elif status != "completed":
        warnings.append(f"run ended with status {status}" + (f": {error}" if error else ""))
    return RunRecords(run_dir=str(run_dir), config=config, layers=layers, devices=devices,
                      calibration=tuple(calibration[k] for k in sorted(calibration)),
                      steps=tuple(ordered), epochs=_last_per_epoch(epochs), status=status,
                      error=None if error is None else str(error), warnings=tuple(warnings),
                      plan_predicted_step_s=predicted, step_model=step_model,
                      rehearsal_predicted_step_s=rehearsed,
                      events=events, checkpoints=checkpoints,
                      replayed_steps=step_records - len(ordered),
                      start_time=_first_time(raw_records), dense_part=dense_part(raw_records),
                      seconds_per_sample=seconds_per_sample(raw_records),
                      wire=wire_text(raw_records), split=split_choice(raw_records),
                      not_used=not_chosen(raw_records, devices))


def _first_time(records: list[dict[str, Any]]) -> float | None:
    for record in records:
        try:
            return float(record["time"])
        except (KeyError, TypeError, ValueError):
            continue
    return None


def _last_per_epoch(epochs: list[EpochRecord]) -> tuple[EpochRecord, ...]:
    """One record per epoch, the last one (an epoch end replayed after a fault or a
    ``--resume`` is written again), in epoch order."""
    by_epoch = {record.epoch: record for record in epochs}
    return tuple(by_epoch[number] for number in sorted(by_epoch))


def _layers_from(steps: list[StepRecord],
                 calibration: dict[int, LayerCalibration]) -> tuple[LayerShape, ...]:
    """Layer kernel counts when ``run_start`` is missing: calibration, else the last step."""
    if calibration:
        return tuple(LayerShape(index=c.layer, kernels=c.kernels)
                     for _, c in sorted(calibration.items()))
    if steps:
        return tuple(LayerShape(index=layer.layer,
                                kernels=sum(d.kernels for d in layer.devices))
                     for layer in steps[-1].layers)
    return ()
