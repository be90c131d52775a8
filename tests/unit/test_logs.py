"""Logs for machines (hetconv.logs): progress lines instead of bar redraws off a terminal,
JSON lines with --log-format json, and no other library's INFO lines."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from hetconv import logs
from hetconv.errors import UserError


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    own = {name: logging.getLogger(name).level for name in logs.OWN_LOGGERS}
    settings = logs.settings()
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    for name, old in own.items():
        logging.getLogger(name).setLevel(old)
    logs._settings = settings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def collect() -> tuple[list[tuple[str, dict[str, Any]]], Any]:
    lines: list[tuple[str, dict[str, Any]]] = []
    return lines, lambda text, **fields: lines.append((text, fields))


def test_progress_every_parses_steps_and_seconds() -> None:
    assert logs.parse_progress_every("50") == logs.ProgressEvery(steps=50, seconds=0.0)
    assert logs.parse_progress_every("2.5s") == logs.ProgressEvery(steps=0, seconds=2.5)
    for bad in ("0", "-3", "abc", "0s", "s"):
        with pytest.raises(UserError, match="--progress-every"):
            logs.parse_progress_every(bad)


def test_line_progress_by_steps_then_a_last_line_at_close() -> None:
    lines, out = collect()
    clock = Clock()
    bar = logs.LineProgress(10, 0, "epoch 1/2", logs.ProgressEvery(steps=4, seconds=0.0),
                            out=out, clock=clock)
    for _ in range(10):
        bar.set_postfix(loss="0.5000", acc="0.750", refresh=False)
        clock.now += 1.0
        bar.update(1)
    bar.close()
    bar.close()  # once only
    assert [fields["done"] for _, fields in lines] == [4, 8, 10]
    assert lines[0][0] == "epoch 1/2: 4/10 batches (40%), loss=0.5000 acc=0.750, 4.0 s"
    assert lines[-1][1]["total"] == 10 and lines[-1][1]["elapsed_s"] == 10.0


def test_line_progress_by_seconds_and_nothing_new_means_no_line() -> None:
    lines, out = collect()
    clock = Clock()
    bar = logs.LineProgress(100, 20, "epoch 2/2", logs.ProgressEvery(steps=0, seconds=30.0),
                            out=out, clock=clock)
    for _ in range(5):
        clock.now += 10.0
        bar.update(1)
    assert [fields["done"] for _, fields in lines] == [23]  # at 30 s, resumed at 20
    bar.close()
    assert [fields["done"] for _, fields in lines] == [23, 25]
    quiet_lines, quiet_out = collect()
    quiet = logs.LineProgress(5, 0, "e", out=quiet_out, clock=clock)
    quiet.close()
    assert quiet_lines == []


def test_off_a_terminal_progress_is_lines_not_a_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "_is_terminal", lambda: False)
    assert isinstance(logs.progress_bar(10, 0, "e", disable=False), logs.LineProgress)
    monkeypatch.setattr(logs, "_is_terminal", lambda: True)
    bar = logs.progress_bar(10, 0, "e", disable=True)
    assert not isinstance(bar, logs.LineProgress)
    bar.close()
    logs.configure(log_format="json")
    assert isinstance(logs.progress_bar(10, 0, "e", disable=False), logs.LineProgress)


def test_json_format_and_no_third_party_info(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure(verbose=False, log_format="json")
    logging.getLogger("matplotlib.category").info("Using categorical units to plot ...")
    logging.getLogger("PIL.PngImagePlugin").debug("STREAM b'IHDR'")
    logging.getLogger("hetconv.worker").info("serving master %s", "tcp://m:5555")
    logging.getLogger("hetconv.master").debug("not without -v")
    logging.getLogger("urllib3").warning("a library's warning still shows")
    logs.emit("hetconv: done", test_accuracy=0.5)
    captured = capsys.readouterr()
    errors = [json.loads(line) for line in captured.err.splitlines()]
    assert [(e["logger"], e["level"], e["message"]) for e in errors] == [
        ("hetconv.worker", "info", "serving master tcp://m:5555"),
        ("urllib3", "warning", "a library's warning still shows")]
    out = [json.loads(line) for line in captured.out.splitlines()]
    assert out[0]["message"] == "hetconv: done" and out[0]["test_accuracy"] == 0.5


def test_text_format_verbose_is_debug_for_hetconv_only(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    logs.configure(verbose=True, log_format="text")
    logging.getLogger("hetconv.master").debug("a debug line")
    logging.getLogger("matplotlib.font_manager").debug("findfont: ...")
    logs.emit("plain line")
    captured = capsys.readouterr()
    assert "hetconv.master DEBUG: a debug line" in captured.err
    assert "findfont" not in captured.err
    assert captured.out == "plain line\n"
    with pytest.raises(UserError, match="--log-format"):
        logs.configure(log_format="xml")
