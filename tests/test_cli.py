"""The ``tensorpar`` command itself: version, ``python -m tensorpar``, errors as one line, --debug."""

import subprocess
import sys

import pytest

from tensorpar import __version__
from tensorpar.cli import main


def test_version_and_python_dash_m():
    for command in (["tensorpar"], [sys.executable, "-m", "tensorpar"]):
        done = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.startswith(f"tensorpar {__version__} (torch "), done


def test_an_error_is_one_line_and_debug_adds_the_traceback(capsys, monkeypatch):
    monkeypatch.setenv("TENSORPAR_DEBUG", "0")  # main() sets it for --debug; restored after
    assert main(["train", "--nproc", "3", "--tp", "2"]) == 2
    assert capsys.readouterr().err == "tensorpar train: error: --tp 2 does not divide --nproc 3\n"
    assert main(["train", "--nproc", "3", "--tp", "2", "--debug"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert err.endswith("tensorpar train: error: --tp 2 does not divide --nproc 3\n")


def test_unexpected_exceptions_are_one_line_with_their_type(capsys, monkeypatch):
    import tensorpar.training.cli as training_cli

    monkeypatch.setenv("TENSORPAR_DEBUG", "0")

    def broken(args):
        raise KeyError("step")

    monkeypatch.setattr(training_cli, "_resolve_world", broken)
    assert main(["train"]) == 1
    assert capsys.readouterr().err == "tensorpar train: error: KeyError: 'step'\n"
