"""``hetconv bench conv`` runs end to end on tiny shapes (timings are never asserted)."""
from __future__ import annotations

from hetconv.bench.conv import PAPER_SHAPES, BenchShape, format_table, run_conv_bench

FIELDS = {
    "shape", "x_shape", "w_shape", "gflop", "ceiling_gflops", "ratio", "plain_ratio",
    *(f"{name}_{what}" for name in ("hetconv", "plain", "torch")
      for what in ("fwd_ms", "bwd_ms", "total_ms", "gflops", "pct_ceiling")),
}


def test_bench_rows_have_every_field_and_the_table_prints() -> None:
    lines: list[str] = []
    shapes = [BenchShape("tiny", 2, 8, 8, 3, 3, 3),
              BenchShape("tiny padded", 1, 6, 5, 2, 3, 2, 2, 1)]
    rows = run_conv_bench(repeats=1, threads=1, batch=2, out=lines.append, shapes=shapes,
                          ceiling_size=64)
    assert [row["shape"] for row in rows] == ["tiny", "tiny padded"]
    for row in rows:
        assert FIELDS <= set(row)
        assert row["x_shape"][0] == 2 and row["hetconv_total_ms"] > 0
        assert row["gflop"] > 0 and row["ceiling_gflops"] > 0
    assert "GFLOP/s" in lines[0]
    assert any(line.startswith("tiny padded") for line in lines)
    assert len(format_table(rows)) == 2 + len(rows)


def test_paper_shapes_and_flop_count() -> None:
    assert [(s.channels, s.kernels) for s in PAPER_SHAPES] == [(50, 500), (150, 800), (3, 500)]
    # C2 of 50:500: 10x10 outputs, 3 * 2*B*K*C*kh*kw*Ho*Wo
    assert PAPER_SHAPES[0].train_flop(64) == 3 * 2 * 64 * 500 * 50 * 25 * 100
