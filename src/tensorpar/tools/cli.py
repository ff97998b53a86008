"""The ``tensorpar`` command: each subcommand lives in the module that implements it.

Whatever fails, in this process or in any rank it started, ends the command with one line,
``tensorpar <command>: error: <message>``, and a non-zero exit (2: bad input, 1: any other
failure); ``--debug`` or ``TENSORPAR_DEBUG=1`` adds the tracebacks.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
import textwrap

from .. import __version__
from ..errors import DEBUG_ENV
from .errors import report, report_signal
from .launch import OneLineErrorHandler

# Each module defines ``register(subparsers)``, which adds its subcommands and sets ``func``.
_COMMAND_MODULES = ("tensorpar.tools.training_cli", "tensorpar.tools.comm_report", "tensorpar.tools.bench")


class HelpFormatter(argparse.HelpFormatter):
    """Description paragraphs wrapped (indented lines kept as written); every option's help ends
    with its default, unless it says it."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for paragraph in text.split("\n\n"):
            if any(line.startswith("  ") for line in paragraph.splitlines()):
                paragraphs.append("\n".join(indent + line for line in paragraph.splitlines()))
            else:
                paragraphs.append(textwrap.fill(" ".join(paragraph.split()), width, initial_indent=indent,
                                                subsequent_indent=indent))
        return "\n\n".join(paragraphs)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, argparse.SUPPRESS)
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                       argparse._HelpAction, argparse._VersionAction))):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line like every other error (usage: ``--help``)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    import torch

    parser = ArgumentParser(
        prog="tensorpar", formatter_class=HelpFormatter,
        description="Megatron-style tensor parallelism for PyTorch: train, generate, "
        "export, predict communication, benchmark against DTensor.")
    parser.add_argument("--version", action="version",
                        version=f"tensorpar {__version__} (torch {torch.__version__})")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    for sub in subparsers.choices.values():
        sub.formatter_class = HelpFormatter
        sub.add_argument("--debug", action="store_true",
                         help=f"print full tracebacks of errors (or set {DEBUG_ENV}=1)")
    return parser


def _suggestion(parser: argparse.ArgumentParser, flag: str) -> str | None:
    """What ``flag`` (unknown to ``parser``) most likely meant: ``--bf16`` is ``--dtype bf16``,
    ``--seqlen`` is ``--seq-len``."""
    name = flag.split("=", 1)[0]
    for action in parser._actions:
        if action.option_strings and action.choices and name.lstrip("-") in action.choices:
            return f"{action.option_strings[-1]} {name.lstrip('-')}"
    options = [option for action in parser._actions for option in action.option_strings]
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.75)
    return close[0] if close else None


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; arguments no parser knows end the command with one line from the subcommand,
    suggesting the flag meant."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
        flag = next((arg for arg in unknown if arg.startswith("-")), None)
        meant = _suggestion(sub, flag) if flag else None
        hint = f" (did you mean {meant}?)" if meant else ""
        sub.error(f"unrecognized arguments: {' '.join(unknown)}{hint}; see {sub.prog} --help")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run ``tensorpar`` with ``argv``; returns the exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        args = _parse(argv)
    except SystemExit as exc:  # --help, --version, or a flag argparse rejected (already printed)
        return exc.code or 0
    if args.debug:
        os.environ[DEBUG_ENV] = "1"  # inherited by the ranks this command starts
    try:
        # Under torchrun, record() leaves the one-line message in the launcher's error file.
        return int(record(args.func, error_handler=OneLineErrorHandler())(args) or 0)
    except (KeyboardInterrupt, SignalException) as exc:  # Ctrl-C, or the launcher's signal: it has ended the ranks
        return report_signal(args.command, exc)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line
        return report(args.command, exc)


if __name__ == "__main__":
    sys.exit(main())
