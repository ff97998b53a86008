"""The ``tensorpar`` command itself: version, ``python -m tensorpar``, errors as one line, --debug."""

import subprocess
import sys

import pytest

from tensorpar import __version__
from tensorpar.cli.main import main
from tests.cli_runner import run_tensorpar


def test_version_and_python_dash_m():
    import torch

    for command in (["tensorpar"], [sys.executable, "-m", "tensorpar"]):
        done = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout == f"tensorpar {__version__} (torch {torch.__version__})\n", done


def test_torch_before_2_6_is_refused_at_install_and_import():
    """Issue 16 item 7: torch.load(weights_only=True), which DCP loads tensors with, can run code
    on torch <= 2.5.1 (CVE-2025-32434)."""
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert [d for d in project["dependencies"] if d.startswith("torch")] == ["torch>=2.6"]
    fake_old = "import torch; torch.__version__ = torch.torch_version.TorchVersion('2.5.1'); import tensorpar"
    done = subprocess.run([sys.executable, "-c", fake_old], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "ImportError: tensorpar needs torch >= 2.6 (older torch.load can run code from a checkpoint file, "
        "CVE-2025-32434); this is torch 2.5.1: pip install 'torch>=2.6'")


def test_an_error_is_one_line_and_debug_adds_the_traceback(capsys, monkeypatch):
    monkeypatch.setenv("TENSORPAR_DEBUG", "0")  # main() sets it for --debug; restored after
    assert main(["train", "--nproc", "3", "--tp", "2"]) == 2
    assert capsys.readouterr().err == "tensorpar train: error: --tp 2 does not divide --nproc 3\n"
    assert main(["train", "--nproc", "3", "--tp", "2", "--debug"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert err.endswith("tensorpar train: error: --tp 2 does not divide --nproc 3\n")


def test_unexpected_exceptions_are_one_line_with_their_type(capsys, monkeypatch):
    import tensorpar.cli.training_cli as training_cli

    monkeypatch.setenv("TENSORPAR_DEBUG", "0")

    def broken(args):
        raise KeyError("step")

    monkeypatch.setattr(training_cli, "_resolve_world", broken)
    assert main(["train"]) == 1
    assert capsys.readouterr().err == "tensorpar train: error: KeyError: 'step'\n"


def _subcommands():
    import argparse

    from tensorpar.cli.main import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, action.choices


def test_every_flag_has_help_that_shows_its_default_and_no_markup():
    import argparse

    parser, commands = _subcommands()
    assert {"train", "generate", "export", "comm", "bench"} <= set(commands)
    for name, sub in commands.items():
        text = sub.format_help()
        for marker in ("``", ":class:", ":func:", ":mod:", "::", "seed 0", "DESIGN"):
            assert marker not in text, (name, marker)
        formatter = sub._get_formatter()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, (name, action.option_strings)
            shown = formatter._get_help_string(action) % {"default": action.default}
            flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
            assert flag or action.required or "default" in shown, (name, action.option_strings, shown)


def test_presets_are_described_honestly(capsys):
    _, commands = _subcommands()
    text = " ".join(commands["train"].format_help().split())
    assert "default: tiny" in text and "smaller than GPT-2's 124M" in text


@pytest.mark.parametrize("argv, message", [
    (["comm", "--layer", "mlp", "--hidden", "4095", "--measure"],
     "tensorpar comm: error: --measure runs --layer mlp as part of a GPT block: --hidden 4095 is not divisible "
     "by --heads 32"),
    (["comm", "--layer", "mlp", "--hidden", "64", "--seq-len", "32", "--heads", "4", "--measure", "--scale", "3"],
     "tensorpar comm: error: --scale 3 does not divide seq_len (32)"),
    (["bench", "--tp", "3", "--hidden", "100"],
     "tensorpar bench: error: --hidden 100 must be divisible by --gpt-heads 8, and --gpt-heads by --tp 3"),
])
def test_comm_and_bench_sizes_that_do_not_divide(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == message + "\n" and captured.out == ""


def test_a_signal_to_the_launcher_is_one_line_and_128_plus_the_signal(capsys, monkeypatch):
    import signal

    import tensorpar.cli.training_cli as training_cli
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def interrupted(args):
        raise SignalException("Process 1 got signal: 2", sigval=signal.SIGINT)

    monkeypatch.setattr(training_cli, "_resolve_world", interrupted)
    assert main(["train"]) == 130
    assert capsys.readouterr().err == "tensorpar train: interrupted (SIGINT)\n"


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["generate", "--help"], ["export", "--help"],
                                  ["prepare", "--help"], ["train", "--steps", "0"], ["train", "--step", "5"]])
def test_help_and_flag_errors_do_not_import_torch(argv):
    """Issue 26: `tensorpar --help` took seconds importing torch before it printed anything."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "tensorpar", *argv],
                          capture_output=True, text=True, timeout=120)
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "tensorpar.cli.main" in imported, done.stderr[-2000:]
    assert done.returncode == (0 if "--help" in argv else 2), done.stderr[-2000:]
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")], argv


def test_the_torch_commands_are_listed_and_load_when_named():
    from tensorpar.cli.main import TORCH_COMMANDS

    done = subprocess.run([sys.executable, "-m", "tensorpar", "--help"], capture_output=True, text=True, timeout=120)
    for name, (_, summary) in TORCH_COMMANDS.items():
        assert f"{name} " in done.stdout and summary in " ".join(done.stdout.split()), done.stdout
        shown = run_tensorpar([name, "--help"])
        assert shown.returncode == 0 and "--tp" in shown.stdout, shown.stderr


def test_abbreviated_flags_are_refused_with_the_flag_meant():
    """`--step 50` was taken as `--steps 50` (argparse's allow_abbrev)."""
    done = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--step", "50"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr == ("tensorpar train: error: unrecognized arguments: --step 50 (did you mean --steps?); "
                           "see tensorpar train --help\n")
    done = subprocess.run([sys.executable, "-m", "tensorpar", "--vers"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "" and len(done.stderr.splitlines()) == 1, done  # not --version


def test_generate_help_describes_no_data_parallelism():
    """Issue 26: generate's --tp help said "the rest of the world is data parallel"."""
    texts = {name: " ".join(_tensorpar_help(name).split()) for name in ("generate", "train")}
    assert "data parallel" not in texts["generate"] and "ranks past --tp repeat the same sampling" in texts["generate"]
    assert "the rest of the world is data parallel" in texts["train"]


def _tensorpar_help(command):
    done = run_tensorpar([command, "--help"])
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_no_parser_takes_an_abbreviation(capsys):
    from tensorpar.cli.training_cli import parse_train_args

    parser, commands = _subcommands()
    assert not parser.allow_abbrev and not [name for name, sub in commands.items() if sub.allow_abbrev]
    with pytest.raises(SystemExit):
        parse_train_args(["--step", "5"])
    assert "unrecognized arguments: --step 5" in capsys.readouterr().err
