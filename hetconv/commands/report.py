"""``hetconv report RUN_DIR [RUN_DIR...] [--json] [--no-html]``: the thin command.

Parses each run directory, computes its summary, prints the terminal report (or
JSON), and writes ``report.html`` into each run directory; with several runs it
also prints a comparison and writes ``comparison.html`` next to the first run.
A missing directory, a directory without ``metrics.jsonl`` or an empty metrics
file is a one-line :class:`hetconv.errors.UserError`.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hetconv.analysis.report.analysis import summarize
from hetconv.analysis.report.json_out import render_json
from hetconv.analysis.report.records import RunRecords, check_run_dir, parse_run
from hetconv.analysis.report.render_text import render_comparison, render_run
from hetconv.analysis.report.summary import RunSummary
from hetconv.errors import UserError


def _warn(message: str) -> None:
    print(f"hetconv report: warning: {message}", file=sys.stderr)


def write_html(runs: list[tuple[RunRecords, RunSummary]]) -> list[Path]:
    """report.html in every run directory, comparison.html next to the first run."""
    from hetconv.analysis.report import render_html  # matplotlib is imported only when needed

    written = []
    for records, summary in runs:
        path = Path(records.run_dir) / render_html.REPORT_FILE
        try:
            render_html.write_atomically(path, render_html.render_run_page(records, summary))
            written.append(path)
        except OSError as error:
            _warn(f"could not write {path}: {error}")
    if len(runs) > 1:
        path = Path(runs[0][0].run_dir).resolve().parent / render_html.COMPARISON_FILE
        try:
            render_html.write_atomically(path, render_html.render_comparison_page(runs))
            written.append(path)
        except OSError as error:
            _warn(f"could not write {path}: {error}")
    return written


def run_report(run_dirs: list[str], json_output: bool, html: bool = True,
               out: Callable[[str], None] = print) -> int:
    """Report on the runs; returns the exit status (0)."""
    if not run_dirs:
        raise UserError("no run directory given (usage: hetconv report RUN_DIR [RUN_DIR...])")
    for run_dir in run_dirs:
        check_run_dir(run_dir)  # every directory checked before any work
    runs = []
    for run_dir in run_dirs:
        records = parse_run(run_dir)
        runs.append((records, summarize(records)))
    summaries = [summary for _, summary in runs]
    if json_output:
        out(render_json(summaries))
    else:
        for summary in summaries:
            out(render_run(summary))
            out("")
        if len(summaries) > 1:
            out(render_comparison(summaries))
            out("")
    if html:
        written = write_html(runs)
        if not json_output:
            for path in written:
                out(f"wrote {path}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="workload-balance report of one or more run directories")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories to report on")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--no-html", action="store_true", help="do not write report.html")


def run(args: argparse.Namespace) -> int:
    return run_report(args.run_dirs, json_output=args.json, html=not args.no_html)
