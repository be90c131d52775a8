"""Metrics as data: JSON lines with the fixed schema in ``docs/metrics.md``.

:class:`MetricsWriter` appends one JSON object per line and flushes it, so a
reader (``hetconv report``) can follow a run that is still in progress.
:func:`read_metrics` parses a file, skipping a cut-off last line with a warning;
:class:`MetricsTail` follows a live run's file, reading only what was appended.
:func:`participant_of` reads the participant id of a per-participant entry, in files
written before the key was ``participant`` (it was ``device``) as well;
:func:`participant_entries` reads a list of such entries, in files written before the
lists were ``participants`` (they were ``devices``) as well.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 3  # 3: per-participant lists under "participants" (2: "devices");
# 2: participant ids under "participant" (1: "device")
PARTICIPANT_KEY = "participant"
LEGACY_PARTICIPANT_KEY = "device"  # the key before it was "participant"; still read
PARTICIPANTS_KEY = "participants"
LEGACY_PARTICIPANTS_KEY = "devices"  # the lists' key before schema 3; still read
log = logging.getLogger(__name__)


def participant_of(entry: Mapping[str, Any]) -> str:
    """The participant id (``master`` or a worker id) of one per-participant entry of a
    record (a step's ``layers[].participants[]``, a calibration's ``participants[]``, a
    plan's ``links[]`` and ``samples[]``, a re-split's ``counts[].participants[]``): its
    ``participant`` key, or ``device`` in files written before the rename. KeyError
    when it has neither."""
    if PARTICIPANT_KEY in entry:
        return str(entry[PARTICIPANT_KEY])
    if LEGACY_PARTICIPANT_KEY in entry:
        return str(entry[LEGACY_PARTICIPANT_KEY])
    raise KeyError(PARTICIPANT_KEY)


def participant_entries(container: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The per-participant entries of a calibration record, of one layer of a step's
    ``layers`` or of one row of a re-split's ``counts``: its ``participants`` list, or
    ``devices`` in files written before schema version 3 ([] when it has neither). Not
    for the ``devices`` record, whose ``devices`` are the participants' devices."""
    value = container.get(PARTICIPANTS_KEY)
    if value is None:
        value = container.get(LEGACY_PARTICIPANTS_KEY)
    return list(value or [])


def drop_cut_off_line(path: Path) -> None:
    """Truncate ``path`` after its last newline when a killed writer left half a line."""
    if not path.exists():
        return
    with open(path, "rb+") as file:
        size = file.seek(0, os.SEEK_END)
        if size == 0:
            return
        file.seek(size - 1)
        if file.read(1) == b"\n":
            return
        keep, block = 0, 65536
        position = size
        while position > 0:  # find the last newline, reading backwards
            start = max(0, position - block)
            file.seek(start)
            chunk = file.read(position - start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            position = start
        file.truncate(keep)
        log.warning("%s: dropped a cut-off last line (%d bytes) before appending", path,
                    size - keep)


class MetricsWriter:
    """Append-only JSON-lines writer; every record gets ``type`` and ``time``. Each
    record written is also handed to every function in ``observers`` (the Prometheus
    exporter, :mod:`hetconv.prometheus`); one that raises is logged and dropped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        drop_cut_off_line(self.path)  # a killed writer's half line would swallow our first
        self._file = open(self.path, "a", encoding="utf-8")
        self.observers: list[Callable[[dict[str, Any]], None]] = []

    def write(self, record_type: str, **fields: Any) -> None:
        record = {"type": record_type, "time": round(time.time(), 6), **fields}
        self._file.write(json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n")
        self._file.flush()
        for observer in list(self.observers):
            try:
                observer(record)
            except Exception:  # an observer must never stop a run
                log.exception("metrics observer failed on a %s record; dropped", record_type)
                self.observers.remove(observer)

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_metrics(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a metrics file in order; bad lines are skipped with a warning."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                record = parse_record(line)
            except ValueError as error:
                log.warning("%s line %d %s; skipped", path, number, error)
                continue
            if record is not None:
                yield record


def parse_record(line: str | bytes) -> dict[str, Any] | None:
    """One line's record (None for a blank line); ValueError saying why when the line is
    not one (cut off, not JSON, or JSON without a ``type``)."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except ValueError:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError("is cut off or not JSON") from None
    if not (isinstance(record, dict) and isinstance(record.get("type"), str)):
        raise ValueError("is not a metrics record")
    return record


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return list(iter_metrics(path))


class MetricsTail:
    """Follows a metrics file that a live run is appending to: each :meth:`records`
    reads only the bytes written since the last call (polling a 1300-step run's 3.6 MB
    file ten times a second costs a core when re-parsed whole). A line not yet ended by
    a newline waits for the next call; a file that shrank or was replaced (a run dir
    reused) is read again from its start. Lines that are not records are skipped, as
    :func:`iter_metrics` does."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._reset((0, 0))

    def _reset(self, identity: tuple[int, int]) -> None:
        self._records: list[dict[str, Any]] = []
        self._offset, self._identity, self._pending = 0, identity, b""
        self.steps = 0  # ``step`` records so far

    def records(self) -> list[dict[str, Any]]:
        """Every complete record so far, in order (a new list each call)."""
        try:
            with open(self.path, "rb") as handle:
                stat = os.fstat(handle.fileno())
                identity = (stat.st_dev, stat.st_ino)
                if identity != self._identity or stat.st_size < self._offset:
                    self._reset(identity)
                handle.seek(self._offset)
                new = handle.read()
        except FileNotFoundError:
            self._reset((0, 0))
            return []
        self._offset += len(new)
        *lines, self._pending = (self._pending + new).split(b"\n")
        for line in lines:
            try:
                record = parse_record(line)
            except ValueError as error:
                log.warning("%s: a line %s; skipped", self.path, error)
                continue
            if record is not None:
                self._records.append(record)
                self.steps += record["type"] == "step"
        return list(self._records)
