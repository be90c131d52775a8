"""The DDP peer of ``hetconv bench scale --peer ddp``: its pure parts (batch shares, the
figures beside hetconv's, the table) and its command line, without a LAN."""
from __future__ import annotations

import pytest

from hetconv.bench.ddp import _arguments, batch_shares, rank_command
from hetconv.bench.scale_peer import (
    add_peer_figures,
    ddp_label,
    format_peer_breakdown,
    format_peer_table,
)


@pytest.mark.parametrize("fractions,batch,split,expected", [
    ((0.45,) * 4, 128, "even", [32, 32, 32, 32]),
    ((0.6, 0.4, 0.2, 0.2), 128, "even", [32, 32, 32, 32]),
    ((0.6, 0.4, 0.2, 0.2), 128, "speed", [54, 36, 19, 19]),
    ((0.5, 0.5, 0.5), 64, "even", [22, 21, 21]),
    ((0.9, 0.05), 4, "speed", [3, 1]),
])
def test_batch_shares(fractions: tuple[float, ...], batch: int, split: str,
                      expected: list[int]) -> None:
    shares = batch_shares(fractions, batch, split)
    assert shares == expected and sum(shares) == batch and min(shares) >= 1


def test_batch_shares_refuse_nonsense() -> None:
    with pytest.raises(ValueError):
        batch_shares((0.5, 0.5), 1, "even")
    with pytest.raises(ValueError):
        batch_shares((0.5, 0.5), 8, "kernels")


def test_a_rank_command_parses_back() -> None:
    command = rank_command("python", 1, 4, "10.78.1.1", 29500, "32:64", 32, "hci1m1", None)
    assert command[:3] == ["python", "-m", "hetconv.bench.ddp"]
    args = _arguments(command[3:])
    assert (args.rank, args.world, args.address, args.port, args.arch, args.samples,
            args.interface, args.out) == (1, 4, "10.78.1.1", 29500, "32:64", 32, "hci1m1", None)


def test_the_peer_table_puts_both_steps_and_their_ratio_side_by_side() -> None:
    mixed, equal = (0.6, 0.3), (0.5, 0.5)
    rows = [{"machines": "2x[0.6,0.3] peer", "step_s": 0.060, "speedup": 1.5},
            {"machines": "2x[0.5,0.5] peer", "step_s": 0.050, "speedup": 1.6}]
    peer = {ddp_label(mixed, "even"): [0.080, 0.084, 0.082],
            ddp_label(mixed, "speed"): [0.060],
            ddp_label((0.6,), "even"): [0.090],
            ddp_label(equal, "even"): [0.040],
            ddp_label((0.5,), "even"): [0.070]}
    add_peer_figures(rows, [(mixed, "peer"), (equal, "peer")], peer)
    assert rows[0]["ddp_even_step_s"] == 0.082 and rows[0]["ddp_speed_step_s"] == 0.060
    assert rows[0]["hetconv_over_ddp_even"] == pytest.approx(0.060 / 0.082)
    assert rows[1]["ddp_speed_step_s"] == 0.040  # equal machines: the even split is by speed
    table = format_peer_table(rows, "1gbit")
    assert table[-2] == ("| 2x[0.6,0.3] peer | 1gbit | 60.0 (1.50x) | 82.0 (1.10x) | 60.0 | "
                         "0.73 | 1.00 |")
    assert table[-1].endswith("| 1.25 | 1.25 |")


def test_the_ratio_s_range_pairs_the_repeats_closest_in_time() -> None:
    """Repeat k of hetconv over repeat k of DDP: the host's drift between repeats shows
    as the range; a run missing from a repeat leaves the range out."""
    mixed = (0.6, 0.3)
    rows = [{"machines": "2x[0.6,0.3] samples", "step_s": 0.060, "speedup": 1.5,
             "repeat_steps_s": [0.060, 0.066, 0.054]},
            {"machines": "2x[0.6,0.3] samples", "step_s": 0.060, "speedup": 1.5,
             "repeat_steps_s": [0.060, 0.066]}]
    peer = {ddp_label(mixed, "even"): [0.080, 0.060, 0.060],
            ddp_label(mixed, "speed"): [0.050, 0.060, 0.060],
            ddp_label((0.6,), "even"): [0.090]}
    add_peer_figures(rows, [(mixed, "samples"), (mixed, "samples")], peer)
    assert rows[0]["hetconv_over_ddp_even_repeats"] == pytest.approx([0.75, 1.1, 0.9])
    assert rows[0]["hetconv_over_ddp_speed_repeats"] == pytest.approx([1.2, 1.1, 0.9])
    assert rows[1]["hetconv_over_ddp_even_repeats"] == []
    table = format_peer_table(rows, "1gbit")
    assert table[-2].endswith("| 1.00 (0.75-1.10) | 1.00 (0.90-1.20) |")
    assert table[-1].endswith("| 1.00 | 1.00 |")
    assert "repeats' range" in table[1]


def test_the_breakdown_puts_ddp_s_compute_and_the_rest_beside_hetconv_s() -> None:
    equal = (0.5, 0.5)
    rows = [{"machines": "2x[0.5,0.5] samples", "step_s": 0.050, "speedup": 1.6,
             "breakdown": {"master": {"compute_s": 0.030, "peer_wait_s": 0.012},
                           "m1": {"compute_s": 0.034, "peer_wait_s": 0.008}}}]
    peer = {ddp_label(equal, "even"): [0.040, 0.044, 0.042], ddp_label((0.5,), "even"): [0.07]}
    compute = {ddp_label(equal, "even"): [[0.030, 0.033], [0.031, 0.035], [], [0.029, 0.034]]}
    add_peer_figures(rows, [(equal, "samples")], peer, compute)
    # each rank's median over the repeats that measured it (a run without: skipped)
    assert rows[0]["ddp_even_compute_s"] == pytest.approx([0.030, 0.034])
    table = format_peer_breakdown(rows)
    assert table[-1] == ("| 2x[0.5,0.5] samples | 42.0 | 30.0-34.0 | 8.0 | 50.0 | "
                         "30.0-34.0 | 8.0-12.0 |")
    rows[0].pop("ddp_even_compute_s")
    assert format_peer_breakdown(rows) == []  # runs from before the ranks measured it


class _Quota:
    """Records the processes a quota would take (no cgroup needed)."""

    def __init__(self) -> None:
        self.pids: list[int] = []

    def add(self, pid: int) -> None:
        self.pids.append(pid)


def test_a_rank_joins_its_quota_after_stopping_itself_and_goes_on() -> None:
    import subprocess
    import sys

    from hetconv.bench.ddp import quota_after_import

    stops = "import os, signal; os.kill(os.getpid(), signal.SIGSTOP); print('went on')"
    quota = _Quota()
    rank = subprocess.Popen([sys.executable, "-c", stops], stdout=subprocess.PIPE, text=True)
    quota_after_import(rank, quota)  # type: ignore[arg-type]
    assert quota.pids == [rank.pid]
    assert rank.communicate(timeout=30) == ("went on\n", None) and rank.returncode == 0
    # a rank that fails before it stops keeps its status
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    quota_after_import(failed, _Quota())  # type: ignore[arg-type]
    assert failed.wait(timeout=5) == 3
    # one that neither stops nor ends is killed, with one line
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(RuntimeError, match="did not finish importing PyTorch within 0 s"):
        quota_after_import(stuck, _Quota(), timeout_s=0.3)  # type: ignore[arg-type]
    assert stuck.wait(timeout=5) != 0
