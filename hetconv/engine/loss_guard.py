"""A loss that jumps by orders of magnitude: a last line against silent wrong training.

The checks by sender (hetconv/participant/samples/outliers.py) and the snapshot audit
(master/audit.py) name a participant whose results are wrong; what slips past them (a
wrong result on a path neither looks at) shows as a loss that jumps by orders of
magnitude in one step. :class:`LossJumpGuard` (pure: losses in, a decision out) says
when: above ``JUMP_FACTOR`` times the median of the last ``WINDOW`` steps' losses, once
``WINDOW`` are known. The trainer then treats it as a fault of nobody in particular: it
restores the last snapshot (which passed its audit) and replays, and the snapshots
that follow are audited as ever. The same jump at the same step after the replay is
the data's, not a participant's (a replay reproduces the run exactly): it is let
through, once, with a warning, and never counted again.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

JUMP_FACTOR = 100.0
"""How many times the recent median loss a step's loss must exceed to be a jump."""
WINDOW = 20
"""Steps whose losses make the median (and must be known before any jump is called)."""


@dataclass(frozen=True)
class Jump:
    """A jump of the loss: one line saying so; ``restore``: restore and replay (False:
    the same jump came back after a replay, it is let through)."""

    line: str
    restore: bool


class LossJumpGuard:
    """Losses in step order; :meth:`check` says whether a step's loss is a jump."""

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.replayed: set[int] = set()  # steps already restored once for a jump

    def check(self, step: int, loss: float) -> Jump | None:
        """A :class:`Jump` when ``loss`` at ``step`` is one (restore and replay the first
        time; let through, with its line, when it comes back at a step replayed once),
        else None. Every loss let through joins the median's window."""
        jump = None
        if len(self.recent) == WINDOW:
            median = statistics.median(self.recent)
            if median > 0 and loss > JUMP_FACTOR * median:
                line = (f"the loss jumped to {loss:.4g} at step {step}, {loss / median:.0f} "
                        f"times the median of the last {WINDOW} steps ({median:.4g})")
                if step not in self.replayed:
                    self.replayed.add(step)
                    return Jump(f"{line}: a wrong result no check named? restoring the last "
                                "audited snapshot", True)
                jump = Jump(f"{line} again after a replay: the data's, going on", False)
        self.recent.append(loss)
        return jump

    def rewind(self) -> None:
        """After a restore: the replayed steps' losses come again."""
        self.recent.clear()
