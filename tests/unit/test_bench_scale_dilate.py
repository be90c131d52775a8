"""``hetconv bench scale --dilate F``: every quota and link rate times F (pure parts, and
the refusals that come before any namespace or quota is made: no root needed)."""
from __future__ import annotations

import pytest

from hetconv.bench.scale_dilate import (
    check_dilations,
    dilated_fractions,
    dilated_rate,
    format_dilation_table,
)
from hetconv.commands.cli import main
from hetconv.errors import UserError
from hetconv.lab.network import parse_rate_bits


def test_the_factors_are_within_zero_and_one_and_each_once() -> None:
    assert check_dilations(()) == (1.0,)
    assert check_dilations((1, 0.5)) == (1.0, 0.5)
    for bad in ((0.0,), (1.5,), (-0.5,)):
        with pytest.raises(UserError, match="within 0..1"):
            check_dilations(bad)
    with pytest.raises(UserError, match="at most once"):
        check_dilations((0.5, 0.5))


@pytest.mark.parametrize("rate,factor,dilated", [
    ("1gbit", 1.0, "1gbit"), ("1gbit", 0.5, "500mbit"), ("100mbit", 0.3, "30mbit"),
    ("1gbit", 0.45, "450mbit"), ("100mbit", 0.123, "12300kbit"), ("10mbit", 0.25, "2500kbit")])
def test_a_dilated_rate_is_the_rate_times_the_factor_in_tc_syntax(
        rate: str, factor: float, dilated: str) -> None:
    assert dilated_rate(rate, factor) == dilated
    assert parse_rate_bits(dilated) == pytest.approx(parse_rate_bits(rate) * factor)


def test_a_link_dilated_below_one_megabit_is_refused() -> None:
    with pytest.raises(UserError, match="below 1 Mbit/s"):
        dilated_rate("10mbit", 0.05)


def test_the_machines_shares_are_dilated_as_labelled() -> None:
    assert dilated_fractions((0.45, 0.45), 0.5) == (0.225, 0.225)
    assert dilated_fractions((0.6, 0.4, 0.2), 1.0) == (0.6, 0.4, 0.2)
    assert dilated_fractions((0.3,), 1 / 3) == (0.1,)


def _row(machines: str, step_s: float, dilation: float, **more: object) -> dict[str, object]:
    return {"machines": machines, "step_s": step_s, "dilation": dilation,
            "rate": "500mbit" if dilation < 1 else "1gbit", "comm_share": 0.25, **more}


def test_the_table_puts_each_dilated_step_times_f_beside_the_plain_run() -> None:
    plain = _row("2x[0.45,0.45] samples", 0.200, 1.0)
    dilated = _row("2x[0.225,0.225] samples", 0.360, 0.5,
                   plain_machines="2x[0.45,0.45] samples")
    assert format_dilation_table([plain]) == []  # nothing dilated: no table
    lines = format_dilation_table([plain, dilated])
    assert lines[-1] == "| 2x[0.225,0.225] samples | 0.5 | 500mbit | 360.0 | 180.0 | 200.0 | 25% |"
    assert lines[-2].count("|") == lines[-1].count("|") == 8
    alone = _row("2x[0.225,0.225] samples", 0.360, 0.5)  # no plain run in the invocation
    assert format_dilation_table([alone])[-1].split(" | ")[5] == "-"


def test_with_the_peer_the_table_has_ddp_s_step_times_f_and_the_ratio() -> None:
    dilated = _row("4x[0.225,0.225,0.225,0.225] samples", 0.400, 0.5,
                   ddp_even_step_s=0.380, hetconv_over_ddp_even=0.400 / 0.380)
    line = format_dilation_table([dilated])[-1]
    assert line == ("| 4x[0.225,0.225,0.225,0.225] samples | 0.5 | 500mbit | 400.0 | 200.0 | "
                    "- | 190.0 | 1.05 | 25% |")


@pytest.mark.parametrize("argv,message", [
    (["--dilate", "0"], "--dilate 0: expected a factor within 0..1"),
    (["--dilate", "2"], "--dilate 2: expected a factor within 0..1"),
    (["--dilate", "0.5", "--dilate", "0.5"], "--dilate: each factor at most once"),
    (["--machines", "0.9", "--machines", "0.45", "--dilate", "1", "--dilate", "0.5"],
     "--dilate: a dilated machine set equals another one"),
    (["--machines", "1,1", "--cfs-period-ms", "100", "--rate", "10mbit", "--dilate", "0.05"],
     "--dilate 0.05: 10mbit would become"),
    (["--machines", "0.2", "--dilate", "0.25"], "--cfs-period-ms 10 with --dilate 0.25: "),
])
def test_a_dilation_the_lab_cannot_make_is_one_line(argv: list[str], message: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    if "--machines" not in argv:
        argv = ["--machines", "0.45,0.45", *argv]
    status = main(["bench", "scale", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"hetconv: error: {message}"), err
