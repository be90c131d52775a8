"""Imports point one way: protocol <- core <- participant <- master, worker <- analysis <- top.

The rules (docs/architecture.md), checked over the
source with :mod:`ast` so that imports inside functions, under ``if TYPE_CHECKING`` and
through ``importlib.import_module("...")`` count too:

- ``hetconv.protocol`` imports nothing else of hetconv; outside it only the standard
  library, numpy, msgpack and zmq;
- the core (every ``hetconv.*`` module outside the packages named below) imports only
  the core and protocol: never the code that only participants run;
- ``hetconv.participant`` (what the master's own share and every worker run) imports
  the core, protocol and itself;
- ``hetconv.master`` and ``hetconv.worker`` import the core, protocol and participant
  code, never each other, never analysis or the top layer;
- ``hetconv.analysis`` (the report, the what-if models: offline) may import everything
  below it, and nothing at run time imports it;
- ``hetconv.commands``, ``hetconv.api``, ``hetconv.bench``, ``hetconv.lab`` and
  ``hetconv.__main__`` are the top and may import anything, but only ``hetconv.__main__``,
  the commands themselves and the Python API (``hetconv.api``: the same run functions, one
  code path) import ``hetconv.commands`` (tests may);
- the split strategies never import each other: ``hetconv.master.kernels`` and
  ``hetconv.master.samples``, ``hetconv.participant.kernels`` and
  ``hetconv.participant.samples``; the master's shared modules import neither strategy,
  except ``hetconv.master.setup``, the one place that picks the split; the participant's
  shared modules import neither of its strategies;
- no file under ``hetconv/`` or ``tests/`` imports the old top-level names
  ``protocol``, ``master`` or ``worker``.

``hetconv/protocol``, ``hetconv/master`` and ``hetconv/worker`` are symlinks to the
top-level folders; the walk follows them and names every module by its ``hetconv.*``
path, the name it is installed under.
"""
from __future__ import annotations

import ast
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO / "hetconv"
LINKED_PACKAGES = ("protocol", "master", "worker")
OLD_TOP_LEVEL_NAMES = frozenset(LINKED_PACKAGES)
PROTOCOL_THIRD_PARTY = frozenset({"numpy", "msgpack", "zmq"})
TOP_PACKAGES = ("hetconv.commands", "hetconv.api", "hetconv.bench", "hetconv.lab")
OWN_LAYERS = ("participant", "analysis")  # hetconv.<name> packages with a layer of their own
# Which layers each layer may import (external packages are not a layer).
ALLOWED_LAYERS = {
    "protocol": {"protocol"},
    "core": {"core", "protocol"},
    "participant": {"core", "protocol", "participant"},
    "master": {"core", "protocol", "participant", "master"},
    "worker": {"core", "protocol", "participant", "worker"},
    "analysis": {"core", "protocol", "participant", "master", "analysis"},
    "top": {"core", "protocol", "participant", "master", "worker", "analysis", "top"},
}
# The split strategies: (package, its strategy subpackages, the shared modules allowed to
# import them). A strategy never imports another; shared code imports none but through
# the modules named.
STRATEGIES = (
    ("hetconv.master", ("kernels", "samples"), ("hetconv.master.setup",)),
    ("hetconv.participant", ("kernels", "samples"), ()),
)


@dataclass(frozen=True)
class Violation:
    """One import that breaks a rule, located by file and line."""

    path: str
    line: int
    importer: str
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported}: {self.rule}"


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_of(module: str) -> str | None:
    """The layer of a ``hetconv.*`` module, or None for anything outside hetconv."""
    if not _within(module, "hetconv"):
        return None
    for name in LINKED_PACKAGES + OWN_LAYERS:
        if _within(module, f"hetconv.{name}"):
            return name
    if module in ("hetconv", "hetconv.__main__") or any(_within(module, top)
                                                         for top in TOP_PACKAGES):
        return "top"  # the package's own face (hetconv/__init__.py) loads the Python API
    return "core"


def strategy_rule(importer: str, imported: str) -> str | None:
    """The broken strategy rule when ``importer`` may not import ``imported``, else None."""
    for package, strategies, dispatchers in STRATEGIES:
        if not (_within(importer, package) and _within(imported, package)):
            continue
        mine = [s for s in strategies if _within(importer, f"{package}.{s}")]
        theirs = [s for s in strategies if _within(imported, f"{package}.{s}")]
        if not theirs or mine == theirs:
            continue
        if mine:
            return f"{package}.{mine[0]} never imports {package}.{theirs[0]}"
        if importer not in dispatchers and importer != package:
            return (f"{package}'s shared modules never import a strategy ({package}.{theirs[0]})"
                    + (f"; only {', '.join(dispatchers)} picks one" if dispatchers else ""))
    return None


def module_name(path: Path, root: Path) -> str:
    """``root/hetconv/ops/conv.py`` -> ``hetconv.ops.conv`` (``__init__`` names the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(package_dir: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Every ``.py`` file under ``package_dir``, symlinked folders followed, by module name."""
    modules: dict[str, Path] = {}
    for folder, subfolders, files in os.walk(package_dir, followlinks=True):
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
        for file in sorted(files):
            if file.endswith(".py"):
                path = Path(folder, file)
                modules[module_name(path, package_dir.parent)] = path
    return modules


def imported_names(module: str, source: str, known: frozenset[str] | set[str],
                   is_package: bool = False) -> list[tuple[int, str, bool]]:
    """``(line, absolute module name, was_relative)`` for every import in ``source``.

    ``from a import b`` names ``a.b`` when that is a known module, else ``a``; relative
    imports are resolved against ``module``; ``importlib.import_module("x")`` and
    ``__import__("x")`` with a literal name count as imports of ``x``.
    """
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[int, str, bool]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, False) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                name = candidate if candidate in known else target
                found.append((node.lineno, name, bool(node.level)))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if (called in {"import_module", "__import__"} and isinstance(first, ast.Constant)
                    and isinstance(first.value, str) and not first.value.startswith(".")):
                found.append((node.lineno, first.value, False))
    return found


def check_source(module: str, source: str, path: str,
                 known: frozenset[str] | set[str] = frozenset(),
                 is_package: bool = False) -> list[Violation]:
    """Every import-direction violation in one module's source."""
    violations: list[Violation] = []
    importer_layer = layer_of(module)
    for line, name, was_relative in imported_names(module, source, known, is_package):
        top_name = name.split(".")[0]

        def report(rule: str, name: str = name, line: int = line) -> None:
            violations.append(Violation(path, line, module, name, rule))

        if not was_relative and top_name in OLD_TOP_LEVEL_NAMES:
            report(f"the old top-level name {top_name!r} is gone: import hetconv.{name}")
            continue
        target_layer = layer_of(name)
        if importer_layer is None:  # tests: only the old-name rule applies
            continue
        if target_layer is None:
            if importer_layer == "protocol" and not (
                    top_name in sys.stdlib_module_names or top_name in PROTOCOL_THIRD_PARTY):
                report("hetconv.protocol imports only the standard library, numpy, msgpack, zmq")
            continue
        if target_layer not in ALLOWED_LAYERS[importer_layer]:
            allowed = ", ".join(sorted(ALLOWED_LAYERS[importer_layer]))
            report(f"{importer_layer} may import only {allowed} (not {target_layer})")
        elif (broken := strategy_rule(module, name)) is not None:
            report(broken)
        elif _within(name, "hetconv.commands") and not (
                module in ("hetconv.__main__", "hetconv.api")
                or _within(module, "hetconv.commands")):
            report("only hetconv.__main__, hetconv.api and hetconv.commands import "
                   "hetconv.commands")
    return violations


def _relative(path: Path) -> str:
    """``path`` relative to the repository, keeping the symlinked ``hetconv/...`` spelling."""
    return os.path.relpath(path, REPO)


# ------------------------------------------------------------------ the real tree


@pytest.fixture(scope="module")
def modules() -> dict[str, Path]:
    return package_modules()


def test_the_walk_finds_every_layer_through_the_symlinks(modules: dict[str, Path]) -> None:
    counts = Counter(layer_of(name) for name in modules)
    for layer in ALLOWED_LAYERS:
        assert counts[layer] > 0, f"no modules found in layer {layer}: {dict(counts)}"
    for name in LINKED_PACKAGES:
        real = [path for path in (REPO / name).rglob("*.py") if "__pycache__" not in path.parts]
        assert counts[name] == len(real) > 0, (name, counts[name], len(real))
    assert {"hetconv", "hetconv.__main__", "hetconv.protocol.codec", "hetconv.master.setup",
            "hetconv.analysis.report.analysis", "hetconv.worker.service",
            "hetconv.commands.cli", "hetconv.ops.conv"} <= set(modules)


def test_imports_point_one_way(modules: dict[str, Path]) -> None:
    known = frozenset(modules)
    violations: list[Violation] = []
    for name, path in modules.items():
        violations += check_source(name, path.read_text(encoding="utf-8"), _relative(path), known,
                                   is_package=path.name == "__init__.py")
    assert not violations, "imports against the direction:\n" + "\n".join(map(str, violations))


def test_no_file_imports_the_old_top_level_names(modules: dict[str, Path]) -> None:
    known = frozenset(modules)
    files = sorted(set(modules.values()) | set((REPO / "tests").rglob("*.py")))
    assert len(files) > len(modules)
    violations: list[Violation] = []
    for path in files:
        violations += [v for v in check_source(module_name(path, REPO), path.read_text(encoding="utf-8"),
                                               _relative(path), known,
                                               is_package=path.name == "__init__.py")
                       if "old top-level name" in v.rule]
    assert not violations, "old import names:\n" + "\n".join(map(str, violations))


# ------------------------------------------------------------------ the checker itself


SYNTHETIC = '''\
"""A module that breaks every rule."""
import importlib

import numpy as np
from hetconv.ops import conv


def lazy() -> None:
    from hetconv.worker import daemon
    import hetconv.commands.cli
    import protocol.codec
    from master import cluster
    importlib.import_module("hetconv.bench.conv")
'''
SYNTHETIC_KNOWN = frozenset({"hetconv.ops.conv", "hetconv.worker.daemon", "hetconv.master.cluster"})


def test_the_checker_reports_lazy_imports_old_names_and_layers() -> None:
    found = check_source("hetconv.master.fake", SYNTHETIC, "master/fake.py", SYNTHETIC_KNOWN)
    by_line = {v.line: v for v in found}
    assert sorted(by_line) == [9, 10, 11, 12, 13], "\n".join(map(str, found))
    assert by_line[9].imported == "hetconv.worker.daemon" and "not worker" in by_line[9].rule
    assert "not top" in by_line[10].rule
    assert "old top-level name 'protocol'" in by_line[11].rule
    assert "old top-level name 'master'" in by_line[12].rule
    assert by_line[13].imported == "hetconv.bench.conv"
    assert str(by_line[9]).startswith("master/fake.py:9: hetconv.master.fake imports ")


def test_the_checker_holds_protocol_and_core_to_their_rules() -> None:
    protocol_source = "import json\nimport zmq\nimport scipy\nfrom hetconv import config\nfrom . import codec\n"
    found = check_source("hetconv.protocol.fake", protocol_source, "protocol/fake.py",
                         {"hetconv.config", "hetconv.protocol.codec"})
    assert [(v.line, v.imported) for v in found] == [(3, "scipy"), (4, "hetconv.config")]
    core_source = "from hetconv.protocol import codec\nfrom .master import plan\nfrom .. import lab\n"
    found = check_source("hetconv.ops.fake", core_source, "hetconv/ops/fake.py",
                         {"hetconv.protocol.codec", "hetconv.ops.master.plan", "hetconv.lab"})
    assert [(v.line, v.imported) for v in found] == [(3, "hetconv.lab")]
    found = check_source("hetconv.bench.fake", "from hetconv.commands import cli\n",
                         "hetconv/bench/fake.py", {"hetconv.commands.cli"})
    assert [v.rule for v in found] == ["only hetconv.__main__, hetconv.api and hetconv.commands import hetconv.commands"]
    assert check_source("hetconv.commands.fake", "from hetconv.commands import cli\n", "x.py") == []
    assert check_source("tests.unit.fake", "from hetconv.commands import cli\n", "x.py") == []


def test_module_names_follow_the_installed_path() -> None:
    assert module_name(REPO / "hetconv/protocol/codec.py", REPO) == "hetconv.protocol.codec"
    assert module_name(REPO / "hetconv/master/report/__init__.py", REPO) == "hetconv.master.report"
    assert [layer_of(m) for m in ("hetconv", "hetconv.__main__", "hetconv.lab.quota",
                                  "hetconv.protocolx", "numpy")] == ["top", "top", "top", "core", None]


# ------------------------------------------------------------------ installed names


def test_the_linked_packages_are_relative_symlinks_to_the_top_level_folders() -> None:
    for name in LINKED_PACKAGES:
        link = PACKAGE_DIR / name
        assert link.is_symlink(), f"hetconv/{name} must be a symlink to ../{name}"
        assert os.readlink(link) == f"../{name}", os.readlink(link)
        assert link.resolve() == (REPO / name).resolve() and (REPO / name / "__init__.py").is_file()


def test_every_installed_package_is_under_hetconv_and_listed() -> None:
    with open(REPO / "pyproject.toml", "rb") as handle:
        listed = tomllib.load(handle)["tool"]["setuptools"]["packages"]
    assert len(listed) == len(set(listed))
    assert [name for name in listed if not _within(name, "hetconv")] == []
    on_disk = {module_name(Path(folder, "__init__.py"), REPO)
               for folder, subfolders, files in os.walk(PACKAGE_DIR, followlinks=True)
               if "__init__.py" in files}
    assert set(listed) == on_disk, (
        f"pyproject.toml [tool.setuptools] packages: missing {sorted(on_disk - set(listed))}, "
        f"not packages {sorted(set(listed) - on_disk)}")


def test_the_checker_keeps_the_strategies_apart() -> None:
    known = {"hetconv.master.samples.stage", "hetconv.master.kernels.stage", "hetconv.master.plan",
             "hetconv.master.setup", "hetconv.participant.samples.chain",
             "hetconv.participant.kernels.exchange", "hetconv.participant.ports"}
    found = check_source("hetconv.master.kernels.fake",
                         "from hetconv.master.samples import stage\nfrom hetconv.master import plan\n",
                         "master/kernels/fake.py", known)
    assert [(v.line, v.rule) for v in found] == [
        (1, "hetconv.master.kernels never imports hetconv.master.samples")]
    found = check_source("hetconv.master.cluster", "from hetconv.master.kernels import stage\n",
                         "master/cluster.py", known)
    assert [v.line for v in found] == [1] and "only hetconv.master.setup" in found[0].rule
    assert check_source("hetconv.master.setup", "from hetconv.master.kernels import stage\n"
                        "from hetconv.master.samples import stage as s\n", "master/setup.py", known) == []
    found = check_source("hetconv.participant.ports",
                         "from hetconv.participant.samples import chain\n",
                         "hetconv/participant/ports.py", known)
    assert [v.line for v in found] == [1] and "shared modules never import" in found[0].rule
    found = check_source("hetconv.participant.kernels.exchange",
                         "from hetconv.participant.samples import chain\n"
                         "from hetconv.participant import ports\n",
                         "hetconv/participant/kernels/exchange.py", known)
    assert [(v.line, v.rule) for v in found] == [
        (1, "hetconv.participant.kernels never imports hetconv.participant.samples")]
    found = check_source("hetconv.engine.fake", "from hetconv.participant import ports\n",
                         "hetconv/engine/fake.py", known)
    assert [v.rule for v in found] == ["core may import only core, protocol (not participant)"]
    found = check_source("hetconv.master.fake", "from hetconv.analysis.report import records\n",
                         "master/fake.py", {"hetconv.analysis.report.records"})
    assert [v.line for v in found] == [1] and "(not analysis)" in found[0].rule


def _all_imports(module: str, path: Path, known: frozenset[str]) -> set[str]:
    names = imported_names(module, path.read_text(encoding="utf-8"), known,
                           is_package=path.name == "__init__.py")
    return {name for _, name, _ in names if name in known and name != module}


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle in ``graph`` (a list of modules, first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_module_imports_in_a_circle(modules: dict[str, Path]) -> None:
    """Not at import time, and not through an import inside a function either (the usual
    way to dodge a circle); only ``if TYPE_CHECKING`` annotations may look back. Package
    ``__init__`` files that re-export are left out (importing a package runs them)."""
    known = frozenset(modules)
    graph = {}
    for name, path in modules.items():
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        checking = [node for node in tree.body
                    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)]
        typing_only = set()
        for node in checking:
            typing_only |= {n for _, n, _ in imported_names(name, ast.unparse(node), known)}
        graph[name] = {m for m in _all_imports(name, path, known) - typing_only
                       if modules[m].name != "__init__.py"}
    assert _circle(graph) is None, "import circle: " + " -> ".join(_circle(graph) or [])


def test_the_circle_finder_finds_one() -> None:
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_module_name_carries_a_strategy_prefix(modules: dict[str, Path]) -> None:
    """A ``sample_`` or ``kernel_`` prefix stands in for a folder (CONVENTIONS 16)."""
    prefixed = sorted(str(path.relative_to(REPO)) for path in modules.values()
                      if path.name.startswith(("sample_", "kernel_")))
    assert prefixed == []
