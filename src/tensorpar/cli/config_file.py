"""A command's flags from a TOML file (``--config FILE.toml``), and its settings written back as TOML.

The file is one flat table whose keys are the command's flags without the leading dashes
(``seq-len`` or ``seq_len``); a flag given on the command line overrides the file. The valid
keys are read off the command's own parser, so a flag added to the command is settable in the
file with nothing else to change. Each value goes through its flag's own check (``steps = 0``
fails as ``--steps 0`` does); a switch takes ``true`` or ``false``, a number is written without
quotes, text in quotes (text that is not UTF-8, such as a path in another encoding, as the
array of its bytes). An unknown key, or a value of the wrong type, is refused in one line
naming the key (and, for an unknown one, the nearest valid key). Nothing in the file is executed.

Example::

    # run.toml
    steps = 200
    seq-len = 64
    fsdp = true

    tensorpar train --config run.toml --lr 1e-3      # the file's settings, --lr from the command line
"""

from __future__ import annotations

import argparse
import difflib
import os
import reprlib
import stat
import sys

from ..errors import UsageError
from ..training.toml_text import toml_setting, toml_value

# Flags that say how the command runs, not what it runs: never read from or written to a file.
_NOT_SETTINGS = frozenset({"help", "config", "print_config", "debug"})
# One-time switches that touch files: from a file (a run's own config.toml reused as a template)
# they would continue or delete a run by surprise. The command line only.
_COMMAND_LINE_ONLY = frozenset({"overwrite", "resume"})
# Never written: those switches, and the run directory, which a file reused elsewhere must not name.
_NOT_WRITTEN = _COMMAND_LINE_ONLY | {"out"}
# A settings file is a few lines; /dev/zero is not one.
MAX_FILE_BYTES = 1 << 20


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` and ``--print-config``."""
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="read flags from a TOML file (keys named like the flags: steps = 200, seq-len = 64, "
                             "fsdp = true); flags on the command line override it (default: none)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the settings the run would use (a resumed run's included) as a TOML file for "
                             "--config, and exit without training")


def settable(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """{key: action} of every flag of ``parser`` a file may set; the key is the long flag without ``--``."""
    keys = {}
    for action in parser._actions:
        longs = [option for option in action.option_strings if option.startswith("--")]
        if longs and action.dest not in _NOT_SETTINGS and not isinstance(action, argparse._VersionAction):
            keys[longs[0][2:]] = action
    return keys


def _is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0


def _shown(value) -> str:
    """``value`` as the file writes it (an array or table cut short: it may nest thousands deep)."""
    return toml_value(value) if isinstance(value, (str, int, float)) else reprlib.repr(value)


def _load(path: str, tomllib) -> dict:
    """The TOML table of the regular file ``path`` of at most ``MAX_FILE_BYTES``, UTF-8."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise UsageError(f"--config {path} is not a regular file (a pipe or a device never ends, or "
                             "blocks): give a TOML file")
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"--config {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise UsageError(f"--config {path} is larger than {MAX_FILE_BYTES >> 20} MiB: a settings file is a few lines")
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UsageError(f"--config {path} is not valid TOML (not UTF-8: byte {exc.start} is "
                         f"0x{data[exc.start]:02x})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise UsageError(f"--config {path} is not valid TOML (nested too deeply)") from None


def _value(key: str, value, action: argparse.Action):
    """The flag's value for ``key = value``, checked as the flag checks it; UsageError says what is wrong."""
    given = f"{key} = {_shown(value)}"
    if action.type in (None, str) and isinstance(value, list) and value \
            and all(type(b) is int and 0 <= b < 256 for b in value):
        value = bytes(value).decode("utf-8", "surrogateescape")  # text that is not UTF-8, as dumps writes it
    if _is_switch(action):
        if not isinstance(value, bool):
            raise UsageError(f"{given}: {key} is a switch, write {key} = true or {key} = false")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value
        return action.const if value else action.default
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        kind = "true/false" if isinstance(value, bool) else type(value).__name__
        raise UsageError(f"{given}: expected a number or text in quotes, not {kind}")
    if action.type is None and not isinstance(value, str):
        raise UsageError(f"{given}: expected text, in quotes: {key} = \"{value}\"")
    try:
        result = action.type(str(value)) if action.type is not None else value
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        raise UsageError(f"{given}: {exc}") from None
    if isinstance(value, str) and isinstance(result, (int, float)):
        raise UsageError(f"{given}: a number, written without quotes: {key} = {value}")
    if action.choices is not None and result not in action.choices:
        raise UsageError(f"{given}: choose from {', '.join(map(str, action.choices))}")
    return result


def read(path: str, *, parser: argparse.ArgumentParser) -> dict[str, object]:
    """{dest: value} of the TOML file ``path`` for ``parser``'s flags (for ``parser.set_defaults``)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # the package still installs on 3.10, where only --config needs more
        raise UsageError(f"--config needs Python 3.11 or newer (the standard library's tomllib); this is "
                         f"Python {sys.version_info.major}.{sys.version_info.minor}") from None
    table = _load(path, tomllib)
    keys = settable(parser)
    values, spelled = {}, {}
    for key, value in table.items():
        name = key.replace("_", "-")
        if name in spelled:
            raise UsageError(f"--config {path}: {spelled[name]} and {key} set the same flag: keep one")
        spelled[name] = key
        if name.replace("-", "_") in _COMMAND_LINE_ONLY and value is not False:
            raise UsageError(f"--config {path}: {key} is a one-time switch that touches files (a file reused as "
                             f"a template would {'continue' if name == 'resume' else 'delete'} a run by "
                             f"surprise): pass --{name} on the command line")
        action = keys.get(name)
        if action is None:
            near = difflib.get_close_matches(name, keys, n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]}?)" if near else ""
            what = f"[{key}] is a table; keys go at the top level, named like the flags" if isinstance(value, dict) \
                else f"unknown key {key}{hint}"
            raise UsageError(f"--config {path}: {what}; see {parser.prog} --help")
        try:
            values[action.dest] = _value(key, value, action)
        except UsageError as exc:
            raise UsageError(f"--config {path}: {exc}") from None
    return values


def dumps(args: argparse.Namespace, *, parser: argparse.ArgumentParser) -> str:
    """``args`` as a TOML file :func:`read` reads back: every flag of ``parser`` that has a value,
    but the one-time switches and ``out`` (the run's own directory: reused, the file starts a new run).

    Example: ``dumps(argparse.Namespace(steps=200, fsdp=False), parser=p)`` is ``"steps = 200\\nfsdp = false\\n"``
    (after a comment line).
    """
    lines = [f"# {parser.prog}'s settings; run it again with: {parser.prog} --config FILE"]
    for key, action in settable(parser).items():
        value = getattr(args, action.dest, None)
        if value is not None and action.dest not in _NOT_WRITTEN:
            lines.append(toml_setting(key, value))
    return "\n".join(lines) + "\n"
