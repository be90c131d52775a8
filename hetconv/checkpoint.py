"""Atomic writes of weights (``.npz``, no object arrays) and JSON metadata.

Files are written to a temporary name in the same directory, fsynced and
renamed, so a crash never leaves a half-written checkpoint behind.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def _atomic_write(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_weights(path: str | Path, arrays: dict[str, np.ndarray]) -> None:
    """Write float arrays by name to an ``.npz`` file atomically."""
    clean = {}
    for name, value in arrays.items():
        array = np.asarray(value)
        if array.dtype == object:
            raise TypeError(f"{name}: object arrays are not allowed in checkpoints")
        clean[name] = array
    _atomic_write(Path(path), lambda handle: np.savez(handle, **clean))  # type: ignore[arg-type]


def load_weights(path: str | Path) -> dict[str, np.ndarray]:
    """Read an ``.npz`` written by :func:`save_weights` (never unpickles)."""
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def save_json(path: str | Path, value: Any) -> None:
    save_text(path, json.dumps(value, indent=2, sort_keys=True) + "\n")


def save_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: temp file, fsync, rename."""
    _atomic_write(Path(path), lambda handle: handle.write(text.encode("utf-8")))
