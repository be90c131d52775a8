"""``hetconv status``: who is in a run, on what, with how many kernels, last seen when.

It asks no new question of the master: it reads what the master already publishes,
either its Prometheus endpoint (``hetconv status http://MASTER:PORT`` for a master
started with ``--metrics-port PORT``) or its run directory
(``hetconv status RUN_DIR``, the ``metrics.jsonl`` there). Both become the same
:class:`RunStatus` (plain data) and the same table: one row per participant with its
device, calibrated seconds per layer, kernels held in the latest step and the time
since the latest step it took part in.
"""
from __future__ import annotations

import argparse
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetconv.errors import UserError
from hetconv.metrics import iter_metrics
from hetconv.prometheus import PARTICIPANT_INFO_KEYS, TrainingTotals

STATUS_TIMEOUT_S = 5.0
"""How long ``hetconv status`` waits for a master's /metrics."""


@dataclass
class ParticipantStatus:
    name: str
    device: str = ""
    description: str = ""
    calibrated_s: dict[int, float] = field(default_factory=dict)
    kernels: int = 0
    last_seen: float = 0.0  # Unix time; 0: never in a step


@dataclass
class RunStatus:
    running: bool
    step: int | None
    epoch: int | None
    loss: float | None
    participants: list[ParticipantStatus]


def from_totals(totals: TrainingTotals) -> RunStatus:
    """The status of a run from its folded metrics records."""
    rows = []
    for name, part in sorted(totals.participants.items()):
        rows.append(ParticipantStatus(
            name=name, device=part.info.get("device", ""),
            description=", ".join(part.info[key] for key in ("name", "hostname")
                                  if part.info.get(key)),
            calibrated_s=dict(part.calibrated_s), kernels=part.kernels,
            last_seen=part.last_seen))
    last = totals.last_step
    return RunStatus(running=bool(totals.running),
                     step=int(last["step"]) if "step" in last else None,
                     epoch=int(last["epoch"]) if "epoch" in last else None,
                     loss=last.get("loss"), participants=rows)


def from_run_dir(run_dir: Path) -> RunStatus:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl there; is it a run directory?")
    totals = TrainingTotals()
    for record in iter_metrics(path):
        totals.observe(record)
    return from_totals(totals)


def from_metrics_text(text: str) -> RunStatus:
    """The status from a master's /metrics text (docs/metrics.md, "Prometheus")."""
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        raise UserError("reading /metrics needs prometheus_client: pip install "
                        "'hetconv[metrics]' (or give the run directory)") from None
    plain: dict[str, float] = {}
    rows: dict[str, ParticipantStatus] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            name = labels.get("participant")
            if name is None:
                plain[sample.name] = float(sample.value)
                continue
            row = rows.setdefault(name, ParticipantStatus(name))
            if sample.name == "hetconv_participant_info":
                row.device = labels.get("device", "")
                row.description = ", ".join(labels[key] for key in PARTICIPANT_INFO_KEYS[2:]
                                            if labels.get(key))
            elif sample.name == "hetconv_participant_calibrated_seconds":
                row.calibrated_s[int(labels["layer"])] = float(sample.value)
            elif sample.name == "hetconv_participant_kernels":
                row.kernels = int(sample.value)
            elif sample.name == "hetconv_participant_last_seen_timestamp_seconds":
                row.last_seen = float(sample.value)
    if "hetconv_run_running" not in plain:
        raise UserError("that endpoint is not a hetconv master's /metrics")
    return RunStatus(running=bool(plain["hetconv_run_running"]),
                     step=int(plain["hetconv_step"]) if "hetconv_step" in plain else None,
                     epoch=int(plain["hetconv_epoch"]) if "hetconv_epoch" in plain else None,
                     loss=plain.get("hetconv_loss"),
                     participants=[rows[name] for name in sorted(rows)])


def fetch_metrics(url: str) -> str:
    target = url.rstrip("/")
    if not target.endswith("/metrics"):
        target += "/metrics"
    try:
        with urllib.request.urlopen(target, timeout=STATUS_TIMEOUT_S) as reply:
            return bytes(reply.read()).decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise UserError(f"cannot read {target}: {reason}; is the master running with "
                        "--metrics-port, and is that port reachable from here?") from None


def render(status: RunStatus, now: float) -> str:
    """The status as text: a run line, then a table of participants."""
    state = "running" if status.running else "not running (ended or not started)"
    where = "" if status.step is None else (
        f"; step {status.step}, epoch {(status.epoch or 0) + 1}, loss {status.loss:.4f}"
        if status.loss is not None else f"; step {status.step}")
    lines = [f"run: {state}{where}"]
    if not status.participants:
        lines.append("no participants yet (the master is waiting for workers or calibrating)")
        return "\n".join(lines)
    table = [("participant", "device", "calibrated s/layer", "kernels", "last seen", "machine")]
    for row in status.participants:
        calibrated = " ".join(f"{row.calibrated_s[layer]:.4f}"
                              for layer in sorted(row.calibrated_s)) or "-"
        seen = f"{max(0.0, now - row.last_seen):.1f} s ago" if row.last_seen else "-"
        table.append((row.name, row.device or "-", calibrated, str(row.kernels), seen,
                      row.description or "-"))
    widths = [max(len(line[column]) for line in table) for column in range(len(table[0]))]
    for line in table:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("status", help="list a run's participants: device, calibrated speed, "
                       "kernels held, last seen")
    p.add_argument("target", metavar="URL|RUN_DIR",
                   help="http://MASTER:PORT (a master started with --metrics-port PORT) or "
                   "the run directory")


def run(args: argparse.Namespace) -> int:
    target: str = args.target
    if target.startswith(("http://", "https://")):
        status = from_metrics_text(fetch_metrics(target))
    elif target.startswith("tcp://"):
        raise UserError(f"{target}: status reads the master's /metrics, not its ZeroMQ "
                        "port: start the master with --metrics-port PORT and give "
                        "http://MASTER:PORT (or give its run directory)")
    else:
        status = from_run_dir(Path(target))
    print(render(status, time.time()))
    return 0
