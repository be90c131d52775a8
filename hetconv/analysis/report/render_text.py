"""The terminal report: plain aligned text that fits in 100 columns.

One block per run (headline, warnings, then the tables of
:mod:`master.report.format`), and for several runs a comparison table with one
column per run, split into several tables when the runs do not fit side by side.
"""
from __future__ import annotations

import textwrap
from collections.abc import Sequence

from hetconv.analysis.report.format import (
    Table,
    comparison_table,
    headline,
    notes,
    resilience_tables,
    run_tables,
)
from hetconv.analysis.report.summary import RunSummary

WIDTH = 100
GAP = "  "


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:max(1, width - 1)] + "~"


def _wrap(cell: str, width: int) -> list[str]:
    """A text cell over ``width`` as lines; the lines after the first indented two
    spaces deeper than the cell's own indent (so an indented label stays one item)."""
    indent = " " * (len(cell) - len(cell.lstrip(" ")) + 2)
    return textwrap.wrap(cell, width, subsequent_indent=indent) or [""]


def _widths(table: Table, width: int) -> list[int]:
    """Column widths; the widest text column shrinks until the table fits."""
    columns = len(table.headers)
    widths = [max([len(part) for part in table.headers[i].split("\n")]
                  + [len(row[i]) for row in table.rows]) for i in range(columns)]
    budget = width - len(GAP) * (columns - 1)
    text_columns = [i for i in range(columns) if table.is_text(i)]
    while sum(widths) > budget and text_columns:
        widest = max(text_columns, key=lambda i: widths[i])
        if widths[widest] <= 8:
            break  # the numbers themselves do not fit; let the line run long
        widths[widest] -= 1
    return widths


def format_table(table: Table, width: int = WIDTH) -> list[str]:
    """A table as lines: title, header, a rule, rows (numbers right-aligned)."""
    widths = _widths(table, width)

    def line(cells: Sequence[str]) -> str:
        parts = [_clip(cell, w).ljust(w) if table.is_text(i) else _clip(cell, w).rjust(w)
                 for i, (cell, w) in enumerate(zip(cells, widths))]
        return GAP.join(parts).rstrip()

    def row_lines(cells: Sequence[str]) -> list[str]:
        """One line, or with ``table.wrap`` as many as the wrapped text cells need."""
        if not table.wrap:
            return [line(cells)]
        pieces = [_wrap(cell, w) if table.is_text(i) and len(cell) > w else [cell]
                  for i, (cell, w) in enumerate(zip(cells, widths))]
        height = max(len(piece) for piece in pieces)
        return [line([piece[k] if k < len(piece) else "" for piece in pieces])
                for k in range(height)]

    header_lines = max(header.count("\n") + 1 for header in table.headers)
    split_headers = [[""] * (header_lines - header.count("\n") - 1) + header.split("\n")
                     for header in table.headers]  # bottom-aligned
    lines = [table.title] + [line([parts[i] for parts in split_headers])
                             for i in range(header_lines)]
    lines.append(GAP.join("-" * w for w in widths))
    if not table.rows:
        return lines + ["(none yet)"]
    return lines + [text for row in table.rows for text in row_lines(row)]


def render_run(summary: RunSummary, width: int = WIDTH) -> str:
    """The whole terminal report of one run."""
    title = f"== {summary.name} ({summary.run_dir}) "
    lines = [_clip(title.ljust(width, "="), width), *textwrap.wrap(headline(summary), width)]
    for warning in summary.warnings:
        lines += textwrap.wrap(f"warning: {warning}", width, subsequent_indent="  ")
    for index, table in enumerate(run_tables(summary) + resilience_tables(summary)):
        lines.append("")
        lines += format_table(table, width)
        if index == 0:
            for note in notes(summary):
                lines += textwrap.wrap(f"note: {note}", width, subsequent_indent="  ")
    return "\n".join(lines)


def render_comparison(summaries: Sequence[RunSummary], width: int = WIDTH) -> str:
    """The main figures of the runs side by side (several tables if they do not fit)."""
    table = comparison_table(summaries)
    label_width = max(len(row[0]) for row in table.rows)
    per_table = max(1, (width - label_width) // 22)
    lines = []
    for start in range(1, len(table.headers), per_table):
        stop = start + per_table
        part = Table(table.title, (table.headers[0], *table.headers[start:stop]),
                     tuple((row[0], *row[start:stop]) for row in table.rows))
        lines += format_table(part, width) + [""]
    return "\n".join(lines).rstrip()
