"""Carrying out the run state machine's commands: the one loop every stage uses.

``master/run.py`` decides (events in, commands out); a stage (``master/kernels/stage.py`` for
the kernel split, ``master/samples/stage.py`` for the sample split) moves what those
decisions mean over its sockets. The loop is the same for both, so it lives here: a
stage offers the few operations a command needs (:class:`CommandSite`), and a fault
while carrying them out (a worker lost during a re-plan) goes back to the state
machine, whose new commands are carried out in turn.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import numpy as np

from hetconv.engine.stage import ConvStage
from hetconv.errors import UserError
from hetconv.master.cluster import WorkerLost
from hetconv.master.run import (
    Admit,
    Command,
    Evict,
    FallBackLocal,
    Fault,
    Resplit,
    RunControl,
    Stop,
)

log = logging.getLogger("hetconv.master")


class CommandSite(Protocol):
    """What a stage offers the command loop."""

    control: RunControl

    def drop_worker(self, participant: str, reason: str, misbehaved: bool = False) -> None:
        """Tell ``participant`` it is out (when it is still there); ``misbehaved``: it
        stays out until its process restarts."""
        ...

    def admit(self, participants: list[str]) -> None:
        """Take the joiners in (calibrated; their share comes with the re-plan)."""
        ...

    def resplit_to(self, command: Resplit, state: dict[str, np.ndarray]) -> None:
        """Re-plan over ``command.alive`` and hand everyone ``state``."""
        ...

    def fault_event(self, lost: WorkerLost) -> Fault:
        """The state machine's event for ``lost`` (the stage quiet first)."""
        ...

    def close(self) -> None: ...


def carry_out(site: CommandSite, commands: list[Command], state: dict[str, np.ndarray],
              local_stage: Callable[[], ConvStage]) -> ConvStage | None:
    """Perform ``commands`` on ``site``; the stage to go on with when it is another
    one (the master alone, from ``state``), None when it is ``site`` itself. A worker
    lost while they are carried out is a fault for the state machine, whose commands
    are carried out next (it gives every worker up after MAX_REPLAN_FAULTS in a row)."""
    pending = list(commands)
    while True:
        try:
            return _perform(site, pending, state, local_stage)
        except WorkerLost as lost:
            log.warning("while re-planning: %s", lost)
            pending = site.control.handle(site.fault_event(lost))


def _perform(site: CommandSite, commands: list[Command], state: dict[str, np.ndarray],
             local_stage: Callable[[], ConvStage]) -> ConvStage | None:
    for command in commands:
        match command:
            case Evict():
                if command.drop:
                    site.drop_worker(command.participant, command.reason, command.misbehaved)
            case Stop():
                raise UserError(command.reason)
            case FallBackLocal():
                local = local_stage()
                local.restore(state)
                site.close()
                log.warning("%s: training on alone", command.reason)
                return local
            case Admit():
                site.admit(list(command.participants))
            case Resplit():
                site.resplit_to(command, state)
    return None
