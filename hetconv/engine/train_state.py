"""A training snapshot: everything needed to go on from a step, in memory and on disk.

The trainer takes one at the start, every ``--checkpoint-every`` steps and when an
epoch's training is done (before its evaluation); it restores the last one after a
fault (docs/resilience.md) and ``hetconv train --resume`` loads it from
``RUN_DIR/checkpoint.npz``. The learning rate is a function of the step and the batch
order a function of (seed, epoch), so (step, epoch, position) pin both down.

On disk: one ``.npz`` (no pickles) with the arrays under ``conv/``, ``dense/`` and
``velocity/``, the loss trace as ``losses`` (float64) and the rest as UTF-8 JSON in
``meta``; written to a temporary file, fsynced, renamed over the old one, and the
directory fsynced, so a kill at any moment leaves the previous complete file.
"""
from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hetconv.engine.checkpoint import write_atomically

CHECKPOINT_NAME = "checkpoint.npz"
FORMAT_VERSION = 1


class CheckpointError(Exception):
    """A checkpoint file that cannot be read back (named in the message)."""


@dataclass
class TrainingState:
    """The state between two steps.

    step: the next global step; epoch, position: its epoch and the batches of that
    epoch already trained (position == steps per epoch: training done, evaluation
    pending). conv: every conv layer's whole state by ``conv{i}.<name>``; dense,
    velocity: the dense layer's parameters and SGD velocities. seen, correct,
    loss_sum, train_s: the epoch's running sums so far; losses: the loss of every step
    before ``step``; epochs: the summaries of the finished epochs.
    """

    step: int
    epoch: int
    position: int
    conv: dict[str, np.ndarray]
    dense: dict[str, np.ndarray]
    velocity: dict[str, np.ndarray]
    seen: int = 0
    correct: int = 0
    loss_sum: float = 0.0
    train_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)

    def nbytes(self) -> int:
        return sum(a.nbytes for part in (self.conv, self.dense, self.velocity)
                   for a in part.values())

    # --- disk ------------------------------------------------------------------------
    def save(self, path: Path) -> int:
        """Write atomically (see the module doc); returns the file's size in bytes."""
        arrays: dict[str, np.ndarray] = {}
        for prefix, part in (("conv", self.conv), ("dense", self.dense),
                             ("velocity", self.velocity)):
            for name, value in part.items():
                arrays[f"{prefix}/{name}"] = np.ascontiguousarray(value)
        arrays["losses"] = np.asarray(self.losses, dtype=np.float64)
        meta = {"format": FORMAT_VERSION, "step": self.step, "epoch": self.epoch,
                "position": self.position, "seen": self.seen, "correct": self.correct,
                "loss_sum": self.loss_sum, "train_s": self.train_s, "epochs": self.epochs}
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
        return write_atomically(path, lambda handle: np.savez(handle, **arrays))  # type: ignore[arg-type]

    @classmethod
    def load(cls, path: Path) -> TrainingState:
        """Read a file written by :meth:`save`; CheckpointError naming what is wrong."""
        try:
            with open(path, "rb") as handle, np.load(handle, allow_pickle=False) as data:
                files = {name: data[name] for name in data.files}
            meta = json.loads(bytes(files.pop("meta")).decode("utf-8"))
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no checkpoint (was the run started with a "
                                  "hetconv that writes them?)") from None
        except (OSError, ValueError, KeyError, UnicodeDecodeError, EOFError,
                zipfile.BadZipFile) as error:
            raise CheckpointError(f"{path}: unreadable checkpoint ({error})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r}, "
                                  f"this hetconv reads {FORMAT_VERSION}")
        parts: dict[str, dict[str, np.ndarray]] = {"conv": {}, "dense": {}, "velocity": {}}
        for name, value in files.items():
            prefix, _, key = name.partition("/")
            if prefix in parts and key:
                parts[prefix][key] = value
        for name, part in parts.items():
            for key, value in part.items():
                if not np.isfinite(value).all():
                    raise CheckpointError(f"{path}: {name}/{key} holds NaN or Inf")
        try:
            return cls(step=int(meta["step"]), epoch=int(meta["epoch"]),
                       position=int(meta["position"]), conv=parts["conv"],
                       dense=parts["dense"], velocity=parts["velocity"],
                       seen=int(meta["seen"]), correct=int(meta["correct"]),
                       loss_sum=float(meta["loss_sum"]), train_s=float(meta["train_s"]),
                       losses=[float(v) for v in files.get("losses", np.zeros(0))],
                       epochs=list(meta["epochs"]))
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"{path}: incomplete checkpoint ({error})") from None


def check_finite(arrays: dict[str, np.ndarray], what: str) -> None:
    """ValueError naming the first array with NaN or Inf (a snapshot is never saved so)."""
    for name, value in arrays.items():
        if not np.isfinite(value).all():
            raise ValueError(f"{what}: {name} holds NaN or Inf")
