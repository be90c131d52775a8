"""A worker daemon that misbehaves on purpose, for the tests.

``python -m tests.support.faulty_worker [FAULT FLAGS] worker [hetconv worker flags]``
runs ``hetconv worker`` with a :class:`WorkerFaults` given to its service (the
``FaultInjector`` of ``hetconv/worker/service.py``; a real worker has none):

- ``--delay-per-kernel-s S``: sleep S seconds per kernel of a shard in every training
  forward and backward, never in calibration, so the worker is slower in training than
  it calibrated (results unchanged);
- ``--corrupt-from-step N``: from training step N on, its forward outputs are wrong, as
  a machine with broken memory would send them;
- ``--corrupt-file PATH``: its outputs are wrong while PATH exists (a test turns a
  worker bad at the moment it holds kernels);
- ``--corrupt-mode``: how they are wrong: ``nan`` (the default), ``scale`` (finite,
  y x 1000), ``crop`` (one row and column short: the wrong H and W), ``train-scale``
  (y x 1000 in training mode only: its evaluation path, which the audit checks, is
  right);
- ``--hang-from-step N``: its compute thread hangs (sleeps for an hour) when it takes up
  a request of step N or later, while its socket thread goes on heartbeating;
- ``--mute-from-step N``: from step N on, every piece it sends on the data plane is
  dropped before it leaves (a wedged peer socket: it stays connected, heartbeats, and
  receives); ``--mute-to NAME`` (repeatable): only the pieces toward NAME (a cut link
  from it to NAME).

Tests start one with ``workers(name, faults=WorkerFaults(...))`` (tests/conftest.py)
or with :meth:`WorkerFaults.spec` in a :class:`hetconv.lab.LocalWorkers` spec.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hetconv import logs
from hetconv.commands import worker
from hetconv.commands.cli import build_parser
from hetconv.engine.shard import ConvShard, LayerSettings
from hetconv.errors import UserError
from hetconv.participant.peer_sockets import PeerSockets
from hetconv.protocol import PeerPiece

REPO = Path(__file__).resolve().parents[2]
MODULE = "tests.support.faulty_worker"
CORRUPT_MODES = ("nan", "scale", "crop", "train-scale")


class FaultyShard(ConvShard):
    """A shard that sleeps ``delay_per_kernel_s`` per kernel in each training forward
    and backward (results unchanged), and answers wrong (``corrupt_mode``) while
    ``corrupt`` is set."""

    delay_per_kernel_s = 0.0
    corrupt_mode = "nan"
    corrupt = False

    def forward(self, x: Any, train: bool,
                rows_ready: Callable[[int], None] | None = None) -> Any:
        if train:
            time.sleep(self.delay_per_kernel_s * self.kernels)
        y = super().forward(x, train, rows_ready)
        return self.corrupt_output(y) if train or self.corrupt_mode != "train-scale" else y

    def training_delay(self) -> None:
        """The delay of one training phase (the sample split's rounds call it)."""
        time.sleep(self.delay_per_kernel_s * self.kernels)

    def corrupt_output(self, y: Any) -> Any:
        """y as this shard answers it: wrong while ``corrupt`` is set (the sample split's
        rounds call this on every layer output they finish)."""
        if not self.corrupt:
            return y
        if self.corrupt_mode in ("scale", "train-scale"):
            return y * np.float32(1000.0)
        if self.corrupt_mode == "crop":
            return np.ascontiguousarray(y[:, :, :-1, :-1])
        return y * np.float32("nan")

    def backward(self, dy: Any, need_dx: bool, learning_rate: float,
                 dx_rows: Callable[[Any, int, int], None] | None = None) -> Any:
        time.sleep(self.delay_per_kernel_s * self.kernels)
        return super().backward(dy, need_dx, learning_rate, dx_rows)


class Muted:
    """Whether this process's data plane drops what it sends (``--mute-from-step``), and
    toward whom (empty: everyone)."""

    on = False
    toward: frozenset[str] = frozenset()


MUTED = Muted()


def muted_send(send: Callable[..., int]) -> Callable[..., int]:
    """``PeerSockets.send`` that drops the piece while :data:`MUTED` says so."""
    def send_unless_muted(self: PeerSockets, participant: str, piece: PeerPiece) -> int:
        if MUTED.on and (not MUTED.toward or participant in MUTED.toward):
            return int(piece.data.nbytes)  # "sent": it never leaves
        return send(self, participant, piece)
    return send_unless_muted


@dataclass(frozen=True)
class WorkerFaults:
    """What a test's worker does wrong (see the module docstring); the defaults: nothing."""

    delay_per_kernel_s: float = 0.0
    corrupt_from_step: int = -1  # < 0: not from a step
    corrupt_mode: str = "nan"
    corrupt_file: str | None = None
    hang_from_step: int = -1
    mute_from_step: int = -1
    mute_to: tuple[str, ...] = ()

    def any(self) -> bool:
        return self.delay_per_kernel_s > 0 or self.corrupt_from_step >= 0 \
            or bool(self.corrupt_file)

    # --- the FaultInjector of hetconv.worker.service ------------------------------------
    def make_shard(self, layer: int, kernel_start: int, kernel_stop: int,
                   settings: LayerSettings, state: dict[str, Any], *,
                   device: str) -> ConvShard:
        if not self.any():
            return ConvShard(layer, kernel_start, kernel_stop, settings, state, device=device)
        shard = FaultyShard(layer, kernel_start, kernel_stop, settings, state, device=device)
        shard.delay_per_kernel_s = self.delay_per_kernel_s
        shard.corrupt_mode = self.corrupt_mode
        return shard

    def at_step(self, step: int, shards: Mapping[int, ConvShard]) -> None:
        """Hang or mute from their steps on; corrupt from ``corrupt_from_step`` on, or
        while ``corrupt_file`` exists."""
        if 0 <= self.mute_from_step <= step and not MUTED.on:
            MUTED.on, MUTED.toward = True, frozenset(self.mute_to)
            print(f"faulty worker: muted toward {', '.join(self.mute_to) or 'every peer'} "
                  f"from step {step}", file=sys.stderr, flush=True)
        if 0 <= self.hang_from_step <= step:
            print(f"faulty worker: compute thread hangs at step {step}", file=sys.stderr,
                  flush=True)
            time.sleep(3600)
        if self.corrupt_from_step < 0 and not self.corrupt_file:
            return
        corrupt = (os.path.exists(self.corrupt_file) if self.corrupt_file
                   else step >= self.corrupt_from_step)
        for layer, shard in shards.items():
            if isinstance(shard, FaultyShard):
                if shard.corrupt != corrupt:  # the evidence a failing test prints
                    print(f"faulty worker: layer {layer + 1} kernels [{shard.kernel_start}, "
                          f"{shard.kernel_stop}) {'corrupt' if corrupt else 'correct'} "
                          f"({self.corrupt_mode}) from step {step}", file=sys.stderr,
                          flush=True)
                shard.corrupt = corrupt

    # --- starting one --------------------------------------------------------------------
    def flags(self) -> list[str]:
        flags = ["--delay-per-kernel-s", repr(self.delay_per_kernel_s),
                 "--corrupt-from-step", str(self.corrupt_from_step),
                 "--corrupt-mode", self.corrupt_mode]
        if self.corrupt_file:
            flags += ["--corrupt-file", self.corrupt_file]
        flags += ["--hang-from-step", str(self.hang_from_step),
                  "--mute-from-step", str(self.mute_from_step)]
        for name in self.mute_to:
            flags += ["--mute-to", name]
        return flags

    def spec(self) -> dict[str, Any]:
        """The :class:`hetconv.lab.LocalWorker` arguments that start this faulty worker."""
        path = os.environ.get("PYTHONPATH", "")
        return {"launcher": ("-m", MODULE, *self.flags()),
                "env": {"PYTHONPATH": str(REPO) + (os.pathsep + path if path else "")}}


def fault_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {MODULE}",
        description="hetconv worker with faults injected (tests only)")
    parser.add_argument("--delay-per-kernel-s", type=float, default=0.0)
    parser.add_argument("--corrupt-from-step", type=int, default=-1)
    parser.add_argument("--corrupt-mode", choices=CORRUPT_MODES, default="nan")
    parser.add_argument("--corrupt-file", default=None)
    parser.add_argument("--hang-from-step", type=int, default=-1)
    parser.add_argument("--mute-from-step", type=int, default=-1)
    parser.add_argument("--mute-to", action="append", default=[])
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="worker, then the flags of hetconv worker")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``hetconv worker`` (as ``hetconv.commands.cli.main`` runs it) with the faults."""
    parser = fault_parser()
    options = parser.parse_args(argv)
    if options.command[:1] != ["worker"]:
        parser.error("the fault flags must be followed by: worker [flags]")
    faults = WorkerFaults(options.delay_per_kernel_s, options.corrupt_from_step,
                          options.corrupt_mode, options.corrupt_file, options.hang_from_step,
                          options.mute_from_step, tuple(options.mute_to))
    if faults.mute_from_step >= 0:
        PeerSockets.send = muted_send(PeerSockets.send)  # type: ignore[method-assign]
    try:
        args = build_parser().parse_args(options.command)
        logs.configure(args.verbose, getattr(args, "log_format", "text"),
                       getattr(args, "progress_every", None))
        return worker.run(args, faults)
    except UserError as error:
        print(f"hetconv: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
