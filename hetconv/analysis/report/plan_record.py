"""What a run's ``plan`` records (and the re-plans after them) say, for the report:
where the dense part ran, who was left out, the split and why, the wire dtype(s), the
sample split's calibration. Each reader takes the run's raw records (``metrics.jsonl``
lines, in order) and is lenient: a missing or garbled field reads as unknown."""
from __future__ import annotations

import math
from typing import Any, Protocol

from hetconv.master.samples.plan import link_wires_text


class Named(Protocol):
    """A participant of the ``devices`` record (``records.ParticipantInfo``)."""

    @property
    def id(self) -> str: ...


def dense_part(records: list[dict[str, Any]]) -> str:
    """Where the last plan ran the dense part (docs/dense-replica.md): the plan record's
    ``dense_part`` when it says "replicas", else "master" (older runs, the kernel split)."""
    for record in reversed(records):
        if record.get("type") == "plan":
            return "replicas" if record.get("dense_part") == "replicas" else "master"
    return "master"


def not_chosen(records: list[dict[str, Any]],
               devices: tuple[Named, ...]) -> tuple[str, ...]:
    """The participants of the ``devices`` record that the last ``plan`` record's
    ``chosen`` leaves out (the planner found they would lengthen the step: a slow link,
    a slow machine), and those a later ``replan`` record's ``left_out`` names (a trial
    measured the step shorter without them: master/samples/trial_without.py); () without a plan
    record."""
    last = max((i for i, r in enumerate(records) if r.get("type") == "plan"), default=None)
    if last is None:
        return ()
    chosen = records[last].get("chosen")
    if not isinstance(chosen, list):
        return ()
    later: set[str] = set()
    for record in records[last + 1:]:
        names = record.get("left_out") if record.get("type") == "replan" else None
        if isinstance(names, list):
            later |= {name for name in names if isinstance(name, str)}
    return tuple(d.id for d in devices if d.id not in chosen or d.id in later)


def split_choice(records: list[dict[str, Any]]) -> tuple[str, str]:
    """The last ``plan`` record's split (``kernels`` or ``samples``) and why (its
    ``split_by_why``: the byte rule, the flag, or both splits' predicted steps);
    ("", "") without one (a local run, ``--split equal``, older runs)."""
    plan = next((r for r in reversed(records) if r.get("type") == "plan"), None)
    if plan is None:
        return "", ""
    split, why = plan.get("split_by"), plan.get("split_by_why")
    if split not in ("kernels", "samples") or not isinstance(why, str) or not why:
        return "", ""
    return str(split), why


def wire_text(records: list[dict[str, Any]]) -> str:
    """The wire dtype(s) of the last ``plan`` record: ``float32``, or under the sample
    split's choice link by link ``float16 on the link of m3, float32 on the others``
    (``float16 on every link``); "" without a plan record (a local run)."""
    plan = next((r for r in reversed(records) if r.get("type") == "plan"), None)
    if plan is None:
        return ""
    links = plan.get("link_wire_dtypes")
    if isinstance(links, dict) and links:
        return link_wires_text({str(name): str(dtype) for name, dtype in links.items()})
    return str(plan.get("wire_dtype") or "float32")


def seconds_per_sample(records: list[dict[str, Any]]) -> dict[str, float]:
    """The last sample-split ``plan`` record's calibration, seconds per sample by
    participant (positive numbers only); empty for the kernel split or older runs."""
    for record in reversed(records):
        if record.get("type") == "plan" and record.get("split_by") == "samples":
            raw = record.get("seconds_per_sample")
            if not isinstance(raw, dict):
                return {}
            out = {}
            for name, value in raw.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and math.isfinite(value) and value > 0:
                    out[str(name)] = float(value)
            return out
    return {}
