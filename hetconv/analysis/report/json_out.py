"""The report as JSON: the same figures as the terminal and HTML reports.

:func:`summary_to_dict` turns a :class:`RunSummary` into plain JSON values
(dataclasses become objects, tuples lists; NaN and infinities become null), with
a ``schema`` field so that scripts reading it can check what they get.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

from hetconv.analysis.report.summary import RunSummary

REPORT_SCHEMA = "hetconv-report/1"


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def summary_to_dict(summary: RunSummary) -> dict[str, Any]:
    """One run's figures as a JSON-ready dict (times in seconds, fractions 0..1)."""
    return {"schema": REPORT_SCHEMA, **_plain(dataclasses.asdict(summary))}


def render_json(summaries: Sequence[RunSummary]) -> str:
    """One object for one run, a list for several."""
    objects = [summary_to_dict(summary) for summary in summaries]
    return json.dumps(objects[0] if len(objects) == 1 else objects, indent=2, allow_nan=False)
