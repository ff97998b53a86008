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
from ..errors import DEBUG_ENV, UsageError
from . import config_file
from .errors import report, report_signal
from .terminal import keep_os_bytes

# Each module defines ``register(subparsers)``, which adds its subcommands and sets ``func``;
# training_cli imports no torch at module level, so its commands' --help and flag errors are quick.
_COMMAND_MODULES = ("tensorpar.cli.training_cli", "tensorpar.cli.comm_report", "tensorpar.cli.bench")
# The commands of modules that import torch (seconds): `tensorpar --help` lists them from here,
# and their module is imported only when the command line names them.
TORCH_COMMANDS = {
    "comm": ("tensorpar.cli.comm_report", "predict (and measure) the TP collectives of a layer or GPT step"),
    "bench": ("tensorpar.cli.bench", "MLP block tensorpar vs DTensor TP on gloo/CPU"),
}


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


def _torch_version() -> str:
    """torch's version from its installed metadata (importing torch takes seconds), else from torch."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:  # a torch on the path that pip did not install
        import torch

        return torch.__version__


class _Version(argparse.Action):
    """``--version``: tensorpar's and torch's versions, without importing torch."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"tensorpar {__version__} (torch {_torch_version()})")
        parser.exit()


def _named_command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (the first argument that is no option), if any."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``tensorpar`` parser: every command's, or (given ``argv``) the torch-importing command
    modules only where ``argv`` names their command."""
    parser = ArgumentParser(
        prog="tensorpar", formatter_class=HelpFormatter, allow_abbrev=False,
        description="Megatron-style tensor parallelism for PyTorch: train, generate, "
        "export, predict communication, benchmark against DTensor.")
    parser.add_argument("--version", action=_Version, help="show the version (and torch's) and exit")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    named = _named_command(argv) if argv is not None else None
    for name in _COMMAND_MODULES:
        lazy = [command for command, (module, _) in TORCH_COMMANDS.items() if module == name]
        if argv is None or not lazy or named in lazy:
            importlib.import_module(name).register(subparsers)
        else:
            for command in lazy:
                subparsers.add_parser(command, help=TORCH_COMMANDS[command][1], add_help=False)
    for sub in subparsers.choices.values():
        sub.formatter_class = HelpFormatter
        sub.allow_abbrev = False
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
    """The command line, over the ``--config`` file's flags where it names one; arguments no parser
    knows end the command with one line from the subcommand, suggesting the flag meant."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    if unknown:
        flag = next((arg for arg in unknown if arg.startswith("-")), None)
        meant = _suggestion(sub, flag) if flag else None
        hint = f" (did you mean {meant}?)" if meant else ""
        sub.error(f"unrecognized arguments: {' '.join(unknown)}{hint}; see {sub.prog} --help")
    if getattr(args, "config", None) is not None:
        try:
            sub.set_defaults(**config_file.read(args.config, parser=sub))
        except UsageError as exc:
            sub.error(str(exc))
        args = parser.parse_args(argv)  # the file's values are the defaults the command line overrides
    return args


def main(argv: list[str] | None = None) -> int:
    """Run ``tensorpar`` with ``argv``; returns the exit status."""
    keep_os_bytes(sys.stdout, sys.stderr)
    try:
        args = _parse(argv)
    except SystemExit as exc:  # --help, --version, or a flag argparse rejected (already printed)
        return exc.code or 0
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import record

    from .launch import OneLineErrorHandler

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
