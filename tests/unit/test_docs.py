"""The docs tell the truth about the code, and keep telling it.

docs/protocol.md's tables (message types and fields, error codes, limits, settings)
are parsed and compared with ``hetconv.protocol`` and ``hetconv.config``;
docs/metrics.md's record types with the ``metrics.write("...")`` calls in the
source; figure files under docs/figures must name the command that wrote them; and
README.md and the docs must not quote a measured speedup or timing typed by hand.
Every parsed table is asserted non-empty, so a reformatted table fails loudly
instead of passing without checking anything.
"""
from __future__ import annotations

import ast
import dataclasses
import os
import re
from pathlib import Path

import pytest

from hetconv import config
from hetconv.model import ConvLayerShape
from hetconv.protocol import errors, limits, messages, version

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL_MD = ROOT / "docs" / "protocol.md"
METRICS_MD = ROOT / "docs" / "metrics.md"
FIGURES = ROOT / "docs" / "figures"
README = ROOT / "README.md"
SOURCE_DIRS = ("hetconv", "master", "worker", "protocol")
BENCHES = ("conv", "split", "protocol", "scale", "chaos", "accuracy")

Row = dict[str, str]


def tables(text: str) -> list[list[Row]]:
    """Every markdown table in ``text``: rows as {header cell: cell}, stripped."""
    found: list[list[Row]] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines) - 1:
        head, rule = lines[index].strip(), lines[index + 1].strip()
        if head.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", rule):
            names = [cell.strip() for cell in head.strip("|").split("|")]
            rows: list[Row] = []
            index += 2
            while index < len(lines) and lines[index].strip().startswith("|"):
                cells = [cell.strip() for cell in lines[index].strip().strip("|").split("|")]
                assert len(cells) == len(names), f"ragged table row: {lines[index]!r}"
                rows.append(dict(zip(names, cells)))
                index += 1
            found.append(rows)
        else:
            index += 1
    return found


def table_with(text: str, *columns: str) -> list[Row]:
    """The one table whose header has exactly ``columns``; it must have rows."""
    matches = [rows for rows in tables(text) if rows and list(rows[0]) == list(columns)]
    assert len(matches) == 1, f"expected one table with columns {columns}, found {len(matches)}"
    assert matches[0], f"the table {columns} is empty"
    return matches[0]


def backticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def only_name(cell: str) -> str:
    names = backticked(cell)
    assert len(names) == 1, f"expected one `name` in {cell!r}"
    return names[0]


def source_files() -> list[Path]:
    """The project's Python source (symlinked packages walked once, not twice)."""
    files: list[Path] = []
    for top in SOURCE_DIRS:
        for folder, _, names in os.walk(ROOT / top):  # does not follow symlinks
            files += [Path(folder) / name for name in names if name.endswith(".py")]
    assert files
    return files


@pytest.fixture(scope="module")
def protocol_doc() -> str:
    return PROTOCOL_MD.read_text(encoding="utf-8")


# --- docs/protocol.md: message types ----------------------------------------------------
MESSAGE_COLUMNS = ("type tag", "class", "direction", "header fields", "arrays", "answered with")
DIRECTIONS = {"M→W": "master → worker", "W→M": "worker → master", "both": "either way"}


def test_every_message_type_is_documented_and_nothing_else(protocol_doc: str) -> None:
    rows = table_with(protocol_doc, *MESSAGE_COLUMNS)
    tags = [only_name(row["type tag"]) for row in rows]
    assert len(tags) == len(set(tags)), "a type is documented twice"
    assert set(tags) == set(messages.SCHEMAS)
    assert len(rows) >= 17


@pytest.mark.parametrize("tag", sorted(messages.SCHEMAS))
def test_message_row_matches_the_dataclass(protocol_doc: str, tag: str) -> None:
    row = next(r for r in table_with(protocol_doc, *MESSAGE_COLUMNS)
               if only_name(r["type tag"]) == tag)
    schema = messages.SCHEMAS[tag]
    assert only_name(row["class"]) == schema.cls.__name__
    # header fields: "`name` kind" each, in declaration order, none without a kind
    header = re.findall(r"`(\w+)`\s+(int|float|str|bool|dict|list)\b", row["header fields"])
    assert len(header) == len(backticked(row["header fields"])), row["header fields"]
    assert tuple(header) == schema.header_fields
    # arrays: "`name` (shape)" each, "*optional*" after an optional one
    arrays = [(name, bool(optional)) for name, optional in re.findall(
        r"`(\w+)`\s*\([^)]*\)(\s*\*optional\*)?", row["arrays"])]
    assert len(arrays) == len(backticked(row["arrays"])), row["arrays"]
    assert tuple(arrays) == schema.array_fields
    # replies name real classes; the direction agrees with the class docstring
    for name in backticked(row["answered with"]):
        assert name in {cls.__name__ for cls in messages.MESSAGE_TYPES.values()}, name
    assert row["direction"] in DIRECTIONS
    assert (schema.cls.__doc__ or "").startswith(DIRECTIONS[row["direction"]]), (
        f"{schema.cls.__name__}'s docstring should start with {DIRECTIONS[row['direction']]!r}")


# --- docs/protocol.md: error codes -------------------------------------------------------
ERROR_COLUMNS = ("code", "constant", "meaning", "sent")


def test_every_error_code_is_documented_with_its_string(protocol_doc: str) -> None:
    rows = table_with(protocol_doc, *ERROR_COLUMNS)
    documented = {only_name(row["constant"]): only_name(row["code"]) for row in rows}
    defined = {name: getattr(errors, name) for name in dir(errors) if name.startswith("ERR_")}
    assert defined, "protocol.errors defines no ERR_* constant"
    assert documented == defined
    assert set(documented.values()) == errors.ERROR_CODES
    assert len(rows) == len(documented), "an error code is documented twice"


def test_codes_documented_as_reserved_are_sent_by_nobody(protocol_doc: str) -> None:
    rows = table_with(protocol_doc, *ERROR_COLUMNS)
    for row in rows:
        assert row["sent"].startswith(("yes", "reserved")), row["sent"]
    reserved = [(only_name(r["constant"]), only_name(r["code"])) for r in rows
                if r["sent"].startswith("reserved")]
    definitions = {ROOT / "protocol" / "errors.py", ROOT / "protocol" / "__init__.py"}
    for path in source_files():
        if path in definitions:
            continue
        text = path.read_text(encoding="utf-8")
        for constant, code in reserved:
            used = re.search(rf"\b{constant}\b|[\"']{code}[\"']", text)
            assert used is None, (f"{path.relative_to(ROOT)} uses {code!r}, which "
                                  "docs/protocol.md calls reserved: document who sends it")


# --- docs/protocol.md: limits, settings and numbers in the prose -------------------------
def _value(cell: str) -> object:
    names = backticked(cell)
    if names:
        return names[0]
    return ast.literal_eval(cell.split()[0].replace("_", ""))


def test_limits_table_equals_protocol_limits(protocol_doc: str) -> None:
    rows = table_with(protocol_doc, "constant", "value", "what it bounds")
    documented = {only_name(row["constant"]): _value(row["value"]) for row in rows}
    defined = {name: getattr(limits, name) for name in dir(limits)
               if name.isupper() and name not in {"KIB", "MIB", "GIB"}}
    assert documented == defined


def test_settings_table_equals_the_config_defaults(protocol_doc: str) -> None:
    rows = table_with(protocol_doc, "setting", "default", "what it does")
    for row in rows:
        class_name, field_name = only_name(row["setting"]).split(".")
        fields = {f.name: f for f in dataclasses.fields(getattr(config, class_name))}
        assert ast.literal_eval(row["default"]) == fields[field_name].default, row


def test_numbers_named_in_the_prose_are_the_code_s(protocol_doc: str) -> None:
    named = re.findall(r"`([A-Z][A-Z0-9_]*)`\s*=\s*(-?[0-9][0-9_.]*)", protocol_doc)
    named += re.findall(r"`([A-Z][A-Z0-9_]*)\s*=\s*(-?[0-9][0-9_.]*)`", protocol_doc)
    checked = 0
    for name, text in named:
        for module in (limits, version, messages, errors):
            if hasattr(module, name):
                assert getattr(module, name) == ast.literal_eval(text.rstrip(".")), name
                checked += 1
    assert checked >= 2  # PROTOCOL_VERSION and NO_REQUEST_ID at least


def test_every_constant_the_doc_names_exists(protocol_doc: str) -> None:
    import zmq

    names = {match.group(1) for span in backticked(protocol_doc)
             if (match := re.match(r"([A-Z][A-Z0-9_]{2,})\b", span))}
    assert len(names) > 20
    definitions = "\n".join(path.read_text("utf-8") for path in source_files())
    for name in sorted(names):
        defined = re.search(rf"^\s*{name}\s*[:=]", definitions, re.MULTILINE)
        assert defined or hasattr(zmq, name), f"docs/protocol.md names {name}, defined nowhere"


# --- docs/metrics.md ---------------------------------------------------------------------
def test_metrics_record_types_are_those_the_code_writes() -> None:
    written: set[str] = set()
    for path in source_files():
        written |= set(re.findall(r"metrics\.write\(\s*\"(\w+)\"", path.read_text("utf-8")))
    documented = set(re.findall(r"^## `(\w+)`", METRICS_MD.read_text("utf-8"), re.MULTILINE))
    assert written, "found no metrics.write(\"...\") call: did the writer change?"
    assert documented == written


def test_metrics_run_start_layers_are_the_layer_shape_fields() -> None:
    run_start = METRICS_MD.read_text("utf-8").split("## `run_start`", 1)[1].split("\n## ")[0]
    row = next(r for r in table_with(run_start, "field", "meaning") if r["field"] == "`layers`")
    assert backticked(row["meaning"]) == [f.name for f in dataclasses.fields(ConvLayerShape)]


# --- figures: produced by a command, never typed by hand ---------------------------------
MEASURED = re.compile(
    r"\d(?:\.\d+)?\s?[x×](?!\w)"  # a speedup or ratio: 2.2x, 1.4 ×
    r"|[+−-]\d+(?:\.\d+)?\s?%"  # an overhead: +7 %, −1 %
    r"|\d(?:\.\d+)?\s?(?:ms|µs|us|GFLOP/s|GB/s|GiB/s|MiB/s|images/s)\b")  # a timing or rate


@pytest.mark.parametrize("path", [README, PROTOCOL_MD, METRICS_MD], ids=lambda p: p.name)
def test_no_measured_figure_is_typed_by_hand(path: Path) -> None:
    hits = MEASURED.findall(path.read_text(encoding="utf-8"))
    assert not hits, (f"{path.name} quotes measured figures {hits}: put them in "
                      "docs/figures/ with 'hetconv bench ... --markdown' and link there")


def test_the_measured_pattern_catches_what_drifted_before() -> None:
    drifted = "the cost-model split was 2.2x faster; 4 MiB | 3.4–5.0 | +7 % | 126 ms"
    assert len(MEASURED.findall(drifted)) == 3
    assert not MEASURED.findall("a 2×2 max pool, --arch 150:800, 64 MiB arrays, 30% quota")


def check_figure_file(path: Path) -> None:
    """A figure file names its command, date and machine, or is a number-free placeholder."""
    text = path.read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("|")
            and not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip())]
    bench = path.stem.split("-")[0]  # scale-100mbit.md: a second figure file of bench scale
    command = re.search(rf"^- command: `hetconv bench {bench}\b[^`]*"
                        rf"--markdown [^`]*{re.escape(path.name)}`", text, re.MULTILINE)
    if "not yet measured" in text.lower() and command is None:
        assert not any(re.search(r"\d", line) for line in rows), path.name
        assert f"hetconv bench {bench}" in text, path.name  # says how to fill it
        return
    assert command is not None, f"{path.name} does not name the command that wrote it"
    assert re.search(r"^- date: \d{4}-\d\d-\d\d", text, re.MULTILINE), path.name
    assert re.search(r"^- machine: .+ cores .+", text, re.MULTILINE), path.name
    assert rows, f"{path.name} holds no table"


def test_every_figure_file_names_the_command_that_wrote_it() -> None:
    files = sorted(p for p in FIGURES.glob("*.md") if p.name != "README.md")
    assert {p.stem for p in files} >= set(BENCHES), "a figure file (or placeholder) is missing"
    for path in files:
        check_figure_file(path)


def test_what_bench_markdown_writes_passes_the_figure_check(tmp_path: Path) -> None:
    from hetconv.bench.protocol_roundtrip import markdown_table
    from hetconv.commands.bench import figure_header, write_markdown
    from hetconv.commands.cli import build_parser

    target = tmp_path / "protocol.md"
    args = build_parser().parse_args(["bench", "protocol", "--sizes", "0.25", "4",
                                      "--markdown", str(target)])
    rows = [{"size_mib": size, "repeats": 9.0, "codec_median_s": 1e-3, "bare_median_s": 9e-4,
             "overhead_pct": 11.1, "codec_cpu_s": 1e-3, "bare_cpu_s": 9e-4,
             "cpu_overhead_pct": 11.1, "codec_gib_per_s": 0.5} for size in (0.25, 4.0)]
    write_markdown(str(target), figure_header(args) + markdown_table(rows))
    check_figure_file(target)
    text = target.read_text(encoding="utf-8")
    assert "- command: `hetconv bench protocol --repeats 9 --sizes 0.25 4 --markdown " in text
    # numpy's BLAS kernels alone move one machine's speed twofold: every file names them
    assert re.search(r"^- machine: .+, numpy \S+ \(\S+ \S+, \S+ kernels", text, re.MULTILINE), text
    assert [p.name for p in tmp_path.iterdir()] == ["protocol.md"]  # no temp file left


def test_the_readme_points_to_the_figure_files() -> None:
    text = README.read_text(encoding="utf-8")
    for bench in BENCHES:
        assert f"docs/figures/{bench}.md" in text


def test_the_protocol_prose_states_the_current_version_and_failover(protocol_doc: str) -> None:
    """Facts in the prose, not only in the tables: the title's version is the code's,
    and nothing says a worker's fault ends the run (it is failed over: issue 20)."""
    from hetconv.protocol.version import PROTOCOL_VERSION

    title = protocol_doc.splitlines()[0]
    assert title == f"# hetconv wire protocol (version {PROTOCOL_VERSION})", title
    assert f"PROTOCOL_VERSION = {PROTOCOL_VERSION}`" in protocol_doc
    lowered = " ".join(protocol_doc.lower().split())
    for stale in ("fails the run", "no failover", "ends the run naming"):
        assert stale not in lowered, f"docs/protocol.md still says {stale!r}"
