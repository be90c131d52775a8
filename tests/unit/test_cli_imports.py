"""The ``hetconv`` command imports only the subcommand it runs (a worker daemon's start
does not pay for bench, report and export), and parses that command's line exactly as
the parser with every subcommand does."""
from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from hetconv.commands.cli import SUBCOMMANDS, build_parser, chosen
from tests.conftest import REPO, child_env


def fresh_interpreter(probe: str) -> str:
    """What ``probe`` prints, run by a new interpreter as the commands' children are."""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env=child_env(), cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_chosen_is_the_first_word_that_is_not_an_option() -> None:
    assert chosen(["worker", "--connect", "tcp://x:1"]) == "worker"
    assert chosen(["-v", "train", "--local"]) == "train"
    assert chosen(["--version"]) is None
    assert chosen([]) is None
    assert chosen(["frob", "train"]) is None  # not a subcommand: the full parser's error


@pytest.mark.parametrize("line", [["worker", "--master", "tcp://127.0.0.1:5555"],
                                  ["-v", "train", "--local", "--epochs", "2"],
                                  ["status", "tcp://127.0.0.1:5555"]])
def test_a_command_line_parses_the_same_with_one_subcommand_or_all(line: list[str]) -> None:
    assert vars(build_parser(chosen(line)).parse_args(line)) == vars(
        build_parser().parse_args(line))


def test_a_worker_start_does_not_import_the_other_subcommands() -> None:
    probe = ("import sys\nfrom hetconv.commands import cli\n"
             "try:\n    cli.main(['worker', '--help'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in sys.modules if m.startswith('hetconv.commands.')))")
    printed = fresh_interpreter(probe)
    modules = ast.literal_eval(printed.strip().splitlines()[-1])
    loaded = {name.rsplit(".", 1)[1] for name in modules}
    assert "worker" in loaded
    assert not loaded & {"bench", "report", "export", "evaluate", "predict"}, loaded
    assert set(SUBCOMMANDS) >= {"train", "worker", "bench"}


def test_a_run_without_curve_does_not_import_asyncio() -> None:
    """pyzmq's ZAP authenticator thread pulls in asyncio (about 80 ms of every process
    start); only a CURVE run starts one, so the daemons' and the master's modules import
    it when it starts, not at their own import."""
    probe = ("import sys\nimport worker.daemon, worker.service, master.run, "
             "hetconv.participant.peer_sockets, hetconv.keys\n"
             "print('asyncio' in sys.modules, 'zmq.auth.thread' in sys.modules)")
    printed = fresh_interpreter(probe)
    assert printed.split() == ["False", "False"], printed
