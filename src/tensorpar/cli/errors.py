"""How a failure reaches the user: one line naming the cause, a traceback only on request.

The library raises :class:`~tensorpar.errors.UsageError` (and :func:`~tensorpar.errors.check_index_range`'s
``ValueError``); the command the user ran prints :func:`one_line` of it with :func:`report`.
``--debug`` (or ``TENSORPAR_DEBUG=1``) prints the tracebacks too. The elastic error-file handler
of the ranks is in :mod:`.launch`.

Example::

    try:
        run()
    except Exception as exc:
        sys.exit(report("train", exc))            # "tensorpar train: error: ..." on stderr
    except KeyboardInterrupt as exc:
        sys.exit(report_signal("train", exc))     # "tensorpar train: interrupted (SIGINT)"
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback

from ..errors import debug_enabled


def exit_code(exc: BaseException) -> int:
    """2 for bad input (argparse's convention), 1 for any other failure."""
    return getattr(exc, "exit_code", 1)


def one_line(exc: BaseException) -> str:
    """The exception's own message on one line; the type is named unless it is one of ours."""
    message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if type(exc).__module__.startswith("tensorpar") and message:
        return message
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def report(command: str, exc: BaseException) -> int:
    """Print ``tensorpar <command>: error: <message>`` (and tracebacks under debug); the exit code."""
    if debug_enabled():
        traceback.print_exception(exc, file=sys.stderr)
        remote = getattr(exc, "traceback", None)
        if remote:
            print(remote, file=sys.stderr, end="" if remote.endswith("\n") else "\n")
    print(f"tensorpar {command}: error: {one_line(exc)}", file=sys.stderr, flush=True)
    return exit_code(exc)


def report_signal(command: str, exc: BaseException) -> int:
    """Print the one line of a command stopped by a signal; the exit code, 128 + the signal.

    ``exc`` is a ``KeyboardInterrupt`` (Ctrl-C in this process) or torch elastic's
    ``SignalException`` (the launcher was sent a signal and has ended its ranks); its notes
    (``add_note``) follow the line, e.g. where the run can continue. Under ``torchrun`` every
    rank is interrupted and only rank 0 says so.

    Example: ``tensorpar train: interrupted (SIGINT); the last checkpoint is run/step_400 (...)``
    """
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not break the line
    try:
        signum = getattr(exc, "sigval", signal.SIGINT)
        if os.environ.get("RANK", "0") == "0":
            what = "interrupted (SIGINT)" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
            notes = "".join(f"; {note}" for note in getattr(exc, "__notes__", ()))
            print(f"tensorpar {command}: {what}{notes}", file=sys.stderr, flush=True)
        return 128 + int(signum)
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def noted_on_signal(note):
    """Add ``note()`` to a Ctrl-C (or the launcher's signal) leaving the block: :func:`report_signal`
    prints it after its line. Example: ``with noted_on_signal(lambda: "see run/"): launch()``"""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        yield
    except (KeyboardInterrupt, SignalException) as exc:
        exc.add_note(note())
        raise
