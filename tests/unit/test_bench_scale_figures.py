"""Which steps `hetconv bench scale` takes its figures from (pure)."""
from __future__ import annotations

from typing import Any

from hetconv.bench.scale_figures import SETTLED_STEPS, settled_split


def records(steps: int, resplits: list[int]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"type": "step", "step": s} for s in range(steps)]
    out += [{"type": "rebalance", "step": s, "new_predicted_step_s": s / 1000}
            for s in resplits]
    return out


def test_no_resplit_means_no_settled_split() -> None:
    assert settled_split(records(40, [])) is None


def test_the_last_resplit_with_enough_steps_after_it_wins() -> None:
    last = 40 - SETTLED_STEPS - 2  # exactly SETTLED_STEPS steps after it (one skipped)
    assert settled_split(records(40, [7, last])) == {
        "type": "rebalance", "step": last, "new_predicted_step_s": last / 1000}
    # a re-split too close to the end is not the steady state: the one before it is
    assert settled_split(records(40, [7, last + 1]))["step"] == 7  # type: ignore[index]
    assert settled_split(records(12, [7])) is None
