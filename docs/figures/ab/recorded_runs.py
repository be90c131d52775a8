"""Recorded steps of ``hetconv bench scale`` runs, for the replays beside this file.

``extract(paths)`` reads runs' ``metrics.jsonl`` (one per bench configuration and
repeat) into a compact dict, ``write``/``load`` keep it as JSON (one run per line):
per run its participants and, per step, the step's seconds (``step_s``), its conv
part's (``conv_s``), and per participant its compute (forward + backward of every conv
layer) and samples, plus the ``model`` records' errors (the step model's checks as
the run made them) and the setup's calibration (ms per sample per participant, the
first ``plan`` record's). Times in ms, rounded to the µs.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

Run = dict[str, Any]  # {"participants", "steps": [[step_ms, conv_ms, [[ms, n] | None, ...]]], "model_errors", "calibration_ms"}


def run_name(path: Path) -> str:
    """``abc123/4x[0.45,0.45,0.45,0.45]-auto/repeat1`` of that run's metrics.jsonl."""
    return (f"{path.parents[2].name.removeprefix('hetconv-scale-')}/{path.parents[1].name}/"
            f"{path.parent.name}")


def extract(path: Path) -> Run:
    participants: list[str] = []
    steps: list[list[Any]] = []
    errors: list[float] = []
    calibration: dict[str, float] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("type") == "model":
            errors.append(round(float(record["error"]), 4))
        if record.get("type") == "plan" and not calibration:
            calibration = {name: round(seconds * 1e3, 4) for name, seconds
                           in (record.get("seconds_per_sample") or {}).items()}
        if record.get("type") != "step":
            continue
        compute: dict[str, float] = {}
        samples: dict[str, int] = {}
        for layer in record["layers"]:
            for device in layer["devices"]:
                name = device["participant"]
                compute[name] = compute.get(name, 0.0) + device["forward_s"] + device["backward_s"]
                samples[name] = device.get("samples", 0)
        for name in compute:
            if name not in participants:
                participants.append(name)
        steps.append([round(record["step_s"] * 1e3, 3), round(record["conv_s"] * 1e3, 3),
                      [[round(compute[n] * 1e3, 3), samples[n]] if n in compute else None
                       for n in participants]])
    width = len(participants)
    for step in steps:  # participants first seen later: absent from earlier steps
        step[2] += [None] * (width - len(step[2]))
    return {"participants": participants, "steps": steps, "model_errors": errors,
            "calibration_ms": calibration}


def write(runs: dict[str, Run], path: Path) -> None:
    path.write_text("{\n" + ",\n".join(f"{json.dumps(name)}: {json.dumps(run)}"
                                        for name, run in sorted(runs.items())) + "\n}\n")


def load(path: Path) -> dict[str, Run]:
    runs: dict[str, Run] = json.loads(path.read_text())
    return runs


def step_figures(run: Run) -> list[tuple[float, float, dict[str, float], dict[str, int]]]:
    """Per step: (step s, conv s, compute s per participant, samples per participant),
    participants absent from a step left out of it."""
    out = []
    for step_ms, conv_ms, per in run["steps"]:
        compute = {n: p[0] / 1e3 for n, p in zip(run["participants"], per) if p is not None}
        samples = {n: p[1] for n, p in zip(run["participants"], per) if p is not None}
        out.append((step_ms / 1e3, conv_ms / 1e3, compute, samples))
    return out


def module_at(revision: str, path: str, root: Path) -> ModuleType:
    """The module at ``path`` (a file of the repository at ``root``) as it was at git
    ``revision``, imported under its own name prefixed ``old_``: the other side of a
    replay."""
    source = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=root,
                            capture_output=True, text=True, check=True).stdout
    name = "old_" + Path(path).stem
    copy = Path(tempfile.mkdtemp()) / f"{name}.py"
    copy.write_text(source)
    spec = importlib.util.spec_from_file_location(name, copy)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
