"""The loss-jump guard (hetconv/engine/loss_guard.py): pure, losses in, decisions out."""
from __future__ import annotations

from hetconv.engine.loss_guard import JUMP_FACTOR, WINDOW, LossJumpGuard


def test_a_jump_restores_once_then_the_same_jump_is_let_through() -> None:
    guard = LossJumpGuard()
    for step in range(WINDOW):
        assert guard.check(step, 1.0 + 0.01 * step) is None
    assert guard.check(WINDOW, 50.0) is None  # 50x: a spike, not a jump
    jump = guard.check(WINDOW + 1, 1.0 * JUMP_FACTOR * 2)
    assert jump is not None and jump.restore and "restoring" in jump.line
    guard.rewind()  # replayed from a snapshot: the window fills again first
    for step in range(WINDOW + 1 - WINDOW, WINDOW + 1):
        assert guard.check(step, 1.0) is None
    again = guard.check(WINDOW + 1, 1.0 * JUMP_FACTOR * 2)
    assert again is not None and not again.restore and "again after a replay" in again.line


def test_no_jump_is_called_before_the_window_is_known() -> None:
    guard = LossJumpGuard()
    assert guard.check(0, 2.3) is None
    assert guard.check(1, 1e6) is None
