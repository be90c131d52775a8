"""The DDP peer of ``hetconv bench scale --peer ddp``: its pure parts (batch shares, the
figures beside hetconv's, the table) and its command line, without a LAN."""
from __future__ import annotations

import pytest

from hetconv.bench.ddp import _arguments, batch_shares, rank_command
from hetconv.bench.scale import add_peer_figures, ddp_label, format_peer_table


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
