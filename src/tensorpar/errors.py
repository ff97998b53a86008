"""How a failure reaches the user: one line naming the cause, a traceback only on request.

The library's layers raise :class:`UsageError` (and :func:`check_index_range`'s ``ValueError``);
the command the user ran prints :func:`one_line` of it with :func:`report`. ``--debug`` (or
``TENSORPAR_DEBUG=1``) prints the tracebacks too. Nothing here imports torch's launcher: the
elastic error-file handler of the ranks lives in :mod:`tensorpar.tools.launch`.

Example::

    try:
        run()
    except Exception as exc:
        sys.exit(report("train", exc))            # "tensorpar train: error: ..." on stderr
"""

from __future__ import annotations

import os
import sys
import traceback

DEBUG_ENV = "TENSORPAR_DEBUG"


class UsageError(ValueError):
    """Input that cannot work (a flag, a size, a path); the message names the offending values."""

    exit_code = 2


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _reads_back(tensor) -> bool:
    """Whether a range check may read its tensor back: free on CPU, a device sync elsewhere, and
    under ``torch.compile`` a graph break (the compiled check is ``torch._assert_async``)."""
    import torch

    if torch.compiler.is_compiling():
        return False
    return tensor.device.type == "cpu" or debug_enabled()


def check_index_range(index, size: int, what: str, where: str, *, ignore: int | None = None) -> None:
    """Raise ``ValueError("<what> <value> is <where>")`` if an entry of ``index`` is outside ``[0, size)``.

    ``ignore``: a value that is allowed too (an ``ignore_index``). On CPU, and anywhere with
    ``TENSORPAR_DEBUG=1``, the offending value is read back and named. On an accelerator (and
    under ``torch.compile``) the check is ``torch._assert_async``: the host never waits for the
    device (kernels keep being queued ahead), and a bad index stops the run when the device
    reaches the check.
    """
    import torch

    if index.numel() == 0:
        return
    if ignore is not None:
        index = index.masked_fill(index == ignore, 0)
    if _reads_back(index):
        low, high = (int(v) for v in index.aminmax())
        if low < 0 or high >= size:
            raise ValueError(f"{what} {low if low < 0 else high} is {where}")
    else:
        torch._assert_async(((index >= 0) & (index < size)).all(),
                            f"a {what} is {where} (TENSORPAR_DEBUG=1 names it)")


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
