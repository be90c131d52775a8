"""``hetconv bench scale --cfs-period-ms``: a period the kernel would refuse is one line,
before any namespace or quota is made (no root needed to see it)."""
from __future__ import annotations

import pytest

from hetconv.commands.cli import main
from hetconv.lab.quota import MIN_QUOTA_US, CpuQuota


@pytest.mark.parametrize("period", ["0.5", "2", "2000"])
def test_a_period_the_kernel_refuses_is_one_line(period: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["bench", "scale", "--machines", "0.45,0.45", "--cfs-period-ms", period])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"hetconv: error: --cfs-period-ms {period}: a CFS period of")
    assert "0.45 core" in err[0] and "least quota" in err[0]


def test_the_quota_refuses_a_share_under_the_kernel_least() -> None:
    with pytest.raises(ValueError, match="at least"):
        CpuQuota(0.45, period_us=int(MIN_QUOTA_US / 0.45) - 1)


def test_the_slice_statistics_runs_get_their_flags() -> None:
    """``--bn-statistics slice`` adds runs labelled ``samples-slice``, trained with
    ``--split-by samples --bn-statistics slice``; the others keep their flags."""
    from hetconv.bench.scale import split_flags

    assert split_flags("samples-slice") == ("--split-by", "samples", "--bn-statistics", "slice")
    assert split_flags("auto-slice") == ("--split-by", "auto", "--bn-statistics", "slice")
    assert split_flags("samples") == ("--split-by", "samples")
    assert split_flags("samples-dense-master") == ("--split-by", "samples", "--dense-part",
                                                   "master")
    assert split_flags("samples-dense-replicas") == ("--split-by", "samples", "--dense-part",
                                                     "replicas")
    assert split_flags("auto-slice-dense-master") == (
        "--split-by", "auto", "--bn-statistics", "slice", "--dense-part", "master")
    assert split_flags("peer") == ("--split-by", "kernels", "--data-plane", "peer")
    assert split_flags("auto-one-in-flight") == ("--split-by", "auto", "--steps-in-flight", "1")
    assert split_flags("samples-slice-dense-master-one-in-flight") == (
        "--split-by", "samples", "--bn-statistics", "slice", "--dense-part", "master",
        "--steps-in-flight", "1")
    # --wire-dtype, last, on any distributed run's label (auto: no suffix)
    assert split_flags("auto-wire-float32") == ("--split-by", "auto", "--wire-dtype", "float32")
    assert split_flags("peer-wire-float16") == ("--split-by", "kernels", "--data-plane", "peer",
                                                "--wire-dtype", "float16")
    assert split_flags("samples-dense-master-one-in-flight-wire-float32") == (
        "--split-by", "samples", "--dense-part", "master", "--steps-in-flight", "1",
        "--wire-dtype", "float32")


def test_the_figure_files_command_repeats_every_repeatable_flag() -> None:
    import argparse

    from hetconv.commands.bench import command_line

    args = argparse.Namespace(
        bench="scale", machines=["0.45,0.45"], data_plane=["peer"], rate="1gbit",
        arch="32:64", epochs=2, batch=128, limit=None, repeats=3, work_dir=None,
        split="model", peer="ddp", split_by=["samples", "auto"],
        bn_statistics=["batch", "slice"], dense_parts=["auto", "master"], cfs_period_ms=2.5,
        steps_in_flight=[2, 1], dilations=[1.0, 0.5], wire_dtypes=["auto", "float32"],
        markdown=None)
    line = command_line(args)
    assert "--split-by samples --split-by auto" in line
    assert "--bn-statistics batch --bn-statistics slice" in line
    assert "--dense-part auto --dense-part master" in line
    assert "--steps-in-flight 2 --steps-in-flight 1" in line
    assert "--cfs-period-ms 2.5 --dilate 1 --dilate 0.5" in line
    assert "--wire-dtype auto --wire-dtype float32" in line


def test_the_figure_files_command_parses_back_to_the_same_scale_options() -> None:
    """What the file's command line says is what ran: parsed again it gives every option
    the run was given (the period and the dilations included)."""
    import shlex

    from hetconv.commands.bench import command_line
    from hetconv.commands.cli import build_parser

    argv = ["bench", "scale", "--machines", "0.45,0.45", "--rate", "100mbit",
            "--cfs-period-ms", "2.5", "--dilate", "1", "--dilate", "0.5", "--peer", "ddp",
            "--split-by", "auto", "--steps-in-flight", "2", "--steps-in-flight", "1",
            "--wire-dtype", "auto", "--wire-dtype", "float32", "--rate", "1gbit,100mbit",
            "--markdown", "out.md"]
    args = build_parser().parse_args(argv)
    again = build_parser().parse_args(shlex.split(command_line(args))[1:])
    assert vars(again) == vars(args)


def test_slice_statistics_without_a_sample_split_is_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["bench", "scale", "--machines", "0.45,0.45", "--split-by", "kernels",
                   "--bn-statistics", "slice"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert "--bn-statistics applies to the sample split's runs" in err[0]


def test_a_bare_scale_bench_measures_what_train_defaults_to_and_says_so(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Without --split-by the bench runs train's default split (auto, what a user gets)
    and its figure file's command spells it out, so the file re-runs the same."""
    import hetconv.bench.scale as scale
    from hetconv.config import SPLIT_BY

    seen: dict[str, object] = {}

    def fake_bench(configurations, **options):
        seen.update(options)
        return {"table": ["| fake |"], "rows": []}

    monkeypatch.setattr(scale, "run_scale_bench", fake_bench)
    out = tmp_path / "scale.md"
    assert main(["bench", "scale", "--machines", "0.45,0.45", "--markdown", str(out)]) == 0
    assert seen["split_by"] == (SPLIT_BY[0],) == ("auto",)
    assert "--split-by auto" in out.read_text()


def test_every_bench_option_is_spelled_out_in_the_figure_files_command() -> None:
    """A new option that command_line does not write would make every figure file that
    uses it name a command that measures something else (--cfs-period-ms once was)."""
    import argparse

    from hetconv.commands.bench import FLAGS
    from hetconv.commands.cli import build_parser

    def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return dict(action.choices)

    for name, parser in subparsers(subparsers(build_parser())["bench"]).items():
        options = {action.dest for action in parser._actions
                   if action.option_strings and action.dest not in ("help", "markdown")}
        assert options <= {dest for _, dest in FLAGS[name]}, (name, options)


def test_steps_in_flight_without_a_sample_split_is_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["bench", "scale", "--machines", "0.45,0.45", "--split-by", "kernels",
                   "--steps-in-flight", "1"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status != 0 and len(lines) == 1 and "--steps-in-flight applies" in lines[0], lines
