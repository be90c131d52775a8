"""Output for people and for machines: logging set-up, user lines and training progress.

``hetconv train`` and ``hetconv worker`` take ``--log-format text|json``
(``HETCONV_LOG_FORMAT``). Log records (``logging``) go to stderr; a run's own lines
(what it trains on, its progress, each epoch, the result) go to stdout through
:func:`emit`. With ``json`` every line on either stream is one JSON object with
``time``, ``level``, ``logger`` and ``message`` (and, for progress, the numbers).
Only hetconv's loggers speak at INFO; every other library's logger is held at
WARNING, so nothing like matplotlib's INFO lines reaches a job's log.

Progress: on a terminal (text format) a tqdm bar; otherwise (a file, a pipe, a
container's log, Slurm's output file) :class:`LineProgress`, one line every
``--progress-every`` steps (``50``) or seconds (``30s``, the default) and one when an
epoch's bar closes: no bar redraws in logs.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from hetconv.errors import UserError

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"
DEFAULT_PROGRESS_EVERY = "30s"
OWN_LOGGERS = ("hetconv", "__main__")
"""Loggers that speak at INFO (DEBUG with -v); everything else stays at WARNING."""


@dataclass(frozen=True)
class ProgressEvery:
    """A progress line every ``steps`` steps (0: not by steps) or ``seconds`` (0: not by
    time), whichever comes first."""

    steps: int = 0
    seconds: float = 30.0


@dataclass(frozen=True)
class LogSettings:
    log_format: str = "text"
    progress_every: ProgressEvery = ProgressEvery()


_settings = LogSettings()


def parse_progress_every(text: str) -> ProgressEvery:
    """``50`` -> every 50 steps, ``30s`` -> every 30 seconds (UserError otherwise)."""
    value = text.strip().lower()
    try:
        if value.endswith("s"):
            seconds = float(value[:-1])
            if seconds > 0:
                return ProgressEvery(steps=0, seconds=seconds)
        else:
            steps = int(value)
            if steps > 0:
                return ProgressEvery(steps=steps, seconds=0.0)
    except ValueError:
        pass
    raise UserError(f"--progress-every {text!r}: give steps (50) or seconds (30s), "
                    "more than 0")


class JsonFormatter(logging.Formatter):
    """One JSON object per log record: time, level, logger, message (and the traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {"time": round(record.created, 6),
                                "level": record.levelname.lower(), "logger": record.name,
                                "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, separators=(",", ":"), default=str)


def configure(verbose: bool = False, log_format: str = "text",
              progress_every: ProgressEvery | None = None) -> None:
    """Set up logging for a command: one stderr handler in ``log_format``; hetconv's
    loggers at INFO (DEBUG when ``verbose``), every other logger at WARNING."""
    global _settings
    if log_format not in LOG_FORMATS:
        raise UserError(f"--log-format {log_format!r}: choose one of {', '.join(LOG_FORMATS)}")
    _settings = LogSettings(log_format=log_format,
                            progress_every=progress_every or _settings.progress_every)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.captureWarnings(False)


def add_output_flags(parser: Any, progress: bool = False) -> None:
    """``--log-format`` (and with ``progress``, ``--progress-every``) on a subcommand."""
    parser.add_argument("--log-format", choices=LOG_FORMATS,
                        default=os.environ.get("HETCONV_LOG_FORMAT", "text"),
                        help="text (default) or json: one JSON object per line on stdout "
                        "and stderr, for log collectors")
    if progress:
        parser.add_argument("--progress-every", type=parse_progress_every,
                            default=os.environ.get("HETCONV_PROGRESS_EVERY",
                                                   DEFAULT_PROGRESS_EVERY),
                            metavar="N|Ns", help="when stdout is not a terminal: a progress "
                            "line every N steps (50) or N seconds (30s, the default)")


def settings() -> LogSettings:
    return _settings


def emit(text: str, **fields: Any) -> None:
    """One line of a run's own output on stdout: ``text`` as it is, or with ``json``
    an object with the message and ``fields``. Safe while a tqdm bar is drawn."""
    if _settings.log_format == "json":
        line = {"time": round(time.time(), 6), "level": "info", "logger": "hetconv",
                "message": text, **fields}
        print(json.dumps(line, separators=(",", ":"), default=str), flush=True)
    else:
        write_line(text)


def write_line(text: str) -> None:
    """``text`` and a newline on stdout, flushed; above the progress bar when one may be
    drawn (tqdm is imported only to draw one: it costs every process 60 ms to start)."""
    if "tqdm" in sys.modules:
        sys.modules["tqdm"].tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()
    else:
        print(text, flush=True)


class Progress(Protocol):
    """What the training loop calls on its progress display (a tqdm bar or lines)."""

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True,
                    **kwargs: Any) -> None: ...

    def update(self, n: float = 1) -> Any: ...

    def close(self) -> None: ...


class LineProgress:
    """Progress for logs: a line every ``every.steps`` updates or ``every.seconds``,
    and one at :meth:`close` when steps were done since the last line."""

    def __init__(self, total: int, initial: int = 0, desc: str = "",
                 every: ProgressEvery = ProgressEvery(),
                 out: Callable[..., None] = emit,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.done, self.desc = total, initial, desc
        self.every, self.out, self.clock = every, out, clock
        self.postfix: dict[str, str] = {}
        self.started = self.last_time = clock()
        self.last_done = initial
        self.closed = False

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True,
                    **kwargs: Any) -> None:
        self.postfix = {str(k): str(v) for k, v in {**(ordered_dict or {}), **kwargs}.items()}

    def update(self, n: float = 1) -> None:
        self.done += int(n)
        now = self.clock()
        by_steps = self.every.steps and self.done - self.last_done >= self.every.steps
        by_time = self.every.seconds and now - self.last_time >= self.every.seconds
        if by_steps or by_time:
            self._line(now)

    def close(self) -> None:
        if not self.closed and self.done != self.last_done:
            self._line(self.clock())
        self.closed = True

    def _line(self, now: float) -> None:
        self.last_done, self.last_time = self.done, now
        percent = 100.0 * self.done / max(1, self.total)
        extra = " ".join(f"{key}={value}" for key, value in self.postfix.items())
        text = (f"{self.desc}: {self.done}/{self.total} batches ({percent:.0f}%)"
                f"{', ' + extra if extra else ''}, {now - self.started:.1f} s")
        self.out(text, event="progress", desc=self.desc, done=self.done, total=self.total,
                 elapsed_s=round(now - self.started, 3),
                 **{key: _number(value) for key, value in self.postfix.items()})


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def progress_bar(total: int, initial: int, desc: str, disable: bool) -> Progress:
    """A tqdm bar on a terminal (text format) or in a Jupyter notebook (tqdm's widget),
    otherwise :class:`LineProgress`."""
    notebook = _in_notebook()
    if not disable and not notebook and (_settings.log_format == "json" or not _is_terminal()):
        return LineProgress(total, initial, desc, _settings.progress_every)
    if notebook:
        from tqdm.auto import tqdm
    else:
        from tqdm import tqdm

    bar: Progress = tqdm(total=total, initial=initial, desc=desc, unit="batch",
                         disable=disable, leave=True, dynamic_ncols=True)
    return bar


def _in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (the Python API in a notebook)."""
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    try:
        instance = shell.get_ipython()
    except AttributeError:
        return False
    return instance is not None and type(instance).__name__ == "ZMQInteractiveShell"


def _is_terminal() -> bool:
    try:
        return sys.stderr.isatty()  # where tqdm draws
    except (AttributeError, ValueError):
        return False
