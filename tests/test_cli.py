"""The command line: its torch-free paths stay torch-free (`hsdp version`, `hsdp plan` and every `--help`
answer in a fraction of a second instead of paying for `import torch`, about 2 s), every option's help shows
its default and the rate spellings the parser reads, and `hsdp train --resume` refuses a run directory
without a checkpoint before starting any rank."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import sys
import hsdp.apps.cli
hsdp.apps.cli.build_parser()
code = hsdp.apps.cli.main({argv!r})
assert "torch" not in sys.modules, "torch was imported"
print("exit", code)
"""


@pytest.mark.parametrize("argv", [["version"], ["plan", "--model", "7b", "--nodes", "2", "--gpus-per-node", "8"]])
def test_torch_free_commands_do_not_import_torch(argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "exit 0" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_the_public_api_is_still_importable_by_name() -> None:
    import hsdp

    assert set(hsdp.__all__) <= set(dir(hsdp))
    for name in hsdp.__all__:  # every lazy export resolves to the object its module defines
        value = getattr(hsdp, name)
        assert getattr(sys.modules[value.__module__], name) is value
    from hsdp import ShardedModel
    from hsdp.engine.model import ShardedModel as Defined

    assert ShardedModel is Defined

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = hsdp.nope


# ---------------------------------------------------------------------------------------------------------
# --help: every default, and the rate spellings the parser reads
# ---------------------------------------------------------------------------------------------------------
def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from hsdp.apps.cli import bench, build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {**sub.choices, "bench": bench.build_parser()}  # bench parses its own arguments


def _option_help(parser: argparse.ArgumentParser, flag: str) -> str:
    """The help text of ``flag`` as ``--help`` prints it, on one line."""
    text = parser.format_help()
    start = text.index(f"\n  {flag}", text.index("options:"))  # not the usage line
    end = next((i for i in (text.find("\n  -", start + 1), text.find("\n\n", start)) if i > 0), len(text))
    return " ".join(text[start:end].split())


def test_every_option_help_shows_its_default() -> None:
    missing = []
    for name, parser in _subparsers().items():
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"hsdp {name} {action.option_strings[-1]} has no help"
            if action.default is None or action.default is False:  # nothing to show (a flag, a computed default)
                continue
            if "default" not in _option_help(parser, action.option_strings[-1]):
                missing.append(f"{name} {action.option_strings[-1]}")
    assert not missing, missing
    bench_help = _option_help(_subparsers()["bench"], "--steps")
    assert bench_help.endswith("(default: 5)"), bench_help


def test_rate_help_names_only_spellings_the_rate_parser_reads() -> None:
    from hsdp.apps.cli.helptext import RATE_UNITS
    from hsdp.tools.quantities import parse_bandwidth

    examples = re.findall(r"\(([^)]*)\)", RATE_UNITS)
    spelled = [s.strip() for group in examples for s in group.split(",")]
    assert {"1gbit", "10gbit", "1GB/s"} <= set(spelled)
    assert parse_bandwidth("10gbit") == 1.25e9 and parse_bandwidth("1GB/s") == 1e9
    for rate in spelled:
        assert parse_bandwidth(rate) > 0
    parsers = _subparsers()
    for name, flag in (("tune", "--inter-node-bandwidth"), ("tune", "--intra-node-bandwidth"),
                       ("bench", "--bandwidths"), ("plan", "--inter-node-bandwidth"),
                       ("plan", "--intra-node-bandwidth"), ("launch", "--inter-node-bandwidth")):
        assert " ".join(RATE_UNITS.split()) in _option_help(parsers[name], flag), (name, flag)


# ---------------------------------------------------------------------------------------------------------
# hsdp train --resume with a run directory that holds no checkpoint
# ---------------------------------------------------------------------------------------------------------
def test_resume_without_a_checkpoint_is_refused_naming_the_runs_nearby(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from hsdp.apps.cli import main

    def spawn(*args: object) -> int:
        raise AssertionError("ranks were started")

    monkeypatch.setattr("hsdp.tools.launch.launch_local", spawn)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    for run in ("runs/train", "runs/other"):
        (tmp_path / run / "checkpoints" / "step_000004").mkdir(parents=True)
    (tmp_path / "runs" / "empty").mkdir()
    (tmp_path / "runs" / "empty" / "metrics.jsonl").write_text("")  # a run killed before its first checkpoint

    assert main(["train", "--resume", "--out", "runs/trian"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.out_dir = 'runs/trian' does not exist" in err, err
    assert "runs/other, runs/train: pass --out with the one to continue" in err
    assert "drop --resume to start a new run there" in err
    assert main(["train", "--resume", "--out", "runs/empty"]) == 2
    err = capsys.readouterr().err
    assert "'runs/empty' holds no checkpoint" in err and "choose another --out (or delete it)" in err, err
    assert main(["train", "--resume", "--out", "elsewhere/run"]) == 2
    assert "no run directory beside it in 'elsewhere' holds checkpoints" in capsys.readouterr().err
    assert not (tmp_path / "runs" / "trian").exists() and not (tmp_path / "elsewhere").exists()
    # Under torchrun --resume without a checkpoint stays a fresh start (a job script's first submission).
    from hsdp.apps.train.config_io import resolve_config
    from hsdp.apps.train.rundir import resume_problem

    assert resume_problem(resolve_config(None, ["train.out_dir=runs/train", "train.resume=true"])) is None
    assert resume_problem(resolve_config(None, ["train.out_dir=runs/trian"])) is None  # not resuming
