"""deploy/bench-ddp.sh, as far as a machine without root or a quiet hour can test it:
its --dry-run prints one `hetconv bench scale` per network and link that hetconv's own
parser accepts, with the defaults a user gets and the peer beside it, and together they
cover every row of issue 22's target table."""
from __future__ import annotations

import argparse
import shlex
import subprocess
from pathlib import Path

from hetconv.commands.cli import build_parser
from tests.conftest import REPO

SCRIPT = REPO / "deploy" / "bench-ddp.sh"
VGG = "c32k3p1,c32k3p1,pool,c64k3p1,c64k3p1,pool,fc256,drop0.5"


def _dry_run(out: Path) -> list[argparse.Namespace]:
    """The commands ``--dry-run`` prints, each parsed by hetconv's own parser."""
    done = subprocess.run([str(SCRIPT), "--dry-run", str(out)], capture_output=True,
                          text=True, timeout=30, check=True)
    commands = [shlex.split(line) for line in done.stdout.splitlines() if line.strip()]
    assert all(words[1:3] == ["-m", "hetconv"] for words in commands), commands
    return [build_parser().parse_args(words[3:]) for words in commands]


def test_every_command_parses_with_the_user_defaults_and_the_peer(tmp_path: Path) -> None:
    commands = _dry_run(tmp_path)
    assert len(commands) == 5
    figures = []
    for args in commands:
        assert (args.command, args.bench) == ("bench", "scale")
        assert args.split_by == ["auto"] and args.peer == "ddp"
        # nothing pinned that a user would not get: batch-norm statistics, dense part and
        # data plane are left to their defaults
        assert args.bn_statistics is None and args.dense_parts is None
        assert args.data_plane is None and args.dilations is None
        assert args.batch == 128 and args.repeats >= 3
        figures.append(Path(args.markdown))
    assert [f.parent for f in figures] == [tmp_path] * 5
    # figure files of `hetconv bench scale` are named scale-*.md (tests/unit/test_docs.py)
    assert sorted(f.name for f in figures) == [
        "scale-targets-100mbit.md", "scale-targets-32-64.md", "scale-targets-64-256.md",
        "scale-targets-resnet20.md", "scale-targets-vgg.md"]


def test_the_commands_cover_the_issue_s_target_rows(tmp_path: Path) -> None:
    rows = {(args.arch, args.rate, machines) for args in _dry_run(tmp_path)
            for machines in args.machines}
    four, two, unequal = "0.45,0.45,0.45,0.45", "0.45,0.45", "0.6,0.4,0.2,0.2"
    assert rows == {
        ("32:64", "1gbit", four), ("32:64", "1gbit", two), ("32:64", "1gbit", unequal),
        ("64:256", "1gbit", four), ("64:256", "1gbit", two), ("64:256", "1gbit", unequal),
        ("32:64", "100mbit", four),
        (VGG, "1gbit", four), (VGG, "1gbit", two),
        ("resnet20", "1gbit", four), ("resnet20", "1gbit", two), ("resnet20", "1gbit", unequal),
    }


def test_bad_arguments_get_one_line_and_run_nothing(tmp_path: Path) -> None:
    done = subprocess.run([str(SCRIPT), "--dry-run", "--bogus"], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("hetconv: error: unknown option '--bogus'")
    assert len(done.stderr.splitlines()) == 1
    done = subprocess.run([str(SCRIPT), "--dry-run", str(tmp_path)], capture_output=True,
                          text=True, timeout=30, env={"PATH": "/usr/bin:/bin",
                                                      "HETCONV_BENCH_REPEATS": "zero"})
    assert done.returncode == 2 and done.stdout == ""
    assert "HETCONV_BENCH_REPEATS must be a positive integer" in done.stderr
