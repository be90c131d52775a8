"""One vocabulary: error codes, array names and choices are spelled in one place each; a
participant id is written as ``participant`` and read through ``participant_of``."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for folder in ("hetconv", "protocol", "master", "worker")
                 for p in (ROOT / folder).rglob("*.py")
                 if p.relative_to(ROOT).parts[1:2] not in {("protocol",), ("master",),
                                                          ("worker",)})

RULES = [
    (re.compile(r"""code\s*=\s*["']"""), "an error code as a literal: use protocol.errors.ERR_*",
     {"protocol/errors.py"}),
    (re.compile(r"""RequestError\(\s*["']"""), "an error code as a literal: use ERR_*", set()),
    (re.compile(r"""f["']conv\{"""), "a layer array key spelled by hand: use names.layer_key",
     {"hetconv/names.py"}),
    (re.compile(r"""__name__\s+in\s+|TYPE\s*==\s*["']"""),
     "dispatch on class-name strings: match by type", set()),
    (re.compile(r"""choices\s*=\s*\(["']"""), "choices retyped: use the tuples in hetconv.config",
     set()),
    (re.compile(r"""\[\s*["']device["']\s*\]"""),
     "an entry's participant id read by hand: use hetconv.metrics.participant_of (it reads "
     "the legacy 'device' key too)", {"master/calibration.py"}),  # a docstring, a real device
    (re.compile(r"""["']device["']\s*:"""),
     "a 'device' key written: a participant id is 'participant'; only a device description "
     "names its cpu/gpu:N 'device'",
     {"hetconv/device_info.py", "hetconv/config.py", "hetconv/commands/train.py"}),
]


def test_sources_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in SOURCES}
    assert {"hetconv/names.py", "master/cluster.py", "worker/service.py"} <= names
    assert not any(n.startswith(("hetconv/master/", "hetconv/worker/")) for n in names)


@pytest.mark.parametrize("pattern,why,allowed", RULES, ids=[r[1][:30] for r in RULES])
def test_no_private_spellings(pattern: re.Pattern[str], why: str, allowed: set[str]) -> None:
    hits = []
    for path in SOURCES:
        name = path.relative_to(ROOT).as_posix()
        if name in allowed:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{name}:{number}: {line.strip()}")
    assert not hits, f"{why}:\n" + "\n".join(hits)


def test_rules_catch_what_they_claim() -> None:
    samples = ['ErrorReply(request_id=0, code="bad_request", message="x")',
               'raise RequestError("unknown_layer", "x")', 'key = f"conv{layer}.weight"',
               'if type(message).__name__ in REPLY_TYPES:', 'p.add_argument("--x", choices=("a", "b"))',
               'name = str(entry["device"])', '{"device": p.participant, "kernels": 3}']
    for (pattern, _, _), sample in zip(RULES, samples):
        assert pattern.search(sample), sample
