"""A sender whose pieces are far out of scale with the others' (silent wrong training).

Under the sample split every member sends, per layer and step, the batch-norm moments of
its slice's conv output (2, K). Members hold slices of the same batch through the same
weights, so the spread of their outputs is alike (within 3x on the demo); a member whose
training-mode forward is scaled (x1000: its evaluation path is right, so the snapshot
audit passes) sends moments whose spread is a thousand times the others'. Each member
checks the moments it combines (:func:`outlier`) and names the one far outside
(:data:`OUTLIER_FACTOR`) as bad data of that sender: the master evicts and quarantines
it, as for a NaN. Pure functions, no sockets.

Not the weight gradients: a slice's gradient is dominated by its few hard samples, so
honest slices differ by orders of magnitude once most samples are learnt (a run of
three one-sample slices measured 173x); a scale rule would evict honest workers.
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping

import numpy as np

OUTLIER_FACTOR = 100.0
"""How many times the others' scale a sender's must exceed to be named: far above the
spread of honest slices' outputs (within 3x on the demo), far below the x1000 of a
broken forward."""


def moments_scale(moments: np.ndarray, count: int) -> float:
    """The scale of one member's (2, K) moments (the sum and M2 of ``count`` values per
    channel): the RMS over channels of its standard deviation."""
    if count <= 0:
        return 0.0
    return float(np.sqrt(np.mean(np.maximum(np.asarray(moments[1], np.float64), 0.0) / count)))


def check_scales(scales: Mapping[str, float], me: str, what: str) -> tuple[str, str] | None:
    """(the outlier, one line saying so) among ``scales`` (:func:`outlier`), or None."""
    culprit = outlier(scales, me)
    if culprit is None:
        return None
    if not np.isfinite(scales[culprit]):
        return culprit, f"peer {culprit}'s {what} holds NaN or Inf"
    others = sorted(v for name, v in scales.items() if name != culprit)
    return culprit, (f"peer {culprit}'s {what} is {scales[culprit]:.3g}, the others' "
                     f"{', '.join(f'{v:.3g}' for v in others)} (more than "
                     f"{OUTLIER_FACTOR:.0f} times: a wrong result that passed the audit)")


def outlier(scales: Mapping[str, float], me: str) -> str | None:
    """The sender whose scale exceeds OUTLIER_FACTOR times the others' (their median;
    with two senders, ``me``'s own when it is one of them: a participant trusts its own
    result and judges the other), or None. Senders with a scale of 0 or less are never
    a reference (an empty or constant slice says nothing)."""
    worst: str | None = None
    for sender, scale in scales.items():
        others = [v for name, v in scales.items() if name != sender and v > 0]
        if len(scales) >= 3 and others:
            reference = statistics.median(others)
        elif len(scales) == 2 and sender != me and me in scales and scales[me] > 0:
            reference = scales[me]
        else:
            continue
        if not np.isfinite(scale) or scale > OUTLIER_FACTOR * reference:
            if worst is None or scale > scales[worst]:
                worst = sender
    return worst
