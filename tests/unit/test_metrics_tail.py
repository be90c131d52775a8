"""MetricsTail follows a file a run is appending to: the same records as read_metrics,
read incrementally, a half-written line waiting for its end, a replaced file re-read."""
from __future__ import annotations

import json
import os
from pathlib import Path

from hetconv.metrics import MetricsTail, read_metrics


def line(kind: str, **fields: object) -> str:
    return json.dumps({"type": kind, **fields}, separators=(",", ":")) + "\n"


def test_the_tail_equals_a_whole_read_at_every_point(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.records() == [] and tail.steps == 0  # no file yet
    text = line("run_start") + "".join(line("step", step=i, loss=1.0 / (i + 1))
                                       for i in range(5)) + "not json\n" + line("run_end")
    with open(path, "w", encoding="utf-8") as handle:
        for cut in range(0, len(text), 7):  # appended in pieces that cut lines anywhere
            handle.write(text[cut:cut + 7])
            handle.flush()
            complete = text[:cut + 7].rsplit("\n", 1)[0] + "\n" if "\n" in text[:cut + 7] else ""
            expected = [json.loads(x) for x in complete.splitlines() if x.startswith("{")]
            assert tail.records() == expected
    assert tail.records() == read_metrics(path)
    assert tail.steps == 5


def test_a_replaced_or_shorter_file_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(line("step", step=0) + line("step", step=1), encoding="utf-8")
    tail = MetricsTail(path)
    assert len(tail.records()) == 2
    replacement = tmp_path / "new.jsonl"
    replacement.write_text(line("run_start"), encoding="utf-8")
    os.replace(replacement, path)  # a new inode
    assert tail.records() == [{"type": "run_start"}] and tail.steps == 0
    path.write_text("", encoding="utf-8")  # truncated in place
    assert tail.records() == []
    path.unlink()
    assert tail.records() == []
