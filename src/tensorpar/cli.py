"""The ``tensorpar`` command: each subcommand lives in the module that implements it."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module defines ``register(subparsers)``, which adds its subcommands and sets ``func``.
_COMMAND_MODULES = ("tensorpar.training.cli", "tensorpar.comm_report", "tensorpar.bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tensorpar", description="Megatron-style tensor parallelism for PyTorch: train, generate, "
        "export, predict communication, benchmark against DTensor.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
