"""The HTML report: one self-contained page per run, and a comparison page.

Everything is inline: CSS in a ``<style>`` element, pictures as base64 PNG
``data:`` URLs (see :mod:`master.report.plots`); no scripts, no web fonts, no
links to anything outside the file. The tables are those of
:mod:`master.report.format`. All text that comes from the run (participant and device
names, paths, warnings) is escaped with :func:`html.escape`.
"""
from __future__ import annotations

import base64
import html
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from hetconv.analysis.report import plots
from hetconv.analysis.report.format import (
    Table,
    comparison_table,
    headline,
    notes,
    resilience_tables,
    run_tables,
)
from hetconv.analysis.report.records import RunRecords
from hetconv.analysis.report.summary import RunSummary

REPORT_FILE = "report.html"
COMPARISON_FILE = "comparison.html"

STYLE = """
body { margin: 0; background: #fafafa; color: #222;
       font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
main { max-width: 1040px; margin: 0 auto; padding: 1em 1.5em 3em; background: #fff; }
h1 { font-size: 1.6em; margin: 0.4em 0; overflow-wrap: anywhere; }
h2 { font-size: 1.25em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
h3 { font-size: 1.05em; margin-top: 1.4em; }
p.meta, p.path { color: #555; margin: 0.2em 0; overflow-wrap: anywhere; }
table { border-collapse: collapse; width: 100%; margin: 0.6em 0; font-size: 0.92em; }
caption { text-align: left; font-weight: 600; padding: 0.3em 0; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.5em; overflow-wrap: anywhere;
         vertical-align: top; }
th { background: #f0f0f0; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
img { max-width: 100%; height: auto; display: block; margin: 0.5em 0; }
ul.warnings { background: #fff4e5; border: 1px solid #f0c36d; padding: 0.5em 2em; }
p.empty { color: #777; font-style: italic; }
dl dt { font-weight: 600; margin-top: 0.5em; }
dl dd { margin-left: 1.5em; }
footer { margin-top: 3em; color: #777; font-size: 0.85em; }
"""

DEFINITIONS = [
    ("communication", ("comm_s: per layer and phase, the phase's wall time minus the slowest "
     "participant's compute time, summed (transfer and serialization on the critical path).")),
    ("after the last result arrived", ("conv_s minus, per layer and phase, the latest "
     "participant's latency (from the phase's start to its result in the master's hands), "
     "summed: conv time the master spends once the results are in (waking up, gathering, "
     "summing, concatenating); mostly counted in communication.")),
    ("distributed conv", "conv_s - comm_s: the slowest participant's compute, layer by layer."),
    ("dense part", "dense_s: the master's fully connected layer, loss and its update."),
    ("balance efficiency", ("per step, layer and phase: ideal = K / sum over participants of "
     "(kernels / seconds), the kernels divided in proportion to measured speeds; slowest = "
     "the slowest participant's seconds. Efficiency = median of the summed ideal over median "
     "of the summed slowest (1.0 = perfectly balanced).")),
    ("imbalance", ("per step and layer, the slowest participant's forward+backward time over "
     "the participants' mean; the median over steps; the worst layer is shown.")),
    ("speedup over the fastest participant", ("estimate: each participant alone would need "
     "the sum over layers of the median over steps of its seconds scaled to the whole layer "
     "(by its calibrated cost fit a + b*kernels, so the fixed cost counts once; under the "
     "sample split linearly in samples); the fastest such one plus the dense time, over the "
     "measured median step time.")),
    ("Amdahl bound", ("(fastest single-participant conv time + dense) / dense: the speedup if "
     "the conv part and communication took no time at all.")),
    ("what if", ("one more participant like the fastest: the conv part scales as the ideal "
     "time with that participant's speed added (balance efficiency kept), communication by "
     "(W+1)/W for W workers (the input goes to every worker). Network twice as fast: the "
     "median step time minus half the median communication.")),
    ("replayed steps", ("a step replayed after a recovery, or again after --resume, has "
     "several step records; the last one counts, in every figure and plot.")),
    ("snapshot cost per step", ("the checkpoint records' seconds (pulling every shard's state, "
     "checking it, writing the file) summed, over the steps trained; bytes likewise.")),
    ("medians", ("all per-step figures are medians over the steps, skipping the run's first "
     "step (warm-up) when there is more than one.")),
]


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _indent(text: str) -> str:
    """Escaped text whose leading spaces (sub-rows of a table) survive in HTML."""
    stripped = text.lstrip(" ")
    return "&nbsp;" * (len(text) - len(stripped)) + _esc(stripped)


def _table(table: Table, caption: bool = False) -> str:
    head = "".join(f"<th>{'<br>'.join(_esc(p) for p in h.split(chr(10)))}</th>"
                   for h in table.headers)
    body = []
    for row in table.rows:
        cells = "".join(f"<td>{_indent(c)}</td>" if table.is_text(i)
                        else f'<td class="num">{_esc(c)}</td>' for i, c in enumerate(row))
        body.append(f"<tr>{cells}</tr>")
    if not body:
        body.append(f'<tr><td colspan="{len(table.headers)}">(none yet)</td></tr>')
    title = f"<caption>{_esc(table.title)}</caption>" if caption else ""
    return (f"<table>{title}<thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")


def _image(png: bytes | None, alt: str) -> str:
    if png is None:
        return '<p class="empty">No steps recorded yet: nothing to plot.</p>'
    data = base64.b64encode(png).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{_esc(alt)}">'


def run_body(records: RunRecords, summary: RunSummary, level: int = 2) -> str:
    """The sections of one run's report, headings starting at ``<h{level}>``."""
    h, sub = f"h{level}", f"h{level + 1}"
    overview, devices, layers, balance, epochs = run_tables(summary)
    parts = [f'<p class="meta">{_esc(headline(summary))}</p>',
             f'<p class="path">run directory: {_esc(summary.run_dir)}</p>']
    if summary.warnings:
        items = "".join(f"<li>{_esc(w)}</li>" for w in summary.warnings)
        parts.append(f'<ul class="warnings">{items}</ul>')
    parts += [f"<{h}>Overview</{h}>", _table(overview)]
    parts += [f"<p>Note: {_esc(note)}</p>" for note in notes(summary)]
    parts += [f"<{h}>Time per step</{h}>",
              _image(plots.time_breakdown(records), "stacked time per step: communication, "
                     "distributed conv and dense part, in milliseconds, with the membership "
                     "events (joins, losses, recoveries, re-plans, re-splits, resumes) marked")]
    if records.events:
        parts.append("<p>The vertical lines mark the membership events listed under "
                     "<em>Membership and re-plans</em>; a replayed step is drawn once, with "
                     "its last record.</p>")
    parts += [f"<{h}>Participants</{h}>", _table(devices, caption=True)]
    unit = "sample" if summary.split_by == "samples" else "kernel"
    parts += [f"<{h}>{unit.capitalize()} split against measured throughput</{h}>",
              (f"<p>Balanced when each participant's {unit} share equals its share of the "
               f"layer's measured throughput ({unit}s per second).</p>"),
              _image(plots.kernel_vs_throughput(summary),
                     f"per layer, {unit} share and measured throughput share of each "
                     "participant"),
              _table(layers, caption=True), _table(balance, caption=True)]
    parts += [f"<{h}>Timeline</{h}>",
              ("<p>Each step laid out phase by phase (forward layers, the dense part, backward "
               "layers in reverse); a phase lasts as long as its latest participant. What is left "
               "of the step's conv wall time after that (master-side gaps, which the metrics do "
               "not place) is drawn at the end.</p>"),
              _image(plots.timeline(records), "per participant timeline of the last steps: "
                     "forward, backward and waiting time per layer")]
    scaling = plots.predicted_scaling(records)
    parts += [f"<{h}>Predicted scaling (model estimate)</{h}>",
              ("<p>The performance model's step time for 1 to 128 machines like the run's "
               "participants (repeated in order) at its measured links, batch and network, as "
               "speedup over the fastest machine alone; the planner may leave machines out. "
               "Estimates, not measurements: <code>hetconv plan</code> prints them as a table "
               "with the measured step beside the estimate for this run's configuration.</p>"),
              _image(scaling, "model estimate of the speedup against the number of machines")
              if scaling is not None else
              ('<p class="empty">No estimate: the run has no cost fits or no measured links '
               "(a distributed run with --split model has both).</p>")]
    events, costs = resilience_tables(summary)
    parts += [f"<{h}>Membership and re-plans</{h}>",
              ("<p>Every worker join and loss, recovery (a fault that cost a step: the last "
               "snapshot restored and the steps since replayed), re-plan, re-split from "
               "measured times and <code>--resume</code>, in time order (seconds since the "
               "run's first record). Below: what the snapshots cost in the fault-free case "
               "(pulling every shard, checking it, writing <code>checkpoint.npz</code>) and "
               "what the faults cost.</p>"),
              _table(events, caption=True), _table(costs, caption=True)]
    parts += [f"<{h}>Training</{h}>",
              _image(plots.training_curves(records), "loss per step and accuracy per epoch"),
              _table(epochs, caption=True)]
    definitions = "".join(f"<dt>{_esc(term)}</dt><dd>{_esc(text)}</dd>"
                          for term, text in DEFINITIONS)
    parts += [f"<{sub}>How the figures are computed</{sub}>", f"<dl>{definitions}</dl>"]
    return "\n".join(parts)


def page(title: str, body: str) -> str:
    generated = time.strftime("%Y-%m-%d %H:%M:%S")
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{_esc(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n<main>\n"
            f"<h1>{_esc(title)}</h1>\n{body}\n"
            f"<footer>Generated by hetconv report on {_esc(generated)}.</footer>\n"
            "</main>\n</body>\n</html>\n")


def render_run_page(records: RunRecords, summary: RunSummary) -> str:
    return page(f"hetconv report: {summary.name}", run_body(records, summary))


def render_comparison_page(runs: Sequence[tuple[RunRecords, RunSummary]]) -> str:
    summaries = [summary for _, summary in runs]
    body = [_table(comparison_table(summaries))]
    for records, summary in runs:
        body.append(f"<h2>{_esc(summary.name)}</h2>")
        body.append(run_body(records, summary, level=3))
    return page("hetconv comparison: " + ", ".join(s.name for s in summaries), "\n".join(body))


def write_atomically(path: Path, text: str) -> None:
    """Write a file through a temporary file in the same directory and a rename."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        os.chmod(temporary, 0o644)  # mkstemp makes it private; a report is for reading
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
