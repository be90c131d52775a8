"""``hetconv bench scale --dilate F``: the same lab with every machine's CPU quota and every
link's rate times F (pure: no runs; :mod:`hetconv.bench.scale` runs them).

Two cores emulate four machines of 0.45 core only by sharing them: 1.8 cores of quota
plus the processes' I/O threads on a host of 2, so a plain run also measures the host's
contention, which a LAN of separate machines does not have. Dilated by F < 1 every
machine and link is F times as fast, the work per step is the same, so an ideal
emulation's step is 1/F times as long: the step times F (the *plain-time equivalent*)
is what the same configuration would take on machines that share nothing, as far as the
dilation takes the host's contention away (4 x 0.45 x 0.5 = 0.9 core of 2). Ratios
between hetconv and the peer need no scaling: both run on the same dilated lab.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hetconv.errors import UserError
from hetconv.lab.network import parse_rate_bits

MIN_RATE_BITS = 1_000_000.0
"""The slowest dilated link (1 Mbit/s): below it tc's bursts and the runs' timeouts no
longer describe a LAN."""


def check_dilations(dilations: Sequence[float]) -> tuple[float, ...]:
    """The ``--dilate`` factors, each within (0, 1] and none twice (UserError otherwise);
    the default is (1.0,): the plain lab."""
    factors = tuple(float(f) for f in dilations) or (1.0,)
    for factor in factors:
        if not 0.0 < factor <= 1.0:
            raise UserError(f"--dilate {factor:g}: expected a factor within 0..1 (0.5 makes "
                            "every machine and link half as fast)")
    if len(set(factors)) != len(factors):
        raise UserError("--dilate: each factor at most once")
    return factors


def dilated_fractions(fractions: tuple[float, ...], factor: float) -> tuple[float, ...]:
    """Each machine's share of a core times ``factor`` (rounded to 4 decimals, as labelled)."""
    return tuple(round(fraction * factor, 4) for fraction in fractions)


def dilated_rate(rate: str, factor: float) -> str:
    """``rate`` (tc's syntax, e.g. ``1gbit``) times ``factor``, in whole kbit; ``rate``
    itself when ``factor`` is 1. UserError below MIN_RATE_BITS."""
    if factor == 1.0:
        return rate
    bits = parse_rate_bits(rate) * factor
    if bits < MIN_RATE_BITS:
        raise UserError(f"--dilate {factor:g}: {rate} would become {bits / 1e3:.0f} kbit/s, "
                        f"below {MIN_RATE_BITS / 1e6:g} Mbit/s")
    kbit = int(round(bits / 1e3))
    return f"{kbit // 1000}mbit" if kbit % 1000 == 0 else f"{kbit}kbit"


def format_dilation_table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines for the dilated rows (``dilation`` < 1): the measured step, the
    step times F (plain-time equivalent), the peer's likewise where it ran, and the same
    machines' plain row of this invocation where there is one (``plain_machines`` names
    it). Nothing when every row is plain."""
    dilated = [row for row in rows if row.get("dilation", 1.0) < 1.0]
    if not dilated:
        return []
    plain = {row["machines"]: row for row in rows if row.get("dilation", 1.0) == 1.0}
    with_peer = any("ddp_even_step_s" in row for row in dilated)
    lines = ["", "Dilated runs (`--dilate F`): every machine's quota and every link's rate "
             "times F, the same work per step, so an ideal emulation's step is 1/F times as "
             "long; the step times F is the plain-time equivalent: what the machines would "
             "take if they shared no cores (the plain row beside it shares the host's two).",
             "", "| machines (core each) | F | link | step ms | step x F ms | plain run ms | "
             + ("DDP even x F ms | hetconv / DDP even | " if with_peer else "")
             + "exposed comm % of step |",
             "|---|---|---|---|---|---|" + ("---|---|" if with_peer else "") + "---|"]
    for row in dilated:
        factor = row["dilation"]
        twin = plain.get(row.get("plain_machines", ""))
        plain_ms = f"{twin['step_s'] * 1e3:.1f}" if twin else "-"
        peer = ""
        if with_peer:
            peer = (f"{row['ddp_even_step_s'] * factor * 1e3:.1f} | "
                    f"{row['hetconv_over_ddp_even']:.2f} | "
                    if "ddp_even_step_s" in row else "- | - | ")
        lines.append(f"| {row['machines']} | {factor:g} | {row['rate']} | "
                     f"{row['step_s'] * 1e3:.1f} | {row['step_s'] * factor * 1e3:.1f} | "
                     f"{plain_ms} | {peer}{100 * row['comm_share']:.0f}% |")
    return lines
