"""Atomic writes of weights (``.npz``, no object arrays) and JSON metadata.

Files are written to a temporary name in the same directory, fsynced, renamed and
the directory fsynced, so a crash never leaves a half-written file behind.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def _atomic_write(path: Path, write: Any) -> int:
    """``write(handle)`` to a temporary file beside ``path``, fsync, rename over
    ``path``, fsync the directory (so the rename itself survives a crash); returns the
    size written. A failure leaves the old file and no temporary behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
            size = handle.tell()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return int(size)


write_atomically = _atomic_write


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
