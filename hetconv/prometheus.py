"""Prometheus ``/metrics`` for ``hetconv train`` and ``hetconv worker`` (``--metrics-port``).

The numbers are the ones already written down: the training side folds every
``metrics.jsonl`` record (``hetconv.metrics.MetricsWriter`` hands each one to
:meth:`TrainingTotals.observe`) into plain totals; the worker side folds every
request it served and its reply (:meth:`WorkerTotals.observe`). Both are plain data
under a lock; a scrape turns one consistent copy into metric families, so a scrape
never sees half a step. Metric names and their meaning are listed in docs/metrics.md
("Prometheus"). ``prometheus_client`` is an optional extra (``hetconv[metrics]``);
only :func:`serve` needs it, and without it ``--metrics-port`` is a one-line error.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hetconv.errors import UserError
from hetconv.metrics import participant_entries, participant_of

# labels of hetconv_participant_info, from the ``devices`` record (``device``: cpu, gpu:N)
PARTICIPANT_INFO_KEYS = ("device", "kind", "name", "hostname")


@dataclass
class ParticipantTotals:
    """One participant's sums over every ``step`` record (all layers, both phases)."""

    compute_s: float = 0.0
    wait_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    peer_bytes_sent: int = 0
    peer_bytes_received: int = 0
    kernels: int = 0  # in the latest step record (0 when it held none there)
    last_seen: float = 0.0  # Unix time of the latest step record it took part in
    info: dict[str, str] = field(default_factory=dict)
    calibrated_s: dict[int, float] = field(default_factory=dict)  # per layer


@dataclass
class TrainingTotals:
    """What a training run's ``metrics.jsonl`` says so far, as Prometheus sees it."""

    running: int = 0
    step_records: int = 0
    images: int = 0
    step_seconds: float = 0.0
    recoveries: int = 0
    workers_gone: int = 0
    replans: int = 0
    rebalances: int = 0
    checkpoints: int = 0
    checkpoint_seconds_sum: float = 0.0
    epochs: int = 0
    last_step: dict[str, float] = field(default_factory=dict)
    last_checkpoint_s: float = 0.0
    last_epoch: dict[str, float] = field(default_factory=dict)
    participants: dict[str, ParticipantTotals] = field(default_factory=dict)

    def participant(self, name: str) -> ParticipantTotals:
        return self.participants.setdefault(name, ParticipantTotals())

    def observe(self, record: dict[str, Any]) -> None:
        """Fold one metrics record in (docs/metrics.md for the fields)."""
        kind = record.get("type")
        if kind == "run_start":
            self.running = 1
        elif kind == "run_end":
            self.running = 0
        elif kind == "devices":
            for entry in record.get("devices", []):
                self.participant(str(entry.get("id"))).info = {
                    key: str(entry.get(key, "")) for key in PARTICIPANT_INFO_KEYS}
        elif kind == "calibration":
            for entry in participant_entries(record):
                self.participant(participant_of(entry)).calibrated_s[int(record["layer"])] = \
                    float(entry["seconds"])
        elif kind == "step":
            self._step(record)
        elif kind == "checkpoint":
            self.checkpoints += 1
            self.last_checkpoint_s = float(record["seconds"])
            self.checkpoint_seconds_sum += float(record["seconds"])
        elif kind == "recovery":
            self.recoveries += 1
            self.workers_gone += 1 if record.get("gone") else 0
        elif kind == "replan":
            self.replans += 1
        elif kind == "rebalance":
            self.rebalances += 1
        elif kind == "epoch":
            self.epochs += 1
            self.last_epoch = {key: float(record[key]) for key in
                               ("epoch", "test_accuracy", "test_loss", "images_per_s")}

    def _step(self, record: dict[str, Any]) -> None:
        self.step_records += 1
        self.images += int(record["images"])
        self.step_seconds += float(record["step_s"])
        self.last_step = {key: float(record[key]) for key in
                          ("step", "epoch", "loss", "accuracy", "learning_rate", "step_s",
                           "conv_s", "dense_s", "comm_s", "data_s")}
        self.last_step["images_per_s"] = record["images"] / max(float(record["step_s"]), 1e-9)
        kernels: dict[str, int] = {}
        for layer in record.get("layers", []):
            for entry in participant_entries(layer):
                name = participant_of(entry)
                totals = self.participant(name)
                totals.compute_s += float(entry.get("forward_s", 0.0)) + \
                    float(entry.get("backward_s", 0.0))
                totals.wait_s += float(entry.get("wait_s", 0.0))
                totals.bytes_sent += int(entry.get("bytes_sent", 0))
                totals.bytes_received += int(entry.get("bytes_received", 0))
                totals.peer_bytes_sent += int(entry.get("peer_bytes_sent", 0))
                totals.peer_bytes_received += int(entry.get("peer_bytes_received", 0))
                totals.last_seen = float(record["time"])
                kernels[name] = kernels.get(name, 0) + int(entry.get("kernels", 0))
        for name, totals in self.participants.items():
            totals.kernels = kernels.get(name, 0)


@dataclass
class WorkerTotals:
    """What one worker daemon served: requests by type, compute time, array bytes."""

    requests: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    compute_s: float = 0.0
    handle_s: float = 0.0
    bytes_received: int = 0
    bytes_sent: int = 0
    peer_bytes_sent: int = 0
    peer_bytes_received: int = 0
    evictions_seen: int = 0
    runs_joined: int = 0
    in_run: int = 0

    def observe(self, request: Any, reply: Any, seconds: float) -> None:
        """One request served (the compute thread's ``request -> reply`` in ``seconds``)."""
        kind = str(getattr(request, "TYPE", type(request).__name__))
        self.requests[kind] = self.requests.get(kind, 0) + 1
        self.errors += 1 if getattr(reply, "TYPE", "") == "error_reply" else 0
        self.compute_s += float(getattr(reply, "compute_s", 0.0))
        self.handle_s += seconds
        self.bytes_received += array_bytes(request)
        self.bytes_sent += array_bytes(reply)
        self.peer_bytes_sent += int(getattr(reply, "peer_bytes_sent", 0))
        self.peer_bytes_received += int(getattr(reply, "peer_bytes_received", 0))


def array_bytes(message: Any) -> int:
    """Bytes of the arrays a message carries (its ndarray fields, and ndarrays in its
    list, tuple and dict fields)."""
    total = 0
    values = [getattr(message, f.name) for f in dataclasses.fields(message)] \
        if dataclasses.is_dataclass(message) else []
    for value in values:
        items = value.values() if isinstance(value, dict) else \
            value if isinstance(value, (list, tuple)) else (value,)
        total += sum(int(item.nbytes) for item in items if isinstance(item, np.ndarray))
    return total


class Exporter:
    """A Prometheus collector over totals kept under a lock: ``update`` changes them,
    a scrape reads one consistent copy through ``families``."""

    def __init__(self, totals: Any, families: Callable[[Any], Iterator[Any]]):
        self.totals = totals
        self._families = families
        self.lock = threading.Lock()

    def update(self, change: Callable[[Any], None]) -> None:
        with self.lock:
            change(self.totals)

    def observe_record(self, record: dict[str, Any]) -> None:
        """A :class:`hetconv.metrics.MetricsWriter` observer (training totals)."""
        with self.lock:
            self.totals.observe(record)

    def observe_served(self, request: Any, reply: Any, seconds: float) -> None:
        """One request a worker served (worker totals)."""
        with self.lock:
            self.totals.observe(request, reply, seconds)

    def collect(self) -> Iterator[Any]:
        with self.lock:
            snapshot = copy.deepcopy(self.totals)
        yield from self._families(snapshot)


def training_exporter() -> Exporter:
    return Exporter(TrainingTotals(), training_families)


def worker_exporter() -> Exporter:
    return Exporter(WorkerTotals(), worker_families)


def training_families(totals: TrainingTotals) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def gauge(name: str, text: str, value: float) -> Any:
        return GaugeMetricFamily(f"hetconv_{name}", text, value=value)

    def counter(name: str, text: str, value: float) -> Any:
        return CounterMetricFamily(f"hetconv_{name}", text, value=value)

    yield gauge("run_running", "1 between run_start and run_end", totals.running)
    yield counter("steps", "step records written (replayed steps count again)",
                  totals.step_records)
    yield counter("images", "training images of every step record", totals.images)
    yield counter("step_seconds", "sum of step_s over the step records", totals.step_seconds)
    last = totals.last_step
    for key, text in (("step", "the latest step record's step"),
                      ("epoch", "the latest step record's epoch (from 0)"),
                      ("loss", "the latest step's batch loss"),
                      ("accuracy", "the latest step's batch accuracy"),
                      ("learning_rate", "the latest step's learning rate"),
                      ("step_s", "the latest step's wall time, seconds"),
                      ("conv_s", "the latest step's conv stage time, seconds"),
                      ("dense_s", "the latest step's dense part time, seconds"),
                      ("comm_s", "the latest step's communication on the critical path, s"),
                      ("data_s", "the latest step's wait for its batch, seconds"),
                      ("images_per_s", "the latest step's images / step_s")):
        if key in last:
            name = {"step_s": "last_step_seconds", "conv_s": "last_conv_seconds",
                    "dense_s": "last_dense_seconds", "comm_s": "last_comm_seconds",
                    "data_s": "last_data_seconds", "images_per_s": "images_per_second"
                    }.get(key, key)
            yield gauge(name, text, last[key])
    yield counter("recoveries", "recovery records: faults that cost a step",
                  totals.recoveries)
    yield counter("recoveries_gone", "recoveries whose participant was dead or gone",
                  totals.workers_gone)
    yield counter("replans", "replan records", totals.replans)
    yield counter("rebalances", "rebalance records", totals.rebalances)
    yield counter("checkpoints", "checkpoint records (snapshots)", totals.checkpoints)
    yield counter("checkpoint_seconds", "sum of the checkpoints' seconds",
                  totals.checkpoint_seconds_sum)
    yield gauge("last_checkpoint_seconds", "the latest snapshot's seconds",
                totals.last_checkpoint_s)
    yield counter("epochs", "epoch records", totals.epochs)
    if totals.last_epoch:
        yield gauge("test_accuracy", "the latest epoch's test accuracy",
                    totals.last_epoch["test_accuracy"])
        yield gauge("test_loss", "the latest epoch's test loss", totals.last_epoch["test_loss"])
    yield from participant_families(totals)


def participant_families(totals: TrainingTotals) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    label = ["participant"]
    info = GaugeMetricFamily("hetconv_participant_info", "1 per participant of the devices "
                             "record, its description in labels",
                             labels=["participant", *PARTICIPANT_INFO_KEYS])
    calibrated = GaugeMetricFamily("hetconv_participant_calibrated_seconds",
                                   "calibration: layer forward+backward seconds with the "
                                   "calibrated kernels", labels=["participant", "layer"])
    sums = {
        "compute_seconds": ("forward_s + backward_s over all layers", "compute_s"),
        "wait_seconds": ("wait_s over all layers", "wait_s"),
        "bytes_sent": ("array bytes the master sent it", "bytes_sent"),
        "bytes_received": ("array bytes received from it", "bytes_received"),
        "peer_bytes_sent": ("array bytes it sent its peers", "peer_bytes_sent"),
        "peer_bytes_received": ("array bytes it received from its peers",
                                "peer_bytes_received"),
    }
    counters = {name: CounterMetricFamily(f"hetconv_participant_{name}", text, labels=label)
                for name, (text, _) in sums.items()}
    kernels = GaugeMetricFamily("hetconv_participant_kernels", "kernels held in the latest "
                                "step, all layers", labels=label)
    seen = GaugeMetricFamily("hetconv_participant_last_seen_timestamp_seconds",
                             "Unix time of the latest step record it took part in",
                             labels=label)
    for name, part in sorted(totals.participants.items()):
        if part.info:
            info.add_metric([name, *(part.info[key] for key in PARTICIPANT_INFO_KEYS)], 1)
        for layer, seconds in sorted(part.calibrated_s.items()):
            calibrated.add_metric([name, str(layer)], seconds)
        for metric, (_, attribute) in sums.items():
            counters[metric].add_metric([name], getattr(part, attribute))
        kernels.add_metric([name], part.kernels)
        seen.add_metric([name], part.last_seen)
    yield info
    yield calibrated
    yield from counters.values()
    yield kernels
    yield seen


def worker_families(totals: WorkerTotals) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    requests = CounterMetricFamily("hetconv_worker_requests", "requests served, by type",
                                   labels=["type"])
    for kind, count in sorted(totals.requests.items()):
        requests.add_metric([kind], count)
    yield requests
    for name, text, value in (
            ("errors", "requests answered with an error_reply", totals.errors),
            ("compute_seconds", "compute_s of the replies (the shard's own time)",
             totals.compute_s),
            ("handle_seconds", "wall time serving requests", totals.handle_s),
            ("bytes_received", "array bytes of the requests", totals.bytes_received),
            ("bytes_sent", "array bytes of the replies", totals.bytes_sent),
            ("peer_bytes_sent", "array bytes sent to peers", totals.peer_bytes_sent),
            ("peer_bytes_received", "array bytes received from peers",
             totals.peer_bytes_received),
            ("evictions_seen", "times the master no longer knew this worker mid-run",
             totals.evictions_seen),
            ("runs_joined", "Welcomes that started a session", totals.runs_joined)):
        yield CounterMetricFamily(f"hetconv_worker_{name}", text, value=value)
    yield GaugeMetricFamily("hetconv_worker_in_run", "1 while in a master's session",
                            value=totals.in_run)


class MetricsServer:
    """``/metrics`` over HTTP on ``port`` (all addresses) for one :class:`Exporter`."""

    def __init__(self, exporter: Exporter, port: int, address: str = "0.0.0.0"):
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError:
            raise UserError("--metrics-port needs prometheus_client: pip install "
                            "'hetconv[metrics]'") from None
        registry = CollectorRegistry(auto_describe=False)
        registry.register(exporter)
        try:
            self.server, self.thread = start_http_server(port, address, registry)
        except OSError as error:
            raise UserError(f"--metrics-port {port}: cannot serve /metrics there: "
                            f"{error.strerror or error}; choose another port") from None
        self.port = int(self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def metrics_port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return port


def add_metrics_port(parser: Any) -> None:
    """``--metrics-port`` (``HETCONV_METRICS_PORT``) on a subcommand."""
    default = os.environ.get("HETCONV_METRICS_PORT") or None
    parser.add_argument("--metrics-port", type=metrics_port, metavar="PORT",
                        default=None if default is None else metrics_port(default),
                        help="serve Prometheus /metrics on this TCP port, all addresses "
                        "(needs the extra: pip install 'hetconv[metrics]')")


def serve(exporter: Exporter, port: int | None) -> MetricsServer | None:
    """A server for ``exporter`` when ``port`` is given (None: no /metrics)."""
    return None if port is None else MetricsServer(exporter, port)
