"""Re-weighting the sample split's slices from measured compute (``--rebalance``).

:class:`SampleBalance`: per-sample seconds per participant from the calibration,
corrected from the measured rounds of recent steps (the median of the first 9 after a
plan, then of the last 27 at the current slices; a participant's round is from the
round's start to its reply: compute, wire, message handling and CPU-quota throttling,
what the barrier waits for; its own waits for its peers' pieces are not its cost) and
re-weighted when the measured slowest participant would finish clearly sooner.
Sans-IO: the stage feeds it every step's figures (``master/samples/between.py``);
docs/sample-split.md ("Slices, faults, joins, rebalancing").
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

from hetconv.config import MASTER_PARTICIPANT
from hetconv.master.samples.plan import Slice
from hetconv.planning.partition import balanced_counts

REBALANCE_WINDOW = 9
"""Steps of measured compute whose median corrects a participant's per-sample cost at
the first check after a plan (a calibration can be far off: act soon), and steps
between two later checks."""
SETTLED_WINDOW = 27
"""Steps of measured compute, at the current slices, whose median every later check
uses. On the lab's quota-throttled machines a participant's compute per sample swings
slowly with the phase of its CPU period against the step's (two equal 0.45-core
machines, 32:64: 0.5-0.8 ms a sample for 10 steps, then 1.3-1.5 for the next 10,
the other machine the opposite way), so a 9-step median followed the swing and two
equal machines were re-sliced 56/72 -> 64/64 -> 81/47 within 45 steps; a window of
three such swings averages them out."""
URGENT_GAIN = 0.30
"""Between the settled checks the last ``REBALANCE_WINDOW`` steps re-weight the slices
only where they would finish at least this much sooner: a machine that turned busy is
acted on after 9 steps, the swings of equal machines' 9-step medians mostly are not
(the recorded runs of two, three and four 0.45-core machines: a predicted gain of
7.5-11.9 % at the median 9-step window, 17.7-22.5 % at the 90th percentile, at most
32.8 %, 30 % or more in 0-2 % of the windows; docs/figures/ab/rebalance-replay.py
--gains)."""
REBALANCE_GAIN = 0.10
"""Re-weight only when the predicted slowest compute drops by at least this fraction.
(5 % was tried: on the lab's quota-throttled machines a participant's compute per
sample moves 10-20 % from one 9-step median to the next, and two equal machines
swung 63/65 -> 73/55 -> 64/64 -> 55/73 in 35 steps.)"""


class SampleBalance:
    """Each participant's step as a fixed part plus a part per sample, o_i + b_i·n_i.

    From the calibration: b_i its seconds per sample, o_i = 0. Measured: b_i the median
    compute per sample of the last ``REBALANCE_WINDOW`` steps at the first check after
    a plan (or a join or an eviction), of the last ``SETTLED_WINDOW`` steps at the
    current slices at every later one (a check every ``REBALANCE_WINDOW`` steps; with
    fewer steps at these slices, of the last ``REBALANCE_WINDOW``, acted on only for a
    gain of ``URGENT_GAIN``), o_i the median of the rest of its rounds (from each round's start to its reply, minus its compute and
    minus its own waits for its peers' pieces: the wire, message handling and CPU-quota
    throttling it pays whatever its slice), less the least of the workers' (the part
    common to them all is the master's). The waits are left out because they are the
    others' cost: under the step chain's batch-norm barriers every participant's round
    ends with the slowest one's, so a participant with too few samples waits for the
    rest, and counting that as its own fixed part would justify its small slice and
    keep any split as it is (a fixed point: o_i + b·n_i equal for all). The
    slices minimise the slowest participant's o_i + b_i·n_i (``balanced_counts``: a
    machine whose fixed part alone is too slow gets few samples or none). ``observe``
    returns True when the measured model's slices would finish at least
    ``REBALANCE_GAIN`` (``URGENT_GAIN``) sooner than the current ones, and adopts them. A re-slice that
    would move samples back the way the last one moved them meets the last estimates
    halfway (damped: under CPU quotas the measured speeds swing with the slices)."""

    def __init__(self, seconds_per_sample: dict[str, float]):
        self.seconds = dict(seconds_per_sample)  # b_i
        self.overhead: dict[str, float] = {}  # o_i (0 until measured)
        self._measured: dict[str, deque[tuple[float, float]]] = {}
        self._last_moves: dict[str, int] = {}  # the last re-slice: samples gained (< 0 lost)
        self._settled = False  # a check happened since the plan: later ones use SETTLED_WINDOW
        self._since_check = 0  # steps observed since the last check
        self._samples_seen: dict[str, int] = {}  # the slices the measurements are of

    def restrict(self, names: Sequence[str]) -> None:
        """Forget participants not in ``names`` (evicted)."""
        self.seconds = {n: t for n, t in self.seconds.items() if n in names}
        self.overhead = {n: t for n, t in self.overhead.items() if n in names}
        self._measured = {n: d for n, d in self._measured.items() if n in names}
        self._last_moves = {}
        self._settled = False

    def add(self, name: str, seconds_per_sample: float) -> None:
        self.seconds[name] = seconds_per_sample
        self.overhead.pop(name, None)
        self._measured.pop(name, None)
        self._last_moves = {}
        self._settled = False

    def slices(self, names: Sequence[str], batch: int) -> list[Slice]:
        """Consecutive slices of ``batch`` in the order of ``names`` (empty ones kept)."""
        costs = [(self.overhead.get(n, 0.0), max(self.seconds[n], 1e-12)) for n in names]
        counts = balanced_counts(costs, batch)
        out, start = [], 0
        for name, count in zip(names, counts):
            out.append(Slice(name, start, start + count))
            start += count
        return out

    def observe(self, compute_s: dict[str, float], latency_s: dict[str, float],
                samples: dict[str, int], waits_s: dict[str, float] | None = None) -> bool:
        """One step's figures per participant: its compute (seconds, peer waits left
        out), its rounds' latency (from each round's start to its reply in the master's
        hands), its samples, and its waits for its peers' pieces (within the latency)."""
        waits = waits_s or {}
        if samples != self._samples_seen:  # other slices (ours, or a re-plan's): measure afresh
            self._measured.clear()
            self._since_check = 0
            self._samples_seen = dict(samples)
        for name, seconds in compute_s.items():
            n = samples.get(name, 0)
            if n > 0 and name in self.seconds:
                rest = latency_s.get(name, seconds) - seconds - waits.get(name, 0.0)
                self._measured.setdefault(name, deque(maxlen=SETTLED_WINDOW)).append(
                    (seconds / n, max(0.0, rest)))
        self._since_check += 1
        working = [n for n in self.seconds if samples.get(n, 0) > 0]
        held = min((len(self._measured.get(n, ())) for n in working), default=0)
        if self._since_check < REBALANCE_WINDOW or held < REBALANCE_WINDOW:
            return False
        self._since_check = 0
        if not self._settled:
            self._settled = True
            return self._decide(samples, REBALANCE_WINDOW, REBALANCE_GAIN)
        if held >= SETTLED_WINDOW:
            return self._decide(samples, SETTLED_WINDOW, REBALANCE_GAIN)
        return self._decide(samples, REBALANCE_WINDOW, URGENT_GAIN)

    def _decide(self, samples: dict[str, int], window: int, gain: float) -> bool:
        """Re-weight from the medians of the last ``window`` steps when the measured
        model's slices would finish at least ``gain`` sooner (adopted: True)."""
        recent = {n: list(d)[-window:] for n, d in self._measured.items() if len(d) >= window}
        measured = {n: (statistics.median(b for b, _ in steps), statistics.median(o for _, o in steps))
                    for n, steps in recent.items()}
        if not measured:
            return False
        names = list(self.seconds)
        per_sample = {n: measured[n][0] if n in measured else self.seconds[n] for n in names}
        # a worker's own fixed part is what it pays beyond the least of the workers: the
        # part common to all of them is the master's (its sends, and its replies read late
        # while its own quota computes its slice), not theirs
        common = min((o for n, (_, o) in measured.items() if n != MASTER_PARTICIPANT),
                     default=0.0)
        overhead = {n: (max(0.0, measured[n][1] - common) if n != MASTER_PARTICIPANT else 0.0)
                    if n in measured else self.overhead.get(n, 0.0) for n in names}

        def finish(counts: dict[str, int]) -> float:
            return max(overhead[n] + per_sample[n] * counts.get(n, 0) for n in names
                       if counts.get(n, 0) > 0)

        now = finish(samples)
        before = (self.seconds, self.overhead)
        batch = sum(samples.values())
        self.seconds, self.overhead = per_sample, overhead
        proposed = {s.participant: s.samples for s in self.slices(names, batch)}
        if reverses(self._last_moves, samples, proposed):
            # back towards where the last re-slice came from: the estimates swing with
            # the slices (a quota-throttled machine with the smaller slice idles at
            # the barriers and computes in bursts, faster per sample), so meet halfway
            self.seconds = {n: (before[0].get(n, per_sample[n]) + per_sample[n]) / 2
                            for n in names}
            self.overhead = {n: (before[1].get(n, overhead[n]) + overhead[n]) / 2
                             for n in names}
            proposed = {s.participant: s.samples for s in self.slices(names, batch)}
        if finish(proposed) > now * (1 - gain):
            self.seconds, self.overhead = before  # not worth a change: keep the slices
            return False
        self._last_moves = {n: proposed.get(n, 0) - samples.get(n, 0) for n in names}
        return True


def reverses(last_moves: dict[str, int], current: dict[str, int],
             proposed: dict[str, int]) -> bool:
    """Whether ``proposed`` moves samples back the way the last re-slice
    (``last_moves``: participant -> samples it gained, negative lost) moved them: some
    participant that gained loses now, or one that lost gains."""
    return any(moved * (proposed.get(n, 0) - current.get(n, 0)) < 0
               for n, moved in last_moves.items())
